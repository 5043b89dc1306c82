"""The front of a comparison with a size ladder per architecture (`sizes:` in the YAML,
docs/quality.md): held-out `metric` against training FLOPs across every size.

- An architecture's **front** is the lower envelope of its sizes' evaluations: of every
  evaluation of every size (the seeds' mean curve), ordered by FLOPs, each one lower than all
  those with fewer FLOPs. A size is on the front when its final evaluation is. An evaluation
  before the end of a run was taken before its learning rate had decayed, so it lies above
  what a run with that budget would reach: the envelope errs towards more FLOPs.
- **FLOPs at equal loss**, read off the fronts: for each size of Y, the FLOPs X's front needs
  for the final value that size reached, interpolated between the two front points of X
  around it (linear in the value and in log-FLOPs, as "to reach" interpolates a curve), as a
  ratio of that size's own FLOPs. Beyond X's ladder there is nothing to read: a value below
  X's best is "not reached"; one above X's first evaluation is reached at most there (`≤`).
- **Seed pairs**: each seed has its own front (the envelope of each size's run at that
  seed), and the same reading for every seed of X against every seed of Y's size gives the
  ratio's interval (min–max).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from bert.compare.stats import spread

__all__ = ["EqualLoss", "Size", "crossing", "equal_loss", "flops_at", "front", "front_lines", "front_plot",
           "front_rows", "front_table", "front_verdict", "ladders_of", "on_front", "summary"]

Curve = tuple[tuple[float, float], ...]  # (training FLOPs, value) of each evaluation, in order


@dataclass(frozen=True)
class Size:
    """One size of a ladder: the curves of its final runs, in the order of the seeds, and their mean."""

    arm: str  # the config's name in the report (`<family>-<size>`)
    family: str  # its ladder
    size: str
    curves: tuple[Curve, ...]
    mean: Curve
    on_plateau: bool  # one of its final runs ended on the unigram plateau

    @property
    def flops(self) -> tuple[float, ...]:
        """Each seed's training FLOPs at its end."""
        return tuple(c[-1][0] for c in self.curves)

    @property
    def values(self) -> tuple[float, ...]:
        """Each seed's final value."""
        return tuple(c[-1][1] for c in self.curves)

    @property
    def mean_flops(self) -> float:
        return self.mean[-1][0]

    @property
    def mean_value(self) -> float:
        return self.mean[-1][1]


def front(sizes: Sequence[Size], seed: Optional[int] = None) -> list[tuple[float, float, Size]]:
    """The lower envelope (FLOPs, value, size) of the ladder's evaluations, by FLOPs: of the
    seeds' mean curves, or of the runs at the seed of index `seed`."""
    points = sorted(((f, v, s) for s in sizes if seed is None or seed < len(s.curves)
                     for f, v in (s.mean if seed is None else s.curves[seed])), key=lambda p: (p[0], p[1]))
    kept, best = [], math.inf
    for flops, value, s in points:
        if value < best:
            kept.append((flops, value, s))
            best = value
    return kept


def on_front(size: Size, points: list[tuple[float, float, Size]]) -> bool:
    """Whether the size's final (mean) evaluation is on the front."""
    return any(s is size and f == size.mean_flops for f, _, s in points)


def flops_at(points: list[tuple[float, float, Size]], target: float) -> tuple[Optional[float], str]:
    """The FLOPs the front needs for `target`, and "≤" when its first point already reaches it
    (None: not reached within the ladder)."""
    for i, (flops, value, _) in enumerate(points):
        if value > target:
            continue
        if i == 0:
            return flops, "≤"
        f0, v0, _ = points[i - 1]
        w = (target - v0) / (value - v0)
        return f0 * (flops / f0) ** w, ""
    return None, ""


def crossing(points: list[tuple[float, float, Size]], target: float) -> Optional[tuple[float, float, Size]]:
    """The front's evaluations around `target`: (FLOPs before, FLOPs after, the size of the one
    after), 0 before the first; None where the ladder does not reach it. The reading lies
    between the two whatever the curve does between them: its bracket."""
    for i, (flops, value, size) in enumerate(points):
        if value <= target:
            return (points[i - 1][0] if i else 0.0), flops, size
    return None


