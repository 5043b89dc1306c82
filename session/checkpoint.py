"""Checkpoint directories: written whole or not at all, checked on every load.

A checkpoint is a directory of files (model.onnx [+ model.onnx.data], optimizer.pt,
session.json) plus `checksums.json`, the SHA-256 of each, written last. It is built
under a temporary sibling name (`.NAME.tmp-PID`) and renamed into place; an existing
checkpoint of the same name is first renamed aside (`.NAME.old-PID`) and removed only
after the new one is in place. A crash at any point therefore leaves either the old
checkpoint, or the new one, under NAME, or (between the two renames) the old one
under `.NAME.old-PID`, which `recover` puts back.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

__all__ = ["CHECKSUMS_FILE", "recover", "verify", "write"]

CHECKSUMS_FILE = "checksums.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def write(target: Path, writers: dict[str, Callable[[Path], None]]) -> Path:
    """Create checkpoint directory `target` atomically; each writer writes one file at the path it gets.

    A full disk is a ValueError that says so and leaves the previous checkpoint as it was.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        for name, writer in writers.items():
            writer(tmp / name)
        sums = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
        (tmp / CHECKSUMS_FILE).write_text(json.dumps(sums, indent=1) + "\n")
        _fsync_dir(tmp)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ValueError(f"the disk is full: cannot write checkpoint {target} ({e.strerror}); "
                             "free space and resume from the previous checkpoint, which is intact") from None
        raise
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        target.rename(old)
    tmp.rename(target)
    _fsync_dir(target.parent)
    if old.exists():
        shutil.rmtree(old)
    return target


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify(directory: Path, required: tuple[str, ...]) -> None:
    """Every required file present and each file equal to its recorded checksum, or a
    ValueError naming the checkpoint, the file and what is wrong with it."""
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
    except json.JSONDecodeError:
        raise ValueError(f"checkpoint {directory}: {CHECKSUMS_FILE} is corrupt (not JSON)") from None
    for name, expected in sums.items():
        path = directory / name
        if not path.exists():
            raise ValueError(f"checkpoint {directory}: {name} is missing (listed in {CHECKSUMS_FILE})")
        actual = _sha256(path)
        if actual != expected:
            raise ValueError(f"checkpoint {directory}: {name} is corrupt (SHA-256 {actual[:12]}… but "
                             f"{expected[:12]}… was written); resume from an earlier checkpoint")


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
