"""Faults of runs and checkpoints: divergence, resume and branches, corrupt state, full disk, signals.

Each test asserts that the error names the culprit and that nothing already written was
lost (files hashed before and after).
"""
from __future__ import annotations

import errno
import hashlib
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bert import with_overrides
from bert.tasks.pretraining import TrainingDiverged, train
from session import checkpoint as checkpoints
from tests.helpers import signal_a_run
from tests.test_training import ROOT, run_config


def snapshot(directory: Path) -> dict[str, str]:
    """SHA-256 of every file under `directory`, by relative path."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def strict_json_lines(path: Path) -> list[dict]:
    def refuse(constant):
        raise AssertionError(f"{path} holds a bare {constant}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------ divergence
@pytest.mark.parametrize("precision, architecture", [("fp32", "groupbert"), ("bf16", "groupbert"), ("fp16", "groupbert")])
def test_a_diverging_run_stops_and_leaves_its_checkpoints_as_written(tmp_path, precision, architecture):
    training = dict(steps=60, learning_rate=1000.0, warmup_steps=0, checkpoint_every=1, precision=precision)
    if precision == "fp16":
        training.update(loss_scaling="dynamic", min_loss_scale=2.0**10)
    cfg = run_config(tmp_path, model=dict(architecture=architecture), training=training)
    written: dict[str, dict] = {}

    def record(row):  # each checkpoint's bytes as soon as it exists
        for ckpt in (tmp_path / "run").glob("checkpoint-*"):
            written.setdefault(ckpt.name, snapshot(ckpt))

    with pytest.raises(TrainingDiverged, match="training diverged at step") as info:
        train(cfg, progress=False, on_log=record)
    assert "no checkpoint was written" in str(info.value) or "were skipped" in str(info.value)
    assert not (tmp_path / "run" / "checkpoint-final").exists()
    for name, files in written.items():
        assert snapshot(tmp_path / "run" / name) == files, f"{name} changed after it was written"
    rows = strict_json_lines(tmp_path / "run" / "metrics.jsonl")
    assert any(r["skipped"] for r in rows) and any(r["loss"] is None for r in rows)


@pytest.mark.slow
def test_the_cli_exits_non_zero_on_divergence(tmp_path):
    cfg = run_config(tmp_path, training=dict(steps=40, learning_rate=1000.0, warmup_steps=0))
    path = tmp_path / "diverge.json"
    path.write_text(json.dumps(cfg.model_dump(mode="json")))
    result = subprocess.run([sys.executable, "bert.py", "--config", str(path)], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 3, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: training diverged at step")
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------- resume, branch
@pytest.fixture(scope="module")
def _trained(tmp_path_factory):
    home = tmp_path_factory.mktemp("trained")
    cfg = run_config(home, training=dict(steps=4, checkpoint_every=2))
    return cfg, train(cfg, progress=False).output_dir


@pytest.fixture
def finished_run(tmp_path, _trained):
    """A run of 4 steps with checkpoints 2 and final, copied for each test to change."""
    cfg, source = _trained
    run = tmp_path / "run"
    shutil.copytree(source, run)
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"output_dir": str(run)})})
    (run / "config.json").write_text(json.dumps(cfg.model_dump(mode="json"), indent=2) + "\n")
    return cfg, run, snapshot(run)


def test_resume_below_the_checkpoint_step_is_refused_and_writes_nothing(finished_run):
    cfg, run, before = finished_run
    fewer = cfg.model_copy(update={"training": cfg.training.model_copy(update={"steps": 2})})
    with pytest.raises(ValueError, match=r"checkpoint-2 is at step 2 and training.steps is 2: nothing to train"):
        train(fewer, checkpoint_input=str(run / "checkpoint-2"), progress=False)
    assert snapshot(run) == before
    assert sorted(p.name for p in run.parent.iterdir()) == ["run"]


def test_resuming_a_checkpoint_the_run_has_passed_branches_and_keeps_the_run(finished_run):
    cfg, run, before = finished_run
    for expected in ("run.1", "run.2"):  # twice from the same checkpoint
        branch = train(cfg, checkpoint_input=str(run / "checkpoint-2"), progress=False)
        assert branch.output_dir.name == expected
        info = json.loads((branch.output_dir / "branch.json").read_text())
        assert info["from_checkpoint"] == str(run / "checkpoint-2") and info["step"] == 2
        assert info["changes"] == ["the run went on to checkpoint-final"]
        assert [r["step"] for r in strict_json_lines(branch.output_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    assert snapshot(run) == before


@pytest.mark.parametrize("override, change", [
    ({"optimizer.learning_rate": 0.02}, "optimizer.learning_rate 0.01 → 0.02"),
    ({"training.steps": 6}, "training.steps 4 → 6"),
])
def test_resuming_with_other_hyperparameters_branches(tmp_path, finished_run, override, change):
    cfg, run, before = finished_run
    other = with_overrides(cfg, override)
    branch = train(other, checkpoint_input=str(run / "checkpoint-final" if "training.steps" in override else
                                                  run / "checkpoint-2"), progress=False)
    assert branch.output_dir != run and change in json.loads((branch.output_dir / "branch.json").read_text())["changes"]
    assert snapshot(run) == before


def test_resuming_into_a_new_output_dir_branches_there(tmp_path, finished_run):
    cfg, run, before = finished_run
    target = tmp_path / "elsewhere"
    moved = cfg.model_copy(update={"training": cfg.training.model_copy(update={"output_dir": str(target)})})
    branch = train(moved, checkpoint_input=str(run / "checkpoint-2"), progress=False)
    assert branch.output_dir == target and (target / "branch.json").exists() and (target / "checkpoint-final").exists()
    assert snapshot(run) == before


# -------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("name", ["optimizer.vg0.safetensors", "weights.vg0.data", "model.onnx", "session.json"])
def test_a_corrupt_checkpoint_file_is_named(finished_run, name):
    cfg, run, _ = finished_run
    ckpt = run / "checkpoint-2"
    data = bytearray((ckpt / name).read_bytes())
    data[len(data) // 2] ^= 0x10  # one flipped bit
    (ckpt / name).write_bytes(bytes(data))
    more = cfg.model_copy(update={"training": cfg.training.model_copy(update={"output_dir": str(run.parent / "x")})})
    with pytest.raises(ValueError, match=rf"checkpoint-2: {name} is corrupt \(SHA-256"):
        train(more, checkpoint_input=str(ckpt), progress=False)


def test_a_checkpoint_missing_a_file_or_its_checksums_is_refused(finished_run):
    cfg, run, _ = finished_run
    (run / "checkpoint-2" / "weights.vg0.data").unlink()
    with pytest.raises(ValueError, match="checkpoint-2 is not a complete checkpoint: weights.vg0.data is missing"):
        checkpoints.verify(run / "checkpoint-2", ("model.onnx", "weights.vg0.data", "session.json"))
    with pytest.raises(ValueError, match=r"checkpoint-2: weights.vg0.data is missing \(listed in checksums.json\)"):
        train(cfg.model_copy(update={"training": cfg.training.model_copy(update={"output_dir": str(run.parent / "y")})}),
              checkpoint_input=str(run / "checkpoint-2"), progress=False)
    (run / "checkpoint-final" / "checksums.json").unlink()
    with pytest.raises(ValueError, match="has no checksums.json"):
        checkpoints.verify(run / "checkpoint-final", ("model.onnx",))


def test_a_directory_that_is_no_checkpoint_is_named(tmp_path):
    cfg = run_config(tmp_path)
    with pytest.raises(ValueError, match=r"--checkpoint-input .* is not a checkpoint directory"):
        train(cfg, checkpoint_input=str(tmp_path), progress=False)


def test_leftovers_of_interrupted_saves_are_tidied(finished_run):
    cfg, run, _ = finished_run
    (run / ".checkpoint-6.tmp-123").mkdir()
    (run / "checkpoint-2").rename(run / ".checkpoint-2.old-456")  # a crash between the two renames
    done = checkpoints.recover(run)
    assert not (run / ".checkpoint-6.tmp-123").exists() and (run / "checkpoint-2" / "checksums.json").exists()
    assert len(done) == 2 and any("restored" in line for line in done)


def test_a_full_disk_says_so_and_keeps_the_previous_checkpoint(finished_run, monkeypatch):
    cfg, run, before = finished_run

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    with pytest.raises(ValueError, match="the disk is full: cannot write checkpoint"):
        checkpoints.write(run / "checkpoint-final", {"model.onnx": full})
    assert snapshot(run) == before and not [p for p in run.iterdir() if ".tmp-" in p.name]


# ------------------------------------------------------------------- signals
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.slow
def test_a_signal_writes_a_checkpoint_at_the_current_step_and_the_run_resumes(tmp_path, signum, code):
    cfg = run_config(tmp_path, training=dict(steps=100000, checkpoint_every=0))
    path = tmp_path / "long.json"
    path.write_text(json.dumps(cfg.model_dump(mode="json")))
    returncode, stderr = signal_a_run(path, tmp_path / "run", signum, ROOT)
    assert returncode == code, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"stopped by {signal.Signals(signum).name} at step ") and "Traceback" not in stderr
    step = int(last.split(" at step ")[1].split(";")[0])
    ckpt = tmp_path / "run" / f"checkpoint-{step}"
    checkpoints.verify(ckpt, ("model.onnx", "weights.vg0.data", "optimizer.vg0.safetensors", "session.json"))
    longer = cfg.model_copy(update={"training": cfg.training.model_copy(update={"steps": step + 2})})
    resumed = train(longer, checkpoint_input=str(ckpt), progress=False)
    assert [r["step"] for r in resumed.metrics] == [step + 1, step + 2]


def test_a_corrupt_checkpoint_is_named_when_it_only_gives_weights(finished_run, tmp_path):
    cfg, run, _ = finished_run
    data = bytearray((run / "checkpoint-final" / "model.onnx").read_bytes())
    data[-100] ^= 0x01
    (run / "checkpoint-final" / "model.onnx").write_bytes(bytes(data))
    phase2 = cfg.model_copy(update={"training": cfg.training.model_copy(
        update={"init_from": str(run / "checkpoint-final"), "output_dir": str(tmp_path / "phase2")})})
    with pytest.raises(ValueError, match=r"checkpoint-final: model.onnx is corrupt"):
        train(phase2, progress=False)
    assert not (tmp_path / "phase2").exists()
