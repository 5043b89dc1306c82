"""The comparison's report, from the runs' own files (metrics.jsonl, config.json, the final
checkpoint's session.json, the fine-tuning runs' eval_results.json), in the output directory:

- `report.md`: the budget; the verdict (bert/compare/stats.py: configs on the unigram plateau
  flagged and never ranked, the best said to be ahead only as far as the seeds allow); the
  final comparison over the seeds (mean and min–max of the final held-out loss and MLM
  accuracy beside the unigram baseline and the held-out standard error; steps, FLOPs,
  seconds, throughput and load); "FLOPs (and seconds) for X to reach Y's final held-out loss"
  with its bracket and its min–max over the seed pairs; each config's grid with its edge
  and plateau flags; each downstream task's dev figures over the seeds (bert/compare/downstream.py);
  the host, precision and kernels;
- `runs.csv` (every run), `curves.csv` (every evaluation of the final runs), `reach.csv`;
- `mlm_loss_vs_flops.png`, `mlm_loss_vs_seconds.png`, `mlm_accuracy_vs_flops.png`,
  `mlm_accuracy_vs_seconds.png`: held-out curves of each config's best point (thin: each seed;
  thick: their mean);
- with `--wandb`, the same tables and plots in a W&B run (offline without credentials).

"To reach" is interpolation between the two consecutive evaluations of X's mean curve around
Y's final mean loss (the first time X's curve is at or below it), linear in the loss and in
log-FLOPs (loss curves are close to straight against log-compute), and with the same weight
in log-seconds; the ratio divides by Y's own FLOPs and seconds at its end. The two
evaluations bound it (the bracket), whatever the curve does between them. Paths in the
report and its tables are relative to its directory.
"""
from __future__ import annotations

import csv
import io
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from bert.compare.downstream import Tuned, downstream, downstream_lines, downstream_verdict
from bert.compare.front import front_lines, front_plot, front_rows, front_table, front_verdict, ladders_of
from bert.compare.run import CompareRuns
from bert.compare.spec import Arm, CompareSpec
from bert.compare.stats import RunEnd, run_end, seconds_refusal, spread, verdict
from bert.run.outputs import save_figure
from fileio import write_atomically

__all__ = ["Reach", "curve", "mean_curve", "pair_ratios", "plateau_note", "reach", "write_compare_report"]

_FIGURES = ("eval_loss", "eval_mlm_loss", "eval_mlm_accuracy")


@dataclass(frozen=True)
class Point:
    step: float
    flops: float
    seconds: float
    values: dict[str, float]


@dataclass(frozen=True)
class Reach:
    """X's FLOPs and seconds to reach Y's final `metric`, and the evaluations interpolated between."""

    x: str
    y: str
    target: float
    flops: Optional[float]  # None: not reached within X's budget
    seconds: Optional[float]
    y_flops: float
    y_seconds: float
    points: tuple[Point, ...]  # the two evaluations (or the first, reached before it)
    bound: str = ""  # "≤" when reached by the first evaluation (no earlier point to interpolate from)

    @property
    def flops_ratio(self) -> Optional[float]:
        return None if self.flops is None else self.flops / self.y_flops

    @property
    def seconds_ratio(self) -> Optional[float]:
        return None if self.seconds is None else self.seconds / self.y_seconds

    @property
    def bracket(self) -> Optional[tuple[float, float]]:
        """The FLOPs ratios of the evaluations before and after the crossing: the reach lies
        between them (from 0 when reached by the first evaluation)."""
        if self.flops is None:
            return None
        low = 0.0 if self.bound else self.points[0].flops
        return low / self.y_flops, self.points[-1].flops / self.y_flops


def curve(run_dir: Path, metric: str) -> list[Point]:
    """The run's evaluations from its metrics.jsonl, in order of step."""
    points = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get(metric) is not None and "train_flops" in record:
            points[record["step"]] = Point(record["step"], record["train_flops"], record["train_seconds"],
                                           {k: record[k] for k in _FIGURES if record.get(k) is not None})
    return [points[s] for s in sorted(points)]


