"""The one run loop (bert/run/loop.py) as pre-training uses it: held-out evaluation, what is
logged and printed, best.json, and torchrun's restarts continuing a job exactly."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import h5py
import pytest

from bert import config_from_dict
from bert.run.rundir import read_best
from bert.run.budget import flops_per_step
from bert.tasks.pretraining import train
from data.create_pretraining_data import create_pretraining_data
from data.pretraining import CreateOptions
from tests.helpers import sections, write_small_corpus
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
        **sections(**{**dict(steps=6, micro_batch_size=4, learning_rate=0.01, warmup_steps=2, output_dir=str(out),
                             log_every=1, eval_every=2), **training}),
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
                             "eval_nsp_accuracy", "unigram_mlm_accuracy", "unigram_mlm_loss", "eval_mlm_targets",
                             "eval_mlm_loss_se", "eval_mlm_accuracy_se"}
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
    from bert.tasks.pretraining import evaluate_only

    scored = evaluate_only(config_from_dict(loop_config(shards, tmp_path / "run")), str(result.checkpoint))
    final = evaluations(result.metrics)[-1]
    for key, value in scored.evaluation.items():
        assert value == pytest.approx(final[key], rel=1e-6, abs=1e-7), key
    assert sorted(p.name for p in tmp_path.rglob("*")) == before, "eval-only writes nothing"
    assert f"eval_loss {final['eval_loss']:.4g}" in capsys.readouterr().out
    from tests.tiny_runs import bert_cli

    assert bert_cli()(["eval", "--config", str(path), "--checkpoint-input", str(result.checkpoint)]) == 0
    assert bert_cli()(["eval", "--config", str(path)]) == 2
    assert "bert.py eval scores weights: pass --checkpoint-input" in capsys.readouterr().err
    assert bert_cli()(["eval", "--config", str(path), "--checkpoint-input", str(result.checkpoint),
                       "--data.eval_samples", "0"]) == 2
    assert "bert.py eval needs held-out data" in capsys.readouterr().err


def test_eval_auto_scores_the_newest_checkpoint_of_the_run_or_says_there_is_none(shards, tmp_path, capsys):
    """`--checkpoint-input auto` means what it means for a run: the newest verified checkpoint of
    the config's run directory (not an ONNX file named "auto"); the old --eval-only reads alike."""
    from tests.tiny_runs import bert_cli

    cfg = loop_config(shards, tmp_path / "run", steps=4, eval_every=0, checkpoint_every=2)
    result = train(config_from_dict(cfg), progress=False)
    path = tmp_path / "loop.json"
    path.write_text(json.dumps(cfg))
    capsys.readouterr()
    for command in (["eval", "--config", str(path), "--checkpoint-input", "auto"],
                    ["--eval-only", "--config", str(path), "--checkpoint-input", "auto"]):
        assert bert_cli()(command) == 0
        out = capsys.readouterr().out
        newest = tmp_path / "run" / "checkpoint-final"
        assert f"scoring {newest}, the newest checkpoint of {tmp_path / 'run'}" in out
        assert f"{newest}: eval_loss {evaluations(result.metrics)[-1]['eval_loss']:.4g}" in out
    (tmp_path / "empty").mkdir()
    assert bert_cli()(["eval", "--config", str(path), "--checkpoint-input", "auto",
                       "--training.output_dir", str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --checkpoint-input auto scores the newest checkpoint of the run directory {tmp_path / 'empty'} "
        "(training.output_dir), which holds no checkpoint that verifies: train first, or name a checkpoint "
        "directory with --checkpoint-input")


def test_evaluation_never_uses_a_file_the_run_trains_on(shards, tmp_path):
    cfg = loop_config(shards, tmp_path / "run")
    cfg["data"]["eval_files"] = [str(shards / "train" / "*.hdf5")]
    with pytest.raises(ValueError, match=r"held-out shard .*shard_00000.hdf5 is one the run trains on \(data.files\)"):
        train(config_from_dict(cfg), progress=False)


def test_log_every_sets_the_records_and_the_progress_lines(shards, tmp_path, capsys):
    """The console shows the metrics records: one plain line per record (not a terminal), with
    the same means over the same steps, said so; the start says what the run will read."""
    cfg = loop_config(shards, tmp_path / "run", log_every=3, eval_every=0, steps=7)
    result = train(config_from_dict(cfg), progress=True)
    records = [r for r in result.metrics if "loss" in r]
    assert [r["step"] for r in records] == [3, 6, 7], "one record per log_every steps, and one at the end"
    out = capsys.readouterr()
    assert "\r" not in out.err + out.out, "no carriage-return bar fragments"
    lines = [line for line in out.out.splitlines() if line.startswith("step") and "→" not in line]
    # The evaluation at the final checkpoint has its own line.
    assert [line.split(":")[0] for line in lines] == ["steps 1-3 of 7", "steps 4-6 of 7", "step 7 of 7", "step 7"]
    for line, record in zip(lines, records):
        assert (f"loss {record['loss']:.3f}, mlm_acc {record['mlm_accuracy']:.3f}, "
                f"nsp_acc {record['nsp_accuracy']:.3f} (means); lr {record['learning_rate']:.2e}") in line, line
    assert "ETA " in lines[0] and "ETA" not in lines[2], "an ETA until the last step"
    samples = sum(h5py.File(f, "r")["input_ids"].shape[0] for f in sorted((shards / "train").glob("*.hdf5")))
    assert f"training data: {samples} samples (1 shard); 7 steps × global batch 4 = 28 samples, " \
           f"{28 / samples:.2f} epochs" in out.out
    assert "evaluation: 48 rows (1 held-out shard), at each checkpoint" in out.out
    assert "steps 1-3 → step 7: loss " in out.out, "the summary's spans are the records' own"
    # Model FLOP/s and MFU: the step's counted FLOPs (bert.py summary's) at the record's pace, over
    # the peak the start line names.
    per_step = flops_per_step(config_from_dict(cfg))
    peak = re.search(r"model FLOPs: (\S+) per step; MFU against (\S+) GFLOP/s \(1024³ fp32 GEMM measured at start\)",
                     out.out)
    assert peak and float(peak.group(1)) == pytest.approx(per_step, rel=1e-3), out.out
    for line, record in zip(lines, records):
        # sequences_per_s has 2 decimals: on a loaded machine (1.5/s) that is 0.3 % of it.
        assert record["tflops"] == pytest.approx(per_step * record["sequences_per_s"] / 4 / 1e12, rel=2e-3,
                                                 abs=per_step * 0.005 / 4 / 1e12)
        # The start line's peak has 3 figures ("182": up to 2.7e-3 off) and the record's MFU 4 decimals;
        # a run was 4.2e-3 off (not traced further). A wrong formula is 2x off.
        assert record["mfu"] == pytest.approx(record["tflops"] * 1e3 / float(peak.group(2)), rel=1e-2, abs=1e-4)
        assert f"GFLOP/s, MFU {record['mfu']:.3f}" in line, line


def test_a_run_shorter_than_the_evaluation_cadence_says_it_evaluates_at_its_checkpoints(shards, tmp_path, capsys):
    train(config_from_dict(loop_config(shards, tmp_path / "short", steps=4, eval_every=50)), progress=False)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("evaluation:")]
    assert said == ["evaluation: 48 rows (1 held-out shard), at each checkpoint (evaluation.every 50 reaches past "
                    "the run's last step, 4)"], said
    train(config_from_dict(loop_config(shards, tmp_path / "long", steps=4, eval_every=2)), progress=False)
    assert "evaluation: 48 rows (1 held-out shard), every 2 steps and at each checkpoint" in capsys.readouterr().out


