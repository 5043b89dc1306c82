"""Output files of the command-line tools (`infer.py --output`, `--quantize`, `bert.py export --output`):
checked before any work starts, written atomically.

`check_output` refuses, in one `ValueError` naming the flag and the path, what would
otherwise fail only after the work is done: a directory where the file goes, a file in
the way of a directory above it, a location the process cannot write (a read-only
directory or file system: tried by creating a file there, so it holds for root and for
immutable directories too), an output that is one of the inputs, or (unless `replace`)
any existing file. Missing directories above it are made when it is written.

They are written by `fileio` (the project's one atomic writer): a failed or interrupted
write leaves nothing half-written, and an existing file stays as it was.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Union

from fileio import staged

__all__ = ["check_output", "check_output_dir", "save_figure"]

PathLike = Union[str, os.PathLike]


def check_output(path: PathLike, flag: str, *, inputs: Sequence[Optional[PathLike]] = (), replace: bool = False,
                 suffix: Optional[str] = None) -> Path:
    """`path` if a file can be written there (see the module docstring); else a ValueError."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; name a file in it")
    if suffix is not None and path.suffix != suffix:
        raise ValueError(f"{flag} {path} must end in {suffix}")
    for given in inputs:
        if given is not None and Path(given).exists() and path.exists() and path.resolve() == Path(given).resolve():
            raise ValueError(f"{flag} {path} is the input {given}; name a new file")
    if path.exists() and not replace:
        raise ValueError(f"{flag} {path} already exists; name a new file (nothing is overwritten)")
    parent = path.absolute().parent
    existing = parent
    while not existing.exists():  # the directories that would be made, up to one that exists
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is a file, not a directory; choose another place")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=existing)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write in {existing} ({e.strerror}); choose a writable place") from None
    os.close(fd)
    os.unlink(probe)
    return path


def check_output_dir(path: PathLike, flag: str) -> Path:
    """`path` if it is a directory or can be made one: neither it nor a directory above it is a
    file (which would otherwise end a run, after its work, in a bare "Not a directory")."""
    path = Path(path)
    existing = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        if existing == path.absolute():
            raise ValueError(f"{flag} {path} is a file, not a directory; name a directory (one is made if missing)")
        raise ValueError(f"{flag} {path}: {existing} is a file, not a directory; choose another place")
    return path


def save_figure(figure, path: PathLike) -> Path:
    """Save a matplotlib figure as a PNG at `path` atomically: a reader sharing the directory
    sees the old plot or the new one, never half of one."""
    with staged(path, replace=True) as tmp:
        figure.savefig(tmp, dpi=110, bbox_inches="tight")
    return Path(path)
