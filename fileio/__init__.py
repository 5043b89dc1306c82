"""Writing files so that a crash, a killed process or a full disk leaves the old file or the
new one whole, never part of one: the one writer of checkpoints, shards, vocabularies,
reports, run files and exports.

Everything is written under a temporary name beside its target (the same file system, so
the rename is atomic), flushed to the disk (`fsync`), renamed into place, and the
directory that now names it flushed too, so that after a power cut the name points at the
whole new file or still at the old one (POSIX leaves a rename's durability to the
directory's fsync; ext4 and XFS need it).

    write_atomically(path, text_or_bytes)   a file at once
    with staged(path) as tmp: ...           a file written by a library (h5py, onnx, torch),
                                            with any files beside it (ONNX external data)
    publish(tmp, target)                    a file written elsewhere beside `target`
    publish_directory(tmp, target)          a directory (a checkpoint, a transformers model):
                                            an existing one is replaced whole
    say(line)                               a line on stderr in one write, never torn: with
                                            PYTHONUNBUFFERED (torchrun jobs often set it) `print`
                                            writes a line and its newline apart, and the errors
                                            of two processes would share a line

A staged write's temporary directory is named for its target, host and process
(`.NAME.HOST-PID.XXXXXXXX`), so one that a killed process left (SIGKILL, a power cut) is
recognised and removed by the next write of the same target on that host.

A write that fails for want of space (`disk_full`: ENOSPC, or a quota's EDQUOT) is reported
by its writer as a `DiskFull`, a one-line ValueError naming what was not written and what
was kept, so a caller (a sweep) can tell it from the run's own failure by its type.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Union

__all__ = ["DiskFull", "disk_full", "fsync_directory", "publish", "publish_directory", "say", "staged",
           "write_atomically"]


class DiskFull(ValueError):
    """A write that failed for want of space; the message names what and what was kept."""


def disk_full(error: BaseException) -> bool:
    """Whether `error` is a write that failed for want of space (or a quota)."""
    return isinstance(error, DiskFull) or isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)

PathLike = Union[str, "os.PathLike[str]"]


def fsync_directory(directory: PathLike) -> None:
    """Flush `directory`'s entries (the names in it) to the disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_tree(directory: Path) -> None:
    """Every file under `directory`, then every directory, deepest first."""
    for root, dirs, files in os.walk(directory, topdown=False):
        for name in files:
            _fsync_file(Path(root) / name)
        fsync_directory(root)


def publish(tmp: PathLike, target: PathLike, replace: bool = True) -> Path:
    """Move the closed file `tmp` (beside `target`) to `target`: flushed, renamed, the directory
    flushed. Without `replace`, an existing `target` is never overwritten (a ValueError says so)."""
    tmp, target = Path(tmp), Path(target)
    _fsync_file(tmp)
    if replace:
        os.replace(tmp, target)
    else:
        _place_new(tmp, target)
    fsync_directory(target.parent)
    return target


def publish_directory(tmp: PathLike, target: PathLike) -> Path:
    """Move the directory `tmp` (beside `target`, every file in it closed) to `target`, an
    existing `target` replaced whole: the new tree flushed, the old one renamed aside, the new
    one renamed in, the parent flushed, the old one removed. A crash leaves `target` whole,
    old or new (or, between the two renames, the old one under `.<name>.old-<pid>`)."""
    tmp, target = Path(tmp), Path(target)
    _fsync_tree(tmp)
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        target.rename(old)
    tmp.rename(target)
    fsync_directory(target.parent)
    if old.exists():
        shutil.rmtree(old)
    return target


@contextlib.contextmanager
def staged(path: PathLike, replace: bool = False) -> Iterator[Path]:
    """Yield a path of the same name in a fresh temporary directory beside `path`; when the
    block ends without an error, every file written there (the file and any beside it, e.g.
    an ONNX model's external data) is published into `path`'s directory, the file itself
    last; otherwise all are removed. Without `replace`, a file that appeared at a target
    meanwhile is never overwritten."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{path.name}.{socket.gethostname()}-"
    _remove_stale(path.parent, prefix)
    tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}.", dir=path.parent))
    placed: list[Path] = []
    try:
        yield tmp / path.name
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == path.name):  # the file itself last
            _fsync_file(f)
            target = path.parent / f.name
            if replace:
                os.replace(f, target)
            else:
                _place_new(f, target)
            placed.append(target)
        fsync_directory(path.parent)
    except BaseException as e:
        if not replace:
            for target in placed:  # a sidecar placed before the file itself failed
                target.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno is not None and e.filename is None:
            # A write or flush that fails (a full disk) names no file: name the one being written.
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale(directory: Path, prefix: str) -> None:
    """Remove the staging directories `<prefix><pid>.*` in `directory` whose process is gone."""
    for tmp in directory.glob(f"{glob.escape(prefix)}*"):
        pid = tmp.name[len(prefix):].partition(".")[0]
        if not pid.isdigit() or not tmp.is_dir():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:  # killed mid-way: what it staged is no one's
            shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass  # alive (another user's process): not ours to remove


def write_atomically(path: PathLike, data: Union[str, bytes], replace: bool = True) -> Path:
    """Write `data` (text as UTF-8) at `path` (see the module docstring)."""
    with staged(path, replace=replace) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")
    return Path(path)


def _place_new(source: Path, target: Path) -> None:
    """Rename `source` to `target` unless `target` exists (checked by the link itself)."""
    appeared = f"{target} appeared while it was being written; it is kept and the new file is not"
    try:
        os.link(source, target)
    except FileExistsError:
        raise ValueError(appeared) from None
    except OSError:  # a file system without hard links
        if target.exists():
            raise ValueError(appeared) from None
        source.replace(target)
        return
    source.unlink()


def say(line: str) -> None:
    """`line` and its newline on stderr in one write, flushed (see the module docstring)."""
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()