@dataclass(frozen=True)
class EqualLoss:
    """X's FLOPs for the final value of one size of Y, against that size's FLOPs."""

    x: str  # the families
    y: str
    y_size: Size
    target: float
    flops: Optional[float]
    bound: str  # "≤": X's first front point reaches it already
    pairs: tuple[Optional[float], ...]  # the ratio for every seed of X against every seed of Y
    pairs_bound: str  # "≤" when a seed's first front point reaches it already
    x_on_plateau: bool  # a size of X's ladder ended on the unigram plateau
    bracket: Optional[tuple[float, float]] = None  # the ratios of the front's evaluations around the crossing
    pairs_bracket: Optional[tuple[float, float]] = None  # the widest of the seed pairs' brackets
    read_on: Optional[str] = None  # the size of X whose evaluation ends the crossing

    @property
    def on_plateau(self) -> bool:
        """Y's size or a size of X ended on the unigram plateau: not a comparison of the models."""
        return self.x_on_plateau or self.y_size.on_plateau

    @property
    def ratio(self) -> Optional[float]:
        return None if self.flops is None else self.flops / self.y_size.mean_flops


def equal_loss(x: str, y: str, ladders: dict[str, list[Size]]) -> list[EqualLoss]:
    """X's FLOPs at the final value of each size of Y, by Y's FLOPs."""
    rows = []
    x_front = front(ladders[x])
    seed_fronts = [front(ladders[x], k) for k in range(min(len(s.curves) for s in ladders[x]))]
    stuck = any(s.on_plateau for s in ladders[x])
    for size in sorted(ladders[y], key=lambda s: s.mean_flops):
        target = size.mean_value
        flops, bound = flops_at(x_front, target)
        pairs = [(flops_at(seed_front, size.values[ky]), size.flops[ky])
                 for seed_front in seed_fronts for ky in range(len(size.values))]
        around = crossing(x_front, target)
        seed_brackets = [(c[0] / of, c[1] / of) for seed_front in seed_fronts for ky, of in enumerate(size.flops)
                         for c in [crossing(seed_front, size.values[ky])] if c is not None]
        rows.append(EqualLoss(x, y, size, target, flops, bound,
                              tuple(None if f is None else f / of for (f, _), of in pairs),
                              "≤" if any(b for (_, b), _ in pairs) else "", stuck,
                              None if around is None else (around[0] / size.mean_flops, around[1] / size.mean_flops),
                              (min(b[0] for b in seed_brackets), max(b[1] for b in seed_brackets))
                              if seed_brackets else None,
                              None if around is None else around[2].size))
    return rows


def summary(row: EqualLoss) -> str:
    """`0.41 on x's m (bracket 0.33–0.52; 0.38–0.45 over 4 seed pairs, brackets 0.3–0.6)`, or
    why there is no figure: the reading, the evaluations around it (the spacing's interval)
    and the seeds' spread with theirs."""
    if row.flops is None:
        return "not reached within the ladder"
    reached = spread([p for p in row.pairs if p is not None])
    low, high = (f"{row.pairs_bound}{v:.3g}" for v in (reached.low, reached.high)) if reached else ("", "")
    within = f"bracket {row.bracket[0]:.3g}–{row.bracket[1]:.3g}" if row.bracket else ""
    pairs = (f"{low}–{high} over {reached.n} of {len(row.pairs)} seed pairs"
             + (f", brackets {row.pairs_bracket[0]:.3g}–{row.pairs_bracket[1]:.3g}" if row.pairs_bracket else "")
             if reached and len(row.pairs) > 1 else "")
    detail = "; ".join(part for part in (within, pairs) if part)
    on = f" on {row.x}'s {row.read_on}" if row.read_on else ""
    return f"{row.bound}{row.ratio:.3g}{on}" + (f" ({detail})" if detail else "")


