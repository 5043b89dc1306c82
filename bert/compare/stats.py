"""What a comparison's final runs say, with how far it could move by chance:

- `Spread`: a figure over the seeds (mean, min–max);
- `RunEnd`: one run's last held-out evaluation (with its sampling error and the unigram
  baseline it recorded, so whether it is still on the plateau), its throughput and the
  machine's load while it ran;
- `verdict`: the ranking in words. Configs with a final run on the unigram plateau are
  flagged and never ranked; with every config on it there is no winner; the best is said to
  be ahead only as far as the seeds' ranges and the held-out error allow;
- `seconds_refusal`: why seconds may not be compared (the load moved by more than
  `LOAD_FACTOR` between the runs).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from bert.unigram import PLATEAU_FACTOR, on_plateau

__all__ = ["LOAD_FACTOR", "RunEnd", "Spread", "ranking", "run_end", "seconds_refusal", "spread", "verdict"]

# Seconds are compared only while the runs' mean load averages stay within this factor of
# each other (each counted as at least 1, the run's own work).
LOAD_FACTOR = 1.5


@dataclass(frozen=True)
class Spread:
    """A figure over the seeds."""

    mean: float
    low: float
    high: float
    n: int

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
    return Spread(statistics.fmean(known), min(known), max(known), len(known))


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


def seconds_refusal(ends: Sequence[RunEnd]) -> Optional[str]:
    """Why the runs' seconds may not be compared, or None when they may."""
    loads = [max(e.load, 1.0) for e in ends if e.load is not None]
    if len(loads) < len(ends):
        return "the load was not recorded for every run"
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
    elif min(values[best].n, values[second].n) == 1:
        lines.append(f"- **{best}** is ahead of {second} by {gap:.3g}{error}; from one seed, no spread says whether "
                     "it would hold at another.")
    elif values[best].overlaps(values[second]):
        lines.append(f"- {best} is ahead of {second} by {gap:.3g} on the mean, but their seeds' ranges overlap: **not "
                     f"separated** at {values[best].n} seeds{error}.")
    else:
        lines.append(f"- **{best}** is ahead of {second} by {gap:.3g}: every seed of {best} is better than every seed "
                     f"of {second}{error}.")
    return lines