def test_a_cpu_run_on_a_machine_with_a_gpu_says_how_to_train_there(shards, tmp_path, capsys, monkeypatch):
    """training.device is cpu unless a config says otherwise: where torch sees GPUs the run's
    start names them and the setting that uses them; on this CPU-only host it says nothing."""
    import torch

    from bert.run import loop

    train(config_from_dict(loop_config(shards, tmp_path / "here", steps=2)), progress=False)
    assert "--training.device cuda" not in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    config = config_from_dict(loop_config(shards, tmp_path / "gpu", steps=2))
    assert loop.unused_gpus(config) == "8 GPUs (NVIDIA H200)"
    assert loop.unused_gpus(config.model_copy(update={"training": config.training.model_copy(
        update={"device": "cuda"})})) == ""
    monkeypatch.undo()
    monkeypatch.setattr(loop, "unused_gpus", lambda config: "8 GPUs (NVIDIA H200)")
    train(config, progress=False)
    assert ("note: training.device cpu, while torch sees 8 GPUs (NVIDIA H200): --training.device cuda trains on them "
            "(docs/gpu.md)") in capsys.readouterr().out.splitlines()


def _overfitting(shards, out: Path, **training) -> dict:
    """Evaluations every step between checkpoints at 4 and 8, and a learning rate that warms up
    to 2.0 over the run: the held-out loss falls, bottoms out early and rises."""
    return loop_config(shards, out, steps=10, eval_every=1, checkpoint_every=4, learning_rate=2.0, warmup_steps=10,
                       decay="constant", **training)


