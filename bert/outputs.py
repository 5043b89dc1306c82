"""Output files of the command-line tools (`infer.py --output`, `--quantize`, `bert.py --export`):
checked before any work starts, written atomically.

`check_output` refuses, in one `ValueError` naming the flag and the path, what would
otherwise fail only after the work is done: a directory where the file goes, a file in
the way of a directory above it, a location the process cannot write (a read-only
directory or file system: tried by creating a file there, so it holds for root and for
immutable directories too), an output that is one of the inputs, or (unless `replace`)
any existing file. Missing directories above it are made when it is written.

`staged` writes through a temporary directory beside the target (same file system) and
renames what was written into place only when the writer succeeds: a failed or
interrupted write leaves nothing half-written, and an existing file stays as it was.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

__all__ = ["check_output", "save_figure", "staged", "write_atomically"]

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


@contextlib.contextmanager
def staged(path: PathLike, replace: bool = False) -> Iterator[Path]:
    """Yield a path of the same name in a fresh temporary directory beside `path`; when the
    block ends without an error, every file written there (the file and any beside it, e.g.
    an ONNX model's external data) is renamed into `path`'s directory; otherwise removed.
    Without `replace`, a file that appeared at a target meanwhile is never overwritten."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    placed: list[Path] = []
    try:
        yield tmp / path.name
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == path.name):  # the file itself last
            target = path.parent / f.name
            if not replace:
                _place_new(f, target, placed)
            else:
                f.replace(target)
    except BaseException:
        for target in placed:  # a sidecar placed before the file itself failed
            target.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _place_new(source: Path, target: Path, placed: list[Path]) -> None:
    """Rename `source` to `target` unless `target` exists (checked by the link itself)."""
    try:
        os.link(source, target)
    except FileExistsError:
        raise ValueError(f"{target} appeared while it was being written; it is kept and the new file is not") from None
    except OSError:  # a file system without hard links
        if target.exists():
            raise ValueError(f"{target} appeared while it was being written; it is kept and the new file is not") from None
        source.replace(target)
    placed.append(target)


def write_atomically(path: PathLike, text: str, replace: bool = True) -> Path:
    """Write `text` (UTF-8) at `path` through a temporary file beside it and a rename."""
    with staged(path, replace=replace) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def save_figure(figure, path: PathLike) -> Path:
    """Save a matplotlib figure as a PNG at `path` atomically: a reader sharing the directory
    sees the old plot or the new one, never half of one."""
    with staged(path, replace=True) as tmp:
        figure.savefig(tmp, dpi=110, bbox_inches="tight")
    return Path(path)