def ladders_of(arms, finals: dict[str, list[dict]], curves: dict, means: dict, ends: dict,
               metric: str) -> dict[str, list[Size]]:
    """Each family's sizes from its final runs (`finals`: the sweeps' rows; `curves`, `means`: their
    evaluations, bert/compare/report.py; `ends`: their RunEnds), the runs in the order of their
    seeds; {} unless two or more families have a ladder."""
    def points(curve) -> Curve:
        return tuple((p.flops, p.values[metric]) for p in curve if metric in p.values)

    ladders: dict[str, list[Size]] = {}
    for name, arm in arms.items():
        mean = points(means[name])
        if arm.size is None or not mean:
            continue
        order = sorted(range(len(finals[name])), key=lambda i: finals[name][i].get("training.seed") or 0)
        runs = tuple(run for run in (points(curves[name][i]) for i in order) if run)
        ladders.setdefault(arm.family, []).append(Size(name, arm.family, arm.size, runs, mean,
                                                       any(bool(e.on_plateau) for e in ends[name])))
    return ladders if len(ladders) >= 2 else {}


def front_rows(ladders: dict[str, list[Size]]) -> list[EqualLoss]:
    return [row for x in ladders for y in ladders if x != y for row in equal_loss(x, y, ladders)]


def front_table(rows: list[EqualLoss], metric: str) -> list[dict]:
    """front.csv: one row per (X, size of Y)."""
    table = []
    for r in rows:
        reached = spread([p for p in r.pairs if p is not None])
        table.append({"x": r.x, "y": r.y, "y_size": r.y_size.size, "metric": metric, "target": r.target,
                      "y_flops": r.y_size.mean_flops, "flops": "" if r.flops is None else f"{r.bound}{r.flops:.6g}",
                      "flops_ratio": "" if r.ratio is None else f"{r.bound}{r.ratio:.4f}",
                      "pairs": len(r.pairs), "pairs_reached": 0 if reached is None else reached.n,
                      "pairs_low": "" if reached is None else f"{r.pairs_bound}{reached.low:.4f}",
                      "pairs_high": "" if reached is None else f"{r.pairs_bound}{reached.high:.4f}",
                      "read_on": r.read_on or "",
                      "bracket_low": "" if r.bracket is None else f"{r.bracket[0]:.4f}",
                      "bracket_high": "" if r.bracket is None else f"{r.bracket[1]:.4f}",
                      "pairs_bracket_low": "" if r.pairs_bracket is None else f"{r.pairs_bracket[0]:.4f}",
                      "pairs_bracket_high": "" if r.pairs_bracket is None else f"{r.pairs_bracket[1]:.4f}",
                      "note": "sizes on the unigram plateau: not a comparison of the models" if r.on_plateau else ""})
    return table


