"""Sweeps from W&B sweep YAML (bert/sweep/): grid end to end, ranking by an evaluation metric,
proposals, divergence, hyperband, a killed or interrupted sweep resumed, a grid extended in place,
edge flags, two workers on one storage, clean errors, and the YAML as `wandb agent` runs it.

Every run is a 32-wide one-layer GroupBERT on random tokens (configs/sweeps/tiny.json).
"""
from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

import bert.sweep
import bert.sweep.storage
import bert.tasks.pretraining

from bert import load_config, with_overrides
from bert.sweep import edge_flags, load_spec, make_sampler, open_storage, open_study, run_sweep, spec_from_dict
from bert.sweep.storage import quiet_optuna
from bert.sweep.worker import _changes, _Worker
from data.create_pretraining_data import create_pretraining_data
from data.pretraining import CreateOptions
from tests.helpers import write_small_corpus
from tests.tiny_runs import ROOT, bert_cli, bert_script, one_thread  # noqa: F401 (an autouse fixture)

TINY = ROOT / "configs" / "sweeps" / "tiny.json"


# Worker processes share 2 cores with this one: one torch thread each, or OpenMP threads spin
# against each other and a 10 ms step of these tiny runs takes a second.
ONE_THREAD = dict(os.environ, OMP_NUM_THREADS="1")


def write_sweep(path: Path, parameters: dict, method: str = "grid", args=(), **keys) -> Path:
    spec = {"program": "bert.py", "name": path.stem, "method": method, "metric": {"name": "loss", "goal": "minimize"},
            "command": ["${env}", "${interpreter}", "${program}", "--config", str(TINY), *args, "${args}"],
            "parameters": parameters, **keys}
    path.write_text(yaml.safe_dump(spec))
    return path


def trials_of(sweep_dir: Path, name: str) -> list:
    study = optuna.load_study(study_name=name, storage=open_storage(str(sweep_dir / "optuna.journal")))
    return sorted(study.get_trials(), key=lambda t: t.number)


def last_logged(run_dir: Path, key: str = "loss") -> float:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])[key]


def lr_of(trial) -> float:
    return trial.user_attrs["values"]["optimizer.learning_rate"]


@pytest.fixture(scope="module")
def held_out_shards(tmp_path_factory):
    """Shards for the tiny model (sequence 16, 3 masks) with a held-out part by document."""
    root = tmp_path_factory.mktemp("sweep_shards")
    files, vocab = write_small_corpus(root, [80], [7], 101)
    create_pretraining_data(files, root / "shards", vocab=vocab.path, progress=False, held_out_fraction=0.25,
                            options=CreateOptions(seq_len=16, max_predictions=3, seed=2))
    return root / "shards"