def mean_curve(curves: list[list[Point]]) -> list[Point]:
    """The seeds' mean: at each step they all evaluated, and at their final evaluations (which a
    seconds budget puts at different steps)."""
    def mean(points: list[Point]) -> Point:
        keys = set.intersection(*(set(p.values) for p in points))
        n = len(points)
        return Point(sum(p.step for p in points) / n, sum(p.flops for p in points) / n,
                     sum(p.seconds for p in points) / n, {k: sum(p.values[k] for p in points) / n for k in keys})

    common = set.intersection(*({p.step for p in c} for c in curves))
    end = min(c[-1].step for c in curves)
    points = [mean([next(p for p in c if p.step == s) for c in curves]) for s in sorted(common) if s < end]
    return points + [mean([c[-1] for c in curves])]


def reach(x: str, y: str, x_curve: list[Point], y_curve: list[Point], metric: str) -> Reach:
    """Where X's curve first comes down to Y's final `metric`: linear in the metric, in log-FLOPs
    and log-seconds between the two evaluations around it."""
    target, end = y_curve[-1].values[metric], y_curve[-1]
    common = dict(x=x, y=y, target=target, y_flops=end.flops, y_seconds=end.seconds)
    for i, p in enumerate(x_curve):
        if p.values[metric] > target:
            continue
        if i == 0:
            return Reach(flops=p.flops, seconds=p.seconds, points=(p,), bound="≤", **common)
        q = x_curve[i - 1]
        w = (target - q.values[metric]) / (p.values[metric] - q.values[metric])
        return Reach(flops=_log_between(q.flops, p.flops, w), seconds=_log_between(q.seconds, p.seconds, w),
                     points=(q, p), **common)
    return Reach(flops=None, seconds=None, points=(x_curve[-1],), **common)


def plateau_note(r: Reach, stuck: list[str]) -> str:
    """What a reach between configs on the unigram plateau (`stuck`) says about itself: "" when
    neither X nor Y is."""
    plateau = [name for name in (r.x, r.y) if name in stuck]
    return f"{' and '.join(plateau)} on the unigram plateau: not a comparison of the models" if plateau else ""


def _log_between(a: float, b: float, w: float) -> float:
    """The point `w` of the way from a to b in log scale (linear where either is not positive)."""
    return a * (b / a) ** w if a > 0 and b > 0 else a + w * (b - a)


def pair_ratios(x_curves: list[list[Point]], y_curves: list[list[Point]], metric: str) -> list[Optional[float]]:
    """The FLOPs ratio of each seed of X reaching each seed of Y's final `metric` (None: not
    reached): the spread of the mean curves' ratio."""
    return [reach("x", "y", xc, yc, metric).flops_ratio for xc in x_curves for yc in y_curves]


# ------------------------------------------------------------------------------- the report
def write_compare_report(spec: CompareSpec, runs: CompareRuns, use_wandb: bool = False) -> dict[str, Any]:
    out = runs.output_dir
    finals = {name: [r for r in runs.finals(name)] for name in runs.arms}
    curves = {name: [curve(Path(r["output_dir"]), spec.metric) for r in rows] for name, rows in finals.items()}
    means = {name: mean_curve(c) for name, c in curves.items()}
    ends = {name: [run_end(_record_at(r["output_dir"], r["step"], spec.metric, own_first=True), spec.metric)
                   for r in rows] for name, rows in finals.items()}
    groups = _size_groups(runs.arms)  # a ladder's configs are compared size by size
    pairs = [(x, y) for group in groups.values() for x in group for y in group if x != y]
    reaches = [reach(x, y, means[x], means[y], spec.metric) for x, y in pairs]
    stuck = [name for name, e in ends.items() if any(run.on_plateau for run in e)]
    spreads = {(x, y): pair_ratios(curves[x], curves[y], spec.metric) for x, y in pairs}
    refusals = {(x, y): seconds_refusal(ends[x] + ends[y], os.cpu_count()) for x, y in pairs}
    found = downstream(spec, runs)
    ladders = ladders_of(runs.arms, finals, curves, means, ends, spec.metric)
    edges = front_rows(ladders)
    ranking = _verdicts(groups, ends, spec.metric) + front_verdict(edges, spec.metric) + \
        downstream_verdict(spec, found, groups)
    host = _host()
    tables = {"runs.csv": _runs_table(spec, runs), "curves.csv": _curves_table(finals, curves, out),
              "reach.csv": _reach_table(spec, reaches, spreads, refusals, stuck)}
    if ladders:
        tables["front.csv"] = front_table(edges, spec.metric)
    for name, rows in tables.items():
        write_atomically(out / name, _csv(rows))
    plots = _plots(spec, finals, curves, means, out)
    if ladders:
        plots.append(out / "front_vs_flops.png")
        front_plot(ladders, spec.metric, spec.name, plots[-1])
    write_atomically(out / "report.md", _markdown(spec, runs, finals, means, ends, ranking, tables, refusals, found,
                                                  front_lines(ladders, edges, spec.metric) if ladders else [], host))
    if use_wandb:
        _to_wandb(spec, out, tables, plots)
    return {"reach": reaches, "means": means, "ends": ends, "verdict": ranking, "pair_ratios": spreads, "stuck": stuck,
            "seconds_refused": refusals, "downstream": found, "front": edges, "host": host,
            "report": out / "report.md"}


