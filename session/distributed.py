"""Processes of a scaled-out run: replicas × virtual graphs on torch.distributed.

`torchrun --nproc-per-node N bert.py ...` (or any launcher that sets RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT, across nodes too) starts N processes. The entry point
joins them with `launch(...)`, a context manager that owns everything process-wide:
the process group, the watchdog thread and SIGINT/SIGTERM while it is active; all of
it is released when the block exits. Sessions created inside find it with `current()`;
a session itself changes no process-wide state.

Which process holds which replica and virtual graph is computed in one place,
`session.ranks.rank_layout` (torch-free: bert.py checks it before torch is imported).
Each session makes two kinds of process groups from it (`make_topology`), freed by
`close()`:

    replica group   the R processes holding one virtual graph: gradients are
                    mean-reduced and, with replicated tensor sharding, the
                    optimizer state is sharded over it
    stage group     the V processes of one replica: activations and gradients
                    flow between them point to point; the global gradient norm is
                    summed over it

The backend is gloo on CPU and NCCL on CUDA; every collective and message is written
for NCCL's semantics (device tensors, order-matched point-to-point messages).
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from fileio import say
from session.ranks import (RankLayout, check_rendezvous_address, nodes_from_env, process_device, rank_layout,
                           world_size_from_env)
from session.watchdog import Watchdog

__all__ = ["CommunicationFailed", "Launch", "RankLayout", "StopRequest", "Topology", "Watchdog", "current", "launch",
           "local_device", "make_topology", "rank_layout", "world_size_from_env"]


@dataclass(frozen=True)
class Topology(RankLayout):
    """The rank layout with the process groups made for it."""

    replica_group: Any = None  # None when replicas == 1
    stage_group: Any = None  # None when virtual_graphs == 1
    own_groups: tuple = ()  # the groups this topology created (freed by `close`)

    def close(self) -> None:
        """Free the process groups this topology made (collective, like their creation)."""
        for group in self.own_groups:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)


def make_topology(replication_factor: Optional[int], virtual_graphs: int) -> Topology:
    """The groups of `session.ranks.rank_layout` in the running process group.

    `replication_factor` None means "every process not used by the pipeline"; a world
    that does not split into replication_factor × virtual_graphs processes is a
    ValueError that names the process counts that fit.
    """
    world = dist.get_world_size() if dist.is_initialized() else world_size_from_env()
    if world > 1 and not dist.is_initialized():
        raise ValueError(f"this process is one of {world} the launcher started, but no process group is running: "
                         "create the session inside `with session.distributed.launch(...)` (bert.py does)")
    layout = rank_layout(world, virtual_graphs, replication_factor, dist.get_rank() if world > 1 else 0,
                         nodes_from_env())
    if world == 1:
        return Topology()
    replicas, rank = layout.replicas, layout.rank
    replica_group = stage_group = None
    made = []
    # new_group is collective: every process creates every group, in the same order.
    for v in range(virtual_graphs):
        ranks = [layout.rank_of(r, v) for r in range(replicas)]
        group = _group(ranks, world, made)
        if rank in ranks and replicas > 1:
            replica_group = group
    for r in range(replicas):
        ranks = [layout.rank_of(r, v) for v in range(virtual_graphs)]
        group = _group(ranks, world, made)
        if rank in ranks and virtual_graphs > 1:
            stage_group = group
    return Topology(rank, replicas, virtual_graphs, replica_group, stage_group, tuple(made))


def _group(ranks: list[int], world: int, made: list) -> Any:
    if len(ranks) == world:
        return dist.group.WORLD
    group = dist.new_group(ranks)
    made.append(group)
    return group


def local_device(device: torch.device) -> torch.device:
    """This process's device: `session.ranks.process_device`, given the GPUs torch sees."""
    visible = torch.cuda.device_count() if device.type == "cuda" else None
    return torch.device(process_device(str(device), visible=visible))


# ------------------------------------------------------------------ launch
_ACTIVE: list["Launch"] = []


