"""The front of a comparison with size ladders (bert/compare/front.py): the ladder in the YAML,
the Pareto fronts, FLOPs at equal loss read off them with their seed pairs, and
configs/compare/tiny_ladder.yaml end to end, its front.csv recomputed from the runs' own
metrics.jsonl.
"""
from __future__ import annotations

import csv
import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from bert.run import budget
from bert.compare import compare_from_dict
from bert.compare.front import Size, equal_loss, flops_at, front, on_front, summary
from tests.tiny_runs import ROOT, bert_cli, one_thread  # noqa: F401 (an autouse fixture)


def _size(family, name, *curves, stuck=False):
    """A size from its seeds' curves [(FLOPs, value), ...]; their mean at each evaluation."""
    mean = tuple((sum(c[i][0] for c in curves) / len(curves), sum(c[i][1] for c in curves) / len(curves))
                 for i in range(len(curves[0])))
    return Size(f"{family}-{name}", family, name, tuple(tuple(c) for c in curves), mean, stuck)


def test_a_front_is_the_lower_envelope_of_every_size_s_evaluations():
    sizes = [_size("b", "s", [(0.5, 6.0), (1.0, 5.0)]), _size("b", "m", [(1.0, 5.5), (2.0, 4.0)]),
             _size("b", "odd", [(2.0, 4.8), (4.0, 4.5)]), _size("b", "l", [(4.0, 4.2), (8.0, 3.0)])]
    points = front(sizes)
    assert [(f, v, s.size) for f, v, s in points] == [(0.5, 6.0, "s"), (1.0, 5.0, "s"), (2.0, 4.0, "m"),
                                                      (8.0, 3.0, "l")]  # odd, and l at 4.0, lie above m's end
    assert [on_front(s, points) for s in sizes] == [True, True, False, True]
    flops, bound = flops_at(points, 3.5)  # halfway from m (4.0) to l (3.0): halfway in log-FLOPs
    assert bound == "" and flops == pytest.approx(math.exp((math.log(2) + math.log(8)) / 2)) == pytest.approx(4.0)
    assert flops_at(points, 6.5) == (0.5, "≤")  # the first evaluation already reaches it
    assert flops_at(points, 2.0) == (None, "")  # beyond the ladder


def _log_interp(front_points, target):
    """An independent reading: np.interp of log-FLOPs against the value (increasing order)."""
    values = [v for _, v in front_points][::-1]
    logs = [math.log(f) for f, _ in front_points][::-1]
    if target < values[0]:
        return None
    if target >= values[-1]:
        return front_points[0][0]
    return math.exp(np.interp(target, values, logs))


def _brute_front(points):
    """Pareto-optimal (FLOPs, value): no other point has fewer or equal FLOPs and a lower value."""
    return sorted((f, v) for f, v in points if not any(g <= f and w < v for g, w in points if (g, w) != (f, v)))


def test_flops_at_equal_loss_and_their_seed_pairs_against_an_independent_reading():
    rng = np.random.default_rng(0)
    for _ in range(50):
        ladders = {}
        for family in ("x", "y"):
            base = rng.uniform(1e9, 4e9)
            ladders[family] = []
            for i in range(3):  # three sizes, two seeds, four evaluations each: losses falling, noisily
                curves = [[(base * 3.0 ** i * (k + 1) / 4 * rng.uniform(0.95, 1.05),
                            6.5 - 0.6 * i - 0.3 * k + rng.uniform(-0.4, 0.4)) for k in range(4)] for _ in range(2)]
                ladders[family].append(_size(family, f"s{i}", *curves))
        x_points = [p for s in ladders["x"] for p in s.mean]
        for row, size in zip(equal_loss("x", "y", ladders), sorted(ladders["y"], key=lambda s: s.mean[-1][0])):
            assert row.y_size is size and row.target == size.mean[-1][1]
            expected = _log_interp(_brute_front(x_points), row.target)
            if expected is None:
                assert row.flops is None and summary(row) == "not reached within the ladder"
                assert row.bracket is None
            else:
                assert row.flops == pytest.approx(expected, rel=1e-9)
                assert row.ratio == pytest.approx(expected / size.mean[-1][0], rel=1e-9)
                # The bracket: the independent front's evaluations on either side of the target.
                brute = _brute_front(x_points)
                after = next(i for i, (_, v) in enumerate(brute) if v <= row.target)
                low = brute[after - 1][0] if after else 0.0
                assert row.bracket == pytest.approx((low / size.mean[-1][0], brute[after][0] / size.mean[-1][0]))
                assert row.bracket[0] <= row.ratio <= row.bracket[1]
                assert f"(bracket {row.bracket[0]:.3g}–{row.bracket[1]:.3g}" in summary(row)
            pairs = []
            for kx, ky in itertools.product(range(2), range(2)):
                seed_front = _brute_front([p for s in ladders["x"] for p in s.curves[kx]])
                f = _log_interp(seed_front, size.curves[ky][-1][1])
                pairs.append(None if f is None else f / size.curves[ky][-1][0])
            assert len(row.pairs) == 4
            for got, wanted in zip(row.pairs, pairs):
                assert got is None if wanted is None else got == pytest.approx(wanted, rel=1e-9)
            reached = [p for p in row.pairs if p is not None]
            if reached:  # the seed pairs' brackets hold every pair's reading
                assert row.pairs_bracket[0] <= min(reached) and max(reached) <= row.pairs_bracket[1]


