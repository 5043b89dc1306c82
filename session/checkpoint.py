"""Checkpoint directories: written whole or not at all, checked before anything is read.

A checkpoint is a directory of files plus `checksums.json`, the SHA-256 of each, written
last. It is built under a temporary sibling name (`.NAME.tmp-PID`) and renamed into
place; an existing checkpoint of the same name is first renamed aside
(`.NAME.old-PID`) and removed only after the new one is in place. A crash at any point
therefore leaves either the old checkpoint, or the new one, under NAME, or (between
the two renames) the old one under `.NAME.old-PID`, which `recover` puts back.

`write` is collective when given a `Collective` (the processes of a launched run):
rank 0 makes the temporary directory, every process writes the files it holds
(a pipeline stage's weights, a shard of the optimizer moments) into it, each file's
owner hashes it, and rank 0 writes the checksums and renames, or, if any process
failed, removes everything and every process raises the same error. No process ever
holds the whole model to write it.

Large tensor files are written in the safetensors layout (an 8-byte header length, a
JSON header of names, dtypes, shapes and byte ranges, then the raw little-endian
bytes), whose header depends only on names and shapes, so several processes can each
write their byte ranges of one file (`TensorFile`); `safetensors.safe_open` reads
any slice of any tensor without loading the rest.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

__all__ = ["CHECKSUMS_FILE", "Collective", "TensorFile", "recover", "verify", "write"]

CHECKSUMS_FILE = "checksums.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


class Collective:
    """What `write` needs of the processes: a rank, gather to rank 0 and broadcast from it
    (torch.distributed's object collectives in a run; the identity in one process)."""

    rank = 0

    def gather(self, value: Any) -> Optional[list[Any]]:
        return [value]

    def broadcast(self, value: Any) -> Any:
        return value


def write(target: Path, writers: dict[str, Callable[[Path], None]], owned: Optional[Iterable[str]] = None,
          collective: Optional[Collective] = None,
          published: Optional[Callable[[Path], None]] = None) -> Optional[Path]:
    """Create checkpoint directory `target` atomically (collective with `collective`).

    Each process passes the writers of the files it writes (each writes one file, or
    its part of one, at the path it gets) and the names of the files it owns (hashes;
    default: all it writes). A full disk is a ValueError that says so and leaves the
    previous checkpoint as it was. `published(target)` runs on rank 0 the moment the
    checkpoint is in place (before the others hear of it: one of them may be gone).
    Returns `target` on rank 0, None elsewhere.
    """
    collective = collective or Collective()
    lead = collective.rank == 0
    tmp = None
    if lead:
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        problem = _attempt(lambda: _fresh_directory(tmp), target)
        tmp = (str(tmp), problem)
    tmp, problem = collective.broadcast(tmp)
    if problem is not None:
        raise ValueError(problem)
    tmp = Path(tmp)
    problem = None
    for name, writer in writers.items():
        problem = problem or _attempt(lambda: writer(tmp / name), target)
    collective.gather(None)  # every process has written: now each owner hashes its files
    sums: dict[str, str] = {}
    if problem is None:
        for name in sorted(set(writers) if owned is None else set(owned)):
            problem = problem or _attempt(lambda: sums.update({name: _sha256(tmp / name)}), target)
    reports = collective.gather((problem, sums))
    outcome = None
    if lead:
        problems = [p for p, _ in reports if p is not None]
        if problems:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome = problems[0]
        else:
            sums = {k: v for _, s in reports for k, v in s.items()}
            outcome = _attempt(lambda: _publish(tmp, target, sums), target)
            if outcome is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            elif published is not None:
                published(target)
    outcome = collective.broadcast(outcome)
    if outcome is not None:
        raise ValueError(outcome)
    return target if lead else None


def _fresh_directory(tmp: Path) -> None:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()


def _attempt(action: Callable[[], None], target: Path) -> Optional[str]:
    """None when `action` succeeds, else the one-line error every process reports."""
    try:
        action()
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return (f"the disk is full: cannot write checkpoint {target} ({e.strerror}); free space and resume from "
                    "the previous checkpoint, which is intact")
        where = f"{e.filename}: " if e.filename else ""
        return f"cannot write checkpoint {target}: {where}{e.strerror or e}"
    return None


def _publish(tmp: Path, target: Path, sums: dict[str, str]) -> None:
    (tmp / CHECKSUMS_FILE).write_text(json.dumps(dict(sorted(sums.items())), indent=1) + "\n")
    _fsync_dir(tmp)
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        target.rename(old)
    tmp.rename(target)
    _fsync_dir(target.parent)
    if old.exists():
        shutil.rmtree(old)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify(directory: Path, required: Sequence[str], only: Optional[Iterable[str]] = None) -> None:
    """Every required file present and each file (or each of `only`) equal to its recorded
    checksum, or a ValueError naming the checkpoint, the file and what is wrong with it.
    Nothing of the checkpoint but `checksums.json` is read before this passes."""
    if not directory.is_dir():
        raise ValueError(f"checkpoint {directory} does not exist (or is not a directory)")
    for name in required:
        if not (directory / name).exists():
            raise ValueError(f"{directory} is not a complete checkpoint: {name} is missing")
    sums_path = directory / CHECKSUMS_FILE
    if not sums_path.exists():
        raise ValueError(f"checkpoint {directory} has no {CHECKSUMS_FILE}: it was not written by this version "
                         "or was copied incompletely; copy it again or start from its weights with "
                         "training.init_from")
    try:
        sums = json.loads(sums_path.read_text())
        if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
            raise ValueError
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"checkpoint {directory}: {CHECKSUMS_FILE} is corrupt (not a JSON object of checksums); "
                         "resume from an earlier checkpoint") from None
    names = list(sums) if only is None else list(dict.fromkeys(only))
    for name in names:
        if name not in sums:
            raise ValueError(f"checkpoint {directory}: {name} has no checksum in {CHECKSUMS_FILE}")
        path = directory / name
        if not path.exists():
            raise ValueError(f"checkpoint {directory}: {name} is missing (listed in {CHECKSUMS_FILE})")
        actual = _sha256(path)
        if actual != sums[name]:
            raise ValueError(f"checkpoint {directory}: {name} is corrupt (SHA-256 {actual[:12]}… but "
                             f"{sums[name][:12]}… was written); resume from an earlier checkpoint")