def current() -> Optional["Launch"]:
    """The innermost active `launch` context, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


@dataclass
class StopRequest:
    """What `Launch.stop_on_signal` hands its block: the signal that asked to stop, if any."""

    request_stop: Callable[[], None]
    announce: bool
    signum: Optional[int] = None


class Launch:
    """The process group of a launched job, its watchdog and its signals, from `__enter__` to `__exit__`.

    With a launcher, `__enter__` joins the process group (unless the caller already did;
    then it leaves it to the caller), runs one collective over all processes (NCCL's
    batched point-to-point calls need one first), and starts the `Watchdog`; one process
    (no launcher) starts none of it. `__exit__` stops the watchdog and leaves the process
    group it joined. An exception leaving the block in one process stops every process,
    naming it (others may be blocked waiting for it); an exception with a true
    `collective` attribute was raised by every process alike and just propagates.

    The context owns SIGINT and SIGTERM (in the main thread, one process too; the
    handlers it replaced come back on exit); nothing else installs handlers for them.
    A signal stops the process at once (KeyboardInterrupt for SIGINT, SystemExit(128 +
    signal) for SIGTERM), after the watchdog has had the chance to name a failed peer (a
    launcher tearing the job down sends SIGTERM when a worker died). Inside
    `stop_on_signal(...)` (the run loop's steps) the first signal only asks to stop after
    the current step; a second one stops at once.
    """

    def __init__(self, device: str | torch.device = "cpu", fault_timeout: float = 60.0,
                 collective_timeout: float = 600.0):
        if not fault_timeout > 0:
            raise ValueError(f"fault_timeout must be > 0 seconds, got {fault_timeout}")
        if not collective_timeout > 0:
            raise ValueError(f"collective_timeout must be > 0 seconds, got {collective_timeout}")
        self.device = local_device(torch.device(device))
        self.fault_timeout = fault_timeout
        self.collective_timeout = collective_timeout
        self.watchdog: Optional[Watchdog] = None
        self._joined = False
        self._previous_handlers: dict[int, Any] = {}
        self._stop: Optional[StopRequest] = None

    @property
    def distributed(self) -> bool:
        return dist.is_initialized() and dist.get_world_size() > 1

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def __enter__(self) -> "Launch":
        rank, timeout = int(os.environ.get("RANK", "0")), self.collective_timeout
        # gloo's own connect may wait several times the timeout for a peer that never calls:
        # past it (and a margin for the store's retries) the process ends, saying why.
        overdue = threading.Timer(timeout + 10, _give_up, (_cannot_reach(
            rank, "while connecting", TimeoutError(f"no connection from the others in {timeout:g} s"), timeout),))
        overdue.daemon = True
        try:
            if world_size_from_env() > 1 and not dist.is_initialized():
                check_rendezvous_address()
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)
                backend = "nccl" if self.device.type == "cuda" else "gloo"
                overdue.start()
                _join(backend, datetime.timedelta(seconds=timeout))
                self._joined = True
            if self.distributed:
                dist.all_reduce(torch.zeros(1, device=self.device))
        except RuntimeError as e:
            overdue.cancel()
            if self._joined:
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
                self._joined = False
            if not _communication_error(e):
                raise
            raise CommunicationFailed(_cannot_reach(rank, "while connecting", e, timeout)) from e
        overdue.cancel()
        if self.distributed:
            self.watchdog = Watchdog(dist.get_rank(), dist.get_world_size(), self.fault_timeout, _attempt() or "0")
        if threading.current_thread() is threading.main_thread():  # only there can Python take signals
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        _ACTIVE.append(self)
        return self

    @contextlib.contextmanager
    def stop_on_signal(self, request_stop: Callable[[], None], announce: bool = False) -> Iterator[StopRequest]:
        """While the block runs, the first SIGINT/SIGTERM calls `request_stop()` (from the
        signal handler: it should only set a flag the block reads) and is recorded in the
        `StopRequest`'s `signum`; with `announce`, one line says so. A second signal stops
        at once, as outside the block."""
        outer, self._stop = self._stop, StopRequest(request_stop, announce)
        try:
            yield self._stop
        finally:
            self._stop = outer

    def _on_signal(self, signum: int, frame: Any) -> None:
        stop = self._stop
        if stop is not None and stop.signum is None:  # the first signal: stop after this step
            stop.signum = signum
            stop.request_stop()
            if stop.announce:
                print(f"\n{signal.Signals(signum).name}: stopping after this step and writing a checkpoint "
                      "(again to stop at once)", flush=True)
            return
        if self.watchdog is not None:
            self.watchdog.name_failed_peer()
        if signum == signal.SIGINT or stop is not None:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def __exit__(self, kind, value, tb) -> None:
        if _ACTIVE and _ACTIVE[-1] is self:
            _ACTIVE.pop()
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()
        if self.watchdog is not None:
            if value is not None and not getattr(value, "collective", False) and isinstance(value, Exception):
                if isinstance(value, RuntimeError) and _communication_error(value):
                    self.watchdog.await_verdict()  # a peer failed: name it (and exit)
                    self.watchdog.abort(_cannot_reach(self.rank, self.watchdog.where(), value,
                                                      self.collective_timeout))
                self.watchdog.fail(f"{type(value).__name__}: {value}")  # exits, the others too
            if value is None:
                # Every process says it is done before any leaves: an exit is then no death.
                self.watchdog.finished()
                dist.all_reduce(torch.zeros(1, device=self.device))
            self.watchdog.close()
            self.watchdog = None
        if self._joined:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            # Free the groups now, while the interpreter runs: a group that lives on (a session
            # not closed, in a reference cycle) into the interpreter's exit has worker threads
            # that release their last operations' tensors then, and that aborts the process
            # ("terminate called without an active exception"). Destroying a group joins its
            # threads.
            gc.collect()
            self._joined = False

    # Called by the run loop and sessions.
    def note_run_dir(self, path: Any) -> None:
        """The run writes its checkpoints in `path`: a fault message that cannot ask the job's
        store for the newest one (its host died) finds it there."""
        if self.watchdog is not None:
            self.watchdog.run_dir = Path(path)

    def note_checkpoint(self, path: Any) -> None:
        """A verified checkpoint was written (or resumed from): fault messages name it (rank 0
        publishes it to every process; each process keeps what it knows itself)."""
        if self.watchdog is not None:
            self.watchdog.note_checkpoint(str(path), publish=self.rank == 0)


def _give_up(message: str) -> None:
    """From a timer thread: the main thread is stuck in a call that does not return in time."""
    sys.stdout.flush()
    say(f"error: {message}")
    os._exit(2)


class CommunicationFailed(ConnectionError):
    """The processes of a job cannot reach each other (the message says what to set)."""


def _communication_error(error: BaseException) -> bool:
    """Whether `error` is a process failing to reach the others: torch.distributed's own types
    (its store, its network, a backend such as NCCL: `DistError`), a connection or a timeout,
    or gloo's transport, which raises a plain RuntimeError that names its source file
    (`[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer`)."""
    return isinstance(error, (dist.DistError, ConnectionError, TimeoutError)) or "gloo/transport/" in str(error)


def _cannot_reach(rank: int, where: str, error: BaseException, timeout: float) -> str:
    """One line: which process could not reach the others while doing what, and what to set
    (docs/distributed.md, "Networks"); the likely cause is an interface the others cannot reach."""
    first = " ".join(str(error).split("\nException raised from")[0].split())[:150]
    return (f"rank {rank} cannot reach the other processes {where} after up to {timeout:g} s "
            f"({type(error).__name__}: {first}): set GLOO_SOCKET_IFNAME (gloo) or NCCL_SOCKET_IFNAME (NCCL) to the "
            "interface the nodes share (`ip -brief address`) and check that every node reaches MASTER_ADDR "
            "(--rdzv-endpoint); more in docs/distributed.md, \"Networks\"")


def _join(backend: str, timeout: datetime.timedelta) -> None:
    """`init_process_group`, safe across `torchrun --max-restarts`.

    torchrun shares its key-value store with the workers and keeps it across restarts, so
    a restarted worker group would read the dead group's connection keys (pytorch issue
    135712): every attempt after the first gets a namespace of its own. On one node all
    workers restart together and agree on the attempt number; across nodes the agents
    count restarts apart, so there the launcher's own fix is needed.
    """
    env = os.environ
    attempt = _attempt()
    if attempt is not None and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 \
            and env.get("LOCAL_WORLD_SIZE") != env.get("WORLD_SIZE") and env.get("RANK") == "0":
        print("note: torchrun --max-restarts over several nodes needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
              "in every launcher's environment (pytorch issue 135712)", file=sys.stderr, flush=True)
    if attempt in (None, "0"):
        dist.init_process_group(backend, timeout=timeout)
        return
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"groupbert/attempt{attempt}/", store),
                            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), timeout=timeout)


def _attempt() -> Optional[str]:
    """torchrun's restart count when its workers share the launcher's key-value store
    (which outlives a restart); None when each worker group gets a store of its own
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, other launchers): nothing of a dead group is
    there to meet, and agents on several nodes, which count restarts apart, agree."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def launch(device: str | torch.device = "cpu", fault_timeout: float = 60.0,
           collective_timeout: float = 600.0) -> Launch:
    """`with launch(device, fault_timeout, collective_timeout):` around everything a launched process does."""
    return Launch(device, fault_timeout, collective_timeout)
