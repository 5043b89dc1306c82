"""Learning-rate schedules as pure functions of the step, so a resumed run needs only the step.

GroupBERT pre-training (Chelombiev et al. 2021, following Graphcore's BERT recipe): square-
root warm-up, then polynomial decay. BERT with LAMB (You et al. 2020) and NVIDIA's
recipe: linear warm-up, then linear (power 1) decay.

    warm-up (step < W):   linear  lr = base · step / W
                          sqrt    lr = base · √(step / W)
    decay   (W ≤ step):   constant    lr = base
                          linear      lr = end + (base − end) · (1 − p)
                          polynomial  lr = end + (base − end) · (1 − p)^power
    with p = (step − W) / (total − W), clamped to [0, 1]; after `total`, lr = end.

Steps count optimizer updates from 0: `schedule(0)` is the rate of the first update.

A run with a budget of training seconds reads the same curve at the fraction of its budget
spent (`at_fraction`) instead of the step, as the budget-limited "cramming" recipe does (Geiping
& Goldstein 2023, section 3): warm-up over the first fraction, decay over the rest, fully
decayed when the time is up. The run loop's clock (bert/run/progress.py) owns that fraction and
passes the rate to `TrainingSession.run`; the curve itself stays a pure function. Such a run's
rates depend on how long steps take, so it is not bit-reproducible.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["Schedule", "set_lr"]

Warmup = Literal["linear", "sqrt"]
Decay = Literal["linear", "polynomial", "constant"]


@dataclass(frozen=True)
class Schedule:
    base_lr: float
    warmup_steps: int
    total_steps: int
    warmup: Warmup = "linear"
    decay: Decay = "linear"
    power: float = 1.0
    end_lr: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.base_lr, (int, float)) and self.base_lr > 0 and math.isfinite(self.base_lr)):
            raise ValueError(f"Schedule.base_lr must be a finite number > 0, got {self.base_lr!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"Schedule.warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if not isinstance(self.total_steps, int) or self.total_steps < 1:
            raise ValueError(f"Schedule.total_steps must be an int >= 1, got {self.total_steps!r}")
        if self.warmup_steps > self.total_steps:
            raise ValueError(
                f"Schedule.warmup_steps ({self.warmup_steps}) exceeds total_steps ({self.total_steps}); "
                "lower the warm-up or train longer"
            )
        if self.warmup not in ("linear", "sqrt"):
            raise ValueError(f"Schedule.warmup must be 'linear' or 'sqrt', got {self.warmup!r}")
        if self.decay not in ("linear", "polynomial", "constant"):
            raise ValueError(f"Schedule.decay must be 'linear', 'polynomial' or 'constant', got {self.decay!r}")
        if not self.power > 0:
            raise ValueError(f"Schedule.power must be > 0, got {self.power!r}")
        if self.decay == "linear" and self.power != 1.0:
            raise ValueError(f"Schedule.power is {self.power} but decay is 'linear'; use decay='polynomial'")
        if not 0 <= self.end_lr <= self.base_lr:
            raise ValueError(f"Schedule.end_lr must lie in [0, base_lr = {self.base_lr}], got {self.end_lr!r}")

    def at_fraction(self, fraction: float) -> float:
        """The rate after `fraction` (0 to 1) of the schedule: `self(fraction · total_steps)`,
        continuous in the fraction."""
        return self(min(max(fraction, 0.0), 1.0) * self.total_steps)

    def __call__(self, step: float) -> float:
        if step < 0:
            raise ValueError(f"schedule step must be >= 0, got {step}")
        if step < self.warmup_steps:
            fraction = step / self.warmup_steps
            return self.base_lr * (fraction if self.warmup == "linear" else math.sqrt(fraction))
        if self.decay == "constant":
            return self.base_lr
        span = self.total_steps - self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / span) if span > 0 else 1.0
        power = 1.0 if self.decay == "linear" else self.power
        return self.end_lr + (self.base_lr - self.end_lr) * (1.0 - progress) ** power


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Writes `lr` into every parameter group of `optimizer` (call before each step)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
