"""The one run loop (bert/loop.py) as pre-training uses it: held-out evaluation, what is
logged and printed, best.json, and torchrun's restarts continuing a job exactly."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from bert import config_from_dict
from bert.train import train
from data.create_pretraining_data import create_pretraining_data
from data.pretraining import CreateOptions
from tests.helpers import write_small_corpus
from tests.test_distributed import _kill_group, _pids_with, torchrun

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Training shards and held-out shards made from other documents."""
    root = tmp_path_factory.mktemp("loop")
    files, vocab = write_small_corpus(root, [120, 40], [5, 6], 300)
    options = CreateOptions(seq_len=32, max_predictions=5, seed=1)
    create_pretraining_data(files[:1], root / "train", vocab=vocab.path, progress=False, options=options)
    create_pretraining_data(files[1:], root / "eval", vocab=vocab.path, progress=False, options=options)
    return root


def loop_config(root: Path, out: Path, **training) -> dict:
    return {
        "name": "loop",
        "model": dict(architecture="groupbert", hidden_size=48, num_layers=2, num_heads=3, vocab_size=300,
                      sequence_length=32, max_predictions=5, max_positions=64),
        "training": {**dict(steps=6, micro_batch_size=4, learning_rate=0.01, warmup_steps=2, output_dir=str(out),
                            log_every=1, eval_every=2), **training},
        "data": dict(source="shards", files=[str(root / "train" / "*.hdf5")],
                     eval_files=[str(root / "eval" / "*.hdf5")], eval_samples=48, shuffle_buffer=64, prefetch=2),
    }


def evaluations(metrics: list[dict]) -> list[dict]:
    return [r for r in metrics if "eval_loss" in r]


