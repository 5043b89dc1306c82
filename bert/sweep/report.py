"""The sweep's report, from the storage (so runs of every worker are in it): runs.csv and runs.md
(runs ranked by the metric, each numeric parameter's edge flag) and PNG plots."""
from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any, Optional

import optuna
from optuna.trial import TrialState

from bert.run.outputs import save_figure
from fileio import write_atomically
from bert.sweep.spec import SweepSpec, is_periodic

__all__ = ["edge_flags", "print_best", "short", "write_report"]

EDGE = 0.1  # a best value in the outer tenth of a range (random, bayes) is at its edge


def write_report(study: optuna.Study, spec: SweepSpec, sweep_dir: Path,
                 plots: bool = True) -> tuple[list[dict], Optional[dict], list[str]]:
    """runs.csv and runs.md (runs sorted by the metric, edge flags) and PNG plots, in the sweep directory."""
    rows = _rows(study, spec)
    best = rows[0] if rows and rows[0]["state"] == "finished" else None
    edges = edge_flags(spec, best)
    columns = ["rank", "trial", "state", spec.metric, "step", *(p.name for p in spec.swept), "output_dir",
               "checkpoint", "note"]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    write_atomically(sweep_dir / "runs.csv", buffer.getvalue())
    write_atomically(sweep_dir / "runs.md", _markdown(spec, rows, columns, best, edges))
    if plots:
        _plots(spec, rows, sweep_dir)
    return rows, best, edges


def _rows(study: optuna.Study, spec: SweepSpec) -> list[dict]:
    trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get("discarded")]
    rerun = {n: t.number for t in trials for n in t.system_attrs.get("retry_history", [])}
    states = {TrialState.COMPLETE: "finished", TrialState.PRUNED: "pruned", TrialState.RUNNING: "running",
              TrialState.WAITING: "waiting"}
    rows = []
    for t in trials:
        state, note = states.get(t.state), t.user_attrs.get("error") or ""
        if state is None and t.number in rerun:
            state, note = "interrupted", f"{note or 'worker died'}; re-run as trial {rerun[t.number]}"
        elif state is None:
            state, note = ("diverged" if "diverged" in note.lower() else "failed", note) if note else \
                ("interrupted", "worker died; no retries left")
        last = max(t.intermediate_values) if t.intermediate_values else None
        value = t.value if t.state == TrialState.COMPLETE else t.intermediate_values.get(last)
        rows.append({"trial": t.number, "state": state, spec.metric: value, "step": last,
                     **t.user_attrs.get("values", {}), "output_dir": t.user_attrs.get("output_dir", ""),
                     "checkpoint": t.user_attrs.get("checkpoint", ""), "note": note,
                     "_curve": sorted(t.intermediate_values.items())})
    order, sign = {"finished": 0, "pruned": 1}, 1 if spec.goal == "minimize" else -1
    rows.sort(key=lambda r: (order.get(r["state"], 2),
                             sign * r[spec.metric] if r[spec.metric] is not None and r["state"] in order else 0,
                             r["trial"]))
    for rank, r in enumerate(rows, 1):
        r["rank"] = rank if r["state"] == "finished" else ""
    return rows


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def edge_flags(spec: SweepSpec, best: Optional[dict]) -> list[str]:
    """A line for each numeric parameter whose best value lies at an edge of the searched range:
    a grid's or a value list's smallest or largest value; the outer tenth of a range (random,
    bayes), on a log scale for the log distributions. The optimum may then lie beyond it."""
    flags = []
    for p in spec.swept if best else ():
        v = best.get(p.name)
        if not _numeric(v):
            continue
        if spec.method == "grid" or p.distribution == "categorical":
            values = [x for x in p.grid() if _numeric(x)]
            lo, hi = (min(values), max(values)) if len(values) > 1 else (None, None)
            side = "smallest" if v == lo else "largest" if v == hi else None
        else:
            lo, hi, at = p.low, p.high, (math.log if p.log else float)
            where = (at(v) - at(lo)) / (at(hi) - at(lo)) if hi > lo else 0.5
            side = "smallest" if where <= EDGE else "largest" if where >= 1 - EDGE else None
        if side:
            end, beyond = (lo, "below") if side == "smallest" else (hi, "above")
            flags.append(f"{p.name}: the best run's {short(v, 6)} is at the {side} end of the searched range "
                         f"({short(end, 6)}); the optimum may lie {beyond} it: extend the range")
    return flags


