"""The watchdog where a host name is not a machine, and stopped ranks.

Ranks that share a host name but not a PID namespace (containers on one node with host
networking) must not look each other's process ids up; a stopped rank must end the job
within fault_timeout + 10 s although a launcher's SIGTERM cannot reach it; two nodes
simulated on one host (one torchrun agent per PID namespace) train as one process does
and restart a killed worker into the uninterrupted job's weights.

The process-spawning tests run ranks under `unshare --pid --fork --mount-proc`, which
needs root (or CAP_SYS_ADMIN); where it fails they are skipped, naming why.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from session.deadman import DeadMan
from session.node import gone_here, node_identity, start_time
from tests.helpers import assert_close
from tests.test_distributed import _config_file, _kill_group

pytestmark = pytest.mark.serial  # silences and fault timeouts measured in wall-clock seconds

ROOT = Path(__file__).resolve().parents[1]
UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]


def _unshare_problem() -> str | None:
    try:
        done = subprocess.run(UNSHARE + ["true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare cannot run here ({e})"
    if done.returncode:
        return f"`unshare --pid --fork --mount-proc true` fails here (needs root): {done.stderr.strip()}"
    return None


needs_unshare = pytest.mark.skipif(bool(_unshare_problem()), reason=_unshare_problem() or "")


# ----------------------------------------------------- which process is local
def test_a_heartbeat_from_another_pid_namespace_is_never_looked_up_here():
    here = node_identity()
    assert here is not None and here.endswith(os.readlink("/proc/self/ns/pid"))
    missing = max(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()) + 10_000
    beat = {"pid": missing, "started": "1", "host": socket.gethostname()}
    # Same host name, another namespace (another container): its pid means nothing here.
    assert not gone_here({**beat, "node": "another-boot/pid:[1]"}, here)
    assert not gone_here({**beat, "node": None}, here)
    assert not gone_here({**beat, "node": here}, None), "without a /proc of its own a process looks nobody up"
    assert gone_here({**beat, "node": here}, here), "the same namespace: the process is gone"


def test_a_process_id_taken_by_a_later_process_is_a_gone_process():
    here = node_identity()
    me = {"pid": os.getpid(), "node": here, "started": start_time(os.getpid())}
    assert me["started"] is not None and not gone_here(me, here)
    assert gone_here({**me, "started": str(int(me["started"]) - 1)}, here)


@pytest.mark.slow
def test_a_zombie_is_a_gone_process():
    child = subprocess.Popen(["true"])
    beat = {"pid": child.pid, "node": node_identity(), "started": start_time(child.pid)}
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        assert gone_here(beat, node_identity())
    finally:
        child.wait()


@pytest.mark.slow
@needs_unshare
def test_a_pid_namespace_has_an_identity_of_its_own_and_none_without_its_own_proc():
    probe = "from session.node import node_identity; print(node_identity())"

    def identity(*unshare: str) -> str:
        done = subprocess.run([*unshare, sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert identity() == node_identity()
    other = identity(*UNSHARE)
    assert other not in (node_identity(), "None") and other.split("/")[0] == node_identity().split("/")[0]
    # A PID namespace that still sees the host's /proc: pids there are not its own.
    assert identity("unshare", "--pid", "--fork") == "None"


# ------------------------------------------------------- the dead man's switch
def _fed(tmp_path: Path, fault_timeout: float, then: str) -> subprocess.Popen:
    """A process that starts a DeadMan, feeds it every 0.1 s and then does `then`."""
    script = tmp_path / "fed.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from session.deadman import DeadMan
        switch = DeadMan(5, {fault_timeout}, grace=0.5)
        print(switch.pid, flush=True)
        end = time.monotonic() + 8
        while time.monotonic() < end:
            switch.feed()
            time.sleep(0.1)
        {then}
    """))
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    process.switch = int(process.stdout.readline())
    return process


