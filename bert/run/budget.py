"""A run's budget: its training FLOPs per step, and its length from `budget.flops` or
`budget.seconds` (bert/config/, docs/config.md).

The FLOPs of a training step are those `bert.py summary` counts, exactly: the graph's forward
FLOPs per row (matmuls, einsums and the grouped convolution; bert/summary.py) × 3 (forward and
backward) × the rows the step processes (micro batch × gradient accumulation × replicas). A row
is `model.sequence_length` positions whatever they hold, so padding costs as much as text; a
packed row (several sequences) costs what its packed graph does (more masked-prediction slots),
which `bert.py summary` of the packed config reports.

- `budget.flops B`: the run takes the most whole steps within B, ⌊B / FLOPs per step⌋,
  so it ends within one step of its budget; its warm-up is `budget.warmup` of those steps and
  its decay the rest, so the learning rate is fully decayed at the budget.
- `budget.seconds T`: the run stops once its training steps (data, forward, backward,
  update; not evaluations or checkpoints) have taken T seconds, and its learning rate follows
  the fraction of T spent (`Schedule.at_fraction`, read by the run loop's clock); `training.steps`
  is then a cap.

`Budget` says all of this to the run loop (bert/run/loop.py), whose clock (bert/run/progress.py) keeps
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
    """Training FLOPs of one graph row: 3 × the forward FLOPs `bert.py summary` counts per row."""
    from bert.model import build_model
    from bert.summary import forward_flops

    return 3 * forward_flops(build_model(model), batch=1)


def flops_per_step(config: Config, replicas: int = 1) -> int:
    return flops_per_row(config.model) * config.batch.global_batch(replicas)


def resolve(config: Config, replicas: int = 1) -> tuple[Config, Optional[str]]:
    """The config a FLOPs budget gives (training.steps set from it) and a line saying so; any
    other config as it is, and None."""
    budget = config.budget
    if budget.flops is None:
        return config, None
    per_step = flops_per_step(config, replicas)
    steps = int(budget.flops // per_step)
    if steps < 1:
        raise ValueError(f"budget.flops {budget.flops:.4g} is less than one training step of this "
                         f"config ({per_step:.4g} FLOPs: {flops_per_row(config.model):.4g} per row × "
                         f"{per_step // flops_per_row(config.model)} rows); raise the budget or lower the batch")
    config = config.model_copy(update={"training": config.training.model_copy(update={"steps": steps})})
    line = (f"training.steps {steps}: budget.flops {budget.flops:.4g} / {per_step:.4g} FLOPs per step "
            f"({per_step * steps / budget.flops:.4%} of it used), warm-up {round(budget.warmup * steps)} steps")
    return config, line


@dataclass(frozen=True)
class Budget:
    """What a run may spend besides its steps, as the run loop reads it."""

    flops_per_step: Optional[int] = None  # set: metrics.jsonl records train_seconds and train_flops
    seconds: Optional[float] = None  # set: the run ends when its steps have taken this long ...
    curve: Optional[Schedule] = None  # ... and its learning rate is this curve at the fraction spent

    @classmethod
    def of(cls, config: Config, replicas: int = 1) -> "Budget":
        """The budget of a (resolved) pre-training config; none without budget.flops or budget.seconds."""
        if config.budget.kind is None:
            return cls()
        seconds = config.budget.seconds
        return cls(flops_per_step(config, replicas), seconds, schedule(config) if seconds is not None else None)


def schedule(config: Config) -> Schedule:
    """The learning rate of a (resolved) config: over training.steps with schedule.warmup_steps;
    with a FLOPs budget, its warm-up budget.warmup of the steps; with a seconds budget, a curve
    over the fraction of the time spent (read with `at_fraction`)."""
    s, budget = config.schedule, config.budget
    total, warmup = config.training.steps, s.warmup_steps
    if budget.flops is not None:
        warmup = round(budget.warmup * total)
    elif budget.seconds is not None:
        total, warmup = _TICKS, round(budget.warmup * _TICKS)
    return Schedule(base_lr=config.optimizer.learning_rate, warmup_steps=warmup, total_steps=total,
                    warmup=s.warmup, decay=s.decay, power=s.decay_power, end_lr=s.end_learning_rate)
