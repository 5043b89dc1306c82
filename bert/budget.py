"""A run's budget: its training FLOPs per step, and its length from `training.budget_flops` or
`training.budget_seconds` (bert/config.py).

The FLOPs of a training step are those `bert.py --summary` counts, exactly: the graph's forward
FLOPs per row (matmuls, einsums and the grouped convolution; bert/summary.py) × 3 (forward and
backward) × the rows the step processes (micro batch × gradient accumulation × replicas). A row
is `model.sequence_length` positions whatever they hold, so padding costs as much as text; a
packed row (several sequences) costs what its packed graph does (more masked-prediction slots),
which `--summary` of the packed config reports.

- `training.budget_flops B`: the run takes the most whole steps within B, ⌊B / FLOPs per step⌋,
  so it ends within one step of its budget; its warm-up is `budget_warmup` of those steps and
  its decay the rest, so the learning rate is fully decayed at the budget.
- `training.budget_seconds T`: the run stops once its training steps (data, forward, backward,
  update; not evaluations or checkpoints) have taken T seconds, and its learning rate follows
  the fraction of T spent (`Schedule.at_fraction`, read by the run loop's clock); `training.steps`
  is then a cap.

`Budget` says all of this to the run loop (bert/loop.py), whose clock (bert/progress.py) keeps
the time spent.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from bert.config import Config, ModelConfig
from session.schedules import Schedule

__all__ = ["Budget", "flops_per_row", "flops_per_step", "resolve", "schedule"]

# The schedule of a time budget is drawn over this many ticks of the fraction spent.
_TICKS = 1_000_000


@functools.lru_cache(maxsize=16)
def flops_per_row(model: ModelConfig) -> int:
    """Training FLOPs of one graph row: 3 × the forward FLOPs `--summary` counts per row."""
    from bert.model import build_model
    from bert.summary import forward_flops

    return 3 * forward_flops(build_model(model), batch=1)


def flops_per_step(config: Config, replicas: int = 1) -> int:
    t = config.training
    return flops_per_row(config.model) * t.micro_batch_size * t.gradient_accumulation * replicas


def resolve(config: Config, replicas: int = 1) -> tuple[Config, Optional[str]]:
    """The config a FLOPs budget gives (training.steps set from it) and a line saying so; any
    other config as it is, and None."""
    t = config.training
    if t.budget_flops is None:
        return config, None
    per_step = flops_per_step(config, replicas)
    steps = int(t.budget_flops // per_step)
    if steps < 1:
        raise ValueError(f"training.budget_flops {t.budget_flops:.4g} is less than one training step of this "
                         f"config ({per_step:.4g} FLOPs: {flops_per_row(config.model):.4g} per row × "
                         f"{per_step // flops_per_row(config.model)} rows); raise the budget or lower the batch")
    config = config.model_copy(update={"training": t.model_copy(update={"steps": steps})})
    line = (f"training.steps {steps}: training.budget_flops {t.budget_flops:.4g} / {per_step:.4g} FLOPs per step "
            f"({per_step * steps / t.budget_flops:.4%} of it used), warm-up {round(t.budget_warmup * steps)} steps")
    return config, line


@dataclass(frozen=True)
class Budget:
    """What a run may spend besides its steps, as the run loop reads it."""

    flops_per_step: Optional[int] = None  # set: metrics.jsonl records train_seconds and train_flops
    seconds: Optional[float] = None  # set: the run ends when its steps have taken this long ...
    curve: Optional[Schedule] = None  # ... and its learning rate is this curve at the fraction spent

    @classmethod
    def of(cls, config: Config, replicas: int = 1) -> "Budget":
        """The budget of a (resolved) pre-training config; none without training.budget_*."""
        t = config.training
        if not t.budget:
            return cls()
        seconds = t.budget_seconds
        return cls(flops_per_step(config, replicas), seconds, schedule(config) if seconds is not None else None)


def schedule(config: Config) -> Schedule:
    """The learning rate of a (resolved) config: over training.steps with warmup_steps; with a
    FLOPs budget, its warm-up budget_warmup of the steps; with a seconds budget, a curve over
    the fraction of the time spent (read with `at_fraction`)."""
    t = config.training
    total, warmup = t.steps, t.warmup_steps
    if t.budget_flops is not None:
        warmup = round(t.budget_warmup * total)
    elif t.budget_seconds is not None:
        total, warmup = _TICKS, round(t.budget_warmup * _TICKS)
    return Schedule(base_lr=t.learning_rate, warmup_steps=warmup, total_steps=total, warmup=t.warmup,
                    decay=t.decay, power=t.decay_power, end_lr=t.end_learning_rate)