def _size_groups(arms: dict[str, Arm]) -> dict[Optional[str], list[str]]:
    """The configs compared with each other: those of one size (every config without a ladder)."""
    groups: dict[Optional[str], list[str]] = {}
    for name, arm in arms.items():
        groups.setdefault(arm.size, []).append(name)
    return groups


def _verdicts(groups: dict[Optional[str], list[str]], ends: dict[str, list[RunEnd]], metric: str) -> list[str]:
    """The verdict of each size (of the whole comparison without a ladder)."""
    if list(groups) == [None]:
        return verdict(ends, metric)
    lines = []
    for size, names in groups.items():
        if len(names) > 1:
            lines += [f"- At {'no size' if size is None else f'size {size}'}:",
                      *(f"  {line}" for line in verdict({n: ends[n] for n in names}, metric))]
    return lines


def _relative(path: Optional[str | os.PathLike], out: Path) -> str:
    """`path` as the report names it: relative to the report's directory."""
    return os.path.relpath(path, out) if path else ""


def _kernels(run_dir: Path) -> str:
    try:
        state = json.loads((Path(run_dir) / "checkpoint-final" / "session.json").read_text())
        kernels = state["kernels"]
        return ", ".join(f"{k}={v}" for k, v in kernels.items()
                         if k not in ("device", "precision", "cpu", "threads_from") and v not in (None, ""))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "?"


def _host() -> dict[str, Any]:
    import torch

    cpu = "?"
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), platform.processor() or "?")
    except OSError:
        pass
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def _value(row: dict, key: str) -> Any:
    v = row.get(key)
    return "" if v is None else v


def _runs_table(spec: CompareSpec, runs: CompareRuns) -> list[dict]:
    """Every run of every stage; its value, step, FLOPs and seconds from one evaluation record:
    the one at the step the sweep took its value from (an interrupted run's own, not that of
    the run that resumed its directory)."""
    rows = []
    for name in runs.arms:
        stages = [("grid", runs.grids[name], spec.metric), ("seeds", runs.seeds[name], spec.metric),
                  *((t.task, runs.tuned[t.task][name], t.metric) for t in spec.fine_tunes)]
        for stage, result, metric in stages:
            if result is None:
                continue
            for r in result.rows:
                row = {"config": name, "stage": stage, "trial": r["trial"], "state": r["state"], "metric": metric,
                       "value": r.get(metric), **{p: r.get(p) for p in _swept(result, metric)}}
                if row.get("training.init_from"):  # the pre-trained checkpoint a fine-tuning run started from
                    row["training.init_from"] = _relative(row["training.init_from"], runs.output_dir)
                at = _record_at(r.get("output_dir"), r.get("step"), metric, own_first=r["state"] == "finished")
                end = run_end(at, metric)
                row.update(step=r.get("step"), train_flops=at.get("train_flops"), train_seconds=at.get("train_seconds"),
                           eval_mlm_accuracy=end.accuracy, unigram_mlm_accuracy=end.unigram,
                           on_plateau="" if end.on_plateau is None else int(end.on_plateau),
                           tokens_per_s=_rounded(end.tokens_per_s, 1), load_average=_rounded(end.load, 2),
                           output_dir=_relative(r.get("output_dir"), runs.output_dir), note=r.get("note", ""))
                rows.append(row)
    return rows


def _swept(result, metric: str) -> list[str]:
    """The config values of the sweep's runs (its parameters, constants included)."""
    fixed = {"rank", "trial", "state", "step", "output_dir", "checkpoint", "note", "_curve", metric}
    return sorted({k for r in result.rows for k in r if k not in fixed})