def test_the_front_verdict_flags_the_size_that_is_on_the_plateau_not_the_one_it_reads():
    """The verdict said "at groupbert s (5.998, on the plateau)" for a GroupBERT size its own
    table marked "no", because BERT's ladder had a size on the plateau: each flag is now its own
    run's."""
    from bert.compare.front import front_rows, front_verdict

    ladders = {"bert": [_size("bert", "s", [(1.0, 7.0), (2.0, 6.9)], stuck=True),
                        _size("bert", "l", [(2.0, 6.5), (8.0, 5.9)])],
               "groupbert": [_size("groupbert", "s", [(1.0, 6.5), (2.0, 5.998)]),
                             _size("groupbert", "l", [(2.0, 6.0), (8.0, 5.0)])]}
    lines = front_verdict(front_rows(ladders), "eval_mlm_loss")
    bert_line = next(line for line in lines if line.startswith("- Front: bert's"))
    assert "at groupbert s (5.998): " in bert_line and "on the plateau)" not in bert_line.split(" (bert's ladder")[0]
    assert bert_line.endswith("(bert's ladder has a size on the unigram plateau: its front is not a comparison of "
                              "the models)."), bert_line
    groupbert_line = next(line for line in lines if line.startswith("- Front: groupbert's"))
    assert "at bert s (6.9, on the plateau): " in groupbert_line and "ladder has" not in groupbert_line


@pytest.mark.parametrize("change,message", [
    ({"sizes": {"only": {"model.hidden_size": 32}}}, "configs.bert.sizes: must map two or more size names"),
    ({"sizes": {"a": {"model.hidden_size": 32}, "b": {"budget.warmup": 0.2}}},
     "configs.bert.sizes.b.budget.warmup: a size may set its own budget.flops, no other budget key"),
    ({"sizes": {"a": {"hidden_size": 32}, "b": {}}},
     "configs.bert.sizes.a.hidden_size: not a dotted config key: write section.key"),
    ({"sizes": {"a b": {}, "c": {}}}, "a size's name must be letters"),
])
def test_ladder_problems_are_one_line_naming_the_key(monkeypatch, change, message):
    monkeypatch.chdir(ROOT)
    raw = yaml.safe_load((ROOT / "configs/compare/tiny_ladder.yaml").read_text())
    raw["configs"]["bert"].update(change)
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        compare_from_dict(raw, "c.yaml")
    assert "\n" not in str(error.value)


def test_each_size_of_a_ladder_is_a_config_at_its_own_budget(monkeypatch):
    monkeypatch.chdir(ROOT)
    raw = yaml.safe_load((ROOT / "configs/compare/tiny_ladder.yaml").read_text())
    spec = compare_from_dict(raw, "c.yaml", {"data.eval_samples": 32})
    assert [(a.name, a.family, a.size) for a in spec.arms] == [
        ("bert-small", "bert", "small"), ("bert-large", "bert", "large"),
        ("groupbert-small", "groupbert", "small"), ("groupbert-large", "groupbert", "large")]
    for arm in spec.arms:
        sizes = raw["configs"][arm.family]["sizes"][arm.size]
        assert arm.config.model.hidden_size == sizes["model.hidden_size"]
        assert arm.config.budget.flops == sizes["budget.flops"] and arm.config.data.eval_samples == 32
    raw["configs"]["bert-small"] = {"config": "configs/compare/tiny_bert.json"}
    with pytest.raises(ValueError, match=re.escape("configs: ['bert-small'] name two configs")):
        compare_from_dict(raw, "c.yaml")


