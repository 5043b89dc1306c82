"""The run loop's checkpoints: when to write one, the run's best evaluation, the last good one.

- `checkpoint-<step>` every `checkpoint.every` steps and when a signal stops the run,
  `checkpoint-final` at the end; each holds the weights, the optimizer and the data position
  (a checkpoint's format: session/checkpoint.py), the run's training seconds and the batch it
  was trained with (bert/run/elastic.py);
- an evaluation better than every earlier one is the run's best: `best.json` names the
  checkpoint holding its weights (the step's own, else `checkpoint-best`, written then and
  replaced by the next best; with `checkpoint.save_best` off, best.json says it was not saved);
- the last good checkpoint is what an error that ends the run points to.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from bert.config import CheckpointConfig
from bert.run.progress import Clock
from bert.run.rundir import BEST_CHECKPOINT, RunDirectory, improves
from session.training import TrainingSession

__all__ = ["Checkpointer"]


class Checkpointer:
    """Checkpoints and best.json of one run (collective: every process calls every method; rank
    0 writes best.json)."""

    def __init__(self, settings: CheckpointConfig, session: TrainingSession, run_dir: RunDirectory, stream, clock: Clock,
                 best_metric: Optional[tuple[str, bool]], best: Optional[dict], batch: dict[str, int]):
        self.session, self.stream, self.clock, self.batch = session, stream, clock, batch
        self.run_dir, self.output_dir = run_dir, run_dir.path
        self.every, self.save_best = settings.every, settings.save_best
        self.best_metric, self.best = best_metric, best
        self.lead = session.topology.rank == 0
        self.last_good: Optional[Path] = run_dir.checkpoint  # what the run can resume from
        self.final: Optional[Path] = None

    def should_save(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0)

    def save_step(self, step: int, last: bool, figures: dict[str, float]) -> Path:
        """The step's checkpoint: checkpoint-final at the end, else checkpoint-<step>."""
        saved = self.save("checkpoint-final" if last else f"checkpoint-{step}", figures)
        if last:
            self.final = saved
        else:
            self.last_good = saved
        return saved

    def save(self, name: str, figures: dict[str, float]) -> Path:
        """Write checkpoint `name` with the evaluation `figures` of its step; its path."""
        extra = {"data": self.stream.state_dict() if self.stream is not None else {}, "evaluation": figures,
                 "train_seconds": self.clock.seconds, "batch": self.batch}
        try:
            self.session.save(self.output_dir / name, extra)  # raises on every process when any one fails
        except ValueError as e:
            earlier = self.last_good if self.last_good is not None and self.last_good.name != name else None
            raise type(e)(f"{e}; " + (f"the run can resume from {earlier} (--checkpoint-input {earlier})"
                                      if earlier else "this run has no earlier checkpoint to resume from")) from None
        return self.output_dir / name

    def keep_best(self, figures: dict[str, float], saved: Optional[Path]) -> None:
        """After an evaluation: if it beats every earlier one, best.json names the checkpoint
        holding its weights (`saved`, the step's own checkpoint, else checkpoint-best)."""
        if not figures or self.best_metric is None:
            return
        if not self.session.broadcast(improves(self.best, figures, self.best_metric) if self.lead else None):
            return
        step, note = self.session.step, ""
        if saved is None and self.save_best and self.session.weights_are_finite():
            saved = self.save(BEST_CHECKPOINT, figures)
        elif saved is None:
            note = (f"not saved: step {step} wrote no checkpoint and checkpoint.save_best is "
                    + ("off" if not self.save_best else "on but its weights are not finite"))
        if self.lead:
            previous = self.best
            self.best = self.run_dir.record_best(saved.name if saved is not None else None, step, figures,
                                                 self.best_metric, note)
            if previous is not None and previous["checkpoint"] == BEST_CHECKPOINT and (
                    saved is None or saved.name != BEST_CHECKPOINT):
                _remove_superseded(self.output_dir / BEST_CHECKPOINT)


def _remove_superseded(directory: Path) -> None:
    """Remove a checkpoint best.json no longer names (renamed to a name `recover` tidies first)."""
    aside = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    try:
        directory.rename(aside)
        shutil.rmtree(aside)
    except OSError as e:
        print(f"note: could not remove {directory}, which best.json no longer names ({e.strerror})", flush=True)