def _record_at(run_dir: Optional[str], step: Optional[int], metric: str, own_first: bool) -> dict:
    """The record of `metric` at `step` in the run's history, with the mean throughput and load
    of the training records before it in the same file. The history a resume set aside
    (metrics.before-resume-*.jsonl) is read first for a run that did not finish there: its
    records are its own, the directory's metrics.jsonl goes on with the run that resumed it."""
    if not run_dir or step is None:
        return {}
    files = sorted(Path(run_dir).glob("metrics.before-resume-*.jsonl"))
    files = [Path(run_dir) / "metrics.jsonl", *files] if own_first else [*files, Path(run_dir) / "metrics.jsonl"]
    for path in files:
        if not path.is_file():
            continue
        speeds, loads = [], []
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("step", 0) > step:
                break
            if record.get("tokens_per_s"):
                speeds.append(record["tokens_per_s"])
                loads += [record["load_average"]] if record.get("load_average") is not None else []
            if record["step"] == step and record.get(metric) is not None:
                return {**record, "tokens_per_s": sum(speeds) / len(speeds) if speeds else None,
                        "load_average": sum(loads) / len(loads) if loads else None}
    return {}


def _rounded(value: Optional[float], digits: int) -> Optional[float]:
    return None if value is None else round(value, digits)


def _curves_table(finals: dict, curves: dict, out: Path) -> list[dict]:
    rows = []
    for name, runs in finals.items():
        for run, points in zip(runs, curves[name]):
            seed = run.get("training.seed")
            for p in points:
                rows.append({"config": name, "seed": seed, "step": p.step, "train_flops": p.flops,
                             "train_seconds": p.seconds, **p.values, "output_dir": _relative(run["output_dir"], out)})
    return rows


def _reach_table(spec: CompareSpec, reaches: list[Reach], spreads: dict, refusals: dict,
                 stuck: list[str]) -> list[dict]:
    rows = []
    for r in reaches:
        used = "; ".join(f"step {p.step:g}: {p.flops:.6g} FLOPs, {p.seconds:.6g} s, {spec.metric} "
                         f"{p.values[spec.metric]:.6g}" for p in r.points)
        ratios = spreads[(r.x, r.y)]
        reached = spread([v for v in ratios if v is not None])
        refused = refusals[(r.x, r.y)]
        rows.append({"x": r.x, "y": r.y, "metric": spec.metric, "target": r.target,
                     "flops": "" if r.flops is None else f"{r.bound}{r.flops:.6g}",
                     "flops_ratio": "" if r.flops_ratio is None else f"{r.bound}{r.flops_ratio:.4f}",
                     "bracket_low": "" if r.bracket is None else f"{r.bracket[0]:.4f}",
                     "bracket_high": "" if r.bracket is None else f"{r.bracket[1]:.4f}",
                     "pairs": len(ratios), "pairs_reached": sum(v is not None for v in ratios),
                     "pairs_low": "" if reached is None else f"{reached.low:.4f}",
                     "pairs_high": "" if reached is None else f"{reached.high:.4f}",
                     "seconds": "" if r.seconds is None else f"{r.bound}{r.seconds:.6g}",
                     "seconds_ratio": "" if r.seconds_ratio is None or refused else f"{r.bound}{r.seconds_ratio:.4f}",
                     "seconds_refused": refused or "", "y_flops": r.y_flops, "y_seconds": r.y_seconds,
                     "points": used, "note": plateau_note(r, stuck)})
    return rows