def _minimum(evals: list[dict]) -> dict:
    best = min(evals, key=lambda r: r["eval_loss"])
    assert best["step"] % 4 and best["step"] < 10 and evals[-1]["eval_loss"] > best["eval_loss"] * 1.01, \
        f"the held-out loss should bottom out between checkpoints and rise: {[r['eval_loss'] for r in evals]}"
    return best


def test_the_best_evaluation_between_checkpoints_is_kept_in_checkpoint_best(shards, tmp_path, capsys):
    """checkpoint.save_best (on by default): the minimum's weights are reachable from best.json and
    score what the run printed for them; later checkpoints do not replace them."""
    cfg = config_from_dict(_overfitting(shards, tmp_path / "run"))
    result = train(cfg, progress=False)
    best = _minimum(evaluations(result.metrics))
    recorded = json.loads((result.output_dir / "best.json").read_text())
    assert recorded == {"checkpoint": "checkpoint-best", "step": best["step"], "metric": "eval_loss",
                        "value": pytest.approx(best["eval_loss"], rel=1e-7), "goal": "minimize"}
    kept = result.output_dir / recorded["checkpoint"]
    assert json.loads((kept / "session.json").read_text())["step"] == best["step"]
    from bert.tasks.pretraining import evaluate_only

    scored = evaluate_only(cfg, str(kept))
    assert scored.evaluation["eval_loss"] == pytest.approx(best["eval_loss"], rel=1e-6), "the minimum's weights"
    out = capsys.readouterr().out
    assert f"best: checkpoint-best (eval_loss {best['eval_loss']:.4g} at step {best['step']}; best.json)" in out
    # A resumed run reads the best so far: a worse evaluation does not replace it.
    assert read_best(result.output_dir) == recorded


def test_a_better_evaluation_at_a_checkpoint_replaces_checkpoint_best(shards, tmp_path):
    result = train(config_from_dict(loop_config(shards, tmp_path / "run", steps=6, eval_every=1, checkpoint_every=3)),
                   progress=False)
    evals = evaluations(result.metrics)
    assert [r["eval_loss"] for r in evals] == sorted(r["eval_loss"] for r in evals)[::-1], "falling throughout"
    assert json.loads((result.output_dir / "best.json").read_text())["checkpoint"] == "checkpoint-final"
    assert not (result.output_dir / "checkpoint-best").exists(), "superseded by checkpoint-final, removed"


def test_without_save_best_the_run_says_the_best_was_not_saved(shards, tmp_path, capsys):
    result = train(config_from_dict(_overfitting(shards, tmp_path / "run", save_best=False)), progress=False)
    best = _minimum(evaluations(result.metrics))
    recorded = json.loads((result.output_dir / "best.json").read_text())
    note = f"not saved: step {best['step']} wrote no checkpoint and checkpoint.save_best is off"
    assert recorded["checkpoint"] is None and recorded["step"] == best["step"] and recorded["note"] == note
    assert not (result.output_dir / "checkpoint-best").exists()
    assert f"best: eval_loss {best['eval_loss']:.4g} at step {best['step']}, {note} (best.json)" in \
        capsys.readouterr().out