# --------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_tiny_grid_runs_end_to_end_and_ranks_by_the_logged_metric(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert bert_cli()(["sweep", str(ROOT / "configs/sweeps/tiny.yaml"), "--sweep-dir", str(out)]) == 0
    trials = trials_of(out, "tiny-lr-grid")
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert sorted(lr_of(t) for t in trials) == [0.001, 0.01, 0.1]
    for t in trials:  # each a normal run, with the swept value applied
        run = Path(t.user_attrs["output_dir"])
        assert json.loads((run / "config.json").read_text())["optimizer"]["learning_rate"] == lr_of(t)
        assert len((run / "metrics.jsonl").read_text().splitlines()) == 8
        assert t.value == last_logged(run)

    rows = list(csv.DictReader((out / "runs.csv").open()))
    logged = {float(r["optimizer.learning_rate"]): last_logged(Path(r["output_dir"])) for r in rows}
    assert [float(r["loss"]) for r in rows] == sorted(logged.values())  # best (lowest loss) first
    assert [r["rank"] for r in rows] == ["1", "2", "3"]
    best = rows[0]
    assert Path(best["checkpoint"]).name == "checkpoint-final" and (Path(best["checkpoint"]) / "model.onnx").exists()
    assert f"best checkpoint: {best['checkpoint']}" in capsys.readouterr().out
    assert f"--training.init_from {best['checkpoint']}" in (out / "runs.md").read_text()
    for png in ("loss_curves.png", "loss_vs_optimizer.learning_rate.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Started again, a finished sweep runs nothing more.
    assert bert_cli()(["sweep", str(ROOT / "configs/sweeps/tiny.yaml"), "--sweep-dir", str(out)]) == 0
    assert len(trials_of(out, "tiny-lr-grid")) == 3


@pytest.mark.slow
def test_a_sweep_with_evaluation_data_ranks_by_the_final_eval_loss(tmp_path, held_out_shards):
    """Real held-out evaluation (data.eval_files, every 4 steps): each trial's value is its final
    eval_loss, its curve every evaluation, and the report ranks and plots by it."""
    data = ["--data.source", "shards", "--data.files", str(held_out_shards / "train" / "*.hdf5"),
            "--data.eval_files", str(held_out_shards / "eval" / "*.hdf5"), "--data.eval_samples", "16",
            "--evaluation.every", "4"]
    sweep = write_sweep(tmp_path / "ev.yaml", {"optimizer.learning_rate": {"values": [0.001, 0.01, 0.1]}},
                        metric={"name": "eval_loss", "goal": "minimize"}, args=data)
    out = tmp_path / "s"
    assert bert_cli()(["sweep", str(sweep), "--sweep-dir", str(out)]) == 0
    finals = {}
    for t in trials_of(out, "ev"):
        records = [json.loads(line) for line in (Path(t.user_attrs["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
        evals = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
        assert t.state == TrialState.COMPLETE and sorted(evals) == [4, 8]
        assert t.value == evals[8] and t.intermediate_values == evals  # the final evaluation; the curve
        assert t.value != records[-1].get("loss"), "not the training loss"
        finals[lr_of(t)] = evals[8]
    assert len(set(finals.values())) == 3
    rows = list(csv.DictReader((out / "runs.csv").open()))
    assert [(float(r["optimizer.learning_rate"]), float(r["eval_loss"])) for r in rows] == sorted(
        finals.items(), key=lambda item: item[1])
    assert "minimize `eval_loss` (each run's final evaluation)" in (out / "runs.md").read_text()
    for png in ("eval_loss_curves.png", "eval_loss_vs_optimizer.learning_rate.png"):  # the plots show the metric
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_squad_sweep_fine_tunes_and_ranks_by_the_dev_f1(tmp_path, capsys):
    from tests.squad_data import write_tiny_squad

    train, dev, vocab = write_tiny_squad(tmp_path / "squad")
    files = ["--data.train_file", str(train), "--data.dev_file", str(dev), "--data.vocab_file", str(vocab.path)]
    sweep = tmp_path / "squad.yaml"
    sweep.write_text(yaml.safe_dump({
        "program": "bert.py", "name": "squad-epochs", "method": "grid", "metric": {"name": "f1", "goal": "maximize"},
        "command": ["${env}", "${interpreter}", "${program}", "--config", str(ROOT / "configs/squad_tiny.json"),
                    *files, "${args}"],
        "parameters": {"training.epochs": {"values": [1]}, "schedule.warmup_steps": {"value": 0}}}))
    out = tmp_path / "sweep"
    assert bert_cli()(["sweep", str(sweep), "--sweep-dir", str(out)]) == 0
    (trial,) = trials_of(out, "squad-epochs")
    run = Path(trial.user_attrs["output_dir"])
    assert trial.state == TrialState.COMPLETE and trial.value == json.loads((run / "eval_results.json").read_text())["f1"]
    # One epoch of the training features in batches of the config's 16 decides the steps.
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = json.loads((run / "config.json").read_text())["training"]["steps"]
    assert steps == rows[-2]["step"] == rows[-1]["step"] != 150  # not the config's training.steps
    features = int(capsys.readouterr().out.split(f"training.steps {steps}: 1 epoch(s) of ")[1].split()[0])
    assert steps == math.ceil(features / 16)


def test_random_sweep_honours_run_cap_across_restarts_and_trials_per_worker(tmp_path):
    sweep = write_sweep(tmp_path / "rand.yaml", {"optimizer.learning_rate": {
        "distribution": "log_uniform_values", "min": 0.001, "max": 0.1}}, method="random", run_cap=3,
        args=["--training.steps=4"])
    cli = bert_cli()
    assert cli(["sweep", str(sweep), "--sweep-dir", str(tmp_path / "s"), "--trials", "2"]) == 0
    assert len(trials_of(tmp_path / "s", "rand")) == 2
    assert cli(["sweep", str(sweep), "--sweep-dir", str(tmp_path / "s")]) == 0
    trials = trials_of(tmp_path / "s", "rand")
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3  # the cap, then it stops
    assert all(0.001 <= lr_of(t) <= 0.1 for t in trials) and len({lr_of(t) for t in trials}) == 3


# ------------------------------------------------------------------- proposals
PROPOSAL_SPEC = {
    "program": "bert.py", "method": "random", "metric": {"name": "loss"},
    "parameters": {
        "a.uniform": {"min": -1.0, "max": 3.0},
        "a.log": {"distribution": "log_uniform_values", "min": 1.0e-5, "max": 1.0e-3},
        "a.int": {"min": 20, "max": 100},
        "a.q": {"distribution": "q_uniform", "min": 0.0, "max": 1.0, "q": 0.25},
        "a.qlog": {"distribution": "q_log_uniform_values", "min": 20, "max": 100, "q": 8},
        "a.exp": {"distribution": "log_uniform", "min": 0.0, "max": 2.0},
        "a.cat": {"values": ["lamb", "adamw", [1, 1]]},
        "a.const": {"value": 7},
    },
}


@pytest.mark.parametrize("method,draws", [("random", 400), ("bayes", 150)])
def test_proposals_stay_inside_the_declared_ranges_and_distributions(method, draws):
    spec = spec_from_dict(dict(PROPOSAL_SPEC, method=method))
    params = {p.name: p for p in spec.swept}
    assert "a.const" not in params and spec.constants == {"a.const": 7}
    distributions = {p.name: p.distribution_for() for p in spec.swept}
    study = optuna.create_study(sampler=make_sampler(spec, seed=3))
    seen = {name: [] for name in params}
    for _ in range(draws):
        trial = study.ask(distributions)
        values = {n: p.value(trial.params[n]) for n, p in params.items()}
        for n, v in values.items():
            seen[n].append(v)
        # An objective with its optimum inside, so TPE has something to model.
        study.tell(trial, (math.log10(values["a.log"]) + 4) ** 2 + (values["a.uniform"] - 1) ** 2)

    u, lg, i, q, ql, ex = (seen[n] for n in ("a.uniform", "a.log", "a.int", "a.q", "a.qlog", "a.exp"))
    assert all(-1 <= x <= 3 and isinstance(x, float) for x in u)
    assert all(1e-5 <= x <= 1e-3 for x in lg)
    assert all(20 <= x <= 100 and type(x) is int for x in i)
    assert set(q) <= {0.0, 0.25, 0.5, 0.75, 1.0}
    assert set(ql) <= set(range(24, 97, 8)) and all(type(x) is int for x in ql)  # multiples of 8 in [20, 100]
    assert all(1 <= x <= math.e**2 for x in ex)
    assert all(v in (["lamb", "adamw", [1, 1]]) for v in seen["a.cat"])
    if method == "random":  # the shapes, not just the ranges (4-sigma bands for 400 draws)
        share = lambda xs, cut: sum(x < cut for x in xs) / len(xs)
        assert 0.4 < share(u, 1.0) < 0.6  # uniform: half below the midpoint
        assert 0.4 < share(lg, 1e-4) < 0.6 and share(lg, 5.05e-4) > 0.85  # log-uniform: half below the geometric mean
        assert 0.4 < share(ex, math.e) < 0.6  # log_uniform: exp of a uniform exponent
        assert set(i) == set(range(20, 101))  # every integer, both ends included
        assert set(q) == {0.0, 0.25, 0.5, 0.75, 1.0} and set(ql) == set(range(24, 97, 8))
        assert all(seen["a.cat"].count(c) > 90 for c in ("lamb", "adamw", [1, 1]))
    else:  # TPE draws more often near the optimum (a.log 1e-4, a.uniform 1) once it has history
        late = lg[len(lg) // 2:]
        assert sum(abs(math.log10(x) + 4) < 0.5 for x in late) / len(late) > 0.6


def test_grid_points_follow_wandb(tmp_path):
    spec = spec_from_dict({"program": "bert.py", "method": "grid", "metric": {"name": "loss"}, "parameters": {
        "a.x": {"values": [1, 2]}, "a.n": {"min": 1, "max": 3}, "a.q": {"distribution": "q_uniform", "min": 0,
                                                                       "max": 1, "q": 0.25}}})
    points = spec.grid_points()
    # int_uniform: every integer; q_uniform: numpy.arange(min, max, q) as W&B's grid (max left out)
    assert len(points) == 2 * 3 * 4 and {p["a.q"] for p in points} == {0.0, 0.25, 0.5, 0.75}
    assert len({json.dumps(p, sort_keys=True) for p in points}) == len(points)


# --------------------------------------------------------------- early stopping
@pytest.mark.parametrize("max_loss,lrs,diverging,why", [
    (None, [0.01, 10.0, 0.001], 10.0, "bound"),  # loss 39 at step 2 > 2 (ln 101 + ln 2) = 10.6
    (1e30, [0.01, 1e5, 0.001], 1e5, "nan"),  # finite but huge, then NaN at step 3
])
def test_a_diverging_run_is_marked_failed_and_the_sweep_completes(tmp_path, max_loss, lrs, diverging, why):
    sweep = write_sweep(tmp_path / "div.yaml", {"optimizer.learning_rate": {"values": lrs}})
    argv = ["sweep", str(sweep), "--sweep-dir", str(tmp_path / "s")]
    argv += ["--max-loss", str(max_loss)] if max_loss else []
    assert bert_cli()(argv) == 0
    trials = trials_of(tmp_path / "s", "div")
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert [lr_of(t) for t in failed] == [diverging]
    error = failed[0].user_attrs["error"]
    assert "diverged" in error and (("bound" in error) if why == "bound" else ("nan" in error.lower()))
    run = Path(failed[0].user_attrs["output_dir"])
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) < 8 and not (run / "checkpoint-final").exists()  # stopped where it diverged
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 2
    rows = list(csv.DictReader((tmp_path / "s" / "runs.csv").open()))
    assert [r["state"] for r in rows] == ["finished", "finished", "diverged"]


def test_hyperband_stops_a_run_that_is_behind_at_a_rung(tmp_path):
    # Trial 0 (lr 0.01) sets the bar at step 3; lr 10 is far above it there (loss ~224) and is stopped.
    sweep = write_sweep(tmp_path / "hb.yaml", {"optimizer.learning_rate": {"values": [0.01, 10.0]}},
                        early_terminate={"type": "hyperband", "min_iter": 3, "eta": 2})
    assert bert_cli()(["sweep", str(sweep), "--sweep-dir", str(tmp_path / "s"), "--max-loss", "1e30"]) == 0
    first, second = trials_of(tmp_path / "s", "hb")
    assert first.state == TrialState.COMPLETE and second.state == TrialState.PRUNED
    assert "hyperband at step 3" in second.user_attrs["error"]
    run = Path(second.user_attrs["output_dir"])
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3
    assert sorted(second.intermediate_values) == [1, 2, 3]


# ------------------------------------------------------- restarts and shared storage
@pytest.mark.slow
def test_a_killed_sweep_resumes_without_rerunning_finished_runs(tmp_path, monkeypatch):
    lrs = [0.001, 0.01, 0.1]
    sweep = write_sweep(tmp_path / "kill.yaml", {"optimizer.learning_rate": {"values": lrs}},
                        args=["--training.steps=40", "--checkpoint.every=10"])
    out = tmp_path / "s"
    log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen([sys.executable, "bert.py", "sweep", str(sweep), "--sweep-dir", str(out)],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=ONE_THREAD)
    deadline = time.monotonic() + 120
    try:  # kill it once trial 1 has a checkpoint to resume from (one worker runs the grid in order)
        while not (out / "trial-1" / "checkpoint-10").is_dir():
            assert worker.poll() is None and time.monotonic() < deadline, (tmp_path / "worker.log").read_text()
            time.sleep(0.01)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    before = trials_of(out, "kill")
    assert before[0].state == TrialState.COMPLETE
    assert before[1].state == TrialState.RUNNING, "the worker finished trial 1 before it could be killed"
    finished = out / "trial-0" / "metrics.jsonl"
    snapshot = finished.read_bytes(), finished.stat().st_mtime_ns

    # SIGKILL leaves no word: the trial is given up for dead once its heartbeat is GRACE_S old (1 s here).
    monkeypatch.setattr(bert.sweep.storage, "GRACE_S", 1)
    assert bert_cli()(["sweep", str(sweep), "--sweep-dir", str(out)]) == 0
    trials = trials_of(out, "kill")
    assert (finished.read_bytes(), finished.stat().st_mtime_ns) == snapshot  # trial 0 never ran again
    assert trials[1].state == TrialState.FAIL  # killed while running: failed, and run again
    retry = [t for t in trials if t.system_attrs.get("failed_trial") == 1]
    assert len(retry) == 1 and retry[0].state == TrialState.COMPLETE and lr_of(retry[0]) == lr_of(trials[1])
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert sorted(lr_of(t) for t in done) == lrs  # every grid point finished exactly once
    # The re-run resumed the killed run from its last checkpoint, in its directory.
    run = out / "trial-1"
    assert retry[0].user_attrs["output_dir"] == str(run.resolve())
    assert list(run.glob("metrics.before-resume-*.jsonl"))
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == list(range(1, 41))


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_queues_the_trial_again_and_the_same_command_resumes_it(tmp_path, monkeypatch, signum):
    lrs = [0.001, 0.01, 0.1]
    sweep = write_sweep(tmp_path / "sig.yaml", {"optimizer.learning_rate": {"values": lrs}},
                        args=["--training.steps=60", "--checkpoint.every=10"])
    out, command = tmp_path / "s", ["sweep", str(sweep), "--sweep-dir", str(tmp_path / "s")]
    worker = subprocess.Popen([sys.executable, "bert.py", *command], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=ONE_THREAD)
    deadline = time.monotonic() + 120
    try:  # signal it once trial 1 is past its first checkpoint (one worker runs the grid in order)
        while not (out / "trial-1" / "checkpoint-10").is_dir():
            assert worker.poll() is None and time.monotonic() < deadline, worker.communicate()
            time.sleep(0.01)
    finally:
        worker.send_signal(signum)
        stdout, stderr = worker.communicate(timeout=120)
    # The run wrote a checkpoint where it stopped; the worker stopped at once, saying so in one line.
    assert worker.returncode == 128 + signum, stdout + stderr
    message = stderr.strip().splitlines()[-1]
    step = int(message.split(" at step ")[1].split(";")[0])
    run = (out / "trial-1").resolve()
    assert message == (f"sweep sig: trial 1 stopped by {signal.Signals(signum).name} at step {step}; it is queued "
                       f"again and resumes from {run / f'checkpoint-{step}'} when the same command runs again")
    assert 10 <= step < 60 and (run / f"checkpoint-{step}").is_dir()
    before = trials_of(out, "sig")
    assert [t.state for t in before] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.WAITING,
                                         TrialState.WAITING]  # trial 2 never started; trial 3 re-runs trial 1
    assert before[3].system_attrs["failed_trial"] == 1 and lr_of(before[3]) == lr_of(before[1])

    # The same command again: what does the run loop get?
    calls, real = [], bert.tasks.pretraining.train

    def spy(config, checkpoint_input=None, use_wandb=False, progress=True, on_log=None):
        steps = []
        calls.append((config.optimizer.learning_rate, checkpoint_input, steps))
        return real(config, checkpoint_input, use_wandb, progress,
                    on_log=lambda r: (steps.append(r["step"]), on_log(r)))

    monkeypatch.setattr(bert.tasks.pretraining, "train", spy)
    assert bert_cli()(command) == 0
    trials = trials_of(out, "sig")
    assert sorted(lr_of(t) for t in trials if t.state == TrialState.COMPLETE) == lrs  # every point, once
    assert trials[3].state == TrialState.COMPLETE and trials[3].user_attrs["output_dir"] == str(run)
    # Resumed from its checkpoint, not from step 0: the first step it ran is the one after it.
    (resumed,) = [c for c in calls if c[0] == lr_of(before[1])]
    assert resumed[1] == str(run / f"checkpoint-{step}") and resumed[2][0] == step + 1
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == list(range(1, 61))
    rows = {r["trial"]: r for r in csv.DictReader((out / "runs.csv").open())}
    assert rows["1"]["state"] == "interrupted" and "re-run as trial 3" in rows["1"]["note"]


@pytest.mark.parametrize("where", ["checkpoint", "metrics"])
def test_a_full_disk_stops_the_sweep_in_one_line_and_its_trial_waits_to_resume(tmp_path, monkeypatch, capsys, where):
    """The disk fills while trial 1 writes its final checkpoint (the checkpoint's own one-line
    error) or a metrics line (a bare ENOSPC naming no file): the worker stops with one line naming
    the path, the trial is interrupted and queued again, not failed, and the same command, once
    there is space, resumes it from its last checkpoint."""
    import errno

    import bert.run.rundir
    import session.checkpoint

    lrs = [0.001, 0.01]
    sweep = write_sweep(tmp_path / "full.yaml", {"optimizer.learning_rate": {"values": lrs}},
                        args=["--training.steps=8", "--checkpoint.every=4"])
    out, command = tmp_path / "s", ["sweep", str(sweep), "--sweep-dir", str(tmp_path / "s")]
    run = (out / "trial-1").resolve()
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if where == "checkpoint":
        publish = session.checkpoint._publish

        def patched(tmp, target, sums):
            if target == run / "checkpoint-final":
                raise full
            return publish(tmp, target, sums)

        monkeypatch.setattr(session.checkpoint, "_publish", patched)
        wanted = f"cannot write checkpoint {run / 'checkpoint-final'} (No space left on device)"
    else:
        log = bert.run.rundir.MetricsLog.log

        def patched(self, record):
            if self.path.parent == run and record["step"] == 6:
                raise full
            return log(self, record)

        monkeypatch.setattr(bert.run.rundir.MetricsLog, "log", patched)
        wanted = f"cannot write in {run} (No space left on device)"
    assert bert_cli()(command) == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message == (f"error: sweep full: the disk is full: {wanted}; trial 1 is queued again and resumes from "
                       f"{run / 'checkpoint-4'}: free space, then the same command continues this sweep")
    trials = trials_of(out, "full")
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.WAITING]
    assert trials[1].user_attrs["error"] == f"interrupted: the disk is full: {wanted}"
    assert trials[2].system_attrs["failed_trial"] == 1
    rows = {r["trial"]: r for r in csv.DictReader((out / "runs.csv").open())}
    assert rows["1"]["state"] == "interrupted" and "re-run as trial 2" in rows["1"]["note"]

    monkeypatch.undo()  # space again
    assert bert_cli()(command) == 0
    trials = trials_of(out, "full")
    assert sorted(lr_of(t) for t in trials if t.state == TrialState.COMPLETE) == lrs
    assert trials[2].user_attrs["output_dir"] == str(run) and (run / "checkpoint-final").is_dir()
    assert "resumes " + str(run / "checkpoint-4") in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.serial  # both workers must find trials to take while the other runs
def test_two_workers_sharing_one_storage_never_run_the_same_trial(tmp_path):
    """A worker process and this test's process share one journal file, as two machines would over NFS."""
    lrs = [0.001, 0.002, 0.004, 0.008, 0.016, 0.032]  # 6 x 40 steps: seconds of work, joining takes ~1 s
    sweep = write_sweep(tmp_path / "pair.yaml", {"optimizer.learning_rate": {"values": lrs}},
                        args=["--training.steps=40"])
    out = tmp_path / "s"
    other = subprocess.Popen([sys.executable, "bert.py", "sweep", str(sweep), "--sweep-dir", str(out)], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ONE_THREAD)
    try:  # join once the other worker is busy, so both take part
        deadline = time.monotonic() + 120
        while not ((out / "trial-0").is_dir() or (out / "trial-1").is_dir()):
            assert other.poll() is None and time.monotonic() < deadline, other.communicate()[0]
            time.sleep(0.02)
        assert bert_cli()(["sweep", str(sweep), "--sweep-dir", str(out)]) == 0
    finally:
        log = other.communicate(timeout=300)[0]
    assert other.returncode == 0, log
    trials = trials_of(out, "pair")
    assert len(trials) == len(lrs) and all(t.state == TrialState.COMPLETE for t in trials)
    assert sorted(lr_of(t) for t in trials) == lrs  # every point once, none twice
    assert {int(t.user_attrs["worker"].split(":")[1]) for t in trials} == {other.pid, os.getpid()}  # both took part
    for t in trials:  # each run written by one process only
        assert len((Path(t.user_attrs["output_dir"]) / "metrics.jsonl").read_text().splitlines()) == 40


def test_claims_are_exclusive_when_workers_race_for_them(tmp_path):
    """Many workers claiming at once from one journal file: each trial goes to exactly one."""
    spec = spec_from_dict({"program": "bert.py", "name": "race", "method": "grid", "metric": {"name": "loss"},
                           "command": ["${program}", "--config", str(TINY), "${args}"],
                           "parameters": {"training.seed": {"min": 0, "max": 39}}}, "race.yaml")
    base = load_config(TINY)
    url = str(tmp_path / "race.journal")
    claimed, errors = [], []

    def worker():
        try:
            study, storage = open_study(spec, base, url)
            me = _Worker(spec, base, tmp_path, study, storage, False, False, 10.0)
            while (got := me._claim()) is not None:
                claimed.append(got[0].number)
                study.tell(got[0], 1.0)  # as after its run
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    with quiet_optuna():  # as run_sweep runs its worker
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    assert sorted(claimed) == list(range(40)), f"claimed twice: {sorted({n for n in claimed if claimed.count(n) > 1})}"


def controlled_eval_loss(monkeypatch, eval_loss, every: int = 4) -> None:
    """Real runs whose on_log also gets an `eval_loss` record every `every` steps with a value the
    test decides (eval_loss(lr, step)), so that which grid point is best is known."""
    real = bert.tasks.pretraining.train

    def train(config, checkpoint_input=None, use_wandb=False, progress=True, on_log=None):
        def log(record):
            on_log(record)
            if record["step"] % every == 0:
                on_log({"step": record["step"], "eval_loss": eval_loss(config.optimizer.learning_rate, record["step"])})
        return real(config, checkpoint_input, use_wandb, progress, on_log=log)

    monkeypatch.setattr(bert.tasks.pretraining, "train", train)


# ------------------------------------------------------- an edited sweep, the edge of the range
def test_a_grid_extended_in_place_continues_the_sweep_and_the_edge_flag_follows_the_best(tmp_path, monkeypatch):
    controlled_eval_loss(monkeypatch, lambda lr, step: (math.log10(lr) + 2) ** 2)  # best at lr 0.01
    grid = {"optimizer.learning_rate": {"values": [0.0001, 0.001]}}
    sweep = write_sweep(tmp_path / "grow.yaml", grid, metric={"name": "eval_loss"})
    out, command = tmp_path / "s", ["sweep", str(sweep), "--sweep-dir", str(tmp_path / "s")]
    assert bert_cli()(command) == 0
    edge = ("optimizer.learning_rate: the best run's 0.001 is at the largest end of the searched range (0.001); "
            "the optimum may lie above it: extend the range")
    assert f"- {edge}" in (out / "runs.md").read_text()
    kept = {t.number: (Path(t.user_attrs["output_dir"]) / "metrics.jsonl").stat().st_mtime_ns
            for t in trials_of(out, "grow")}

    # The same YAML with more values: the same sweep; only the new points run.
    grid["optimizer.learning_rate"]["values"] += [0.01, 0.1]
    write_sweep(sweep, grid, metric={"name": "eval_loss"})
    result = []
    monkeypatch.setattr(bert.sweep, "run_sweep", lambda *a, **k: result.append(run_sweep(*a, **k)) or result[-1])
    assert bert_cli()(command) == 0
    trials = trials_of(out, "grow")
    assert [(t.number, lr_of(t), t.state) for t in trials] == [
        (0, 0.0001, TrialState.COMPLETE), (1, 0.001, TrialState.COMPLETE), (2, 0.01, TrialState.COMPLETE),
        (3, 0.1, TrialState.COMPLETE)]
    assert {n: (Path(trials[n].user_attrs["output_dir"]) / "metrics.jsonl").stat().st_mtime_ns for n in kept} == kept
    assert result[0].best["trial"] == 2 and result[0].edges == []  # best inside the range now: no flag
    assert "At the edge" not in (out / "runs.md").read_text()


@pytest.mark.parametrize("change,extra,message", [
    ({"metric": {"name": "loss", "goal": "maximize"}}, [], "goal 'minimize' → 'maximize'"),
    ({"parameters": {"optimizer.learning_rate": {"values": [0.001]}}}, [], "the grid lost 1 of its points"),
    ({}, ["--training.steps", "9"], "config.training.steps 8 → 9"),
    ({"method": "random", "parameters": {"optimizer.learning_rate": {"min": 0.001, "max": 0.01}}}, [],
     "method 'grid' → 'random'"),
])
def test_a_sweep_edited_otherwise_is_refused_naming_the_change(tmp_path, capsys, change, extra, message):
    raw = {"program": "bert.py", "name": "same", "method": "grid", "metric": {"name": "loss"},
           "command": ["${program}", "--config", str(TINY), "${args}"],
           "parameters": {"optimizer.learning_rate": {"values": [0.001, 0.01]}}}
    sweep = tmp_path / "same.yaml"
    command = ["sweep", str(sweep), "--sweep-dir", str(tmp_path / "s")]
    sweep.write_text(yaml.safe_dump(raw))
    assert bert_cli()([*command, "--trials", "1"]) == 0
    sweep.write_text(yaml.safe_dump({**raw, **change}))
    capsys.readouterr()
    assert bert_cli()([*command, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: sweep 'same' in ") and message in err and "give this one another name" in err
    assert err.count("\n") == 1 and len(trials_of(tmp_path / "s", "same")) == 2  # nothing added, nothing run


def test_a_config_field_that_a_later_version_added_is_no_change():
    """The lead's run loop adds data.eval_files and evaluation.every: sweeps started before go on."""
    old = {"metric": "loss", "parameters": {"a.x": "grid"}, "config": {"data": {"files": []}}}
    assert _changes(old, {**old, "config": {"data": {"files": [], "eval_files": []}, "extra": {}}}) == []
    assert _changes(old, {"metric": "eval_loss", "parameters": {"a.x": "grid", "a.y": "grid"},
                          "config": {"data": {"files": ["a"]}}}) == [
        "config.data.files [] → ['a']", "metric 'loss' → 'eval_loss'", "parameters.a.y None → 'grid'"]


@pytest.mark.parametrize("parameter,best,flag", [
    ({"min": 0.0, "max": 1.0}, 0.95, "largest end of the searched range (1)"),
    ({"min": 0.0, "max": 1.0}, 0.5, None),
    ({"distribution": "log_uniform_values", "min": 1.0e-5, "max": 1.0e-1}, 1.5e-5, "smallest end"),
    ({"distribution": "log_uniform_values", "min": 1.0e-5, "max": 1.0e-1}, 1.0e-3, None),  # middle on a log scale
    ({"min": 1, "max": 50}, 2, "smallest end of the searched range (1)"),
    ({"values": [16, 32, 64]}, 64, "largest end of the searched range (64)"),
    ({"values": [16, 32, 64]}, 32, None),
    ({"values": ["lamb", "adamw"]}, "lamb", None),  # not a number: no edge
])
def test_the_edge_flag_marks_a_best_value_at_an_end_of_a_bounded_range(parameter, best, flag):
    spec = spec_from_dict({"program": "bert.py", "method": "random", "metric": {"name": "loss"},
                           "parameters": {"a.x": parameter}})
    flags = edge_flags(spec, {"a.x": best})
    assert (flags == []) if flag is None else (len(flags) == 1 and flag in flags[0])


# ----------------------------------------------------------------- clean errors (issue 20)
@pytest.mark.parametrize("content", [b"garbage\n", b'{"a": 1}\n', b"\x00\xff" * 300 + b"\n{not json\n",
                                     bytes(range(256)) * 16 + b"\x9c", b'{"a": 1}\n{"op_code":'],
                         ids=["text", "json", "binary", "random-bytes", "not-a-journal-then-a-record-begun"])
def test_a_corrupt_journal_is_one_line_naming_it_and_is_left_as_it_was(tmp_path, capsys, content):
    """Not an Optuna journal at all: no `truncate -s` of a last line taken for a torn write."""
    sweep = write_sweep(tmp_path / "c.yaml", {"optimizer.learning_rate": {"values": [0.01]}})
    journal = tmp_path / "s" / "optuna.journal"
    journal.parent.mkdir()
    journal.write_bytes(content)
    assert bert_cli()(["sweep", str(sweep), "--sweep-dir", str(journal.parent)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: sweep storage {journal.resolve()} cannot be read (") and err.count("\n") == 1
    assert "move it away to start the sweep afresh" in err and "internal error" not in err
    assert "cut short" not in err and "truncate" not in err, err
    assert journal.read_bytes() == content and not (journal.parent / "trial-0").exists()


def test_a_corrupt_sqlite_storage_is_one_line_naming_it(tmp_path, capsys):
    sweep = write_sweep(tmp_path / "c.yaml", {"optimizer.learning_rate": {"values": [0.01]}})
    db = tmp_path / "optuna.db"
    db.write_bytes(bytes(range(256)) * 16)
    assert bert_cli()(["sweep", str(sweep), "--sweep-dir", str(tmp_path / "s"), "--storage", f"sqlite:///{db}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: sweep storage sqlite:///{db} cannot be read (") and err.count("\n") == 1
    assert db.read_bytes() == bytes(range(256)) * 16


def journal_of_a_started_grid(path: Path) -> bytes:
    """A real sweep's journal (a grid of two, its first trial finished), made without training."""
    spec = load_spec(write_sweep(path.parent.parent / "j.yaml", {"optimizer.learning_rate": {"values": [0.01, 0.1]}}))
    with quiet_optuna():
        study, storage = open_study(spec, load_config(TINY), str(path))
        trial, _ = _Worker(spec, load_config(TINY), path.parent, study, storage, False, False, 10.0)._claim()
        trial.report(4.5, 1)
        study.tell(trial, 4.0)
    return path.read_bytes()


@pytest.mark.parametrize("damage,message", [
    (lambda lines: b"".join(lines)[:-7], "its last line is cut short after byte {cut}: a write that never finished); "
                                         "cut it off with `truncate -s {cut} {path}` to continue the sweep, or move it away"),
    (lambda lines: b"".join(lines[:2] + [b'{"op_code": 8, "trial_id": \n'] + lines[2:]),
     "(not JSON: Expecting value at character 28)"),
    (lambda lines: b"".join(lines[:2] + [b"\xff\xfe\x00garbage\n"] + lines[2:]), "(not UTF-8 text at byte "),
    (lambda lines: b"".join(lines + [b"\n"]), "(its last line, {n}, is not JSON"),  # a whole empty last line: Optuna would skip it
    (lambda lines: b"".join(lines[:2] + [b'{"op_code": 99, "worker_id": "w"}\n'] + lines[2:]),
     "(AssertionError: "),  # Optuna's own words
    (lambda lines: b"".join(lines[:2] + [b"[1, 2]\n"] + lines[2:]),
     "(TypeError: "),
    (lambda lines: b"".join(lines[:2] + [b'{"op_code": 8, "worker_id": "w", "trial_id": 0}\n'] + lines[2:]),
     "(KeyError: 'user_attr')"),
    (lambda lines: b"".join(lines[:2] + [b'{"op_code": 6, "worker_id": "w", "trial_id": 0, "state": 1, "values": '
                                         b'[1.0], "datetime_complete": "yesterday"}\n'] + lines[2:]),
     "(ValueError: Invalid isoformat string"),
    (lambda lines: b"".join(lines + [b'{"op_code": 8, "worker_id": "w", "trial_id": 1, "user_attr": {"values": 5}}\n']),
     "study 'j': trial 1's attribute 'values' is 5"),  # valid for Optuna, not what the sweep wrote
], ids=["cut-short", "garbled-line", "binary-line", "empty-last-line", "foreign-op", "json-list", "missing-field",
        "bad-date", "foreign-attribute"])
def test_a_damaged_journal_of_a_real_sweep_is_one_line_naming_it_and_what_to_do(tmp_path, capsys, damage, message):
    """Damage found anywhere in the journal (not only its first line) is one line naming the file,
    the line and what to do; nothing is run and nothing is written to the file."""
    journal = tmp_path / "s" / "optuna.journal"
    journal.parent.mkdir()
    lines = journal_of_a_started_grid(journal).splitlines(keepends=True)
    damaged = damage(lines)
    journal.write_bytes(damaged)
    assert bert_cli()(["sweep", str(tmp_path / "j.yaml"), "--sweep-dir", str(journal.parent)]) == 2
    err = capsys.readouterr().err
    expected = message.format(cut=damaged.rfind(b"\n") + 1, path=journal.resolve(), n=len(lines) + 1)
    assert err.startswith(f"error: sweep storage {journal.resolve()} cannot be read (") and err.count("\n") == 1, err
    assert expected in err and "internal error" not in err, err
    assert journal.read_bytes() == damaged and not (journal.parent / "trial-1").exists()


@pytest.mark.slow
def test_a_journal_cut_short_continues_once_cut_as_the_message_says(tmp_path, capsys):
    journal = tmp_path / "s" / "optuna.journal"
    journal.parent.mkdir()
    whole = journal_of_a_started_grid(journal)
    journal.write_bytes(whole + b'{"op_code": 9, "worker_id"')  # a write cut short by a full disk
    command = ["sweep", str(tmp_path / "j.yaml"), "--sweep-dir", str(journal.parent), "--trials", "0"]
    assert bert_cli()(command) == 2
    fix = capsys.readouterr().err.split("cut it off with `")[1].split("`")[0]
    subprocess.run(fix, shell=True, check=True)
    assert journal.read_bytes() == whole
    assert bert_cli()(command) == 0  # the sweep is readable again, as it was
    assert [t.state for t in trials_of(journal.parent, "j")] == [TrialState.COMPLETE, TrialState.WAITING]


def test_a_journal_damaged_while_the_sweep_runs_stops_the_worker_in_one_line(tmp_path, capsys, monkeypatch):
    """Another process appends a line that is not JSON while a trial runs (a torn write): the worker
    stops at the storage call that meets it with the line naming the file, and writes nothing more."""
    sweep = write_sweep(tmp_path / "live.yaml", {"optimizer.learning_rate": {"values": [0.01, 0.1]}})
    journal = tmp_path / "s" / "optuna.journal"
    real = bert.tasks.pretraining.train

    def train(config, checkpoint_input=None, use_wandb=False, progress=True, on_log=None):
        def log(record):
            if record["step"] == 3:
                with journal.open("ab") as f:
                    f.write(b'{"op_code": 9, "worker_id": "elsewh\n')
            on_log(record)
        return real(config, checkpoint_input, use_wandb, progress, on_log=log)

    monkeypatch.setattr(bert.tasks.pretraining, "train", train)
    assert bert_cli()(["sweep", str(sweep), "--sweep-dir", str(journal.parent)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: sweep storage {journal.resolve()} cannot be read (not JSON: "), err
    lines = journal.read_bytes().splitlines()
    bad = lines.index(b'{"op_code": 9, "worker_id": "elsewh')
    # Optuna takes a last line that is not JSON for a write in progress: the damage is found when a
    # record follows it, the worker's own next one at most.
    assert len(lines) - bad <= 2, "records written after the damage was found"
    assert not (journal.parent / "trial-1").exists()


def test_a_database_that_is_not_optunas_is_refused_untouched(tmp_path, capsys):
    import sqlite3

    sweep = write_sweep(tmp_path / "c.yaml", {"optimizer.learning_rate": {"values": [0.01]}})
    db = tmp_path / "other.db"
    with contextlib.closing(sqlite3.connect(db)) as connection:
        connection.execute("CREATE TABLE studies (x INTEGER)")  # a table of Optuna's name, another schema
        connection.commit()
    before = db.read_bytes()
    assert bert_cli()(["sweep", str(sweep), "--sweep-dir", str(tmp_path / "s"), "--storage", f"sqlite:///{db}"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: sweep storage sqlite:///{db} is a database but not an Optuna storage (its tables: "
                   "studies); name another --storage, or move the file away to start the sweep afresh\n")
    assert db.read_bytes() == before


def test_negative_trials_are_refused(tmp_path, capsys):
    assert bert_cli()(["sweep", str(ROOT / "configs/sweeps/tiny.yaml"), "--sweep-dir", str(tmp_path / "s"),
                       "--trials", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --trials -1: give 0 or more") and err.count("\n") == 1
    assert not (tmp_path / "s").exists()


# ------------------------------------------------------------------------ the YAML
@pytest.mark.parametrize("change,message", [
    ({"scheduler": {}}, "'scheduler' is a W&B server feature"),
    ({"colour": "red"}, "unknown key 'colour'"),
    ({"method": "hyper"}, "method = 'hyper': Input should be 'grid', 'random' or 'bayes'"),
    ({"metric": {"name": "loss", "impute": "worst"}}, "unknown key 'metric.impute'"),
    ({"parameters": {"optimizer.learning_rate": {"distribution": "normal", "mu": 0, "sigma": 1}}},
     "'normal' is not supported"),
    ({"parameters": {"optimizer.learning_rate": {"values": [1, 2], "probabilities": [0.5, 0.5]}}},
     "'categorical_w_probabilities' is not supported"),
    ({"parameters": {"optimizer.learning_rate": {"min": 0.1, "max": 1.0}}}, "a grid needs values"),
    ({"method": "random", "parameters": {"optimizer.learning_rate": {"min": "1e-5", "max": 0.1}}},
     "write it with a decimal point"),
    ({"parameters": {"training": {"parameters": {"learning_rate": {"values": [1]}}}}}, "name each field with dots"),
    ({"parameters": {"optimizer.learning_rate": {"values": [1], "step": 2}}},
     "unknown key 'parameters.optimizer.learning_rate.step'"),
    ({"early_terminate": {"type": "hyperband", "min_iter": 3, "strict": False}}, "strict false"),
    ({"early_terminate": {"type": "hyperband", "eta": 3}}, "needs min_iter, or max_iter and s"),
    ({"command": ["${program}", "--config", "x.json"]}, "must pass ${args}"),
    ({"command": ["${program}", "${args_json}"]}, "macro ${args_json} is not supported"),
    ({"parameters": {"optimizer.learning_rate": {"distribution": 5, "min": 0.1, "max": 1.0}}},
     "parameters.optimizer.learning_rate.distribution = 5: Input should be a valid string"),
    ({"early_terminate": {"type": "hyperband", "max_iter": "27", "s": 2}},
     "early_terminate.max_iter = '27': Input should be a valid integer"),
    ({"program": "train.py"}, "program = 'train.py': must be bert.py"),
])
def test_yaml_problems_are_clear_errors(change, message):
    raw = {"program": "bert.py", "method": "grid", "metric": {"name": "loss"},
           "command": ["${program}", "--config", str(TINY), "${args}"],
           "parameters": {"optimizer.learning_rate": {"values": [0.1]}}}
    with pytest.raises(ValueError, match=message.replace("$", r"\$").replace("{", r"\{").replace("(", r"\(")):
        spec_from_dict({**raw, **change}, "bad.yaml")


def test_cli_refuses_unknown_fields_and_unlogged_metrics(tmp_path, capsys):
    cli = bert_cli()
    bad_field = write_sweep(tmp_path / "f.yaml", {"training.learnin_rate": {"values": [0.1]}})
    assert cli(["sweep", str(bad_field), "--sweep-dir", str(tmp_path / "f")]) == 2
    assert "unknown key 'training.learnin_rate'" in capsys.readouterr().err
    assert not (tmp_path / "f" / "trial-0").exists()  # refused before any run
    # A training metric is in every record: a misspelt one stops the sweep at the first step.
    bad_metric = write_sweep(tmp_path / "m.yaml", {"optimizer.learning_rate": {"values": [0.1, 0.2]}},
                             metric={"name": "mlm_acc", "goal": "maximize"})
    assert cli(["sweep", str(bad_metric), "--sweep-dir", str(tmp_path / "m")]) == 2
    assert "metric 'mlm_acc'" in capsys.readouterr().err
    first, second = trials_of(tmp_path / "m", "m")
    assert len((Path(first.user_attrs["output_dir"]) / "metrics.jsonl").read_text().splitlines()) == 1
    assert second.state == TrialState.WAITING  # never ran
    # An evaluation metric comes only at evaluations: a run that ends without one stops the sweep.
    no_eval = write_sweep(tmp_path / "e.yaml", {"optimizer.learning_rate": {"values": [0.1, 0.2]}},
                          metric={"name": "eval_loss"})
    assert cli(["sweep", str(no_eval), "--sweep-dir", str(tmp_path / "e")]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after the run's progress bar
    assert last.startswith("error: trial 0 logged no 'eval_loss'") and "data.eval_files" in last
    assert [t.state for t in trials_of(tmp_path / "e", "e")] == [TrialState.FAIL, TrialState.WAITING]


SHIPPED = sorted((ROOT / "configs" / "sweeps").glob("*.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_sweeps_run_under_wandb_agent_unchanged(path):
    """Expand the command with wandb's own agent code; bert.py must accept what it produces."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command, create_sweep_command_args

    spec = load_spec(path)
    raw = yaml.safe_load(path.read_text())
    point = spec.grid_points()[0] if spec.method == "grid" else {p.name: p.value(p.low)
                                                                  for p in spec.swept}
    point = dict(spec.constants, **point)
    args = create_sweep_command_args({"args": {k: {"value": v} for k, v in point.items()}})
    argv = []
    for token in create_sweep_command(raw["command"]):  # as wandb_agent.Agent._command_run fills it
        argv += {"${env}": ["/usr/bin/env"], "${interpreter}": ["python"], "${program}": [raw["program"]]}.get(
            token, args.get(token[2:-1], [token]) if token.startswith("${") else [token])
    assert argv[:3] == ["/usr/bin/env", "python", "bert.py"]
    config_file = argv[argv.index("--config") + 1]
    assert (ROOT / config_file).exists(), f"{path.name} names {config_file}, which is not in the tree"
    # What bert.py's main does with them: the config file, then the overrides over it.
    overrides = bert_script().parse_overrides([a for a in argv[3:] if a.startswith("--") and "." in a])
    fixed = bert_script().parse_overrides([t for t in raw["command"] if t.startswith("--") and "." in t])
    assert overrides == {**fixed, **point}  # values survive wandb's str() and bert.py's JSON-or-text parsing
    config = with_overrides(load_config(ROOT / config_file), overrides)
    for key, value in point.items():
        section, field = key.split(".")
        assert getattr(getattr(config, section), field) == value


@pytest.mark.parametrize("kind", ["sweep", "comparison"])
def test_sweep_and_comparison_files_are_read_alike_one_line_per_fault(tmp_path, kind):
    """One YAML reader for both specs (bert/config/specfile.py): a missing file, a directory and a file
    that is not YAML each end in one line naming the file."""
    from bert.compare import load_compare
    from bert.sweep import load_spec

    load = load_spec if kind == "sweep" else load_compare
    bad = tmp_path / "bad.yaml"
    bad.write_text("method: [grid\nparameters: {")
    for path, message in [(tmp_path / "none.yaml", f"{kind} file {tmp_path / 'none.yaml'} does not exist"),
                          (tmp_path, f"{kind} file {tmp_path} is a directory; name the YAML file"),
                          (bad, f"{kind} file {bad} is not valid YAML: ")]:
        with pytest.raises(ValueError) as error:
            load(path)
        assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)


def test_a_sweep_file_giving_one_parameter_twice_is_refused_not_cut_to_the_last(tmp_path):
    """A key given twice in any mapping of the YAML is one line naming the key, the lines and the
    file (bert/config/specfile.py), not YAML's silent last-one-wins."""
    from bert.sweep import load_spec

    path = tmp_path / "twice.yaml"
    path.write_text("method: grid\nmetric: {name: loss}\nparameters:\n"
                    "  optimizer.learning_rate: {values: [0.01]}\n"
                    "  optimizer.learning_rate: {values: [0.02]}\n")
    with pytest.raises(ValueError) as error:
        load_spec(path)
    assert str(error.value).startswith(f"sweep file {path}: key 'optimizer.learning_rate' appears twice "
                                       "(lines 4 and 5)") and "\n" not in str(error.value)


def test_a_sweep_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("kept\n")
    for sweep_dir, wanted in [(taken, f"error: sweep --sweep-dir {taken} is a file, not a directory; "),
                              (taken / "s", f"error: sweep --sweep-dir {taken / 's'}: {taken} is a file, ")]:
        assert bert_cli()(["sweep", str(ROOT / "configs/sweeps/tiny.yaml"), "--sweep-dir", str(sweep_dir)]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(wanted)
    assert taken.read_text() == "kept\n"


def test_the_command_may_name_the_train_subcommand_and_no_other_job(tmp_path, capsys):
    cli = bert_cli()
    raw = {"program": "bert.py", "method": "grid", "metric": {"name": "loss"},
           "parameters": {"optimizer.learning_rate": {"values": [0.01]}}}
    train = tmp_path / "train.yaml"
    train.write_text(yaml.safe_dump({**raw, "name": "train", "command": [
        "${program}", "train", "--config", str(TINY), "--training.steps=2", "${args}"]}))
    assert cli(["sweep", str(train), "--sweep-dir", str(tmp_path / "t")]) == 0
    assert [t.state for t in trials_of(tmp_path / "t", "train")] == [TrialState.COMPLETE]
    for job in (["--summary"], ["export", "--output", "x.onnx"], ["--checkpoint-input", "c"]):
        other = tmp_path / "other.yaml"
        other.write_text(yaml.safe_dump({**raw, "name": "other", "command": [
            "${program}", *job[:1], "--config", str(TINY), *job[1:], "${args}"]}))
        capsys.readouterr()
        assert cli(["sweep", str(other), "--sweep-dir", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"sweep {other}: its command" in err, err
        assert not (tmp_path / "o").exists(), "refused before anything was written"