def _csv(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows({k: _value(r, k) for k in columns} for r in rows)
    return buffer.getvalue()


def _plots(spec: CompareSpec, finals: dict, curves: dict, means: dict, out: Path) -> list[Path]:
    from matplotlib.figure import Figure  # no pyplot: Figure renders with Agg, no display needed

    paths = []
    for figure, label in (("eval_mlm_loss", "held-out MLM loss"), ("eval_mlm_accuracy", "held-out MLM accuracy")):
        for axis, xlabel in (("flops", "training FLOPs"), ("seconds", "training seconds (wall clock)")):
            ax = Figure(figsize=(6.5, 4.2)).subplots()
            for i, name in enumerate(means):
                for c in curves[name]:
                    pts = [(getattr(p, axis), p.values[figure]) for p in c if figure in p.values]
                    if pts:
                        ax.plot(*zip(*pts), color=f"C{i}", alpha=0.35, linewidth=0.8)
                pts = [(getattr(p, axis), p.values[figure]) for p in means[name] if figure in p.values]
                if pts:
                    ax.plot(*zip(*pts), color=f"C{i}", linewidth=2, marker="o", markersize=3,
                            label=f"{name} ({len(curves[name])} seed{'s' * (len(curves[name]) > 1)})")
            ax.set(xlabel=xlabel, ylabel=label, title=f"{spec.name}: {label} against {xlabel.split(' (')[0]}")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize="small")
            path = out / f"{figure.removeprefix('eval_')}_vs_{axis}.png"
            save_figure(ax.figure, path)
            paths.append(path)
    return paths


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None or v == "":
        return ""
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def _markdown(spec: CompareSpec, runs: CompareRuns, finals: dict, means: dict, ends: dict[str, list[RunEnd]],
              ranking: list[str], tables: dict[str, list[dict]], refusals: dict, found: dict[str, list[Tuned]],
              front: list[str], host: dict) -> str:
    from bert.run import budget as budgets

    out, run_rows, reach_rows = runs.output_dir, tables["runs.csv"], tables["reach.csv"]
    unit = "FLOPs" if spec.budget == "flops" else "seconds of training"
    lines = [f"# Comparison {spec.name}", ""]
    if spec.description:
        lines += [spec.description, ""]
    lines += [f"From {spec.source}. Budget: {spec.amount:.4g} {unit} per run (warm-up {spec.warmup:g} of it, then "
              f"decay to the end{'; not bit-reproducible' if spec.budget == 'seconds' else ''}). Ranked by each run's "
              f"final `{spec.metric}`; seeds {list(spec.seeds)} (the grid at seed {spec.seeds[0]}).", ""]
    lines += ["| config | architecture | hidden × layers | FLOPs per step | steps | precision | kernels |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, arm in runs.arms.items():
        m = arm.config.model
        steps = budgets.resolve(arm.config)[0].training.steps if spec.budget == "flops" else "(time)"
        lines.append(f"| {name} | {m.architecture.value} | {m.hidden_size} × {m.num_layers} | "
                     f"{budgets.flops_per_step(arm.config):.4g} | {steps} | {arm.config.precision.dtype} | "
                     f"{_kernels(Path(finals[name][0]['output_dir']))} |")
    lines += ["", "## Verdict", "", *ranking, ""]
    lines += ["## Final comparison", "",
              "Each config's best grid point at every seed: the mean of the final evaluations, and their min–max over "
              "the seeds. ± is the held-out standard error of one run's figure (over the evaluation's batches of "
              "whole sequences): what a different held-out sample could move it by. `unigram` is the accuracy of "
              "always answering the most frequent training target; below 1.5× it a run is on the plateau.", "",
              f"| config | point | {spec.metric} | ± | eval_mlm_accuracy | ± | unigram | on the plateau | steps | "
              "training FLOPs | training seconds | tokens/s | load average | per seed |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, rows in finals.items():
        end, runs_ = means[name][-1], ends[name]
        point = ", ".join(f"{k}={_fmt(v, 6)}" for k, v in rows[0].items()
                          if k in _swept(runs.grids[name], spec.metric) and k != "training.seed")
        each = ", ".join(f"seed {r.get('training.seed')}: {_fmt(r.get(spec.metric))}" for r in rows)
        figures = [spread([getattr(e, k) for e in runs_])
                   for k in ("value", "value_se", "accuracy", "accuracy_se", "unigram", "tokens_per_s", "load")]
        text = ["" if f is None else f.text(d) for f, d in zip(figures, (4, 2, 4, 2, 4, 4, 3))]
        known = [e.on_plateau for e in runs_ if e.on_plateau is not None]
        stuck = f"{sum(known)} of {len(runs_)}" if known else "not recorded"
        lines.append(f"| {name} | {point} | {text[0]} | {text[1]} | {text[2]} | {text[3]} | {text[4]} | {stuck} | "
                     f"{end.step:g} | {end.flops:.4g} | {end.seconds:.4g} | {text[5]} | {text[6]} | {each} |")
    lines += ["", f"## To reach another config's final {spec.metric}", "",
              "Interpolated between the two evaluations of X's mean curve around Y's final mean value, linear in the "
              "value and in log-FLOPs (and log-seconds); the **bracket** is the FLOPs ratio of those two evaluations, "
              "which bound the crossing whatever the curve does between them; **seed pairs** is the min–max of the "
              "ratio over every seed of X reaching every seed of Y (how many reach). Ratios are against Y's own FLOPs "
              "and seconds at its end. Seconds are compared only when the runs' load averages stay within "
              "1.5× of each other.", "",
              "| X | to reach Y's | target | FLOPs | FLOPs ratio | bracket | seed pairs | seconds | seconds ratio | "
              "evaluations used | note |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in reach_rows:
        reached = r["flops"] or "not reached"
        bracket = f"{r['bracket_low']}–{r['bracket_high']}" if r["bracket_low"] != "" else ""
        pairs = (f"{r['pairs_low']}–{r['pairs_high']} ({r['pairs_reached']} of {r['pairs']})"
                 if r["pairs_reached"] else f"none of {r['pairs']}")
        ratio = r["seconds_ratio"] if not r["seconds_refused"] else "not compared"
        lines.append(f"| {r['x']} | {r['y']} | {r['target']:.5g} | {reached} | {r['flops_ratio']} | {bracket} | "
                     f"{pairs} | {r['seconds']} | {ratio} | {r['points']} | {r['note']} |")
    refused = sorted({why for why in refusals.values() if why})
    if refused:
        lines += ["", "Seconds not compared: " + "; ".join(refused) + "."]
    lines += ["", "## Grids", ""]
    plateau = {(r["config"], r["stage"], r["trial"]): r["on_plateau"] for r in run_rows}
    for name in runs.arms:
        result = runs.grids[name]
        params = [p for p in _swept(result, spec.metric) if p != "training.seed"]
        lines += [f"### {name}", "", f"`{_relative(result.sweep_dir / 'runs.md', out)}`", ""]
        if result.edges:
            lines += ["At the edge of the grid:", "", *(f"- {e}" for e in result.edges), ""]
        lines += ["| rank | " + " | ".join(params) + f" | {spec.metric} | state | edge | on the plateau |",
                  "| --- |" + " --- |" * (len(params) + 4)]
        best = result.best or {}
        for r in result.rows:
            edge = "at the edge" if r is best and result.edges else ""
            # an interrupted run says where it went on ("re-run as trial N"), a failed one why
            state, note = r["state"], r.get("note") or ""
            if state != "finished" and note:
                state = note if note.startswith(f"{state}: ") else f"{state}: {note}"
            stuck = {1: "yes", 0: "no"}.get(plateau.get((name, "grid", r["trial"])), "")
            lines.append(f"| {r.get('rank', '')} | " + " | ".join(_fmt(r.get(p), 6) for p in params) +
                         f" | {_fmt(r.get(spec.metric), 6)} | {state} | {edge} | {stuck} |")
        lines.append("")
    lines += front + downstream_lines(spec, found, out)
    lines += ["## Host", "", f"{host['host']}: {host['cpu']}, {host['cores']} cores, torch {host['torch']} with "
              f"{host['threads']} thread{'' if host['threads'] == 1 else 's'}; load average {_fmt(host['load'], 3)} "
              "when this report was written (seconds are wall clock on this machine; each run's own load average is "
              "in the final comparison and `runs.csv`).", "",
              "Plots: " + ", ".join(f"`{p}`" for p in ("mlm_loss_vs_flops.png", "mlm_loss_vs_seconds.png",
                                                      "mlm_accuracy_vs_flops.png", "mlm_accuracy_vs_seconds.png",
                                                      *(["front_vs_flops.png"] if front else []))),
              "Tables: " + ", ".join(f"`{name}`" for name in tables) + ".", ""]
    return "\n".join(lines)


def _to_wandb(spec: CompareSpec, out: Path, tables: dict[str, list[dict]], plots: list[Path]) -> None:
    import wandb

    from bert.run.wandb_run import start_wandb

    class _Named:  # what start_wandb reads of a config
        name = f"compare-{spec.name}"

        @staticmethod
        def model_dump(mode: str = "json") -> dict:
            return {"comparison": spec.source, "budget": {spec.budget: spec.amount, "warmup": spec.warmup},
                    "metric": spec.metric, "seeds": list(spec.seeds), "configs": [a.name for a in spec.arms]}

    run = start_wandb(out, _Named())
    try:
        for name, rows in tables.items():
            columns = list(dict.fromkeys(k for r in rows for k in r))
            run.log({name.removesuffix(".csv"): wandb.Table(columns=columns,
                                                            data=[[_value(r, c) for c in columns] for r in rows])})
        run.log({p.stem: wandb.Image(str(p)) for p in plots})
    finally:
        run.finish()



