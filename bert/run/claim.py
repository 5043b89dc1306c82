"""Who may write a run directory: one process at a time, named to any other.

A run directory has one writer. `claim` takes it: an exclusive `flock` on `run.lock`,
held for the run's life, with the holder's host, pid, start time and command written in
it; a second writer is refused with one line naming the holder. The lock belongs to the
open file, so it ends with the process that took it, however it ends: a lock file left
by a killed holder is recognised as stale and taken over, and a job torchrun restarts
(whose old rank 0 is dead) claims its run again. A holder that ends normally removes
the file. A `run.lock` that is a symbolic link is refused, never written through.
`claim_fresh` takes a directory or, when it holds a run or is being claimed, the first free
`<dir>.N` beside it. Which directory a run asks for is bert/run/rundir.py's to say.
"""
from __future__ import annotations

import errno
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional

__all__ = ["LOCK_FILE", "RunClaim", "claim", "claim_fresh", "holds_run", "read_holder"]

LOCK_FILE = "run.lock"


class _InUse(ValueError):
    """The run directory is claimed by a live process (the message names it)."""


class RunClaim:
    """This process's exclusive claim on a run directory (`claim`); `release` ends it."""

    def __init__(self, directory: Path, fd: int, created: bool, stale: Optional[str]):
        self.directory, self._fd, self._created = directory, fd, created
        self.stale = stale  # the holder a killed process left in run.lock, taken over

    def release(self) -> None:
        """Remove run.lock (while still holding it) and let go; a directory this claim
        created and nothing was written into is removed too."""
        if self._fd is None:
            return
        path = self.directory / LOCK_FILE
        try:
            if os.path.samestat(os.fstat(self._fd), os.stat(path)):
                path.unlink()
        except OSError:
            pass  # gone or unreadable: the lock ends with the file descriptor all the same
        os.close(self._fd)
        self._fd = None
        if self._created:
            try:
                self.directory.rmdir()  # only when empty
            except OSError:
                pass

    def said(self, note: str) -> str:
        """`note`, and a line saying a stale run.lock was taken over when this claim took one."""
        if self.stale is None:
            return note
        stale = (f"{self.directory / LOCK_FILE} was left by a run that ended without releasing it ({self.stale}); "
                 "it no longer holds it: claimed")
        return f"{note}\n{stale}" if note else stale

    def __enter__(self) -> "RunClaim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __reduce__(self):  # an open lock does not travel to other processes
        raise TypeError("a RunClaim belongs to the process that took it")


def claim(directory: Path) -> RunClaim:
    """Claim `directory` (created if missing) for this process, or a ValueError naming the
    live holder (host, pid, since when, command) and what to do."""
    import fcntl

    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"training.output_dir {directory} is a file, not a directory; choose another output_dir")
    created = not directory.exists()
    path = directory / LOCK_FILE
    while True:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create the run directory {directory} ({e.strerror}); choose a "
                             "training.output_dir that can be written") from None
        try:
            # Never through a symbolic link: the file it names would be truncated and overwritten.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except FileNotFoundError:
            continue  # an empty directory its last holder removed as this claim began: made again
        except OSError as e:
            if created:
                _remove_if_empty(directory)
            if e.errno == errno.ELOOP:
                raise ValueError(f"cannot claim the run directory {directory}: {path} is a symbolic link (to "
                                 f"{os.readlink(path)}), which no run writes; remove the link, then run again") from None
            fix = ("remove it if it is no run's lock" if e.errno == errno.EISDIR else
                   "choose a training.output_dir this process can write")
            raise ValueError(f"cannot claim the run directory {directory}: {path}: {e.strerror}; {fix}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise _InUse(f"{directory} is in use by another run ({_current_holder(path)}); wait for it to end or "
                             "stop it (a run stopped by SIGINT/SIGTERM writes a checkpoint to resume from), or "
                             "choose another training.output_dir") from None
            raise ValueError(f"cannot lock {path} ({e.strerror}): the file system of {directory} does not "
                             "support file locks; put training.output_dir on one that does") from None
        try:  # the file locked must still be the one at `path`: a holder that ended removes it
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    stale = _holder_text(os.pread(fd, 4096, 0))
    record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S %z"),
              "command": shlex.join([os.path.basename(sys.executable), *sys.argv])[:500]}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    except OSError as e:  # a full disk: the lock holds without the note of who holds it
        print(f"note: cannot write who holds {path} ({e.strerror}); the claim holds all the same", flush=True)
    return RunClaim(directory, fd, created, stale or None)


def claim_fresh(base: Path) -> RunClaim:
    """`base`, or the first `<base>.N` that holds no run and no other process is claiming,
    claimed (two runs starting together never take the same one)."""
    n = 0
    while True:
        out = base if n == 0 else base.with_name(f"{base.name}.{n}")
        if not holds_run(out):
            try:
                held = claim(out)
            except _InUse:
                held = None
            if held is not None:
                if not holds_run(out):
                    return held
                held.release()
        n += 1


def holds_run(directory: Path) -> bool:
    """Whether `directory` holds anything but a lock file (a file in its place counts)."""
    if not directory.exists():
        return False
    if not directory.is_dir():
        return True
    return any(p.name != LOCK_FILE for p in directory.iterdir())


def _remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:
        pass


# How long a refused claim waits for the holder that has just taken the lock to write its record.
_RECORD_WAIT = 1.0


def _current_holder(path: Path) -> str:
    """`read_holder` of a lock file another process holds now. The holder writes its record
    just after it takes the lock, so a file still empty, or still naming a process of this
    host that has ended (the killed holder before it), is read again for up to a second."""
    deadline = time.monotonic() + _RECORD_WAIT
    while not _names_a_live_holder(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return read_holder(path)


def _names_a_live_holder(path: Path) -> bool:
    """Whether the lock file's record names a holder that may be alive (a process on this
    host that exists, or one on another host); False for an empty file or an ended process."""
    try:
        raw = path.read_bytes()[:4096]
        record = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    if not isinstance(record, dict) or record.get("host") != socket.gethostname():
        return isinstance(record, dict)
    try:
        os.kill(int(record["pid"]), 0)
    except ProcessLookupError:
        return False
    except (KeyError, TypeError, ValueError, OverflowError, PermissionError):
        return True  # no pid to check, or another user's live process
    return True


def read_holder(path: Path) -> str:
    """Who holds (or held) a run.lock, in words, from whatever the file holds."""
    try:
        with open(path, "rb") as f:
            raw = f.read(4096)
    except OSError as e:
        return f"its holder unknown: {path}: {e.strerror}"
    return _holder_text(raw) or f"its holder has not yet written {path.name}"


def _holder_text(raw: bytes) -> str:
    """'host H, pid P, since T: COMMAND' from a lock file's bytes; '' for an empty file."""
    if not raw.strip():
        return ""
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        record = None
    if not isinstance(record, dict):
        return f"{LOCK_FILE} holds no holder record: {_one_line(raw[:80].decode('utf-8', 'replace'), 80)!r}"
    parts = [f"{key} {_one_line(record[key], 100)}" for key in ("host", "pid", "since") if key in record]
    command = record.get("command")
    return (", ".join(parts) or "an unnamed holder") + (f": {_one_line(command, 200)}" if command else "")


def _one_line(value: Any, limit: int) -> str:
    return " ".join(str(value).split())[:limit]