@pytest.mark.slow
def test_the_switch_ends_its_process_once_stopped_and_leaves_with_it(tmp_path):
    process = _fed(tmp_path, 1.0, "switch.close()")
    try:
        time.sleep(1)
        os.kill(process.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        process.wait(timeout=20)
        took = time.monotonic() - stopped
    finally:
        _kill_group(process)
    assert process.returncode == -signal.SIGKILL, process.stderr.read()
    # Fed every 0.1 s until it stopped: silent for fault_timeout 1 s + grace 0.5 s by then.
    assert took >= 1.4, f"ended {took:.2f} s after it stopped, before its silence reached 1.5 s"
    assert "error: rank 5 " in process.stderr.read()
    deadline = time.monotonic() + 5
    while Path(f"/proc/{process.switch}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{process.switch}").exists() or _state(process.switch) == "Z"


@pytest.mark.slow
def test_a_whole_group_stopped_and_continued_is_not_silence_and_a_close_lets_the_switch_go(tmp_path):
    process = _fed(tmp_path, 1.0, "switch.close(); print('closed', flush=True)")
    try:
        time.sleep(1)
        os.killpg(process.pid, signal.SIGSTOP)  # Ctrl-Z: the process and its switch stand still
        time.sleep(4)
        os.killpg(process.pid, signal.SIGCONT)
        out, err = process.communicate(timeout=30)
    finally:
        _kill_group(process)
    assert process.returncode == 0 and out.strip() == "closed", err
    assert not Path(f"/proc/{process.switch}").exists()


@pytest.mark.slow
def test_a_switch_is_fed_without_blocking_when_it_reads_nothing():
    switch = DeadMan(0, 60.0, grace=1.0)
    try:
        os.kill(switch.pid, signal.SIGSTOP)
        started = time.monotonic()
        for _ in range(200_000):  # more than a pipe holds
            switch.feed()
        assert time.monotonic() - started < 10
        os.kill(switch.pid, signal.SIGCONT)
    finally:
        switch.close()
    assert switch._process.returncode == 0


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


# ----------------------------------------------- ranks in PID namespaces of their own
def _rank_process(tag: str, rank: int) -> list[int]:
    """The bert.py python processes of rank `rank` started with GROUPBERT_TEST_TAG=tag."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if f"GROUPBERT_TEST_TAG={tag}".encode() in env and f"RANK={rank}".encode() in env \
                and Path(argv[0]).name.startswith("python") and "bert.py" in argv:
            found.append(int(entry.name))
    return found


def _kill_tagged(tag: str) -> None:
    """Every process this test started (torchrun's workers live in sessions of their own)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"GROUPBERT_TEST_TAG={tag}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


def _start(command: list[str], tag: str, cwd: Path = ROOT) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GROUPBERT_TEST_TAG": tag}
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def fault_midway(command: list[str], cwd: Path, ready: Path, rank: int, fault: Callable[[int], None],
                 timeout: float) -> tuple[int, str, float]:
    """Run `command`; once `ready` exists, `fault(pid)` on the bert.py process of `rank`. Its
    status, its output and the seconds from the fault to its end; every process it started is
    gone after."""
    tag = uuid.uuid4().hex
    process = _start(command, tag, cwd)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()[-4000:]
            time.sleep(0.1)
        (victim,) = _rank_process(tag, rank)
        fault(victim)
        faulted = time.monotonic()
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            said = e.output.decode(errors="replace") if isinstance(e.output, bytes) else e.output or ""
            raise AssertionError(f"still running {timeout:g} s after the fault\n{said[-6000:]}") from None
        return process.returncode, output, time.monotonic() - faulted
    finally:
        _kill_group(process)
        _kill_tagged(tag)


def _torchrun_per_rank_namespace(*worker: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--no-python",
            *UNSHARE, *worker]


@pytest.mark.slow
@needs_unshare
def test_ranks_in_pid_namespaces_of_their_own_on_one_host_run_to_the_end(tmp_path):
    config = _config_file(tmp_path, steps=4, checkpoint_every=2, fault_timeout=10)
    # Each rank's python is its namespace's process LOCAL_RANK + 2 (a shell is 1, one `true`
    # per local rank before it): a peer's process id names another process, or none, here.
    shifted = ('i=0; while [ "$i" -lt "$LOCAL_RANK" ]; do /bin/true; i=$((i + 1)); done; '
               f'{sys.executable} bert.py "$@"; exit $?')
    tag = uuid.uuid4().hex
    process = _start(_torchrun_per_rank_namespace("sh", "-c", shifted, "sh", "--config", str(config)), tag)
    try:
        output, _ = process.communicate(timeout=300)
    finally:
        _kill_group(process)
        _kill_tagged(tag)
    assert process.returncode == 0, output[-4000:]
    assert "died" not in output and (tmp_path / "run" / "checkpoint-final").is_dir(), output[-4000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


@pytest.mark.slow
@needs_unshare
def test_a_stopped_rank_in_its_own_pid_namespace_ends_the_job_within_fault_timeout_and_10_s(tmp_path):
    timeout = 8
    config = _config_file(tmp_path, steps=100000, checkpoint_every=3, fault_timeout=timeout)
    # python is its namespace's init (PID 1, as in a container without an init process),
    # which a SIGKILL from inside the namespace cannot end.
    status, output, took = fault_midway(_torchrun_per_rank_namespace(sys.executable, "bert.py", "--config", str(config)),
                                        ROOT, tmp_path / "run" / "checkpoint-3", 1,
                                        lambda pid: os.kill(pid, signal.SIGSTOP), timeout + 60)
    assert took < timeout + 10, f"the job ended {took:.0f} s after rank 1 stopped\n{output[-4000:]}"
    assert status != 0
    assert re.search(r"error: rank 1 (?:in|after) step \d+ \([^)]*\) stopped responding: no heartbeat for \d+ s .*stopping "
                     r"rank 0\. the newest verified checkpoint is \S+checkpoint-\d+: resume with", output), \
        output[-4000:]


# ------------------------------------------------ two nodes simulated on one host
def _documented_two_nodes() -> str:
    """The two-node command of docs/distributed.md, as written (the doc test skips it: it runs here)."""
    from tests.doc_commands import shell_blocks

    (block,) = [b for b in shell_blocks(ROOT / "docs" / "distributed.md") if b.text.startswith("for node in 0 1")]
    assert block.text.endswith('[ "$failed" = 0 ]'), block.text
    return block.text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _repository_view(cwd: Path) -> None:
    """A working directory where the documented command finds bert.py and configs/ (its
    runs/ are written here, not into the repository)."""
    cwd.mkdir()
    for name in ("bert.py", "configs"):
        (cwd / name).symlink_to(ROOT / name)


def _weights(run: Path) -> np.ndarray:
    return np.fromfile(run / "checkpoint-final" / "weights.vg0.data", dtype=np.float32)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """The documented two-node job run to its end (only the rendezvous port changed)."""
    if _unshare_problem():
        pytest.skip(_unshare_problem())
    cwd = tmp_path_factory.mktemp("two-nodes") / "repo"
    command = _documented_two_nodes().replace("localhost:29400", f"localhost:{_free_port()}")
    status, output = _run_in(cwd, command, 400)
    assert status == 0 and "checkpoint: runs/two-nodes/checkpoint-final" in output, output[-6000:]
    return cwd, command, output


def _run_in(cwd: Path, command: str, timeout: float) -> tuple[int, str]:
    """`bash -c command` in a repository view at `cwd`: its status and output; every process it
    started is gone after."""
    _repository_view(cwd)
    tag = uuid.uuid4().hex
    process = _start(["bash", "-c", command], tag, cwd)
    try:
        output, _ = process.communicate(timeout=timeout)
    finally:
        _kill_group(process)
        _kill_tagged(tag)
    return process.returncode, output


@pytest.mark.slow
def test_two_nodes_in_pid_namespaces_of_their_own_train_as_one_process(two_nodes, tmp_path):
    cwd, command, output = two_nodes
    assert "global batch 8 = micro batch 4 × gradient accumulation 1 × 2 replica(s)" in output
    # One process with twice the accumulation reads the same rows (docs: the global stream).
    bert = command.split("bert.py", 1)[1].split("&", 1)[0].replace("\\\n", " ").split()
    one = [a if a != "runs/two-nodes" else "runs/one" for a in bert] + ["--batch.gradient_accumulation", "2"]
    done = subprocess.run([sys.executable, "bert.py", *one], cwd=cwd, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    assert_close(_weights(cwd / "runs/two-nodes"), _weights(cwd / "runs/one"), 1e-5, "two nodes vs one process")


@pytest.mark.slow
def test_two_nodes_restart_a_killed_worker_and_end_with_the_uninterrupted_weights(two_nodes, tmp_path):
    uninterrupted, command, _ = two_nodes
    cwd = tmp_path / "repo"
    _repository_view(cwd)
    command = re.sub(r"localhost:\d+", f"localhost:{_free_port()}", command)
    status, output, _ = fault_midway(["bash", "-c", command], cwd, cwd / "runs/two-nodes/checkpoint-4", 1,
                                     lambda pid: os.kill(pid, signal.SIGKILL), 400)
    assert status == 0, output[-6000:]
    assert "resuming from" in output, output[-6000:]
    for name in ("weights.vg0.data", "optimizer.vg0.safetensors"):
        assert (cwd / "runs/two-nodes/checkpoint-final" / name).read_bytes() == \
            (uninterrupted / "runs/two-nodes/checkpoint-final" / name).read_bytes(), name


@pytest.mark.slow
def test_the_documented_two_node_command_fails_when_its_agents_fail(tmp_path):
    if _unshare_problem():
        pytest.skip(_unshare_problem())
    command = _documented_two_nodes().replace("localhost:29400", f"localhost:{_free_port()}")
    broken = command.replace("--config configs/demo.json", "--config configs/missing.json")
    status, output = _run_in(tmp_path / "repo", broken, 300)
    assert "configs/missing.json" in output, output[-4000:]
    assert status != 0, f"both agents failed and the command returned 0\n{output[-4000:]}"


# ------------------------------------------------- a rank frozen with its switch
def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _freezer() -> Path | None:
    """A cgroup v2 directory whose processes can be frozen (cgroup.freeze), or None."""
    for root in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        if (root / "cgroup.procs").exists():
            try:
                group = root / f"groupbert-test-{uuid.uuid4().hex[:8]}"
                group.mkdir()
            except OSError:
                continue
            if (group / "cgroup.freeze").exists():
                return group
            group.rmdir()
    return None


def _freezer_v1() -> Path | None:
    """A cgroup v1 freezer group (freezer.state), where SIGKILL waits for a thaw, or None."""
    root = Path("/sys/fs/cgroup/freezer")
    try:
        group = root / f"groupbert-test-{uuid.uuid4().hex[:8]}"
        group.mkdir()
    except OSError:
        return None
    if (group / "freezer.state").exists():
        return group
    group.rmdir()
    return None


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_frozen_process_is_ended_by_thawing_its_freezer_group_where_a_kill_alone_waits(version):
    """Under cgroup v1's freezer a SIGKILL is held until the group thaws, and the job hung on the
    frozen rank with "SIGKILL to process N" said; `end` thaws the group so that the kill lands,
    and says so. Under v2's freezer the kill ends a frozen process by itself."""
    from session.node import end, frozen_by

    group = _freezer_v1() if version == "v1" else _freezer()
    if group is None:
        pytest.skip(f"no cgroup {version} freezer group can be made here (root and a mounted freezer)")
    control = group / ("freezer.state" if version == "v1" else "cgroup.freeze")
    victim = subprocess.Popen(["sleep", "300"])
    try:
        (group / ("tasks" if version == "v1" else "cgroup.procs")).write_text(str(victim.pid))
        control.write_text("FROZEN" if version == "v1" else "1")
        deadline = time.monotonic() + 5
        while frozen_by(victim.pid) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert frozen_by(victim.pid) == control
        said = end([victim.pid])
        assert victim.wait(timeout=5) == -signal.SIGKILL
        if version == "v1":
            assert said == f"it was frozen by the cgroup freezer ({control}): thawed so that the SIGKILL ends it"
        else:
            assert said == "", "a v2 freezer lets SIGKILL end the process"
    finally:
        victim.kill()
        victim.wait()
        with contextlib.suppress(OSError):
            control.write_text("THAWED" if version == "v1" else "0")
        time.sleep(0.2)
        group.rmdir()


@pytest.mark.slow
@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_rank_frozen_with_its_switch_ends_the_job_within_fault_timeout_and_10_s(tmp_path, version):
    """`docker pause`, a cgroup freezer: a rank and its dead man's switch stop together, so the
    switch cannot end it, and torchrun's SIGTERM would wait 30 s. The peer that sees the silence
    ends both (they share its PID namespace). Frozen by a cgroup v2 freezer where one can be made
    (root), else by SIGSTOP to both (the same for them: neither runs); and by a cgroup v1
    freezer, which holds a SIGKILL until it thaws: the peer thaws it and says so (the job hung
    on it, its message naming a kill that could not land)."""
    group = _freezer() if version == "v2" else _freezer_v1()
    if version == "v1" and group is None:
        pytest.skip("no cgroup v1 freezer group can be made here (root and a mounted v1 freezer)")
    # cgroup.procs in both: v1's `tasks` would move one thread, and a rank frozen in a call that
    # let go of the GIL would beat on from its watchdog's thread (what `docker pause` never does).
    procs, control, frozen_state, thawed = (("cgroup.procs", "cgroup.freeze", "1", "0") if version == "v2" else
                                            ("cgroup.procs", "freezer.state", "FROZEN", "THAWED"))
    timeout = 8
    config = _config_file(tmp_path, steps=100000, checkpoint_every=3, fault_timeout=timeout)
    def freeze(victim: int) -> None:
        frozen = [victim, *_children(victim)]  # the rank and its switch
        assert len(frozen) == 2, frozen
        if group is not None:
            for pid in frozen:
                (group / procs).write_text(str(pid))
            (group / control).write_text(frozen_state)
        else:
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)

    try:
        status, output, took = fault_midway([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                             "--nproc-per-node=2", "bert.py", "--config", str(config)],
                                            ROOT, tmp_path / "run" / "checkpoint-3", 1, freeze, timeout + 60)
    finally:
        if group is not None:
            (group / control).write_text(thawed)
            time.sleep(0.5)
            group.rmdir()
    assert took < timeout + 10, f"the job ended {took:.0f} s after rank 1 froze\n{output[-4000:]}"
    assert status != 0
    thaw = (r"; it was frozen by the cgroup freezer \(\S+freezer\.state\): thawed so that the SIGKILL ends it"
            if version == "v1" else "")
    assert re.search(r"error: rank 1 (?:in|after) step \d+ \([^)]*\) stopped responding: no heartbeat for \d+ s .*; "
                     rf"this process ended it \(SIGKILL to process \d+ on \S+{thaw}\); stopping rank 0\. the newest "
                     r"verified checkpoint is \S+checkpoint-\d+", output), output[-4000:]
