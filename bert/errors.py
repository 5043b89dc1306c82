"""How a run can end other than by finishing: raised by every process alike (`collective`),
so the launch context lets them through instead of stopping the others (session.distributed)."""
from __future__ import annotations

__all__ = ["RunInterrupted", "RunRefused", "TrainingDiverged"]


class TrainingDiverged(RuntimeError):
    """The loss or the gradients stopped being finite and did not recover."""

    collective = True  # decided from all-reduced values: every process raises it


class RunInterrupted(RuntimeError):
    """A signal stopped the run after a step; `signal` is its number."""

    collective = True

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signal = signum


class RunRefused(ValueError):
    """Rank 0 refused the run before it started (a run directory in use, a checkpoint that does
    not fit): every process raises it with rank 0's message."""

    collective = True