def recover(run_dir: Path) -> list[str]:
    """Tidy what interrupted saves left in `run_dir`; returns what was done, one line each."""
    done = []
    if not run_dir.is_dir():
        return done
    for path in sorted(run_dir.iterdir()):
        name = path.name
        if not name.startswith(".") or not path.is_dir():
            continue
        if ".tmp-" in name:  # never finished: the checkpoint it was to become is not in it
            shutil.rmtree(path)
            done.append(f"removed the unfinished checkpoint {path}")
        elif ".old-" in name:
            final = run_dir / name[1:].split(".old-")[0]
            if final.exists():
                shutil.rmtree(path)
                done.append(f"removed {path}, replaced by {final}")
            else:  # the crash came between the two renames: the old one is the checkpoint
                path.rename(final)
                done.append(f"restored {final} from {path}")
    return done


class TensorFile:
    """The safetensors layout of flat fp32 tensors `names` of `sizes` elements, in that order.

    The header depends only on names and sizes, so every process computes the same
    byte range for every element: `write(path, name, first, values)` writes `values`
    as elements `first...` of tensor `name` (several processes may write disjoint
    ranges of one file); `read(path, name, first, count)` reads a range back.
    """

    def __init__(self, names: Sequence[str], sizes: Sequence[int]):
        self.names = list(names)
        self.sizes = [int(n) for n in sizes]
        header, offset = {}, 0
        self._offsets = {}
        for name, numel in zip(self.names, self.sizes):
            size = 4 * numel
            header[name] = {"dtype": "F32", "shape": [numel], "data_offsets": [offset, offset + size]}
            self._offsets[name] = offset
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % 8)  # the data starts 8-byte aligned
        self.header = len(text).to_bytes(8, "little") + text
        self.size = len(self.header) + offset

    def create(self, path: Path) -> None:
        """Write the header (one process; the others' ranges may come before or after it)."""
        with open(path, "r+b" if path.exists() else "wb") as f:
            f.write(self.header)

    def write(self, path: Path, name: str, first: int, values: np.ndarray) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            data = np.ascontiguousarray(values, dtype="<f4").tobytes()
            position = len(self.header) + self._offsets[name] + 4 * first
            while data:
                written = os.pwrite(fd, data, position)
                data, position = data[written:], position + written
        finally:
            os.close(fd)

    @staticmethod
    def read(path: Path, name: str, first: int = 0, count: Optional[int] = None) -> np.ndarray:
        """Elements `first...` (`count` of them; default to the end) of the flat tensor `name`."""
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            flat = f.get_slice(name)
            end = flat.get_shape()[0] if count is None else first + count
            return flat[first:end]
