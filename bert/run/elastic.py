"""A resume with another number of replicas keeps the run's global batch.

    config, note = keep_global_batch(config, checkpoint, replicas)

A run's global batch is micro batch × gradient accumulation × replicas, and its learning-
rate schedule, its data position and its budget are all counted in steps of that batch.
When a checkpoint is resumed by another number of replicas (torchrun `--nnodes 1:2` after
losing a node, or a resume by hand on fewer machines), the step must stay what it was:
with `batch.keep_global_batch` (the default) the gradient accumulation changes so that
micro batch × accumulation × replicas is the checkpoint's global batch again, said in one
line; where no whole accumulation does it, the resume is refused, naming the replica
counts that work. With `keep_global_batch` false the batch follows the processes, and
`bert.run.rundir.plan_run` makes the resume a branch that records the change in branch.json.

Every process computes the same answer from the checkpoint (its `extra["batch"]`, written
by bert/run/checkpointing.py; for checkpoints written before that, the run's config.json and
the checkpoint's topology), before the data stream or the session is built.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from bert.config import Config
from session import checkpoint as checkpoints

__all__ = ["SavedBatch", "batch_record", "keep_global_batch", "saved_batch"]


@dataclass(frozen=True)
class SavedBatch:
    """The batch a checkpoint was trained with."""

    micro_batch_size: int
    gradient_accumulation: int
    replicas: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation * self.replicas

    def describe(self) -> str:
        return (f"global batch {self.global_batch} = micro batch {self.micro_batch_size} × gradient accumulation "
                f"{self.gradient_accumulation} × {self.replicas} replica(s)")


def batch_record(config: Config, replicas: int) -> dict[str, int]:
    """What a checkpoint records of the batch it was trained with (its `extra["batch"]`)."""
    return {"micro_batch_size": config.batch.micro_batch_size,
            "gradient_accumulation": config.batch.gradient_accumulation, "replicas": replicas}


def saved_batch(checkpoint: Path) -> Optional[SavedBatch]:
    """The batch `checkpoint` was trained with; None where nothing says (an older checkpoint
    outside its run directory)."""
    state = checkpoints.read_state(checkpoint)
    recorded = state.per_rank[0].get("extra", {}).get("batch") if state.per_rank else None
    if isinstance(recorded, dict):
        try:
            return SavedBatch(int(recorded["micro_batch_size"]), int(recorded["gradient_accumulation"]),
                              int(recorded["replicas"]))
        except (KeyError, TypeError, ValueError):
            pass
    try:  # written before checkpoints recorded it: the run's config with the checkpoint's topology
        batch = json.loads((checkpoint.parent / "config.json").read_text())["batch"]
        return SavedBatch(int(batch["micro_batch_size"]), int(batch["gradient_accumulation"]),
                          int(state.topology.get("replicas", 1)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def keep_global_batch(config: Config, checkpoint: Optional[Path], replicas: int) -> tuple[Config, str]:
    """`config` with the gradient accumulation that gives `replicas` the global batch of
    `checkpoint`, and the line that says so ("" when nothing changes); a ValueError naming
    the replica counts that work when none does."""
    saved = saved_batch(checkpoint) if checkpoint is not None else None
    if saved is None or saved.replicas == replicas or not config.batch.keep_global_batch:
        return config, ""
    micro, accumulation = config.batch.micro_batch_size, config.batch.gradient_accumulation
    if micro * accumulation * replicas == saved.global_batch:
        return config, ""
    rows = saved.global_batch // micro if saved.global_batch % micro == 0 else 0
    if rows and rows % replicas == 0:
        kept = rows // replicas
        batch = config.batch.model_copy(update={"gradient_accumulation": kept})
        line = (f"note: {checkpoint} was trained with {saved.describe()}; with {replicas} replica(s) the gradient "
                f"accumulation is {kept} (the config says {accumulation}) to keep that global batch, so the "
                "learning-rate schedule and the data position mean what they meant (set batch.keep_global_batch "
                "false to train on with the config's batch instead, as a branch)")
        return config.model_copy(update={"batch": batch}), line
    fits = [r for r in range(1, rows + 1) if rows % r == 0] if rows else []
    counts = ", ".join(f"{r} (accumulation {rows // r})" for r in fits[:8]) or "none at this micro batch"
    raise ValueError(
        f"{checkpoint} was trained with {saved.describe()}, which {replicas} replicas of micro batch {micro} cannot "
        f"make: resume with a replica count that divides it: {counts}; or set batch.keep_global_batch false to "
        f"train on with global batch {micro * accumulation * replicas} (a branch of the run)")
