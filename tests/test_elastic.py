"""Elastic resumes keep the run's global batch (bert/elastic.py): a checkpoint resumed by
another number of replicas changes the gradient accumulation, says so, and trains on as
the uninterrupted run; where no accumulation does it, the resume is refused; asked for
explicitly, the new batch is a branch."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from bert import config_from_dict
from bert.elastic import SavedBatch, keep_global_batch, saved_batch
from bert.rundir import plan_run
from bert.train import train
from tests.test_distributed import _kill_group, _pids_with, torchrun
from tests.test_loop import ROOT, loop_config, shards  # noqa: F401 (the fixture)


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