def test_best_json_that_is_damaged_is_named_and_one_behind_checkpoint_best_is_caught_up(shards, tmp_path):
    result = train(config_from_dict(_overfitting(shards, tmp_path / "run")), progress=False)
    run = result.output_dir
    recorded = json.loads((run / "best.json").read_text())
    # Stopped between writing checkpoint-best and best.json: best.json still names an earlier step.
    (run / "best.json").write_text(json.dumps({**recorded, "step": 1, "value": 9.0}))
    assert read_best(run) == {**recorded, "value": pytest.approx(recorded["value"], rel=1e-7)}
    for text, what in [("[1]", "holds a JSON list"), ('{"checkpoint": "../x", "step": 1}', "not a checkpoint"),
                       (json.dumps({**recorded, "value": "low"}), "value 'low' is not a finite number")]:
        (run / "best.json").write_text(text)
        with pytest.raises(ValueError, match=f"{run / 'best.json'}.*{what}"):
            read_best(run)


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
@pytest.mark.serial  # a worker killed under a wall-clock fault timeout
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
    killed, _, resumed = output.partition("resuming from")
    assert resumed, output[-4000:]
    # The attempt that lost its worker names it: rank 0's watchdog ("rank 1 ... died"), or torchrun's
    # own record of the worker's exit when the agent ends rank 0 first (seen once, in CI, stop 59).
    assert "died" in killed or "(exitcode: -9) local_rank: 1" in killed, killed[-3000:]
    for name in ("weights.vg0.data", "optimizer.vg0.safetensors"):
        assert (tmp_path / "killed" / "checkpoint-final" / name).read_bytes() == \
            (tmp_path / "whole" / "checkpoint-final" / name).read_bytes(), name


@pytest.mark.slow
@pytest.mark.serial  # both ranks stop within a wall-clock fault timeout
def test_sigterm_under_torchrun_every_rank_names_the_checkpoint(shards, tmp_path):
    """SIGTERM to rank 1 of two: both stop after the same step with one checkpoint, and each
    rank's last line names it (rank 1 never says none was written because rank 0 wrote it)."""
    path = tmp_path / "long.json"
    path.write_text(json.dumps(loop_config(shards, tmp_path / "run", steps=100000, eval_every=0, fault_timeout=20)))
    tag = uuid.uuid4().hex
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "bert.py",
               "--config", str(path)]
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "GROUPBERT_TEST_TAG": tag},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()[-4000:]
            time.sleep(0.1)
        (victim,) = _pids_with(tag, rank=1)
        os.kill(victim, signal.SIGTERM)
        output, _ = process.communicate(timeout=240)
    finally:
        _kill_group(process)
    lines = [line for line in output.splitlines() if line.startswith("stopped by ")]
    assert len(lines) == 2 and "not clean" not in output, output[-4000:]
    steps = {line.split(" at step ")[1].split(";")[0] for line in lines}
    assert len(steps) == 1, lines
    checkpoint = tmp_path / "run" / f"checkpoint-{steps.pop()}"
    assert all(f"checkpoint: {checkpoint}; resume with --checkpoint-input {checkpoint}" in line for line in lines)
    assert {line.split(" at step ")[0] for line in lines} == {"stopped by SIGTERM", "stopped by a signal in another process"}
    assert (checkpoint / "checksums.json").exists(), f"{checkpoint} was not written"


def _quoted_console_lines(readme: str) -> list[str]:
    """The console lines the README's Quick start shows from `make train` (its `text` block)."""
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    (transcript,) = re.findall(r"```text\n(.*?)```", section, flags=re.S)
    prefixes = ("training data:", "evaluation:", "steps ", "step ", "best:", "checkpoint:")
    return [" ".join(line.split()) for line in transcript.splitlines() if line.startswith(prefixes)]


def _shape(quote: str, directory: str) -> re.Pattern:
    """A quoted line as a pattern: any figures where it has figures, anything where it has `...`,
    any run directory where it names runs/demo, the test's demo directory for demo_data."""
    pattern = re.escape(quote).replace(r"\.\.\.", ".*").replace("runs/demo", ".*").replace("demo_data",
                                                                                          re.escape(directory))
    pattern = pattern.replace(r"best:\ checkpoint\-final", r"best:\ checkpoint\-\w+")  # the capped run's best
    return re.compile(re.sub(r"\d+(?:\\\.\d+)?(?:e\\?-\d+)?", r"[-+0-9.e]+", pattern))


