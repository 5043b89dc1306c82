"""Budgets and comparisons (bert/run/budget.py, bert/compare/): FLOPs per step as `--summary` counts
them (padded and packed), runs that end at a FLOPs or seconds budget fully decayed, the
interpolation of "FLOPs to reach", the comparison YAML's errors, and configs/compare/tiny.yaml end
to end with a kill and a rerun.
"""
from __future__ import annotations

import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

import bert.sweep.storage
from bert import config_from_dict, load_config
from bert.run import budget
from bert.compare import compare_from_dict, mean_curve, reach
from bert.compare.report import Point, pair_ratios
from bert.compare.stats import RunEnd, ranking, seconds_refusal, spread, verdict
from tests.helpers import merge_settings, sections
from tests.tiny_runs import ROOT, bert_cli, one_thread  # noqa: F401 (an autouse fixture)

TINY = {"name": "budget", "model": {"architecture": "groupbert", "hidden_size": 48, "num_layers": 2, "num_heads": 3,
                                    "vocab_size": 101, "max_positions": 24, "sequence_length": 19,
                                    "max_predictions": 5},
        **sections(micro_batch_size=4, log_every=1, warmup="linear", decay="linear"),
        "data": {"source": "synthetic"}}


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------- FLOPs per step
@pytest.mark.parametrize("architecture", ["bert", "groupbert"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_flops_per_step_are_the_summary_figure_times_the_tokens_of_a_step(tmp_path, capsys, architecture, packed):
    raw = json.loads(json.dumps(TINY))
    raw["model"].update(architecture=architecture, packed=packed)
    merge_settings(raw, micro_batch_size=5, gradient_accumulation=3)
    raw["data"] = {"source": "demo"}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw))
    config = load_config(path)
    assert bert_cli()(["summary", "--config", str(path)]) == 0
    text = capsys.readouterr().out
    per_token = float(re.search(r"forward FLOPs per token: [\d.]+ GFLOP \(([\d.e+-]+);", text).group(1))
    tokens = 5 * 3 * 2 * 19  # rows of a step (micro batch × accumulation × 2 replicas) × positions per row
    expected = 3 * per_token * tokens  # --summary prints 4 significant digits
    assert budget.flops_per_step(config, replicas=2) == pytest.approx(expected, rel=1e-3)
    from bert.model import build_model
    from bert.summary import forward_flops

    exact = 3 * forward_flops(build_model(config.model), batch=1) * 5 * 3 * 2
    assert budget.flops_per_step(config, replicas=2) == exact
    if packed:  # a packed row carries more masked slots: its graph costs more than the padded one
        assert exact > budget.flops_per_step(config.model_copy(update={"model": config.model.unpacked()}), 2)


# --------------------------------------------------------------------- budgets
@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["bert", "groupbert"])
def test_a_flops_budget_ends_within_one_step_of_it_with_the_rate_fully_decayed(tmp_path, architecture):
    raw = json.loads(json.dumps(TINY))
    raw["model"]["architecture"] = architecture
    per_step = budget.flops_per_step(config_from_dict(raw))
    amount = 12.7 * per_step
    merge_settings(raw, budget_flops=amount, budget_warmup=0.25, output_dir=str(tmp_path / "run"))
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw))
    assert bert_cli()(["--config", str(path)]) == 0
    rows = [r for r in records(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 13))
    last = rows[-1]
    assert last["train_flops"] == 12 * per_step and last["train_flops"] <= amount < last["train_flops"] + per_step
    # Linear warm-up over round(0.25 · 12) = 3 steps, linear decay to 0 at step 12 (the budget).
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["training"]["steps"] == 12 and config["budget"]["flops"] == amount
    base = raw.get("optimizer", {}).get("learning_rate", 0.006)
    expected = [base * min(s / 3, (12 - s) / 9) for s in range(12)]  # the rate of each step (from step 0)
    assert [r["learning_rate"] for r in rows] == pytest.approx(expected, abs=1e-9)
    schedule = budget.schedule(budget.resolve(config_from_dict(raw))[0])
    assert schedule(12) == 0.0, "the rate at the budget"