@pytest.mark.slow
def test_the_tiny_ladder_runs_end_to_end_and_its_front_is_that_of_the_runs_own_records(tmp_path, monkeypatch):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    spec_path = "configs/compare/tiny_ladder.yaml"
    assert bert_cli()(["compare", spec_path]) == 0
    out = tmp_path / "runs" / "compare" / "tiny-ladder"
    spec = compare_from_dict(yaml.safe_load(Path(spec_path).read_text()), spec_path)

    runs = {}  # each size's evaluations (FLOPs, loss) at each seed, from its runs' own metrics.jsonl
    for arm in spec.arms:
        per_step = budget.flops_per_step(arm.config)
        runs[arm.name] = []
        for run in (out / arm.name / "grid" / "trial-0", out / arm.name / "seeds" / "trial-0"):
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            evals = [(r["train_flops"], r["eval_mlm_loss"]) for r in records if "eval_mlm_loss" in r]
            assert evals[-1][0] <= arm.config.budget.flops < evals[-1][0] + per_step
            runs[arm.name].append(evals)
    mean = {a: [(sum(c[i][0] for c in curves) / 2, sum(c[i][1] for c in curves) / 2)
                for i in range(len(curves[0]))] for a, curves in runs.items()}  # the seeds evaluate at one step

    rows = {(r["x"], r["y"], r["y_size"]): r for r in csv.DictReader((out / "front.csv").open())}
    families = {"bert": ["bert-small", "bert-large"], "groupbert": ["groupbert-small", "groupbert-large"]}
    for x, y in (("bert", "groupbert"), ("groupbert", "bert")):
        x_front = _brute_front([p for a in families[x] for p in mean[a]])
        for a in families[y]:
            row = rows[(x, y, a.split("-")[1])]
            target, y_flops = mean[a][-1][1], mean[a][-1][0]
            assert float(row["target"]) == pytest.approx(target, rel=1e-9)
            expected = _log_interp(x_front, target)
            if expected is None:
                assert row["flops"] == "" and row["flops_ratio"] == ""
            else:
                bound = "≤" if expected == x_front[0][0] else ""
                assert row["flops"] == f"{bound}{expected:.6g}"
                assert row["flops_ratio"] == f"{bound}{expected / y_flops:.4f}"
            pairs = [_log_interp(_brute_front([p for b in families[x] for p in runs[b][kx]]), runs[a][ky][-1][1])
                     for kx in range(2) for ky in range(2)]
            ratios = [f / runs[a][ky][-1][0] for f, ky in zip(pairs, [0, 1, 0, 1]) if f is not None]
            assert int(row["pairs"]) == 4 and int(row["pairs_reached"]) == len(ratios)
            if ratios:
                assert float(row["pairs_low"].lstrip("≤")) == pytest.approx(min(ratios), abs=1e-4)
                assert float(row["pairs_high"].lstrip("≤")) == pytest.approx(max(ratios), abs=1e-4)
    report = (out / "report.md").read_text()
    assert "## The front" in report and "- At size small:" in report and "- At size large:" in report
    assert "- Front: groupbert's FLOPs for bert's final `eval_mlm_loss`" in report
    assert (out / "front_vs_flops.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    reach = list(csv.DictReader((out / "reach.csv").open()))
    assert sorted((r["x"], r["y"]) for r in reach) == sorted([  # "to reach" within a size only
        ("bert-small", "groupbert-small"), ("groupbert-small", "bert-small"),
        ("bert-large", "groupbert-large"), ("groupbert-large", "bert-large")])
    assert str(tmp_path) not in (out / "front.csv").read_text() + report


def test_with_a_ladder_the_downstream_scores_are_ranked_size_by_size(monkeypatch):
    from scipy.stats import ttest_ind

    from bert.compare.downstream import Tuned, downstream_verdict

    monkeypatch.chdir(ROOT)
    raw = yaml.safe_load((ROOT / "configs/compare/tiny_ladder.yaml").read_text())
    raw.pop("classify")  # the default task
    spec = compare_from_dict(raw, "c.yaml")

    def tuned(config, seed, accuracy):
        scores = {"accuracy": accuracy, "f1": None, "matthews_correlation": None}
        return Tuned(config, seed, scores, 300, Path("."))

    found = {"classify": [tuned("bert-small", 0, 0.30), tuned("bert-small", 1, 0.25), tuned("groupbert-small", 0, 0.45),
                          tuned("groupbert-small", 1, 0.41), tuned("bert-large", 0, 0.48),
                          tuned("groupbert-large", 0, 0.44)]}
    groups = {"small": ["bert-small", "groupbert-small"], "large": ["bert-large", "groupbert-large"]}
    lines = downstream_verdict(spec, found, groups)
    assert lines[0] == ("- classification (classify_demo) at size small: ranked by the mean dev accuracy (min–max "
                        "over the seeds): 1. groupbert-small 0.43 (0.41–0.45), 2. bert-small 0.275 (0.25–0.3).")
    p = ttest_ind([0.45, 0.41], [0.30, 0.25], equal_var=False).pvalue  # the dev error (0.029) is below the spread
    assert lines[1].startswith(f"- **groupbert-small** is ahead of bert-small by 0.155 (Welch's t-test over 2 and 2 "
                               f"seeds, p = {p:.2g} against 0.05"), lines[1]
    assert lines[2].startswith("- classification (classify_demo) at size large: ranked")
    assert "1. bert-large 0.48" in lines[2]
    assert "from one seed" in lines[3]
    everyone = downstream_verdict(spec, found)
    assert everyone[0].startswith("- classification (classify_demo): ranked") and "1. bert-large 0.48" in everyone[0]