@pytest.mark.slow
def test_the_readme_quotes_the_lines_make_train_prints(tmp_path, capsys):
    """Every console line the README quotes from the demo run is the start of a line a demo run
    prints (figures aside): configs/demo.json with its steps and sizes capped."""
    from tests.tiny_runs import bert_cli

    quotes = _quoted_console_lines((ROOT / "README.md").read_text())
    assert {q.split()[0] for q in quotes} >= {"training", "evaluation:", "steps", "step", "best:", "checkpoint:"}
    directory = str(tmp_path / "demo_data")
    code = bert_cli()(["--config", "configs/demo.json", "--training.steps", "20", "--schedule.warmup_steps", "2",
                       "--evaluation.every", "10", "--checkpoint.every", "10", "--training.output_dir",
                       str(tmp_path / "runs" / "demo"), "--data.directory", directory, "--data.eval_samples", "64",
                       "--model.hidden_size", "48", "--model.sequence_length", "32", "--model.max_predictions", "5",
                       "--model.num_layers", "1"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0, out
    for quote in quotes:
        shape = _shape(quote, directory)
        assert any(shape.match(line) for line in out), f"README quotes {quote!r}; the run printed:\n" + "\n".join(out)


def test_on_a_terminal_the_bar_shows_the_last_records_means(monkeypatch):
    """The bar's figures are the last metrics record's (means over its steps, said so), not the
    last step's; tqdm gives the rate and the ETA."""
    import io

    from bert.run.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = Progress(True, 20, 0, "demo")
    for step in range(1, 11):
        bar.step(step)
    bar.record(1, 10, {"loss": "8.188", "mlm_acc": "0.042"}, ["lr 5.48e-03", "348 tokens/s"])
    bar.close()
    shown = sys.stderr.getvalue().split("\r")[-1]
    assert "10/20" in shown and "steps 1-10: loss 8.188, mlm_acc 0.042 (means), lr 5.48e-03, 348 tokens/s" in shown


def test_a_run_with_a_seconds_budget_names_the_budget_not_a_step_count(capsys):
    """A time budget ends the run at a step not known in advance (the step limit it is given is
    10⁹): its lines said 'steps 1-49 of 1000000000' and, at the end, 'ETA 0s'."""
    from bert.run.progress import Progress

    progress = Progress(True, 10**9, 0, "demo", seconds=45.0)
    for step in range(1, 11):
        progress.step(step)
    progress.record(1, 10, {"loss": "8.188"}, ["lr 5.48e-03"], seconds_left=12.5)
    progress.record(11, 20, {"loss": "7.9"}, ["lr 1e-04"], seconds_left=-0.3)  # the step that spent it
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["steps 1-10 of a 45 s budget: loss 8.188 (means); lr 5.48e-03, ETA 12s",
                     "steps 11-20 of a 45 s budget: loss 7.9 (means); lr 1e-04"], lines


@pytest.mark.parametrize("rows, columns, bar", [(0, 0, False), (24, 80, True)], ids=["0x0", "80x24"])
def test_a_terminal_of_no_width_gets_the_plain_lines(monkeypatch, capsys, rows, columns, bar):
    """A terminal whose size reads 0×0 showed no bar and no lines at all (tqdm draws in the width
    - 1): it gets the plain lines, as output that is not a terminal does."""
    import fcntl
    import struct
    import termios

    from bert.run.progress import Progress

    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    with os.fdopen(follower, "w") as terminal, os.fdopen(leader, "rb", buffering=0):
        monkeypatch.setattr(sys, "stderr", terminal)
        progress = Progress(True, 20, 0, "demo")
        for step in range(1, 11):
            progress.step(step)
        progress.record(1, 10, {"loss": "8.188"}, ["lr 5.48e-03"])
        progress.close()
        monkeypatch.undo()
    out = capsys.readouterr().out
    assert (progress.bar is not None) == bar
    assert out.startswith("steps 1-10 of 20: loss 8.188 (means); lr 5.48e-03, ETA ") if not bar else out == "", out
