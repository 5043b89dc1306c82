"""What a comparison's final runs say, with how far it could move by chance:

- `Spread`: a figure over the seeds (mean, min–max);
- `RunEnd`: one run's last held-out evaluation (with its sampling error and the unigram
  baseline it recorded, so whether it is still on the plateau), its throughput and the
  machine's load while it ran;
- `verdict`: the ranking in words. Configs with a final run on the unigram plateau are
  flagged and never ranked; with every config on it there is no winner; the best is said to
  be ahead only when a test at `LEVEL` says so (`separation`: Welch's t-test of the two best
  configs' seeds, each config's variance at least its runs' held-out variance, the level
  shared out over the pairs of configs), and otherwise "not resolved" with the seeds that
  would resolve the gap seen;
- `seconds_refusal`: why seconds may not be compared (a busy machine, or the load moved by
  more than `LOAD_FACTOR` between the runs).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from bert.tasks.unigram import PLATEAU_FACTOR, on_plateau

__all__ = ["LEVEL", "LOAD_FACTOR", "RunEnd", "Separation", "Spread", "ranking", "run_end", "seconds_refusal",
           "separation", "spread", "verdict"]

# Seconds are compared only while the runs' mean load averages stay within this factor of
# each other (each counted as at least 1, the run's own work).
LOAD_FACTOR = 1.5
# The rate at which "ahead" may be said of configs that do not differ (tests/test_compare.py
# draws null comparisons to check it), and the most seeds "run K more" proposes.
LEVEL = 0.05
MAX_SEEDS = 64


@dataclass(frozen=True)
class Spread:
    """A figure over the seeds."""

    mean: float
    low: float
    high: float
    n: int
    values: tuple[float, ...] = ()  # the seeds' own figures

    def text(self, digits: int = 4) -> str:
        """`3.959 (3.957–3.961)`; the value alone from one seed, or when the seeds agree."""
        if self.n == 1 or self.low == self.high:
            return f"{self.mean:.{digits}g}"
        return f"{self.mean:.{digits}g} ({self.low:.{digits}g}–{self.high:.{digits}g})"

    def overlaps(self, other: "Spread") -> bool:
        return self.low <= other.high and other.low <= self.high


def spread(values: Sequence[Optional[float]]) -> Optional[Spread]:
    """The spread of the values given (None ones left out); None without any."""
    known = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not known:
        return None
    return Spread(statistics.fmean(known), min(known), max(known), len(known), tuple(known))


@dataclass(frozen=True)
class Separation:
    """Whether two configs' means differ at `level`: the test's p-value and, when they do not,
    the seeds per config at which the gap and spread seen would (None: not within MAX_SEEDS)."""

    p: float
    level: float
    seeds_needed: Optional[int]

    @property
    def resolved(self) -> bool:
        return self.p < self.level


def separation(a: Spread, b: Spread, errors: Sequence[float] = (), level: float = LEVEL) -> Separation:
    """Welch's t-test (two-sided) of the seeds of `a` against those of `b`, each config's variance
    at least the held-out variance of one run (`errors`: the runs' standard errors), so that
    seeds that agree by chance claim no more than the evaluation allows."""
    from scipy import stats

    floor = statistics.fmean(e * e for e in errors) if errors else 0.0
    own = [statistics.variance(x.values) for x in (a, b)]
    gap = abs(a.mean - b.mean)

    def welch(var: Sequence[float], n_a: int, n_b: int) -> float:
        v_a, v_b = var[0] / n_a, var[1] / n_b
        if v_a + v_b == 0:
            return 0.0 if gap > 0 else 1.0
        df = (v_a + v_b) ** 2 / (v_a * v_a / (n_a - 1) + v_b * v_b / (n_b - 1))
        return float(2 * stats.t.sf(gap / math.sqrt(v_a + v_b), df))

    def p_value(n_a: int, n_b: int) -> float:
        # The floor raises a variance but may raise the degrees of freedom more: the larger p of the two.
        return max(welch(own, n_a, n_b), welch([max(v, floor) for v in own], n_a, n_b))

    p = p_value(a.n, b.n)
    needed = None
    if p >= level and gap > 0:
        needed = next((n for n in range(max(a.n, b.n) + 1, MAX_SEEDS + 1) if p_value(n, n) < level), None)
    return Separation(p, level, needed)


@dataclass(frozen=True)
class RunEnd:
    """A run's last held-out evaluation and what it ran beside."""

    value: Optional[float]  # the comparison's metric
    accuracy: Optional[float]  # eval_mlm_accuracy
    unigram: Optional[float]  # the baseline's accuracy on the same targets (None: not recorded)
    value_se: Optional[float]  # the held-out standard errors (None: not recorded)
    accuracy_se: Optional[float]
    targets: Optional[int]
    tokens_per_s: Optional[float]  # means over the run's training records
    load: Optional[float]
    flops: Optional[float] = None  # train_flops at that evaluation

    @property
    def on_plateau(self) -> Optional[bool]:
        """Whether the run ended on the unigram plateau; None when it did not record the baseline."""
        if self.unigram is None or self.accuracy is None:
            return None
        return on_plateau(self.accuracy, self.unigram)


def run_end(record: dict, metric: str) -> RunEnd:
    """A run's RunEnd from its evaluation record of `metric`, with the mean `tokens_per_s` and
    `load_average` of the training records before it (report.py's `_record_at`)."""
    se = record.get(f"{metric}_se") if metric == "eval_mlm_loss" else None
    return RunEnd(value=record.get(metric), accuracy=record.get("eval_mlm_accuracy"),
                  unigram=record.get("unigram_mlm_accuracy"), value_se=_finite(se),
                  accuracy_se=_finite(record.get("eval_mlm_accuracy_se")), targets=record.get("eval_mlm_targets"),
                  tokens_per_s=record.get("tokens_per_s"), load=record.get("load_average"),
                  flops=record.get("train_flops"))


def _finite(v: Optional[float]) -> Optional[float]:
    return v if v is not None and math.isfinite(v) else None


def seconds_refusal(ends: Sequence[RunEnd], cpus: Optional[int] = None) -> Optional[str]:
    """Why the runs' seconds may not be compared, or None when they may: the load not recorded,
    more runnable tasks than the machine's `cpus` (a busy machine: its seconds measure the
    others' work as much as the run's; the same BERT took 300.6 s and 623.8 s at loads 23.6 and
    25.7 on 2 CPUs), or a load that moved by more than LOAD_FACTOR between the runs."""
    loads = [max(e.load, 1.0) for e in ends if e.load is not None]
    if len(loads) < len(ends):
        return "the load was not recorded for every run"
    if cpus and max(loads) > cpus:
        return (f"the machine was busy: a load average of up to {max(loads):.2f} on its {cpus} CPUs (more runnable "
                "tasks than CPUs); compare seconds measured on an idle machine")
    if max(loads) > LOAD_FACTOR * min(loads):
        return (f"the load average moved from {min(loads):.2f} to {max(loads):.2f} between the runs (more than "
                f"{LOAD_FACTOR:g}×)")
    return None


def verdict(ends: dict[str, list[RunEnd]], metric: str, goal_minimize: bool = True) -> list[str]:
    """The ranking of the configs by their mean final `metric`, in words (markdown lines)."""
    flagged, ranked, unknown = [], [], []
    for name, runs in ends.items():
        stuck = sum(bool(e.on_plateau) for e in runs)
        if stuck:
            flagged.append(f"**{name}** is on the unigram plateau ({stuck} of {len(runs)} final run"
                           f"{'s' * (len(runs) > 1)} below {PLATEAU_FACTOR:g}× the baseline's held-out MLM "
                           "accuracy): not ranked")
        else:
            ranked.append(name)
        if any(e.on_plateau is None for e in runs):
            unknown.append(name)
    lines = [f"- {line}" for line in flagged]
    if unknown:
        lines.append(f"- {', '.join(unknown)}: the runs did not record the unigram baseline (made before it was "
                     "recorded), so whether they left the plateau is unknown")
    if not ranked:
        return lines + ["- **No winner**: every config is still on the unigram plateau, so the comparison shows how "
                        "soon each model leaves it, not which one is better. Give each more budget, or look at its "
                        "grid for rates that leave it (docs/running.md, \"The unigram plateau\")."]
    values = {name: spread([e.value for e in ends[name]]) for name in ranked}
    values = {n: v for n, v in values.items() if v is not None}
    errors = {n: [e.value_se for e in ends[n] if e.value_se is not None] for n in values}
    lines += ranking(values, errors, f"final `{metric}`", "held-out standard error", goal_minimize)
    if len(values) == 1:
        others = "the other configs are" if len(ends) > 2 else "the other config is"
        lines.append(f"- **{next(iter(values))}** is the only config past the plateau; {others} not ranked.")
    return lines


def ranking(values: dict[str, Spread], errors: dict[str, list[float]], figure: str, error_name: str,
            goal_minimize: bool = True, topic: str = "") -> list[str]:
    """The configs ranked by the mean of `figure` over their seeds, and whether the best is ahead
    of the next as far as the seeds' ranges and one run's sampling `errors` (its `error_name`)
    allow, in words."""
    ranked = sorted(values, key=lambda n: values[n].mean if goal_minimize else -values[n].mean)
    if not ranked:
        return []
    order = ", ".join(f"{i}. {n} {values[n].text()}" for i, n in enumerate(ranked, 1))
    lines = [f"- {topic + ': ranked' if topic else 'Ranked'} by the mean {figure} (min–max over the seeds): {order}."]
    if len(ranked) == 1:
        return lines
    best, second = ranked[0], ranked[1]
    gap = abs(values[second].mean - values[best].mean)
    known = [e for n in (best, second) for e in errors.get(n, [])]
    error = (f"; the {error_name} of one run's {figure.removeprefix('final ')} is about {max(known):.2g}, so the "
             f"gap is {gap / max(known):.0f}× it" if known and max(known) > 0 else "")
    if gap == 0:
        lines.append(f"- {best} and {second} are level on the mean{error.split(', so')[0]}.")
        return lines
    if min(values[best].n, values[second].n) == 1:
        lines.append(f"- {best} leads {second} by {gap:.3g}{error}; from one seed, no spread says whether it would "
                     "hold at another: **not resolved**, run 2 or more seeds each.")
        return lines
    pairs = len(ranked) * (len(ranked) - 1) // 2  # the best and the next are picked from every pair: Bonferroni
    level = LEVEL / pairs
    test = separation(values[best], values[second], known, level)
    how = (f"Welch's t-test over {values[best].n} and {values[second].n} seeds, p = {test.p:.2g} against "
           f"{level:.2g} (a {LEVEL:.0%} chance of \"ahead\" between configs that do not differ"
           + (f", shared over {pairs} pairs" if pairs > 1 else "") + ")")
    if test.resolved:
        lines.append(f"- **{best}** is ahead of {second} by {gap:.3g} ({how}){error}.")
    else:
        seeds = max(values[best].n, values[second].n)
        more = (f"run {test.seeds_needed - seeds} more seed(s) each if the gap and spread hold"
                if test.seeds_needed is not None else f"no number of seeds up to {MAX_SEEDS} would, at this spread")
        lines.append(f"- {best} leads {second} by {gap:.3g} on the mean: **not resolved** at {values[best].n} seeds "
                     f"({how}); {more}{error}.")
    return lines