@pytest.mark.slow
def test_a_seconds_budget_stops_on_time_with_the_rate_keyed_to_the_time_spent(tmp_path):
    raw = json.loads(json.dumps(TINY))
    merge_settings(raw, budget_seconds=1.5, budget_warmup=0.2, steps=10**6, checkpoint_every=4,
                           output_dir=str(tmp_path / "run"))
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw))
    assert bert_cli()(["--config", str(path)]) == 0
    rows = [r for r in records(tmp_path / "run") if "loss" in r]
    seconds = [r["train_seconds"] for r in rows]
    # metrics.jsonl rounds train_seconds to the millisecond: a step that ended at 1.4996 s (under
    # the budget) reads 1.5, so the step before the last may equal the budget, never pass it.
    assert seconds[-1] >= 1.5 >= seconds[-2] and seconds[-2] < seconds[-1], "stopped at the first step past its budget"
    assert seconds == sorted(seconds) and (tmp_path / "run" / "checkpoint-final").is_dir()
    curve = budget.schedule(config_from_dict(raw))
    for before, row in zip([0.0] + seconds, rows):  # each step's rate: the curve at the time spent before it
        assert row["learning_rate"] == pytest.approx(curve.at_fraction(before / 1.5), abs=0.006 * 2e-3)
    assert curve.at_fraction(1.0) == 0.0, "fully decayed when the time is up"
    # A resume keeps the time spent (checkpoint-4's) and goes on counting from it.
    spent = next(r["train_seconds"] for r in rows if r["step"] == 4)
    assert bert_cli()(["--config", str(path), "--checkpoint-input", str(tmp_path / "run" / "checkpoint-4")]) == 0
    branch = records(Path(f"{tmp_path / 'run'}.1"))
    resumed = [r for r in branch if "loss" in r and r["step"] > 4]
    assert resumed[0]["train_seconds"] > spent and resumed[-1]["train_seconds"] >= 1.5


@pytest.mark.parametrize("change,message", [
    ({"budget": {"flops": 1.0e9, "seconds": 5.0}}, "two budgets: give one"),
    ({"budget": {"warmup": 0.1}}, "budget: warmup 0.1 is a fraction of a budget"),
    ({"budget": {"flops": 1.0e9}, "schedule": {"warmup_steps": 3}}, "with a budget the warm-up is budget.warmup"),
    ({"budget": {"flops": 10.0}}, "is less than one training step"),
])
def test_budget_settings_that_cannot_work_are_one_line(change, message):
    raw = json.loads(json.dumps(TINY))
    for section, settings in change.items():
        raw[section] = {**raw.get(section, {}), **settings}
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        budget.resolve(config_from_dict(raw, "b.json"))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("key", ["training.budget_flops", "budget.flops", "budget.seconds"])
def test_a_budget_on_a_squad_config_says_it_applies_to_pre_training(key):
    """Not the warm-up advice (schedule.warmup_steps → budget.warmup), which would not make it work."""
    from bert import with_overrides

    squad = load_config(ROOT / "configs/squad_tiny.json")
    assert squad.schedule.warmup_steps > 0
    with pytest.raises(ValueError) as error:
        with_overrides(squad, {key: 1.0e12}, "command line")
    message = str(error.value)
    assert f"budget.{key.rsplit('_', 1)[-1].rsplit('.', 1)[-1]} applies to pre-training; fine-tuning counts " \
           "training.steps or training.epochs" in message, message
    assert "warm-up" not in message and "\n" not in message


# --------------------------------------------------------------------- "to reach"
def _curve(points):
    return [Point(s, f, t, {"eval_mlm_loss": v}) for s, f, t, v in points]


def test_to_reach_interpolates_in_log_flops_between_the_two_evaluations_around_the_target():
    x = _curve([(10, 100.0, 1.0, 5.0), (20, 200.0, 3.0, 4.0), (30, 300.0, 4.0, 3.0)])
    y = _curve([(5, 150.0, 2.0, 6.0), (10, 300.0, 5.0, 3.6)])
    r = reach("x", "y", x, y, "eval_mlm_loss")
    w = (3.6 - 4.0) / (3.0 - 4.0)  # 0.4 of the way from step 20 to step 30, in log-FLOPs and log-seconds
    flops, seconds = math.exp(math.log(200) + w * (math.log(300) - math.log(200))), 3 * (4 / 3) ** w
    assert r.target == 3.6 and r.flops == pytest.approx(flops, rel=1e-12) and r.seconds == pytest.approx(seconds)
    assert 200 + w * 100 > r.flops > 200  # below the straight line: the log scale's
    assert [p.step for p in r.points] == [20, 30] and r.bracket == (pytest.approx(200 / 300), 1.0)
    assert r.flops_ratio == pytest.approx(flops / 300) and r.seconds_ratio == pytest.approx(seconds / 5)
    first = reach("y", "x", y, _curve([(10, 100.0, 1.0, 6.5)]), "eval_mlm_loss")  # below the target at once
    assert first.bound == "≤" and first.flops == 150.0 and len(first.points) == 1 and first.bracket == (0.0, 1.5)
    never = reach("y", "x", y, _curve([(10, 100.0, 1.0, 1.0)]), "eval_mlm_loss")
    assert never.flops is None and never.flops_ratio is None and never.bracket is None
    # every seed of X against every seed of Y: the spread of the mean curves' ratio
    y2 = _curve([(5, 150.0, 2.0, 6.0), (10, 250.0, 5.0, 4.5)])
    ratios = pair_ratios([x, _curve([(10, 100.0, 1.0, 3.5)])], [y, y2], "eval_mlm_loss")
    assert ratios == [pytest.approx(flops / 300), pytest.approx(100 * 2 ** 0.5 / 250), 100 / 300, 100 / 250]
    assert pair_ratios([x], [_curve([(10, 100.0, 1.0, 1.0)])], "eval_mlm_loss") == [None]