def test_evaluation_comes_every_eval_every_steps_on_held_out_data_and_names_the_best(shards, tmp_path):
    result = train(config_from_dict(loop_config(shards, tmp_path / "run")), progress=False)
    evals = evaluations(result.metrics)
    assert [r["step"] for r in evals] == [2, 4, 6]
    assert set(evals[0]) == {"step", "eval_loss", "eval_mlm_loss", "eval_mlm_accuracy", "eval_nsp_loss",
                             "eval_nsp_accuracy"}
    assert abs(evals[0]["eval_loss"] - evals[0]["eval_mlm_loss"] - evals[0]["eval_nsp_loss"]) < 1e-5
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"], "the model learns what the held-out text shares"
    logged = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert evaluations(logged) == evals
    # The checkpoint carries its figures, and best.json names the best checkpoint.
    state = json.loads((result.checkpoint / "session.json").read_text())
    assert state["per_rank"][0]["extra"]["evaluation"]["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], 1e-6)
    best = json.loads((result.output_dir / "best.json").read_text())
    assert best["checkpoint"] == "checkpoint-final" and best["metric"] == "eval_loss"


def test_eval_only_scores_a_checkpoint_as_the_run_scored_it(shards, tmp_path, capsys):
    """`bert.py --eval-only` on pre-training weights: the run's own final figures, nothing trained
    or written; without held-out data it says what is missing."""
    result = train(config_from_dict(loop_config(shards, tmp_path / "run")), progress=False)
    path = tmp_path / "loop.json"
    path.write_text(json.dumps(loop_config(shards, tmp_path / "run")))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    capsys.readouterr()
    from bert.train import evaluate_only

    scored = evaluate_only(config_from_dict(loop_config(shards, tmp_path / "run")), str(result.checkpoint))
    final = evaluations(result.metrics)[-1]
    for key, value in scored.evaluation.items():
        assert value == pytest.approx(final[key], rel=1e-6, abs=1e-7), key
    assert sorted(p.name for p in tmp_path.rglob("*")) == before, "eval-only writes nothing"
    assert f"eval_loss {final['eval_loss']:.4g}" in capsys.readouterr().out
    from tests.tiny_runs import bert_cli

    assert bert_cli()(["--config", str(path), "--checkpoint-input", str(result.checkpoint), "--eval-only"]) == 0
    assert bert_cli()(["--config", str(path), "--eval-only"]) == 2
    assert "--eval-only scores weights: pass --checkpoint-input" in capsys.readouterr().err
    assert bert_cli()(["--config", str(path), "--checkpoint-input", str(result.checkpoint), "--eval-only",
                       "--data.eval_samples", "0"]) == 2
    assert "--eval-only needs held-out data" in capsys.readouterr().err


def test_evaluation_never_uses_a_file_the_run_trains_on(shards, tmp_path):
    cfg = loop_config(shards, tmp_path / "run")
    cfg["data"]["eval_files"] = [str(shards / "train" / "*.hdf5")]
    with pytest.raises(ValueError, match="is in data.files and data.eval_files"):
        train(config_from_dict(cfg), progress=False)


def test_log_every_sets_the_records_and_the_progress_lines(shards, tmp_path, capsys):
    cfg = loop_config(shards, tmp_path / "run", log_every=3, eval_every=0)
    result = train(config_from_dict(cfg), progress=True)
    records = [r for r in result.metrics if "loss" in r]
    assert [r["step"] for r in records] == [3, 6], "one record per log_every steps"
    out = capsys.readouterr()
    lines = [line.split(":")[0] for line in out.out.splitlines() if line.startswith("step ")]
    # Not a terminal: plain lines every log_every steps, no carriage-return bar fragments;
    # the evaluation at the final checkpoint has its own line.
    assert lines == ["step 3/6", "step 6/6", "step 6"] and "\r" not in out.err + out.out


@pytest.mark.slow
def test_evaluation_figures_are_the_same_for_one_and_two_replicas(shards, tmp_path):
    one = train(config_from_dict(loop_config(shards, tmp_path / "one", gradient_accumulation=2, steps=4)),
                progress=False)
    path = tmp_path / "two.json"
    path.write_text(json.dumps(loop_config(shards, tmp_path / "two", steps=4)))
    result = torchrun(2, "bert.py", "--config", str(path))
    assert result.returncode == 0, result.stdout[-4000:]
    two = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(evaluations(one.metrics), evaluations(two), strict=True):
        assert a["step"] == b["step"]
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), f"step {a['step']} {key}"


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_and_the_job_ends_as_an_uninterrupted_one(shards, tmp_path):
    """`torchrun --max-restarts 1`: a worker killed mid-run, every worker restarts, resumes from
    the run's newest checkpoint (the default under torchrun), and the final weights equal an
    uninterrupted job's, bit for bit."""
    def job(out: Path) -> Path:
        path = tmp_path / f"{out.name}.json"
        path.write_text(json.dumps(loop_config(shards, out, steps=12, checkpoint_every=3, eval_every=0,
                                               fault_timeout=10)))
        return path

    uninterrupted = torchrun(2, "--max-restarts=1", "bert.py", "--config", str(job(tmp_path / "whole")))
    assert uninterrupted.returncode == 0, uninterrupted.stdout[-4000:]
    tag = uuid.uuid4().hex
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "--max-restarts=1", "bert.py", "--config", str(job(tmp_path / "killed"))]
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "GROUPBERT_TEST_TAG": tag},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "killed" / "checkpoint-6").exists():
            assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()[-4000:]
            time.sleep(0.1)
        (victim,) = _pids_with(tag, rank=1)
        os.kill(victim, signal.SIGKILL)
        output, _ = process.communicate(timeout=300)
    finally:
        _kill_group(process)
    assert process.returncode == 0, output[-4000:]
    assert "died" in output and "resuming from" in output, output[-4000:]
    for name in ("weights.vg0.data", "optimizer.vg0.safetensors"):
        assert (tmp_path / "killed" / "checkpoint-final" / name).read_bytes() == \
            (tmp_path / "whole" / "checkpoint-final" / name).read_bytes(), name
