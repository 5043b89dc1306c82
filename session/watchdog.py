"""A launched process's watchdog: stops every process, naming the culprit, when one
process dies or stops, or when the job's key-value store falls silent.

It runs in a thread of its own (session/distributed.py's `Launch` starts it) and talks to
the launcher's key-value store from another: a TCPStore call to a host that is stopped,
paused or cut off waits forever (`check` has no timeout), and the watchdog must notice that
silence rather than wait in it. Its peers on this node, their PID namespace and their end
are session/node.py's; the dead man's switch that ends a stopped process is
session/deadman.py.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist

from fileio import say
from session import checkpoint as checkpoints
from session.deadman import DeadMan
from session.node import end, exited, gone_here, node_identity, start_time

__all__ = ["Watchdog"]

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

The store itself failed when a call to it raises (its host died) or has not returned
for `fault_timeout` seconds (its host is stopped, paused or cut off; a TCPStore `check`
would wait forever): every process then stops with a line naming the store's host, and
a torchrun agent of this node, which would wait on the silent store to meet again (a
minute per call, at every restart), is ended with it.

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

    def __init__(self, rank: int, world: int, fault_timeout: float, attempt: str = "0", store: Any = None):
        self.rank, self.world = rank, world
        self.timeout = fault_timeout
        self.interval = min(1.0, fault_timeout / 10)
        # torchrun keeps its store across restarts (--max-restarts): heartbeats and the abort
        # message belong to one attempt, the newest checkpoint to the whole job.
        base = dist.PrefixStore("groupbert/watchdog/", store or _own_store_client())
        self.store = dist.PrefixStore(f"attempt{attempt}/", base)
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
        self._asker = _Asker()
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
        self._asker.close()
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
                abort, value = self._ask(lambda: self._exchange(peer))
            except _Silent as e:  # its host is stopped, paused or cut off
                if not self._stop.is_set():
                    self._exit(_store_silent(e.seconds) + _end_own_agent(), store=False)
                return
            except Exception as e:  # the store is gone: its host (the launcher or rank 0) died
                if not self._stop.is_set():
                    self._exit(_store_lost(e), store=False)
                return
            if abort is not None:
                self._exit(abort)
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

    def _exchange(self, peer: int) -> tuple[Optional[str], Optional[str]]:
        """One heartbeat published; the abort message and `peer`'s heartbeat (None when absent)."""
        self.store.set(f"hb/{self.rank}", json.dumps(self._heartbeat()))
        abort = self.store.get("abort").decode() if self.store.check(["abort"]) else None
        value = self.store.get(f"hb/{peer}").decode() if self.store.check([f"hb/{peer}"]) else None
        return abort, value

    def _ask(self, call: Callable[[], Any]) -> Any:
        """`call`'s result, from the store's thread; `_Silent` when it has not returned within
        `fault_timeout` (the switch is fed meanwhile: this process is not the one stopped)."""
        return self._asker.ask(call, self.timeout, self.interval, self._deadman.feed)

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
            message = self._ask(lambda: self.store.compare_set("abort", "", message).decode()) or message
        except Exception:  # silent or gone: this process's own message, then
            pass
        self._exit(message)

    def _exit(self, message: str, store: bool = True) -> None:
        """Print `message` with the checkpoint to resume from and exit; without `store` (it is
        gone or silent) the checkpoint is the newest one on disk."""
        published = None
        if store:
            with contextlib.suppress(Exception):
                published = self._ask(lambda: _read(self.job_store, "checkpoint"))
        checkpoint = published or self._newest_on_disk()
        truth = (f"the newest verified checkpoint is {checkpoint}: resume with --checkpoint-input {checkpoint}"
                 if checkpoint else "no checkpoint was written yet: the run starts again from the beginning")
        sys.stdout.flush()
        say(f"error: {message}; stopping rank {self.rank}. {truth}")
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


def _store_host() -> str:
    return ("the torchrun agent of the first node, which hosts the job's key-value store,"
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else
            "rank 0, which hosts the job's key-value store,")


def _store_lost(error: BaseException) -> str:
    """The job's key-value store is gone: its host died or cannot be reached, named."""
    said = " ".join(str(error).split("\nException raised from")[0].split())[:200]
    return f"{_store_host()} died or cannot be reached (lost the store: {type(error).__name__}: {said})"


def _store_silent(seconds: float) -> str:
    """The job's key-value store has not answered for `seconds`: its host, named."""
    return (f"{_store_host()} is silent: no answer for {seconds:.0f} s (stopped, paused, or cut off from this "
            "node)")


def _end_own_agent(wait: float = 3.0) -> str:
    """Under torchrun, this node's agent would wait on a silent store to meet again while the
    job cannot go on (its store calls have no timeout, or a minute per call at every restart).
    SIGTERM first: torchrun stops its workers and leaves the rendezvous open for a resume, but
    only once its store call returns, which it may never do; then SIGKILL, which a container's
    PID 1 does not take from inside its namespace. What was done, in words ("" for nothing)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return ""
    agent = os.getppid()
    try:
        words = Path(f"/proc/{agent}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    if not any(w == b"torch.distributed.run" or w.endswith(b"/torchrun") or w == b"torchrun" for w in words):
        return ""
    ended = "; this process ended its own torchrun agent, which would wait on it to meet again"
    with contextlib.suppress(OSError):
        os.kill(agent, signal.SIGTERM)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if exited(agent):
            return ended
        time.sleep(0.1)
    if agent == 1:
        return ("; its torchrun agent waits on it and, as this PID namespace's init (a container's PID 1), takes no "
                "SIGKILL from here: end the container, and start torchrun under an init next time (docker run "
                "--init, tini)")
    with contextlib.suppress(OSError):
        os.kill(agent, signal.SIGKILL)
    return ended


class _Silent(Exception):
    def __init__(self, seconds: float):
        super().__init__(f"no answer for {seconds:.0f} s")
        self.seconds = seconds


class _Asker:
    """Calls to the store, made one at a time by a daemon thread of their own, so that a
    call that never returns holds that thread only (the process exits past it)."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="groupbert-watchdog-store", daemon=True).start()

    def close(self) -> None:
        self._calls.put(None)

    def _serve(self) -> None:
        while (asked := self._calls.get()) is not None:
            call, box, done = asked
            try:
                box.append((True, call()))
            except BaseException as e:  # handed to the asker
                box.append((False, e))
            done.set()

    def ask(self, call: Callable[[], Any], timeout: float, interval: float, waiting: Callable[[], None]) -> Any:
        """`call`'s result or exception; `_Silent` after `timeout` s without one (`waiting()`
        every `interval` meanwhile)."""
        box: list = []
        done = threading.Event()
        began = time.monotonic()
        self._calls.put((call, box, done))
        while not done.wait(interval):
            waiting()
            if time.monotonic() - began > timeout:
                raise _Silent(time.monotonic() - began)
        ok, value = box[0]
        if ok:
            return value
        raise value


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