def test_the_spread_over_seeds_and_the_verdict_flag_plateau_runs_and_never_rank_them():
    from scipy.stats import ttest_ind

    assert spread([3.957, None, 3.961, float("nan")]).text() == "3.959 (3.957–3.961)" and spread([]) is None
    assert spread([2.0]).text() == "2" and spread([1.0, 2.0]).overlaps(spread([1.5, 3.0]))

    def end(loss, accuracy, unigram=0.1, se=0.01):
        return RunEnd(loss, accuracy, unigram, se, None, 1000, 1.0e4, 1.0)

    past, stuck = [end(4.0, 0.3), end(4.1, 0.32)], [end(6.0, 0.12), end(5.9, 0.16)]  # 0.12 < 1.5 × 0.1
    assert stuck[0].on_plateau and not stuck[1].on_plateau and end(4, 0.3, None).on_plateau is None
    lines = verdict({"groupbert": past, "bert": stuck}, "eval_mlm_loss")
    assert lines[0] == ("- **bert** is on the unigram plateau (1 of 2 final runs below 1.5× the baseline's held-out "
                        "MLM accuracy): not ranked")
    assert lines[1].endswith(": 1. groupbert 4.05 (4–4.1).")
    assert "**groupbert** is the only config past the plateau" in lines[2]
    nothing = verdict({"groupbert": [end(6.0, 0.12)], "bert": [end(5.0, 0.1)]}, "eval_mlm_loss")
    assert "**No winner**" in nothing[-1] and not any("Ranked" in line for line in nothing)
    # p: scipy's Welch test on the seeds (the held-out error, 0.01, is below their spread).
    close = verdict({"a": past, "b": [end(4.05, 0.3), end(4.2, 0.3)]}, "eval_mlm_loss")
    p = ttest_ind([4.0, 4.1], [4.05, 4.2], equal_var=False).pvalue
    assert f"a leads b by 0.075 on the mean: **not resolved** at 2 seeds (Welch's t-test over 2 and 2 seeds, p = " \
        f"{p:.2g} against 0.05" in close[-1] and "run 11 more seed(s) each if the gap and spread hold" in close[-1] \
        and "the gap is 8× it" in close[-1], close[-1]
    apart = verdict({"a": past, "b": [end(5.0, 0.3), end(5.2, 0.3)]}, "eval_mlm_loss")
    p = ttest_ind([4.0, 4.1], [5.0, 5.2], equal_var=False).pvalue
    assert f"**a** is ahead of b by 1.05 (Welch's t-test over 2 and 2 seeds, p = {p:.2g} against 0.05" in apart[-1]
    assert "no spread" in verdict({"a": past[:1], "b": [end(5.0, 0.3)]}, "eval_mlm_loss")[-1]


def test_seconds_are_compared_only_while_the_load_stays_within_its_factor():
    def loaded(load):
        return RunEnd(4.0, 0.3, 0.1, None, None, None, 1.0e4, load)

    assert seconds_refusal([loaded(0.2), loaded(1.4)]) is None  # each counted as at least the run's own 1
    assert seconds_refusal([loaded(2.0), loaded(2.9)]) is None
    assert seconds_refusal([loaded(1.0), loaded(3.1)]) == \
        "the load average moved from 1.00 to 3.10 between the runs (more than 1.5×)"
    assert "not recorded" in seconds_refusal([loaded(1.0), loaded(None)])
    # Within the factor of each other, but on a machine with far more work than CPUs.
    assert seconds_refusal([loaded(23.6), loaded(25.7)], cpus=2) == (
        "the machine was busy: a load average of up to 25.70 on its 2 CPUs (more runnable tasks than CPUs); compare "
        "seconds measured on an idle machine")
    assert seconds_refusal([loaded(1.4), loaded(1.9)], cpus=2) is None


def test_the_mean_of_seeds_keeps_common_steps_and_averages_the_ends():
    a = _curve([(10, 1.0, 1.0, 4.0), (20, 2.0, 2.0, 3.0), (25, 2.5, 3.0, 2.0)])
    b = _curve([(10, 1.0, 3.0, 6.0), (20, 2.0, 4.0, 5.0), (22, 2.2, 5.0, 4.0)])
    mean = mean_curve([a, b])
    assert [(p.step, p.seconds, p.values["eval_mlm_loss"]) for p in mean] == [
        (10, 2.0, 5.0), (20, 3.0, 4.0), (23.5, 4.0, 3.0)]


