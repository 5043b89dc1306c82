"""Process-wide settings that make a training step fast, applied once by the product's entry
point (bert.py) before any work, so that what the benchmarks measure is what users get
(bench/train_throughput.py and bench/step_profile.py apply the same). Torch-free: bert.py
applies them before it imports torch.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Mapping, Optional

__all__ = ["Threads", "choose_threads", "retain_freed_memory", "threads_source", "use_cpu_threads"]

# glibc's malloc serves blocks above its mmap threshold (at most 32 MiB, adjusted as blocks
# are freed) from fresh pages and returns them on free, so every training step faults in
# its large tensors again: the MLM logits and their gradient (640 x 30522 fp32, 78 MB each)
# cost 68 ms of page faults per allocation on the 2-core Zen 4 VM, against 8 ms to fill
# memory already held; a BERT step (hidden 256, 4 layers, batch 32) spends 10 % of its
# CPU time so. Raising both thresholds keeps freed memory for the next step.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def retain_freed_memory(threshold: int = 1 << 30) -> bool:
    """glibc's malloc keeps freed blocks up to `threshold` bytes for reuse (mallopt
    M_MMAP_THRESHOLD and M_TRIM_THRESHOLD) instead of returning them to the system. The
    process then holds its peak memory. Returns whether it applied (False where the C
    library is not glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, min(2 * threshold, 2**31 - 1)))


# ------------------------------------------------------------------------- threads
# torch's default (OpenMP's and MKL's) is one intra-op thread per core of the process's
# affinity. It reads neither the cgroup CPU quota (a Kubernetes pod limited to 1.5 CPUs of a
# 64-core node runs 64 threads) nor how many processes share the node (each of torchrun's
# N processes takes every core). Threads beyond the CPUs granted wait for each other: on a
# busy 2-core VM a fine-tune ran 6.9x slower on 2 threads than on 1 (issue 51).


@dataclass(frozen=True)
class Threads:
    """An intra-op thread count and where it came from ("OMP_NUM_THREADS=1", "affinity 2 CPUs,
    cgroup quota 1.5 CPUs / 2 local processes")."""

    count: int
    source: str


_applied: Optional[Threads] = None  # what use_cpu_threads gave this process


def choose_threads(env: Mapping[str, str] = os.environ, affinity: Optional[Collection[int]] = None,
                   root: Path = Path("/")) -> Threads:
    """OMP_NUM_THREADS when set; else the CPUs this process may use (its affinity, capped by
    its cgroups' CPU quota, rounded up), shared among torchrun's processes on this node
    (LOCAL_WORLD_SIZE; srun binds each task to CPUs of its own, so its affinity is its share
    already). At least 1. `root` holds /proc and /sys (tests give a fabricated one)."""
    explicit = env.get("OMP_NUM_THREADS", "").strip()
    if explicit:
        return Threads(_explicit_count(explicit), f"OMP_NUM_THREADS={explicit}")
    cpus = len(affinity if affinity is not None else _affinity())
    quota = cgroup_cpu_quota(root)
    local = int(env["LOCAL_WORLD_SIZE"]) if env.get("LOCAL_WORLD_SIZE", "").isdigit() else 1
    usable = cpus if quota is None else min(cpus, math.ceil(quota))
    source = (f"affinity {_cpus(cpus)}" + ("" if quota is None else f", cgroup quota {_cpus(quota)}")
              + (f" / {local} local processes" if local > 1 else ""))
    return Threads(max(1, usable // max(local, 1)), source)


def use_cpu_threads() -> Threads:
    """The entry point's thread count (choose_threads), given to torch, OpenMP and MKL as
    OMP_NUM_THREADS before torch is imported; the compiled ops follow torch's count
    (at::parallel_for). An explicit OMP_NUM_THREADS stands, and a process that imported torch
    first (a test, a notebook calling bert.py's main) keeps the count it set."""
    global _applied
    threads = choose_threads()
    if "torch" not in sys.modules:
        if not os.environ.get("OMP_NUM_THREADS", "").strip():
            os.environ["OMP_NUM_THREADS"] = str(threads.count)
        _applied = threads
    return threads


def threads_source(count: int) -> str:
    """Where `count`, the threads torch runs with, came from (for the kernels line)."""
    if _applied is not None and _applied.count == count:
        return _applied.source
    return "set by the caller or torch's default"


def cgroup_cpu_quota(root: Path = Path("/")) -> Optional[float]:
    """The CPUs this process's cgroups allow it (quota / period; the tightest of its cgroup and
    those above it), None when none sets a quota. cgroup v2: cpu.max ("150000 100000", "max
    100000"); v1: cpu.cfs_quota_us (-1: none) / cpu.cfs_period_us. The cgroup is found in
    /proc/self/cgroup; a container without a cgroup namespace of its own sees a path that is
    not under its /sys/fs/cgroup, and finds its limit at the mount's top."""
    limits = []
    for line in _read(root / "proc/self/cgroup").splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2: one hierarchy
            limits += [_v2_quota(d) for d in _cgroup_dirs(root / "sys/fs/cgroup", path)]
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own mount ("cpu" or "cpu,cpuacct")
            limits += [_v1_quota(d) for d in _cgroup_dirs(root / "sys/fs/cgroup" / controllers, path)]
    return min((q for q in limits if q is not None), default=None)


def _explicit_count(value: str) -> int:
    first = value.split(",")[0].strip()  # OpenMP's nested form "4,2": the outer level is torch's
    if not first.isdigit() or int(first) < 1:
        raise ValueError(f"OMP_NUM_THREADS={value!r} is not a number of threads: set a whole number, 1 on a "
                         "machine shared with other jobs, or unset it to use as many as the CPUs this process "
                         "may use allow")
    return int(first)


def _cpus(n: float) -> str:
    return f"{n:.3g} CPU{'' if n == 1 else 's'}"


def _affinity() -> Collection[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)


def _cgroup_dirs(mount: Path, path: str) -> list[Path]:
    """The cgroup's directory under `mount` and every one above it, the mount last."""
    parts = [p for p in path.split("/") if p]
    return [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _v2_quota(directory: Path) -> Optional[float]:
    quota, _, period = _read(directory / "cpu.max").partition(" ")
    return _ratio(quota, period)


def _v1_quota(directory: Path) -> Optional[float]:
    return _ratio(_read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us"))


def _ratio(quota: str, period: str) -> Optional[float]:
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:  # "max", a missing or garbled file: no quota here
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None  # v1's -1: none


def _read(path: Path) -> str:
    """The file's text, "" where it cannot be read (no such file: not this cgroup version)."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""