def _markdown(spec: SweepSpec, rows: list[dict], columns: list[str], best: Optional[dict], edges: list[str]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return ""
        return f"{v:.6g}" if isinstance(v, float) else str(v).replace("|", "\\|").replace("\n", " ")

    counts = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    lines = [f"# Sweep {spec.name}", "", f"{spec.method} sweep from {spec.source}; {spec.goal} `{spec.metric}` "
             f"(each run's {_value_is(spec)}). Runs: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".", ""]
    if spec.description:
        lines[1:1] = ["", spec.description.strip()]
    if spec.constants:
        lines += ["Fixed: " + ", ".join(f"`{k}={v}`" for k, v in spec.constants.items()) + ".", ""]
    if best:
        lines += [f"Best: trial {best['trial']}, {spec.metric} {cell(best[spec.metric])}, checkpoint "
                  f"`{best['checkpoint']}` (phase 2: `--training.init_from {best['checkpoint']}`).", ""]
    if edges:
        lines += ["At the edge of the search:", "", *(f"- {e}" for e in edges), ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _value_is(spec: SweepSpec) -> str:
    return "final evaluation" if is_periodic(spec.metric) else "last logged value"


def _plots(spec: SweepSpec, rows: list[dict], sweep_dir: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: Figure renders with Agg, no display needed

    styles = {"finished": dict(marker="o"), "pruned": dict(marker="o", facecolors="none"),
              "diverged": dict(marker="x"), "failed": dict(marker="x"), "interrupted": dict(marker="+")}
    for p in spec.swept:
        ax = Figure(figsize=(6, 4)).subplots()
        values = p.grid() if p.distribution == "categorical" else []
        labels = [_label(v) for v in values] if any(not _numeric(v) for v in values) else []
        for state, style in styles.items():
            pts = [(r[p.name], r[spec.metric]) for r in rows if r["state"] == state and p.name in r
                   and r[spec.metric] is not None and math.isfinite(r[spec.metric])]
            if pts:
                xs = [labels.index(_label(x)) if labels else x for x, _ in pts]
                ax.scatter(xs, [y for _, y in pts], label=state, color=f"C{list(styles).index(state)}", **style)
        if labels:
            ax.set_xticks(range(len(labels)), labels)
        elif p.log or values and min(values) > 0 and max(values) >= 100 * min(values):
            ax.set_xscale("log")
        ax.set(xlabel=p.name, ylabel=f"{spec.metric} ({_value_is(spec)})",
               title=f"{spec.name}: {spec.metric} against {p.name}")
        if ax.collections:
            ax.legend(fontsize="small")
        save_figure(ax.figure, sweep_dir / f"{spec.metric}_vs_{p.name}.png")

    ax = Figure(figsize=(7, 4.5)).subplots()
    for r in sorted(rows, key=lambda r: r["trial"]):
        curve = [(s, v) for s, v in r["_curve"] if math.isfinite(v)]
        if curve:
            label = f"{r['trial']}: " + ", ".join(f"{p.name.split('.')[-1]}={short(r.get(p.name), 4)}"
                                                  for p in spec.swept)
            ax.plot(*zip(*curve), label=label, marker="o" if is_periodic(spec.metric) else None,
                    linestyle="-" if r["state"] == "finished" else "--")
    ax.set(xlabel="step", ylabel=spec.metric, title=f"{spec.name}: {spec.metric} over steps (dashed: stopped early)")
    if ax.lines:
        ax.legend(fontsize="x-small", ncol=1 + len(ax.lines) // 12)
    save_figure(ax.figure, sweep_dir / f"{spec.metric}_curves.png")


def short(v: Any, digits: int) -> str:
    return f"{v:.{digits}g}" if isinstance(v, float) else str(v)


def _label(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)




def print_best(spec: SweepSpec, best: Optional[dict], edges: list[str], sweep_dir: Path) -> None:
    print(f"report: {sweep_dir / 'runs.md'} (and runs.csv, *.png)")
    if best is None:
        print("no run has finished yet")
        return
    shown = ", ".join(f"{p.name}={short(best.get(p.name), 6)}" for p in spec.swept)
    print(f"best: trial {best['trial']} [{shown}] {spec.metric} {best[spec.metric]:.6g}")
    for edge in edges:
        print(f"edge: {edge}")
    print(f"best checkpoint: {best['checkpoint']}")