# --------------------------------------------------------------------- the YAML
def _spec(**changes) -> dict:
    raw = yaml.safe_load((ROOT / "configs/compare/tiny.yaml").read_text())
    raw.pop("squad")
    raw.update(changes)
    return raw


@pytest.mark.parametrize("change,message", [
    ({"colour": "red"}, "unknown key 'colour'"),
    ({"budget": {"flops": 1.0e+10, "seconds": 5}}, "budget: must give flops or seconds (one of them)"),
    ({"budget": {"flops": "1e10"}}, "write it with a decimal point and a signed exponent: 1.0e+10"),
    ({"budget": {"seconds": 60}, "evaluations": None}, "a seconds budget needs eval_every"),
    ({"budget": {"seconds": 60}}, "evaluations spreads evaluations over a run's steps"),
    ({"configs": {"bert": {"config": "configs/compare/tiny_bert.json"}}}, "two or more"),
    ({"configs": {"a": {"config": "configs/compare/tiny_bert.json"}, "b": {"config": "nope.json"}}},
     "configs.b: config file nope.json does not exist"),
    ({"configs": {"a": {"config": "configs/compare/tiny_bert.json", "parameters": {"training.seed": {"values": [1]}}},
                  "b": {"config": "configs/compare/tiny_groupbert.json"}}}, "is set by the comparison itself"),
    ({"configs": {"a": {"config": "configs/compare/tiny_bert.json", "overrides": {"training.lr": 1}},
                  "b": {"config": "configs/compare/tiny_groupbert.json"}}}, "unknown key 'training.lr'"),
    ({"configs": {"a": {"config": "configs/squad_tiny.json"}, "b": {"config": "configs/compare/tiny_bert.json"}}},
     "the comparison pre-trains"),
    ({"seeds": [1, 1]}, "seeds = [1, 1]: must be a list of distinct integers"),
    ({"metric": "loss"}, "metric = 'loss': Input should be 'eval_mlm_loss' or 'eval_loss'"),
    ({"squad": {"config": "configs/squad_tiny.json", "dev_file": "missing.json", "train_file": "missing.json"}},
     "squad.train_file missing.json does not exist"),
    ({"classify": {"config": "configs/demo.json"}}, "classify.config configs/demo.json is not a labelled-task config"),
    ({"classify": {"config": "configs/classify_demo.json", "dev_file": "gone.tsv"}},
     "classify.dev_file gone.tsv does not exist"),
    ({"classify": {"config": "configs/classify_demo.json", "epochs": 1}}, "unknown key 'classify.epochs'"),
    ({"classify": "configs/classify_demo.json"},
     "classify = 'configs/classify_demo.json': should be a mapping with config (and train_file"),
])
def test_comparison_yaml_problems_are_one_line_naming_the_key(monkeypatch, change, message):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        compare_from_dict(_spec(**change), "c.yaml")
    assert str(error.value).startswith("comparison c.yaml: ") and "\n" not in str(error.value)


def test_every_comparison_fine_tunes_on_the_shipped_labelled_task_unless_it_says_null(tmp_path, monkeypatch):
    """The default `classify:` is the repository's own files, found from any working directory."""
    raw = _spec()
    raw.pop("classify")
    monkeypatch.chdir(ROOT)
    spec = compare_from_dict(raw, "c.yaml")
    monkeypatch.chdir(tmp_path)  # the arms' configs are not found here; the default task is
    for arm in raw["configs"].values():
        arm["config"] = str(ROOT / arm["config"])
    elsewhere = compare_from_dict(raw, "c.yaml")
    for found in (spec, elsewhere):
        task = found.classify
        assert task.task == "classify" and task.metric == "accuracy" and found.fine_tunes == (task,)
        assert task.config.data.train_file == str(ROOT / "data/samples/labelled/sotu_era_train.tsv")
        assert task.scores == ("accuracy", "f1", "matthews_correlation")
    assert compare_from_dict({**raw, "classify": None}, "c.yaml").fine_tunes == ()


