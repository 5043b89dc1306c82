"""A launched process's dead man's switch: ends that process when its heartbeat stops.

The watchdog of a launched process (session/watchdog.py) starts one `DeadMan`: a
small process running this file (standard library only: it starts in milliseconds and
holds no torch) to which the watchdog's thread writes one byte per heartbeat. When no
byte has come for `fault_timeout` + `grace` seconds of the switch's own running time,
the process is stopped (SIGSTOP) or hung. By then its peers have named it and stopped
themselves, but a launcher's SIGTERM cannot reach a stopped process (torchrun waits
30 s before its SIGKILL), so the job would hang on. The switch, which always shares the
process's PID namespace (a peer in another container or on another node cannot reach
it), ends it: SIGKILL, then SIGCONT for a process that is its namespace's init (a
container's PID 1 ignores a SIGKILL sent from inside its namespace), which then runs
on, reads the job's abort message and exits.

Silence is counted in the switch's own waits, so a process group stopped and continued
as a whole (Ctrl-Z, `fg`) is not silent for the time it stood still. The switch leaves
when the pipe closes (`close`, or the process ended) or the process is no longer its
parent; SIGINT and SIGTERM are the launched process's to handle and ignored here.

    python -I -S deadman.py FD PID RANK FAULT_TIMEOUT GRACE     (what DeadMan starts)
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys

__all__ = ["DeadMan"]


class DeadMan:
    """The launched process's side: starts the switch, feeds it, lets it go."""

    def __init__(self, rank: int, fault_timeout: float, grace: float):
        read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # a stopped switch must never block a heartbeat
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), str(read), str(os.getpid()), str(rank),
                 str(fault_timeout), str(grace)],
                pass_fds=(read,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env={})  # needs none
        finally:
            os.close(read)

    @property
    def pid(self) -> int:
        return self._process.pid

    def feed(self) -> None:
        """One heartbeat."""
        if self._write >= 0:
            with contextlib.suppress(OSError):  # the pipe is full (the switch is stopped too) or closed
                os.write(self._write, b".")

    def close(self) -> None:
        """The process leaves the launch normally: the switch exits."""
        if self._write < 0:
            return
        os.close(self._write)
        self._write = -1
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def _watch(fd: int, pid: int, rank: int, fault_timeout: float, grace: float) -> int:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    tick = min(1.0, fault_timeout / 10)
    silent = 0.0
    while os.getppid() == pid:
        ready, _, _ = select.select([fd], [], [], tick)
        if ready:
            if not os.read(fd, 4096):
                return 0  # closed: the watchdog stopped, or the process ended
            silent = 0.0
            continue
        silent += tick
        if silent >= fault_timeout + grace:
            # One write, as fileio.say writes (this isolated interpreter, -I -S, imports no project module).
            sys.stderr.write(f"error: rank {rank} (process {pid}) sent no heartbeat for {silent:.0f} s: it is stopped "
                             "or hung; ending it so that the launcher stops the job\n")
            sys.stderr.flush()
            for signum in (signal.SIGKILL, signal.SIGCONT):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
            return 0
    return 0


if __name__ == "__main__":
    fd, pid, rank, fault_timeout, grace = sys.argv[1:6]
    sys.exit(_watch(int(fd), int(pid), int(rank), float(fault_timeout), float(grace)))
