"""Elastic resumes keep the run's global batch (bert/run/elastic.py): a checkpoint resumed by
another number of replicas changes the gradient accumulation, says so, and trains on as
the uninterrupted run; where no accumulation does it, the resume is refused; asked for
explicitly, the new batch is a branch. Under `torchrun --nnodes 1:2` (two nodes simulated by
agents in PID namespaces of their own), losing the node that does not host the c10d
rendezvous shrinks the job to the other, which trains on as the 2-node job; losing the one
that hosts it, or pausing it, ends the job (docs/distributed.md, "Which node must survive")."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from bert import config_from_dict
from bert.run.elastic import SavedBatch, keep_global_batch, saved_batch
from bert.run.rundir import plan_run
from bert.tasks.pretraining import train
from tests.test_distributed import _kill_group, _pids_with, torchrun
from tests.test_loop import ROOT, loop_config, shards  # noqa: F401 (the fixture)
from tests.test_watchdog_ns import (UNSHARE, _children, _free_port, _kill_tagged, _repository_view,
                                   _unshare_problem)


def _config(root: Path, out: Path, **training):
    return config_from_dict(loop_config(root, out, **{"eval_every": 0, **training}))


@pytest.fixture(scope="module")
def one_process_run(shards, tmp_path_factory):  # noqa: F811
    """A one-process run with global batch 8 = micro batch 4 × accumulation 2, as a run killed
    after its checkpoint-2 leaves it (its later checkpoints removed)."""
    out = tmp_path_factory.mktemp("elastic") / "run"
    train(_config(shards, out, steps=6, checkpoint_every=2, gradient_accumulation=2), progress=False)
    for later in ("checkpoint-4", "checkpoint-final"):
        shutil.rmtree(out / later)
    return out


def test_a_checkpoint_records_the_batch_it_was_trained_with(one_process_run):
    assert saved_batch(one_process_run / "checkpoint-2") == SavedBatch(4, 2, 1)
    assert saved_batch(one_process_run / "checkpoint-2").global_batch == 8


def test_two_replicas_resuming_a_one_process_checkpoint_halve_the_accumulation_and_say_so(shards, one_process_run):  # noqa: F811
    config = _config(shards, one_process_run, steps=6, checkpoint_every=2, gradient_accumulation=2)
    kept, note = keep_global_batch(config, one_process_run / "checkpoint-2", replicas=2)
    assert kept.batch.gradient_accumulation == 1 and kept.batch.micro_batch_size == 4
    assert "global batch 8 = micro batch 4 × gradient accumulation 2 × 1 replica(s)" in note
    assert "the gradient accumulation is 1 (the config says 2)" in note
    # The same global batch is the same run: it continues in place, not as a branch.
    plan = plan_run(kept, str(one_process_run / "checkpoint-2"), replicas=2)
    try:
        assert plan.branched_from is None and plan.output_dir == one_process_run, plan.changes
    finally:
        plan.claim.release()


def test_a_replica_count_that_cannot_keep_the_batch_is_refused_naming_those_that_can(shards, one_process_run):  # noqa: F811
    config = _config(shards, one_process_run, gradient_accumulation=2)
    with pytest.raises(ValueError) as refused:
        keep_global_batch(config, one_process_run / "checkpoint-2", replicas=3)
    message = str(refused.value)
    assert "which 3 replicas of micro batch 4 cannot make: resume with a replica count" in message
    assert "1 (accumulation 2), 2 (accumulation 1)" in message and "batch.keep_global_batch false" in message


def test_the_new_batch_asked_for_is_a_branch_that_records_it(shards, one_process_run):  # noqa: F811
    raw = loop_config(shards, one_process_run, steps=6, checkpoint_every=2, eval_every=0, gradient_accumulation=2)
    raw["batch"]["keep_global_batch"] = False
    config = config_from_dict(raw)
    assert keep_global_batch(config, one_process_run / "checkpoint-2", replicas=2) == (config, "")
    plan = plan_run(config, str(one_process_run / "checkpoint-2"), replicas=2)
    try:
        assert plan.branched_from == (one_process_run / "checkpoint-2").resolve()
        assert "global batch 8 → 16 (1 → 2 replicas)" in plan.changes
    finally:
        plan.claim.release()


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def _stop_after_a_checkpoint(command: list[str], run_dir: Path, rank: int) -> str:
    """Run `command`; once checkpoint-2 exists, SIGTERM the process of `rank` (one process: give
    it RANK 0 so it is found): the job stops after its current step with a checkpoint. Its output."""
    tag = uuid.uuid4().hex
    one = {"RANK": "0"} if "torch.distributed.run" not in command else {}
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "GROUPBERT_TEST_TAG": tag,
                                                       **one},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoint-2").exists():
            assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()[-4000:]
            time.sleep(0.05)
        (victim,) = _pids_with(tag, rank=rank)
        os.kill(victim, signal.SIGTERM)
        output, _ = process.communicate(timeout=240)
    finally:
        _kill_group(process)
    assert "stopped by SIGTERM" in output, output[-4000:]
    return output


def _newest_step(run_dir: Path) -> int:
    return max(int(p.name.split("-")[1]) for p in run_dir.glob("checkpoint-[0-9]*"))


STEPS = 24


@pytest.mark.slow
def test_a_two_replica_run_resumed_by_one_process_keeps_its_batch_and_trains_as_uninterrupted(shards, tmp_path):  # noqa: F811
    def job(out: Path) -> Path:
        path = tmp_path / f"{out.name}.json"
        path.write_text(json.dumps(loop_config(shards, out, steps=STEPS, checkpoint_every=2, eval_every=0)))
        return path

    whole = torchrun(2, "bert.py", "train", "--config", str(job(tmp_path / "whole")))
    assert whole.returncode == 0, whole.stdout[-4000:]
    stopped = tmp_path / "stopped"
    _stop_after_a_checkpoint([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                              "bert.py", "train", "--config", str(job(stopped))], stopped, rank=1)
    step = _newest_step(stopped)
    assert step < STEPS, "the run ended before it was stopped: nothing left to resume"
    resumed = subprocess.run([sys.executable, "bert.py", "train", "--config", str(tmp_path / "stopped.json"),
                              "--checkpoint-input", "auto"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert "with 1 replica(s) the gradient accumulation is 2 (the config says 1)" in resumed.stdout
    assert "global batch 8 = micro batch 4 × gradient accumulation 2 × 1 replica(s)" in resumed.stdout
    assert not (tmp_path / "stopped.1").exists(), "the resume branched instead of continuing in place"
    expected, got = _losses(tmp_path / "whole"), _losses(stopped)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for s in range(step + 1, STEPS + 1):
        assert got[s] == pytest.approx(expected[s], rel=1e-5), f"step {s} after resuming at {step}"


@pytest.mark.slow
def test_a_one_process_run_resumed_by_two_replicas_keeps_its_batch_and_trains_as_uninterrupted(shards, tmp_path):  # noqa: F811
    def job(out: Path) -> Path:
        path = tmp_path / f"{out.name}.json"
        path.write_text(json.dumps(loop_config(shards, out, steps=STEPS, checkpoint_every=2, eval_every=0,
                                               gradient_accumulation=2)))
        return path

    whole = train(config_from_dict(json.loads(job(tmp_path / "whole").read_text())), progress=False)
    stopped = tmp_path / "stopped"
    _stop_after_a_checkpoint([sys.executable, "bert.py", "train", "--config", str(job(stopped))], stopped, rank=0)
    step = _newest_step(stopped)
    assert step < STEPS, "the run ended before it was stopped: nothing left to resume"
    resumed = torchrun(2, "bert.py", "train", "--config", str(tmp_path / "stopped.json"))  # auto under torchrun
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "with 2 replica(s) the gradient accumulation is 1 (the config says 2)" in resumed.stdout
    assert not (tmp_path / "stopped.1").exists(), "the resume branched instead of continuing in place"
    expected, got = {r["step"]: r["loss"] for r in whole.metrics if "loss" in r}, _losses(stopped)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for s in range(step + 1, STEPS + 1):
        assert got[s] == pytest.approx(expected[s], rel=1e-5), f"step {s} after resuming at {step}"


# ------------------------------------------- a node lost under `torchrun --nnodes 1:2`
ELASTIC_JOB = ["--config", "configs/demo.json", "--data.source", "synthetic", "--training.steps", "16",
               "--schedule.warmup_steps", "2", "--batch.micro_batch_size", "4", "--checkpoint.every", "4",
               "--evaluation.every", "0", "--training.log_every", "1", "--parallel.fault_timeout", "10"]


def _elastic_node(node: int, port: int, shell: bool = False) -> list[str]:
    """docs/distributed.md's `--nnodes 1:2` command for node 0 or 1, each agent in a PID namespace of
    its own with an address of its own (as "Launching" simulates two nodes); node 0 hosts the
    c10d rendezvous (`is_host`, which the endpoint's host would decide across machines). The
    agent is its namespace's init (a container's PID 1), or with `shell` a shell's child (a
    machine's torchrun, started by srun or a login shell)."""
    init = ["sh", "-c", '"$@"; exit $?', "sh"] if shell else []
    return [*UNSHARE, *init, "env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "3", "--local-addr", f"127.0.0.{node + 1}",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "elastic",
            "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}",
            "bert.py", "train", *ELASTIC_JOB, "--training.output_dir", "runs/elastic"]


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it (torchrun's workers live in sessions of their own)."""
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        with contextlib.suppress(OSError):  # it ended meanwhile
            todo.extend(_children(found[-1]))
    return found


def _lose_a_node(cwd: Path, lost: int, timeout: float, pause: bool = False, shell: bool = False,
                 said: str = "") -> tuple[int | None, str, float]:
    """Both nodes' agents; once checkpoint-4 exists, node `lost` dies whole (its agent, the PID
    namespace's init, is killed: the kernel ends everything in it), or with `pause` stops whole
    (SIGSTOP to its agent and every process below it: a paused VM, a hung machine, a network
    cut off; its sockets stay open and silent). The survivor's status and output, and the
    seconds from the loss to its end; with `said`, to its first line that starts so (status None:
    it may run on)."""
    tag, port = uuid.uuid4().hex, _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GROUPBERT_TEST_TAG": tag}
    logs = [cwd / f"node{node}.log" for node in (0, 1)]
    agents = [subprocess.Popen(_elastic_node(node, port, shell), cwd=cwd, env=env, stdout=log.open("w"),
                               stderr=subprocess.STDOUT, start_new_session=True) for node, log in enumerate(logs)]
    survivor = agents[1 - lost]
    try:
        deadline = time.monotonic() + 300
        while not (cwd / "runs/elastic/checkpoint-4").exists():
            assert all(a.poll() is None for a in agents) and time.monotonic() < deadline, \
                logs[0].read_text()[-3000:] + logs[1].read_text()[-3000:]
            time.sleep(0.1)
        if pause:
            for pid in _descendants(agents[lost].pid):
                os.kill(pid, signal.SIGSTOP)
        else:
            os.kill(agents[lost].pid, signal.SIGKILL)  # unshare --kill-child: its namespace goes with it
        lost_at = time.monotonic()
        if said:
            while not any(line.startswith(said) for line in logs[1 - lost].read_text().splitlines()):
                assert time.monotonic() < lost_at + timeout, logs[1 - lost].read_text()[-6000:]
                time.sleep(0.1)
            return None, logs[1 - lost].read_text(), time.monotonic() - lost_at
        status = survivor.wait(timeout=timeout)
        return status, logs[1 - lost].read_text(), time.monotonic() - lost_at
    finally:
        for agent in agents:
            _kill_group(agent)
        _kill_tagged(tag)


@pytest.fixture(scope="module")
def one_process_losses(tmp_path_factory) -> dict[int, float]:
    """ELASTIC_JOB in one process with twice the accumulation: the global batch of 2 nodes."""
    cwd = tmp_path_factory.mktemp("elastic-one") / "repo"
    _repository_view(cwd)
    done = subprocess.run([sys.executable, "bert.py", "train", *ELASTIC_JOB, "--batch.gradient_accumulation", "2",
                           "--training.output_dir", "runs/one"], cwd=cwd, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return _losses(cwd / "runs/one")


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.skipif(bool(_unshare_problem()), reason=_unshare_problem() or "")
def test_under_nnodes_1_to_2_losing_the_node_without_the_rendezvous_shrinks_to_one(one_process_losses, tmp_path):
    """Node 1 dies after checkpoint-4: node 0's worker names it, its agent restarts the group
    with the one node left (c10d waits its last call, 30 s, for more), and the run resumes with
    1 replica and twice the accumulation: the global batch and the losses of the 2-node job."""
    cwd = tmp_path / "repo"
    _repository_view(cwd)
    status, output, took = _lose_a_node(cwd, lost=1, timeout=400)
    assert status == 0, output[-6000:]
    assert "with 1 replica(s) the gradient accumulation is 2 (the config says 1)" in output, output[-6000:]
    got = _losses(cwd / "runs/elastic")
    assert sorted(got) == sorted(one_process_losses) == list(range(1, 17))
    for step, loss in one_process_losses.items():
        assert got[step] == pytest.approx(loss, rel=1e-5), f"step {step}"
    print(f"node 1 lost: the run ended {took:.0f} s later")


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.skipif(bool(_unshare_problem()), reason=_unshare_problem() or "")
def test_under_nnodes_1_to_2_losing_the_node_that_hosts_the_rendezvous_ends_the_job(tmp_path):
    """Node 0 hosts the c10d rendezvous store: when it dies, node 1's agent cannot meet anyone
    again and fails, whatever --max-restarts allows (the newest checkpoint stays for a resume)."""
    cwd = tmp_path / "repo"
    _repository_view(cwd)
    status, output, took = _lose_a_node(cwd, lost=0, timeout=400)
    assert status != 0, output[-6000:]
    # Its worker names the lost rank 0 and the checkpoint to resume; its agent cannot meet again.
    assert re.search(r"error: rank 0, which hosts the job's key-value store, died or cannot be reached .*; stopping "
                     r"rank 1\. the newest verified checkpoint is runs/elastic/checkpoint-\d+", output), output[-6000:]
    assert "RendezvousConnectionError" in output and "resuming from" not in output, output[-6000:]
    print(f"node 0 lost: node 1's agent ended {took:.0f} s later, status {status}")


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.skipif(bool(_unshare_problem()), reason=_unshare_problem() or "")
@pytest.mark.parametrize("agent", ["a shell's child", "the namespace's init"])
def test_under_nnodes_1_to_2_pausing_the_node_that_hosts_the_rendezvous_ends_the_other_within_the_fault_timeout(
        tmp_path, agent):
    """Node 0, which hosts the c10d rendezvous and the job's store, stops whole (a paused VM):
    its sockets stay open and answer nothing. Node 1's worker finds the store silent for
    `parallel.fault_timeout` and names its host, not a healthy rank (the dead man's switch
    blamed rank 1 before). Its agent would wait on the silent store for ever (109 s and more
    before): the worker ends it, so node 1 ends within the fault timeout and 10 s; an agent
    that is its PID namespace's init (a container's PID 1) takes no SIGKILL from inside, and
    the line says so and what to do."""
    cwd = tmp_path / "repo"
    _repository_view(cwd)
    init = agent == "the namespace's init"
    status, output, took = _lose_a_node(cwd, lost=0, timeout=10 + 10 if init else 120, pause=True, shell=not init,
                                        said="error: " if init else "")
    assert took < 10 + 10, f"node 1 ended {took:.0f} s after node 0 stopped\n{output[-6000:]}"
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and (init or status != 0), output[-6000:]
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 hosts the job's store, node 0's agent the rendezvous's.
    # SIGTERM ends the agent when its main thread is between store calls; an init may stay.
    ended = "this process ended its own torchrun agent, which would wait on it to meet again"
    agent_said = (r"(?:its torchrun agent waits on it and, as this PID namespace's init \(a container's PID 1\), "
                  r"takes no SIGKILL from here: end the container, and start torchrun under an init next time \(docker "
                  rf"run --init, tini\)|{ended})" if init else ended)
    assert re.match(r"error: rank 0, which hosts the job's key-value store, is silent: no answer for 1\d s \(stopped, "
                    rf"paused, or cut off from this node\); {agent_said}; stopping rank 1\. the newest verified "
                    r"checkpoint is runs/elastic/checkpoint-\d+", errors[0]), output[-6000:]
    print(f"node 0 paused, node 1's agent {agent}: its error line {took:.0f} s later, status {status}")