def test_a_downstream_ranking_is_higher_first_and_says_whether_the_seeds_separate():
    from scipy.stats import ttest_ind

    from bert.compare.downstream import accuracy_se

    lines = ranking({"a": spread([0.80, 0.84]), "b": spread([0.70, 0.72])}, {"a": [0.02], "b": [0.02]},
                    "dev accuracy", "dev set's standard error", goal_minimize=False, topic="classification")
    assert lines[0] == "- classification: ranked by the mean dev accuracy (min–max over the seeds): 1. a 0.82 " \
        "(0.8–0.84), 2. b 0.71 (0.7–0.72)."
    # Every seed of a is better than every seed of b, at 2 seeds: not enough to say "ahead" at 5 %.
    p = ttest_ind([0.80, 0.84], [0.70, 0.72], equal_var=False).pvalue
    assert lines[1].startswith("- a leads b by 0.11 on the mean: **not resolved** at 2 seeds (Welch's t-test over 2 "
                               f"and 2 seeds, p = {p:.2g} against 0.05"), lines[1]
    assert lines[1].endswith("run 1 more seed(s) each if the gap and spread hold; the dev set's standard error of one "
                             "run's dev accuracy is about 0.02, so the gap is 6× it."), lines[1]
    close = ranking({"a": spread([0.80, 0.84]), "b": spread([0.70, 0.81])}, {}, "dev f1", "e", goal_minimize=False)
    assert "**not resolved** at 2 seeds" in close[-1] and close[0].startswith("- Ranked by the mean dev f1")
    level = ranking({"a": spread([0.25, 0.25]), "b": spread([0.25])}, {"a": [0.025]}, "dev accuracy", "error",
                    goal_minimize=False)
    assert level[-1] == "- a and b are level on the mean; the error of one run's dev accuracy is about 0.025."
    assert accuracy_se(0.75, 300) == pytest.approx(0.025)  # √(0.75 · 0.25 / 300)


@pytest.mark.parametrize("seeds", [2, 3, 5])
def test_ahead_is_said_of_configs_that_do_not_differ_at_most_at_the_stated_rate(seeds):
    """20,000 null comparisons at 2 seeds called "ahead, every seed better" 34 % of the time.
    Now: draws of two configs from one distribution, the verdict's own words counted; the rate
    of "ahead" stays within LEVEL (5 %) up to the draws' sampling error, and a real gap of
    four standard deviations is called at 3 seeds and more."""
    from bert.compare.stats import LEVEL

    rng = np.random.default_rng(seeds)
    draws = 2000
    ahead = sum("is ahead" in ranking({c: spread(list(rng.normal(0.0, 1.0, seeds))) for c in "ab"}, {}, "f", "e")[-1]
                for _ in range(draws))
    assert ahead / draws <= LEVEL + 2 * (LEVEL * (1 - LEVEL) / draws) ** 0.5, f"{ahead} of {draws} null draws ahead"
    if seeds >= 3:
        real = sum("is ahead" in ranking({"a": spread(list(rng.normal(0.0, 1.0, seeds))),
                                          "b": spread(list(rng.normal(4.0, 1.0, seeds)))}, {}, "f", "e")[-1]
                   for _ in range(200))
        assert real >= 0.8 * 200, f"a 4-sigma gap called ahead in only {real} of 200"


def test_seeds_that_agree_by_chance_claim_no_more_than_the_held_out_error_allows():
    from bert.compare.stats import separation

    tight_a, tight_b = spread([4.000, 4.001]), spread([4.030, 4.031])  # 30× their own spread apart
    assert separation(tight_a, tight_b).resolved
    held_out = separation(tight_a, tight_b, errors=[0.05, 0.05])  # but one run's held-out error is 0.05
    assert not held_out.resolved and held_out.seeds_needed is not None and held_out.seeds_needed > 2


def test_a_comparison_naming_one_config_twice_is_refused_not_cut_to_the_last(tmp_path, monkeypatch):
    """YAML's last-one-wins would drop the first `bert:` arm (its grid) without a word."""
    from bert.compare import load_compare

    monkeypatch.chdir(ROOT)
    text = (ROOT / "configs/compare/tiny.yaml").read_text()
    arm = text[text.index("  bert:\n"):text.index("  groupbert:\n")]
    path = tmp_path / "twice.yaml"
    path.write_text(text.replace("\nclassify:", "\n" + arm + "classify:", 1))
    with pytest.raises(ValueError) as error:
        load_compare(path)
    message = str(error.value)
    assert message.startswith(f"comparison file {path}: key 'bert' appears twice (lines ") and "\n" not in message


def test_the_comparison_puts_its_budget_corpus_and_overrides_on_every_config(monkeypatch):
    monkeypatch.chdir(ROOT)
    spec = compare_from_dict(_spec(), "c.yaml", {"data.eval_samples": 64})
    for arm in spec.arms:
        c = arm.config
        assert (c.budget.flops, c.budget.warmup, c.schedule.warmup_steps) == (1.2e10, 0.1, 0)
        assert arm.config.data.directory == "demo_data/seq32" and arm.config.data.eval_samples == 64
    assert [a.name for a in spec.arms] == ["bert", "groupbert"] and spec.seeds == (0, 1)


