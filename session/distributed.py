"""Processes of a scaled-out run: replicas × virtual graphs on torch.distributed.

`torchrun --nproc-per-node N bert.py ...` (or any launcher that sets RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT, across nodes too) starts N processes; each builds the same
`Topology`. With R replicas of a graph placed on V virtual graphs (PopART's IPUs:
`__ipu_number`, V = 1 without pipelining), the world holds R × V processes:

    rank = replica · V + virtual_graph

so the stages of one replica are neighbours (on one node when V divides the processes
per node: pipeline traffic stays local) and a virtual graph's replicas are V apart.
Two kinds of process groups:

    replica group   the R processes holding one virtual graph: gradients are
                    mean-reduced and, with replicated tensor sharding, the
                    optimizer state is sharded over it
    stage group     the V processes of one replica: activations and gradients
                    flow between them point to point; the global gradient norm is
                    summed over it

The backend is gloo on CPU and NCCL on CUDA.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["Topology", "Watchdog", "init_topology", "local_device", "watchdog_for", "world_size_from_env"]


def world_size_from_env() -> int:
    """The number of processes the launcher started (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class Topology:
    rank: int = 0
    replicas: int = 1
    virtual_graphs: int = 1
    replica_group: Any = None  # None when replicas == 1
    stage_group: Any = None  # None when virtual_graphs == 1

    @property
    def world_size(self) -> int:
        return self.replicas * self.virtual_graphs

    @property
    def replica(self) -> int:
        return self.rank // self.virtual_graphs

    @property
    def virtual_graph(self) -> int:
        return self.rank % self.virtual_graphs

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def rank_of(self, replica: int, virtual_graph: int) -> int:
        return replica * self.virtual_graphs + virtual_graph

    def describe(self) -> str:
        return f"rank {self.rank} (replica {self.replica}, virtual graph {self.virtual_graph})"


def init_topology(replication_factor: Optional[int], virtual_graphs: int, device: torch.device,
                  timeout_s: float = 1800.0) -> Topology:
    """Join (or start) the process group the launcher describes and make the groups.

    `replication_factor` None means "every process not used by the pipeline": the
    world size divided by `virtual_graphs`. A world that does not split into
    replication_factor × virtual_graphs processes is a ValueError that says how to launch.
    """
    world = dist.get_world_size() if dist.is_initialized() else world_size_from_env()
    if replication_factor is None:
        if world % virtual_graphs:
            raise ValueError(
                f"{world} processes do not split into replicas of {virtual_graphs} pipeline processes "
                f"(one per virtual graph); launch a multiple of {virtual_graphs} processes")
        replication_factor = world // virtual_graphs
    if replication_factor * virtual_graphs != world:
        raise ValueError(
            f"training.replication_factor {replication_factor} × {virtual_graphs} virtual graph(s) needs "
            f"{replication_factor * virtual_graphs} processes, but {world} were launched; launch with "
            f"`torchrun --nproc-per-node {replication_factor * virtual_graphs} bert.py ...` or leave "
            "replication_factor unset to use every process")
    if world == 1:
        return Topology()
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    replica_group = stage_group = None
    # new_group is collective: every process creates every group, in the same order.
    for v in range(virtual_graphs):
        ranks = [r * virtual_graphs + v for r in range(replication_factor)]
        group = _group(ranks, world)
        if rank in ranks and replication_factor > 1:
            replica_group = group
    for r in range(replication_factor):
        ranks = [r * virtual_graphs + v for v in range(virtual_graphs)]
        group = _group(ranks, world)
        if rank in ranks and virtual_graphs > 1:
            stage_group = group
    return Topology(rank, replication_factor, virtual_graphs, replica_group, stage_group)


def _group(ranks: list[int], world: int) -> Any:
    return dist.group.WORLD if len(ranks) == world else dist.new_group(ranks)


def local_device(device: torch.device) -> torch.device:
    """A CUDA device per local process (LOCAL_RANK) when `device` names CUDA without an index."""
    if device.type == "cuda" and device.index is None and world_size_from_env() > 1:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


class Watchdog:
    """Stops every process, naming the culprit, when one process dies, stops or gets stuck.

    A thread in each process publishes a heartbeat in the launcher's key-value store
    every second, with the step and what the main loop is doing, and watches the next
    rank's (a ring, so the load on the store grows with the world, not its square):

    - no heartbeat for `timeout` / 4 (15 s by default): the process died or was stopped;
    - its main loop neither moved on nor waited for another process for `timeout`
      (computing, not blocked on a peer, not saving): it is stuck.

    The first process to see a fault, or to fail itself (`fail`), writes one message
    under an abort key; every process prints it as `error: ...` and exits with status 1
    within seconds, even from inside a blocked collective. Checkpoints are written to a
    temporary directory and renamed, so an exit never leaves one half-written.
    """

    def __init__(self, topology: Topology, timeout: float, store: Any = None):
        self.topology = topology
        self.timeout = timeout
        self.silence = timeout / 4
        self.interval = min(1.0, timeout / 20)
        self.store = dist.PrefixStore("groupbert/watchdog/", store or _own_store_client())
        self.step = 0
        self.phase = "starting"
        self.waiting = False
        self.busy = True  # until the first step ends: start-up and compilation take long
        self._progress = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="groupbert-watchdog", daemon=True)
        self._thread.start()
        # An exception nobody caught ends this process: say so to the others first (they
        # may be blocked waiting for it), then exit without running exit handlers that could
        # wait on them too.
        previous = sys.excepthook

        def excepthook(kind, value, tb):
            previous(kind, value, tb)
            self.fail(f"{kind.__name__}: {value}")

        sys.excepthook = excepthook

    # Called by the main thread: cheap attribute writes only.
    def progress(self, phase: str, *, waiting: bool = False) -> None:
        self.phase, self.waiting = phase, waiting
        self._progress += 1

    def step_done(self, step: int) -> None:
        self.step, self.busy = step, False
        self.progress("between steps")

    @contextlib.contextmanager
    def long_operation(self, phase: str):
        """Something that may legitimately take longer than the timeout (a checkpoint)."""
        busy, self.busy = self.busy, True
        self.progress(phase)
        try:
            yield
        finally:
            self.busy = busy
            self.progress(f"after {phase}")

    def fail(self, message: str) -> None:
        """This process failed: tell the others (they exit), before it exits itself."""
        self._abort(f"{self.topology.describe()} failed at step {self.step}: {message}")

    def await_verdict(self) -> None:
        """A collective failed here: find which process caused it, tell everyone and exit.

        The culprit is the process whose heartbeat stopped; one that wrote the abort key
        first is named by its own message. Returns when no culprit shows itself within
        the silence timeout (the caller then reports its own error).
        """
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a launcher tearing down must not cut the message
        store = dist.PrefixStore("groupbert/watchdog/", _own_store_client())
        rank, world = self.topology.rank, self.topology.world_size
        start = time.monotonic()
        first = {r: _read(store, f"hb/{r}") for r in range(world) if r != rank}
        while time.monotonic() - start < self.silence + 2:
            time.sleep(self.interval)
            if _read(store, "abort") is not None:
                self._exit(_read(store, "abort"))
            waited = time.monotonic() - start
            if waited < 3 * self.interval + 1:
                continue
            for r, value in first.items():
                if value is not None and _read(store, f"hb/{r}") == value:
                    _, _, step, _, _, phase = json.loads(value)
                    self._abort(f"rank {r} at step {step} ({phase}) stopped responding: no heartbeat for "
                                f"{waited:.0f} s (the process died or was stopped)")

    def close(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------ thread
    def _loop(self) -> None:
        rank, world = self.topology.rank, self.topology.world_size
        peer = (rank + 1) % world
        seen, moved = None, None
        last_seen = last_moved = time.monotonic()
        beat = 0
        while not self._stop.wait(self.interval):
            beat += 1
            try:
                self.store.set(f"hb/{rank}", json.dumps(
                    [beat, self._progress, self.step, self.waiting, self.busy, self.phase]))
                if self.store.check(["abort"]):
                    self._exit(self.store.get("abort").decode())
                now = time.monotonic()
                value = self.store.get(f"hb/{peer}").decode() if self.store.check([f"hb/{peer}"]) else None
            except Exception as e:  # the store is gone: its host (the launcher or rank 0) died
                if not self._stop.is_set():
                    self._exit(f"lost the rendezvous store ({type(e).__name__}: {e}); another process or the "
                               "launcher died")
                return
            if value is not None and value != seen:
                seen, last_seen = value, now
                _, progress, step, waiting, busy, phase = json.loads(value)
                if progress != moved or waiting or busy:
                    moved, last_moved = progress, now
            described = f"rank {peer}" + (" (before its first heartbeat)" if seen is None else "")
            if seen is not None:
                _, _, step, _, _, phase = json.loads(seen)
                described += f" at step {step} ({phase})"
            if now - last_seen > self.silence:
                self._abort(f"{described} stopped responding: no heartbeat for {now - last_seen:.0f} s "
                            "(the process died or was stopped)")
            elif now - last_moved > self.timeout:
                self._abort(f"{described} is stuck: no progress for {now - last_moved:.0f} s")

    def _abort(self, message: str) -> None:
        try:
            # The first message wins; later ones are consequences of it.
            message = self.store.compare_set("abort", "", message).decode() or message
        except Exception:
            pass
        self._exit(message)

    def _exit(self, message: str) -> None:
        sys.stdout.flush()
        print(f"error: {message}; stopping {self.topology.describe()}. The last checkpoint is intact: resume "
              "with --checkpoint-input", file=sys.stderr, flush=True)
        os._exit(1)


def _own_store_client() -> Any:
    """A connection of the watchdog's own to the launcher's key-value store (the process
    group's connection stays with the main thread)."""
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=datetime.timedelta(seconds=30))
    except (KeyError, ValueError, RuntimeError):
        return dist.distributed_c10d._get_default_store()


_WATCHDOG: Optional[Watchdog] = None


def watchdog_for(topology: Topology, timeout: float) -> Watchdog:
    """The process's one watchdog (several sessions in one process share it)."""
    global _WATCHDOG
    if _WATCHDOG is None or _WATCHDOG.topology.rank != topology.rank:
        _WATCHDOG = Watchdog(topology, timeout)
    return _WATCHDOG


def _read(store: Any, key: str) -> Optional[str]:
    try:
        return store.get(key).decode() if store.check([key]) else None
    except Exception:
        return None
