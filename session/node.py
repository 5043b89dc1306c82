"""Processes on this node, as a launched process's watchdog sees its peers (session/watchdog.py):
the PID namespace it shares with them, a process's state and start time in /proc, and ending one.

A peer stopped or frozen together with its dead man's switch (SIGSTOP, `docker pause`, a cgroup
freezer) is ended with SIGKILL by a peer in the same PID namespace. Under the cgroup v2 freezer
a SIGKILL ends a frozen process; under cgroup v1's (`freezer.state` FROZEN) it waits until the
group is thawed, and the job would hang on that process. `end` therefore thaws the freezer group
that holds a process it killed, where it may write it, so that the kill lands; where it may not,
it says which file holds the process frozen.
"""
from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Optional

__all__ = ["end", "exited", "frozen_by", "gone_here", "node_identity", "start_time", "stat"]

_FREEZER_V1 = Path("/sys/fs/cgroup/freezer")
_CGROUP_V2 = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))


def node_identity() -> Optional[str]:
    """This process's PID namespace on this boot: processes with the same identity see
    each other's process ids in /proc. None when /proc is not this namespace's (a PID
    namespace without its own /proc mount): then no peer is looked up there."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")  # e.g. "pid:[4026531836]"
        if os.readlink("/proc/self") != str(os.getpid()):
            return None
    except OSError:
        return None
    return f"{boot}/{namespace}"


def stat(pid: int) -> Optional[list[str]]:
    """The fields of /proc/<pid>/stat after the command name (state first), None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> Optional[str]:
    """When the process started, in clock ticks since boot (stat field 22): a process id
    that names another process since (reused) has another start time."""
    fields = stat(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def exited(pid: int) -> bool:
    """Whether process `pid` of this namespace has ended: no such process, or a zombie."""
    fields = stat(pid)
    return fields is None or fields[0] in ("Z", "X")


def gone_here(beat: dict, node: Optional[str]) -> bool:
    """Whether the process of a heartbeat ran in this PID namespace (`node`) and is gone:
    no such process, a zombie, or its id reused by a process started later."""
    if node is None or beat.get("node") != node:
        return False
    if exited(int(beat["pid"])):
        return True
    started = start_time(int(beat["pid"]))
    return beat.get("started") is not None and started is not None and started != beat["started"]


def frozen_by(pid: int) -> Optional[Path]:
    """The freezer control file that holds `pid` frozen (cgroup v1 `freezer.state` FROZEN or
    FREEZING, cgroup v2 `cgroup.freeze` 1), or None."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "freezer" in controllers.split(","):
            control = _FREEZER_V1 / path.lstrip("/") / "freezer.state"
            if _read(control) in ("FROZEN", "FREEZING"):
                return control
        elif controllers == "":
            for root in _CGROUP_V2:
                control = root / path.lstrip("/") / "cgroup.freeze"
                if _read(control) == "1":
                    return control
    return None


def end(pids: list[int]) -> str:
    """SIGKILL to each of `pids` at once (a rank and its dead man's switch), then a thaw of a
    cgroup v1 freezer group that holds one frozen, so that its kill lands (v2's freezer lets a
    SIGKILL through); "" when nothing was frozen, else what was done, in words for the job's
    message. Nothing waits here: the caller's message must come before its peers see the end."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    said = []
    for control in dict.fromkeys(c for c in map(frozen_by, pids) if c is not None and c.name == "freezer.state"):
        try:
            control.write_text("THAWED")
            said.append(f"it was frozen by the cgroup freezer ({control}): thawed so that the SIGKILL ends it")
        except OSError as e:
            said.append(f"it is frozen by the cgroup freezer ({control}) and cannot end until it is thawed "
                        f"({e.strerror}): thaw it, or stop its container")
    return "; ".join(said)


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip()
    except OSError:
        return None