@pytest.mark.parametrize("where", ["itself", "above"])
def test_an_output_dir_that_is_a_file_is_one_line_before_any_run(tmp_path, monkeypatch, capsys, where):
    """Not the bare `<dir>/bert/grid: Not a directory` of the first mkdir."""
    monkeypatch.chdir(ROOT)
    spec = tmp_path / "c.yaml"
    spec.write_text(yaml.safe_dump(_spec()))
    taken = tmp_path / "taken"
    taken.write_text("a file the user keeps\n")
    out = taken if where == "itself" else taken / "compare"
    assert bert_cli()(["--compare", str(spec), "--output-dir", str(out)]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    wanted = (f"error: compare --output-dir {out} is a file, not a directory" if where == "itself" else
              f"error: compare --output-dir {out}: {taken} is a file, not a directory")
    assert error.startswith(wanted), error
    assert taken.read_text() == "a file the user keeps\n" and sorted(tmp_path.iterdir()) == [spec, taken]


# --------------------------------------------------------------------- end to end
def _grid_runs(out: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(out.glob("*/*/trial-*/metrics.jsonl"))}


@pytest.mark.slow
def test_the_tiny_comparison_runs_end_to_end_and_a_kill_and_rerun_repeats_nothing(tmp_path, monkeypatch, capsys):
    """configs/compare/tiny.yaml as its header says (make squad-demo first), killed with SIGKILL
    while a grid run is under way and started again."""
    from data.squad_demo import write_squad_demo

    for shared in ("configs", "data"):  # the YAML's paths are the repository's
        (tmp_path / shared).symlink_to(ROOT / shared)
    monkeypatch.chdir(tmp_path)
    write_squad_demo(tmp_path / "demo_data" / "squad")  # what `make squad-demo` writes
    spec_path = "configs/compare/tiny.yaml"
    out = tmp_path / "runs" / "compare" / "tiny-compare"

    worker = subprocess.Popen([sys.executable, str(ROOT / "bert.py"), "compare", spec_path], cwd=tmp_path,
                              stdout=(tmp_path / "first.log").open("w"), stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 300
    try:  # killed once bert's first grid run is finished and its second has a checkpoint
        while not (out / "bert/grid/trial-1/checkpoint-13").is_dir():
            assert worker.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
            time.sleep(0.01)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    assert not (out / "bert/grid/trial-1/checkpoint-final").exists(), "trial 1 finished before it could be killed"
    finished = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in [out / "bert/grid/trial-0/metrics.jsonl"]}

    monkeypatch.setattr(bert.sweep.storage, "GRACE_S", 1)  # the killed run's worker is dead: re-run it at once
    assert bert_cli()(["compare", spec_path]) == 0
    printed = capsys.readouterr().out
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in finished} == finished  # never run again
    killed = out / "bert/grid/trial-1"
    assert list(killed.glob("metrics.before-resume-*.jsonl")), "the killed run resumed from its checkpoint"
    assert [r["step"] for r in records(killed) if "loss" in r] == list(range(5, 51, 5))  # log_every 5

    # Every run stopped at the budget: the most whole steps within 1.2e10 FLOPs.
    spec = compare_from_dict(yaml.safe_load(Path(spec_path).read_text()), spec_path)
    for arm in spec.arms:
        per_step = budget.flops_per_step(arm.config)
        steps = int(1.2e10 // per_step)
        runs = sorted((out / arm.name).glob("grid/trial-*")) + sorted((out / arm.name).glob("seeds/trial-*"))
        assert len(runs) == 3  # two grid points, the best again at seed 1: none twice
        for run in runs:
            last = [r for r in records(run) if "loss" in r][-1]
            assert last["step"] == steps and last["train_flops"] == steps * per_step <= 1.2e10
            assert 1.2e10 - last["train_flops"] < per_step

    # The report's "FLOPs to reach" is the interpolation of the final runs' own metrics.jsonl, in
    # log-FLOPs, with its bracket, and its spread over every pair of seeds.
    finals, seeds, ends = {}, {}, {}
    for arm in ("bert", "groupbert"):
        grid = list(csv.DictReader((out / arm / "grid" / "runs.csv").open()))
        best = grid[0]["output_dir"]
        runs = [Path(best)] + [Path(r["output_dir"]) for r in csv.DictReader((out / arm / "seeds" / "runs.csv").open())]
        evals = [{r["step"]: r for r in records(run) if "eval_mlm_loss" in r} for run in runs]
        steps = sorted(set.intersection(*(set(e) for e in evals)))
        finals[arm] = [(s, sum(e[s]["train_flops"] for e in evals) / len(evals),
                        sum(e[s]["eval_mlm_loss"] for e in evals) / len(evals)) for s in steps]
        seeds[arm] = [[(s, e[s]["train_flops"], e[s]["eval_mlm_loss"]) for s in sorted(e)] for e in evals]
        ends[arm] = [e[max(e)] for e in evals]

    def to_reach(curve, target):  # (FLOPs, bracket) of a curve of (step, FLOPs, loss) reaching target
        after = next((i for i, (_, _, v) in enumerate(curve) if v <= target), None)
        if after is None or after == 0:
            return (None if after is None else curve[0][1]), after
        (_, f0, v0), (_, f1, v1) = curve[after - 1], curve[after]
        return f0 * (f1 / f0) ** ((target - v0) / (v1 - v0)), after

    rows = {(r["x"], r["y"]): r for r in csv.DictReader((out / "reach.csv").open())}
    for x, y in (("bert", "groupbert"), ("groupbert", "bert")):
        target, y_flops = finals[y][-1][2], finals[y][-1][1]
        flops, after = to_reach(finals[x], target)
        row = rows[(x, y)]
        assert float(row["target"]) == pytest.approx(target, rel=1e-12)
        if after is None:
            assert row["flops"] == "" and f"{x} does not reach {y}'s final" in printed
        elif after == 0:
            assert row["flops"] == f"≤{finals[x][0][1]:.6g}" and row["bracket_low"] == "0.0000"
        else:
            assert float(row["flops"]) == pytest.approx(flops, rel=1e-5)
            assert f"step {finals[x][after - 1][0]}: " in row["points"] and f"step {finals[x][after][0]}: " in row["points"]
            assert float(row["flops_ratio"]) == pytest.approx(flops / y_flops, abs=1e-4)
            assert float(row["bracket_low"]) <= float(row["flops_ratio"]) <= float(row["bracket_high"])
            assert float(row["bracket_high"]) == pytest.approx(finals[x][after][1] / y_flops, abs=1e-4)
            assert f"| {x} | {y} | {target:.5g} | {float(row['flops']):.6g} |" in (out / "report.md").read_text()
        pairs = [to_reach(xc, yc[-1][2])[0] for xc in seeds[x] for yc in seeds[y]]
        ratios = [f / yc[-1][1] for f, (xc, yc) in zip(pairs, [(a, b) for a in seeds[x] for b in seeds[y]])
                  if f is not None]
        assert int(row["pairs"]) == 4 and int(row["pairs_reached"]) == len(ratios)
        if ratios:
            assert float(row["pairs_low"]) == pytest.approx(min(ratios), abs=1e-4)
            assert float(row["pairs_high"]) == pytest.approx(max(ratios), abs=1e-4)

    # The verdict from the final runs' own records: one on the plateau flags its config, never ranked.
    report = (out / "report.md").read_text()
    stuck = {arm: [r["eval_mlm_accuracy"] < 1.5 * r["unigram_mlm_accuracy"] for r in ends[arm]] for arm in ends}
    for arm, flags in stuck.items():
        values = sorted(r["eval_mlm_loss"] for r in ends[arm])
        assert f"| {arm} | optimizer.learning_rate=" in report and \
            f"{sum(values) / 2:.4g} ({values[0]:.4g}–{values[1]:.4g})" in report, "the seeds' mean and min–max"
        assert (f"**{arm}** is on the unigram plateau ({sum(flags)} of 2" in report) == any(flags)
    if all(any(f) for f in stuck.values()):  # at 1.2e10 FLOPs of hidden 48 it is, on this corpus
        assert "**No winner**" in report and "No winner: every config" in printed and "Ranked by the mean" not in report
        assert "on the unigram plateau: not a comparison of the models" in printed
    else:
        assert "Ranked by the mean final" in report
    for table in ("report.md", "runs.csv", "curves.csv", "reach.csv"):
        assert str(tmp_path) not in (out / table).read_text(), f"{table} names no absolute path"

    # Each runs.csv row takes its value, step, FLOPs and seconds from one record of its run: the
    # killed trial's from its own history, not from the run that resumed its directory.
    table = list(csv.DictReader((out / "runs.csv").open()))
    killed_rows = [r for r in table if r["state"] == "interrupted"]
    assert len(killed_rows) == 1 and killed_rows[0]["output_dir"] == "bert/grid/trial-1", table
    for r in table:
        if r["stage"] in ("classify", "squad") or not r["value"]:
            continue
        history = [out / r["output_dir"] / "metrics.jsonl"]
        if r["state"] == "interrupted":
            history = sorted((out / r["output_dir"]).glob("metrics.before-resume-*.jsonl"))
        record = next(x for path in history for x in map(json.loads, path.read_text().splitlines())
                      if x["step"] == int(r["step"]) and "eval_mlm_loss" in x)
        assert float(r["value"]) == pytest.approx(record["eval_mlm_loss"], rel=1e-9)
        assert float(r["train_flops"]) == record["train_flops"] and float(r["train_seconds"]) == record["train_seconds"]
        assert r["on_plateau"] == str(int(record["eval_mlm_accuracy"] < 1.5 * record["unigram_mlm_accuracy"]))
        assert float(r["tokens_per_s"]) > 0 and r["load_average"] != ""

    # Every final run (each seed of each winner) fine-tuned once on each task; the report's figures
    # are the runs' own, their accuracy that of their predictions (scikit-learn), over the seeds.
    from sklearn.metrics import accuracy_score

    for arm in ("bert", "groupbert"):
        grid = list(csv.DictReader((out / arm / "grid" / "runs.csv").open()))
        starts = [grid[0]["checkpoint"]] + [r["checkpoint"] for r in csv.DictReader((out / arm / "seeds" /
                                                                                      "runs.csv").open())]
        figures = {}
        for task, names in (("classify", ("accuracy", "f1", "matthews_correlation")), ("squad", ("f1", "exact_match"))):
            tuned = list(csv.DictReader((out / arm / task / "runs.csv").open()))
            assert sorted(r["training.init_from"] for r in tuned) == sorted(starts) and len(starts) == 2
            scores = [json.loads((Path(r["output_dir"]) / "eval_results.json").read_text()) for r in tuned]
            figures[task] = [spread([s[k] for s in scores]).text(4) for k in names]
            if task == "classify":
                for r, s in zip(tuned, scores):
                    predicted = [line.split("\t") for line in
                                 (Path(r["output_dir"]) / "predictions.tsv").read_text().splitlines()[1:]]
                    assert len(predicted) == 300 and s["dev_file"].endswith("sotu_era_dev.tsv")
                    assert s["accuracy"] == pytest.approx(accuracy_score([g for _, _, g in predicted],
                                                                         [p for _, p, _ in predicted]), abs=1e-4)
                error = sum(math.sqrt(s["accuracy"] * (1 - s["accuracy"]) / 300) for s in scores) / 2
                figures[task].insert(1, f"{error:.2g}")
        assert f"| {arm} | {' | '.join(figures['classify'])} | seed " in report, figures
        assert f"| {arm} | {' | '.join(figures['squad'])} | seed " in report, figures
    # Fine-tunes that learned nothing (one class for every dev row: tiny models, few steps) are
    # named and not ranked; the others are ranked.
    degenerate = [Path(r["output_dir"]) for arm in ("bert", "groupbert")
                  for r in csv.DictReader((out / arm / "classify" / "runs.csv").open())
                  if "degenerate" in json.loads((Path(r["output_dir"]) / "eval_results.json").read_text())]
    named = [line for line in report.splitlines()
             if line.startswith("- classification (classify_demo): ") and line.endswith(": not ranked")]
    assert len(named) == len(degenerate), report
    assert ("- classification (classify_demo): ranked by the mean dev accuracy" in report if len(degenerate) < 4 else
            "- classification (classify_demo): no config ranked: every fine-tune learned nothing" in report)
    assert "- SQuAD: ranked by the mean dev f1" in report
    for png in ("mlm_loss_vs_flops", "mlm_loss_vs_seconds", "mlm_accuracy_vs_flops", "mlm_accuracy_vs_seconds"):
        assert (out / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Host" in report and "kernels" in report and "| bert | bert | 48 × 2 |" in report

    # Once more: everything is done, nothing runs, the report is the same.
    before = _grid_runs(out)
    assert bert_cli()(["compare", spec_path]) == 0
    assert _grid_runs(out) == before and (out / "report.md").read_text().split("## Host")[0] == \
        report.split("## Host")[0]
    assert math.isfinite(float(rows[("bert", "groupbert")]["target"]))


SHIPPED = sorted((ROOT / "configs" / "compare").glob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_comparisons_load_and_every_config_fits_its_budget(monkeypatch, path):
    from bert.compare.run import prepared_arm

    monkeypatch.chdir(ROOT)  # their paths are the repository's
    raw = yaml.safe_load(path.read_text())
    raw.pop("squad", None)  # its files are made by make squad-demo (the end-to-end test makes them)
    spec = compare_from_dict(raw, str(path))
    for arm in spec.arms:
        config = budget.resolve(prepared_arm(spec, arm).config)[0]
        steps, every = config.training.steps, config.evaluation.every
        if spec.budget == "seconds":  # the clock ends the run: evaluations every eval_every steps
            assert config.budget.seconds == spec.amount and every == spec.eval_every and config.budget.flops is None
            continue
        assert 1 <= every <= steps and math.ceil(steps / every) == spec.evaluations
        amount = config.budget.flops  # the comparison's, or a size's own
        assert amount == (spec.amount if arm.size is None else raw["configs"][arm.family]["sizes"][arm.size]["budget.flops"])
        assert steps * budget.flops_per_step(config) <= amount < (steps + 1) * budget.flops_per_step(config)


def check_docs_quality_md(ran) -> None:
    """After docs/quality.md ran (tests/test_docs.py): the corpus recipe wrote its shards."""
    sandbox = ran[0].sandbox
    assert sorted((sandbox / "data/pretraining/sotu/seq128").glob("train/*.hdf5"))
    assert sorted((sandbox / "data/pretraining/sotu/seq128").glob("eval/*.hdf5"))