def front_lines(ladders: dict[str, list[Size]], rows: list[EqualLoss], metric: str) -> list[str]:
    """The report's section: every size's final point, the fronts, and FLOPs at equal loss."""
    lines = ["## The front", "",
             f"Each size's final `{metric}` (mean over its seeds, min–max) against its training FLOPs. An "
             "architecture's front is the lower envelope of its sizes' evaluations (the seeds' mean curves): a size "
             "is on it when its final evaluation is, that is when no evaluation of the ladder reaches a lower value "
             "with fewer FLOPs (`front_vs_flops.png`).", "",
             f"| config | size | training FLOPs | {metric} | on the front | on the plateau |",
             "| --- | --- | --- | --- | --- | --- |"]
    for family, sizes in ladders.items():
        edge = front(sizes)
        for s in sorted(sizes, key=lambda s: s.mean_flops):
            lines.append(f"| {family} | {s.size} | {s.mean_flops:.4g} | {spread(s.values).text(4)} | "
                         f"{'yes' if on_front(s, edge) else 'no'} | {'yes' if s.on_plateau else 'no'} |")
    lines += ["", f"### FLOPs at equal `{metric}`", "",
              "X's FLOPs for the final value of each size of Y, read off X's front (linear in the value and in "
              "log-FLOPs between its two points around it), as a ratio of that size's own FLOPs; **seed pairs**: "
              "the same for every seed's front of X against every seed of Y's size (min–max, how many reach). The "
              "**bracket** is the ratio of the front's two evaluations around the crossing: the reading lies between "
              "them whatever the curve does there; the seed pairs' brackets are the widest over the pairs, the "
              "interval with both sources of spread. **Read on** names the size of X whose evaluation ends the "
              "crossing: where it is not Y's own size, the front reads a smaller (or larger) X, and \"to reach\" "
              "(X's same size only) reads as many FLOPs or more. A front point before the end of a run was evaluated before "
              "its learning rate decayed: the reading errs towards more FLOPs for X.", "",
              f"| X | at Y's size | its {metric} | its FLOPs | X's FLOPs | ratio | read on | bracket | seed pairs "
              "| their brackets | note |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in front_table(rows, metric):
        pairs = (f"{row['pairs_low']}–{row['pairs_high']} ({row['pairs_reached']} of {row['pairs']})"
                 if row["pairs_reached"] else f"none of {row['pairs']}")
        bracket = f"{row['bracket_low']}–{row['bracket_high']}" if row["bracket_low"] else ""
        theirs = f"{row['pairs_bracket_low']}–{row['pairs_bracket_high']}" if row["pairs_bracket_low"] else ""
        lines.append(f"| {row['x']} | {row['y']} {row['y_size']} | {row['target']:.5g} | {row['y_flops']:.4g} | "
                     f"{row['flops'] or 'not reached'} | {row['flops_ratio']} | {row['read_on']} | {bracket} | "
                     f"{pairs} | {theirs} | {row['note']} |")
    return lines + [""]


def front_verdict(rows: list[EqualLoss], metric: str) -> list[str]:
    """One line per pair of architectures: X's FLOPs ratio at each size of Y."""
    lines = []
    for x, y in dict.fromkeys((r.x, r.y) for r in rows):
        mine = [r for r in rows if (r.x, r.y) == (x, y)]
        each = "; ".join(f"at {y} {r.y_size.size} ({r.target:.4g}"
                         f"{', on the plateau' if r.y_size.on_plateau else ''}): {summary(r)}" for r in mine)
        stuck = (f" ({x}'s ladder has a size on the unigram plateau: its front is not a comparison of the models)"
                 if any(r.x_on_plateau for r in mine) else "")
        lines.append(f"- Front: {x}'s FLOPs for {y}'s final `{metric}`, as a ratio of {y}'s: {each}{stuck}.")
    return lines


def front_plot(ladders: dict[str, list[Size]], metric: str, title: str, path) -> None:
    """Every size's mean curve (thin), its final point (o: on the front, x: not), and each
    architecture's front (thick)."""
    from matplotlib.figure import Figure

    from bert.run.outputs import save_figure

    ax = Figure(figsize=(6.5, 4.2)).subplots()
    for i, (family, sizes) in enumerate(ladders.items()):
        edge = front(sizes)
        for s in sizes:
            ax.plot(*zip(*s.mean), color=f"C{i}", alpha=0.35, linewidth=0.8)
            ax.plot([s.mean_flops], [s.mean_value], color=f"C{i}", marker="o" if on_front(s, edge) else "x")
            ax.annotate(s.size, (s.mean_flops, s.mean_value), fontsize="x-small", color=f"C{i}")
        ax.plot([f for f, _, _ in edge], [v for _, v, _ in edge], color=f"C{i}", linewidth=2,
                label=f"{family} front ({sum(on_front(s, edge) for s in sizes)} of {len(sizes)} sizes' ends on it)")
    ax.set(xscale="log", xlabel="training FLOPs", ylabel=metric, title=f"{title}: {metric} against training FLOPs")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    save_figure(ax.figure, path)
