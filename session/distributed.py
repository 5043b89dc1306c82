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
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from session import checkpoint as checkpoints
from session.deadman import DeadMan
from session.node import end, gone_here, node_identity, start_time
from session.ranks import (RankLayout, check_rendezvous_address, nodes_from_env, process_device, rank_layout,
                           world_size_from_env)

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
            self.watchdog = Watchdog(dist.get_rank(), dist.get_world_size(), self.fault_timeout)
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
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(2)


class CommunicationFailed(ConnectionError):
    """The processes of a job cannot reach each other (the message says what to set)."""


# Words of the errors torch.distributed raises when a connection fails or times out.
_COMMUNICATION_WORDS = ("connect", "Connection", "peer", "Timed out", "timed out", "timeout", "Timeout", "unreachable",
                        "refused", "Socket", "socket", "closed by remote", "ECONNRESET", "NCCL error")


def _communication_error(error: BaseException) -> bool:
    return isinstance(error, getattr(dist, "DistNetworkError", ())) or \
        any(word in str(error) for word in _COMMUNICATION_WORDS)


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


# ---------------------------------------------------------------- watchdog
_FINISHED = "finished"


class Watchdog:
    """Stops every process, naming the culprit, when one process dies or stops.

    It measures liveness, never step length: a thread in each process publishes a
    heartbeat in the launcher's key-value store every `fault_timeout` / 10 seconds (1 s
    at most) and at once when the step changes, whatever the main thread is doing (a
    step may take minutes), and watches the next rank's (a ring: the load on the store
    grows with the world, not its square). The next rank failed when

    - it shares this process's PID namespace (the same boot and namespace, which each
      heartbeat carries: a host name is not enough, containers on one node share it)
      and its process is gone (checked every heartbeat), or
    - its heartbeat has not changed for `fault_timeout` seconds (died in another
      namespace or on another host, or stopped: SIGSTOP, a hung machine).

    The first process to see a fault, or to fail itself (`fail`), writes one message
    under an abort key; every process prints it as `error: ...` and exits with status 1
    within a heartbeat, even from inside a blocked collective. The message names the
    failed rank, the step it was in and what it was doing, and the newest checkpoint
    rank 0 wrote and verified (or that there is none yet).

    A stopped process cannot take the launcher's SIGTERM (torchrun then waits 30 s
    before its SIGKILL), so each process also starts a dead man's switch
    (session/deadman.py, a small stdlib-only process) that this thread feeds at every
    heartbeat: silent for `fault_timeout` + `grace` seconds, after its peers have named
    it, the process is ended where it runs, and the launcher stops the job at once.
    """

    def __init__(self, rank: int, world: int, fault_timeout: float, store: Any = None):
        self.rank, self.world = rank, world
        self.timeout = fault_timeout
        self.interval = min(1.0, fault_timeout / 10)
        # torchrun keeps its store across restarts (--max-restarts): heartbeats and the abort
        # message belong to one attempt, the newest checkpoint to the whole job.
        base = dist.PrefixStore("groupbert/watchdog/", store or _own_store_client())
        self.store = dist.PrefixStore(f"attempt{_attempt() or '0'}/", base)
        self.job_store = base
        self.host = socket.gethostname()
        self.node = node_identity()
        self.started = start_time(os.getpid())
        self.step = 0  # the step in progress (`inside`), else the last step completed
        self.inside = False
        self.phase = "starting"
        self.run_dir: Optional[Path] = None  # where the run writes its checkpoints (Launch.note_run_dir)
        self.checkpoint: Optional[str] = None  # the newest verified checkpoint this process knows of
        self._beat = 0
        self._deadman = DeadMan(rank, fault_timeout, grace=2 * self.interval + 1)
        self._switch_started = start_time(self._deadman.pid)
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="groupbert-watchdog", daemon=True)
        self._thread.start()

    # Called by the main thread: attribute writes and an event only.
    def at(self, step: int, phase: str) -> None:
        """The main loop is in `step` (1-based), doing `phase`."""
        changed = step != self.step or not self.inside
        self.step, self.inside, self.phase = step, True, phase
        if changed:
            self._changed.set()

    def after(self, step: int) -> None:
        """`step` is done (or the run resumed at it): what follows is between steps."""
        changed = step != self.step or self.inside
        self.step, self.inside, self.phase = step, False, "between steps"
        if changed:
            self._changed.set()

    def progress(self, phase: str, **_: Any) -> None:
        self.phase = phase

    def where(self) -> str:
        return _position(self.step, self.inside, self.phase)

    def note_checkpoint(self, path: str, publish: bool) -> None:
        self.checkpoint = path
        if publish:
            with contextlib.suppress(Exception):
                self.job_store.set("checkpoint", path)

    def finished(self) -> None:
        """This process ends normally: its watcher must not take its exit for a death."""
        self.phase = _FINISHED
        self.store.set(f"hb/{self.rank}", json.dumps(self._heartbeat()))

    def fail(self, message: str) -> None:
        """This process failed: tell the others (they exit), before it exits itself."""
        self.abort(f"rank {self.rank} failed {self.where()}: {message}")

    def name_failed_peer(self) -> None:
        """A signal arrived (a launcher tearing the job down?): if a peer died, say which and exit."""
        began = time.monotonic()
        deadline = began + 3 * self.interval + 1
        try:
            self.store.check(["abort"])
        except Exception as e:  # its host is gone: that names the culprit
            self._exit(_store_lost(e))
        first = {r: _read(self.store, f"hb/{r}") for r in range(self.world) if r != self.rank}
        while time.monotonic() < deadline:
            if _read(self.store, "abort") is not None:
                self._exit(_read(self.store, "abort"))
            for r, value in first.items():
                beat = json.loads(value) if value is not None else None
                if beat is not None and beat["phase"] != _FINISHED and self._dead_here(beat):
                    self.abort(self._lost(r, beat, "died"))
            time.sleep(self.interval / 2)
        for r, value in first.items():
            if value is not None and _read(self.store, f"hb/{r}") == value and json.loads(value)["phase"] != _FINISHED:
                beat = json.loads(value)
                ended = self._end_here(beat)
                self.abort(self._lost(r, beat, "stopped responding", time.monotonic() - began) + ended)

    def await_verdict(self) -> None:
        """A collective failed here: find which process caused it, tell everyone and exit.

        The culprit is the process that is gone or whose heartbeat stopped; one that
        wrote the abort key first is named by its own message. Returns when no culprit
        shows itself within a few heartbeats (the caller then reports its own error).
        """
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a launcher tearing down must not cut the message
        self.name_failed_peer()

    def close(self) -> None:
        self._stop.set()
        self._changed.set()
        self._thread.join(timeout=5)
        self._deadman.close()

    # ------------------------------------------------------------ thread
    def _heartbeat(self) -> dict:
        self._beat += 1
        return {"beat": self._beat, "pid": os.getpid(), "started": self.started, "node": self.node, "host": self.host,
                "step": self.step, "inside": self.inside, "phase": self.phase, "switch": self._deadman.pid,
                "switch_started": self._switch_started}

    def _loop(self) -> None:
        peer = (self.rank + 1) % self.world
        seen, last_seen = None, time.monotonic()
        while not self._stop.is_set():
            self._deadman.feed()
            try:
                self.store.set(f"hb/{self.rank}", json.dumps(self._heartbeat()))
                if self.store.check(["abort"]):
                    self._exit(self.store.get("abort").decode())
                value = self.store.get(f"hb/{peer}").decode() if self.store.check([f"hb/{peer}"]) else None
            except Exception as e:  # the store is gone: its host (the launcher or rank 0) died
                if not self._stop.is_set():
                    self._exit(_store_lost(e))
                return
            now = time.monotonic()
            if value is not None and value != seen:
                seen, last_seen = value, now
            beat = json.loads(seen) if seen is not None else None
            if beat is not None and beat["phase"] == _FINISHED:
                pass  # it ended normally
            elif beat is not None and self._dead_here(beat):
                self.abort(self._lost(peer, beat, "died"))
            elif now - last_seen > self.timeout:
                ended = self._end_here(beat)
                self.abort(self._lost(peer, beat, "stopped responding", now - last_seen) + ended)
            self._changed.wait(self.interval)
            self._changed.clear()

    def _end_here(self, beat: Optional[dict]) -> str:
        """A silent peer in this PID namespace is stopped or frozen with its dead man's switch
        (SIGSTOP, a cgroup freezer): neither can act, and a launcher's SIGTERM would wait its
        grace period out. End both (SIGKILL ends a stopped or frozen process); what was done,
        in words for the message ("" for a peer elsewhere)."""
        if beat is None or self.node is None or beat.get("node") != self.node:
            return ""
        ours = [int(pid) for pid, started in ((beat["pid"], beat.get("started")),
                                              (beat.get("switch"), beat.get("switch_started")))
                if pid and started is not None and start_time(int(pid)) == started]
        if not ours:
            return ""
        outcome = end(ours)
        return f"; this process ended it (SIGKILL to process {ours[0]} on {beat['host']}" + \
            (f"; {outcome}" if outcome else "") + ")"

    def _dead_here(self, beat: dict) -> bool:
        """Whether the process of this heartbeat shares this one's PID namespace and is gone."""
        return gone_here(beat, self.node)

    def _lost(self, rank: int, beat: Optional[dict], what: str, silent: Optional[float] = None) -> str:
        if beat is None:
            where = " before its first heartbeat"
        else:
            where = " " + _position(beat["step"], beat.get("inside", True), beat["phase"])
        why = (f": no heartbeat for {silent:.0f} s (the process died, in another PID namespace or on another host, "
               "or was stopped)" if silent is not None else
               f" (process {beat['pid']} on {beat['host']} is gone)" if what == "died" and beat else "")
        return f"rank {rank}{where} {what}{why}"

    def abort(self, message: str) -> None:
        """Stop every process with `message` (the first one written wins), this one last."""
        try:
            # The first message wins; later ones are consequences of it.
            message = self.store.compare_set("abort", "", message).decode() or message
        except Exception:
            pass
        self._exit(message)

    def _exit(self, message: str) -> None:
        checkpoint = _read(self.job_store, "checkpoint") or self._newest_on_disk()
        truth = (f"the newest verified checkpoint is {checkpoint}: resume with --checkpoint-input {checkpoint}"
                 if checkpoint else "no checkpoint was written yet: the run starts again from the beginning")
        sys.stdout.flush()
        print(f"error: {message}; stopping rank {self.rank}. {truth}", file=sys.stderr, flush=True)
        os._exit(1)


    def _newest_on_disk(self) -> Optional[str]:
        """Without the job's store (its host died): the newest verified checkpoint in the run
        directory, which rank 0 may have published after this process last heard of one."""
        run_dir = self.run_dir or (Path(self.checkpoint).parent if self.checkpoint else None)
        found = checkpoints.newest(run_dir) if run_dir is not None else None
        return str(found) if found is not None else self.checkpoint


def _position(step: int, inside: bool, phase: str) -> str:
    """Where a process is, in words: in the step it was doing, or after the last one it did."""
    if inside:
        return f"in step {step} ({phase})"
    return f"after step {step} ({phase})" if step else f"before its first step ({phase})"


def _store_lost(error: BaseException) -> str:
    """The job's key-value store is gone: its host died or cannot be reached, named."""
    host = ("the torchrun agent of the first node, which hosts the job's key-value store,"
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else
            "rank 0, which hosts the job's key-value store,")
    said = " ".join(str(error).split())[:200]
    return f"{host} died or cannot be reached (lost the store: {type(error).__name__}: {said})"


def _own_store_client() -> Any:
    """A connection of the watchdog's own to the launcher's key-value store (the process
    group's connection stays with the main thread)."""
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=datetime.timedelta(seconds=30))
    except (KeyError, ValueError, RuntimeError):
        return dist.distributed_c10d._get_default_store()


def _read(store: Any, key: str) -> Optional[str]:
    try:
        return store.get(key).decode() if store.check([key]) else None
    except Exception:
        return None
