"""The unigram plateau: what a masked-LM scores that has learned token frequencies and nothing else.

A small model on real text first learns to answer the most frequent token ("the") at every
mask, and may stay there for hundreds of steps; its MLM accuracy is then far above chance
(1 / vocab) while it knows nothing of the text. So every held-out evaluation of pre-training is
read against this baseline, measured on the same held-out targets:

- `accuracy`: of always answering the training targets' most frequent token;
- `loss`: the cross-entropy (nats) of the held-out targets under the training targets' unigram
  distribution, add-one smoothed over the vocab (an unseen token costs a finite loss);
- `train_accuracy`: that token's share of the training targets (the same baseline for the
  training batches' MLM accuracy).

The counts are of the training shards' masked-LM targets (the loader counts them as it checks
the shards; [UNK] never counts, data.masking), so the baseline is free and needs no vocab file.

A model is **on the plateau** while its held-out MLM accuracy is below `PLATEAU_FACTOR` times
the baseline's; a run still there after `WARN_AFTER` of its steps is warned once, with what
usually helps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

__all__ = ["PLATEAU_FACTOR", "WARN_AFTER", "Unigram", "on_plateau", "unigram_baseline"]

PLATEAU_FACTOR = 1.5  # on the plateau: held-out MLM accuracy below 1.5× the baseline's
WARN_AFTER = 0.5  # the share of a run's steps after which a run still on the plateau is warned

_ACCURACY, _LOSS = "eval_mlm_accuracy", "eval_mlm_loss"


def on_plateau(accuracy: float, baseline: float) -> bool:
    """Whether a held-out MLM accuracy is on the plateau of a baseline accuracy."""
    return accuracy < PLATEAU_FACTOR * baseline


@dataclass(frozen=True)
class Unigram:
    """The unigram baseline of a held-out set (see the module docstring)."""

    accuracy: float
    loss: float
    train_accuracy: float
    token: str  # the most frequent training target, as the vocab writes it (or its id)
    targets: int  # held-out targets scored

    def figures(self) -> dict[str, float]:
        """The baseline of each held-out figure it has one for."""
        return {_ACCURACY: self.accuracy, _LOSS: self.loss}

    def record(self) -> dict[str, float]:
        """Its keys in a metrics record (metrics.jsonl, W&B)."""
        return {"unigram_mlm_accuracy": round(self.accuracy, 6), "unigram_mlm_loss": round(self.loss, 6)}

    def on_plateau(self, accuracy: float) -> bool:
        return on_plateau(accuracy, self.accuracy)

    def verdict(self, figures: dict[str, float]) -> Optional[str]:
        """Held-out figures against the baseline in words; None without an MLM accuracy."""
        if _ACCURACY not in figures:
            return None
        accuracy = figures[_ACCURACY]
        where = "on the unigram plateau" if self.on_plateau(accuracy) else "past the unigram plateau"
        loss = f", MLM loss {figures[_LOSS]:.3f} against {self.loss:.3f}" if _LOSS in figures else ""
        return (f"held-out MLM accuracy {accuracy:.3f} = {accuracy / max(self.accuracy, 1e-12):.2f}× the unigram "
                f"baseline {self.accuracy:.3f} (always {self.token!r}){loss}: {where}")

    def warning(self, figures: dict[str, float], step: int, share: float, architecture: str = "bert"
                ) -> Optional[str]:
        """The plateau warning of an evaluation at `step`, `share` of the run's way through, of a
        run of `architecture`; None while it is not due."""
        if share < WARN_AFTER or _ACCURACY not in figures or not self.on_plateau(figures[_ACCURACY]):
            return None
        loss = figures.get(_LOSS)
        if loss is not None and loss > self.loss:
            learned = (f"its MLM loss {loss:.3f} is still above the unigram's {self.loss:.3f}: it has not yet "
                       "learned even the token frequencies")
        else:
            learned = "the model has learned token frequencies and little else"
        other = (", or GroupBERT, which leaves the plateau sooner than BERT" if architecture == "bert" else "")
        return (f"warning: at step {step} ({share:.0%} of the run) the held-out MLM accuracy "
                f"{figures[_ACCURACY]:.3f} is below {PLATEAU_FACTOR:g}× the unigram baseline {self.accuracy:.3f} "
                f"(always answering {self.token!r}): {learned}. What usually helps: a lower "
                "optimizer.learning_rate (LAMB above about 0.01 can stay here), a longer warm-up "
                f"(schedule.warmup_steps), more steps{other} (docs/data.md, \"Your own corpus\": a recipe that "
                "leaves it on 2 cores)")


def unigram_baseline(train_counts: np.ndarray, held_out: Sequence[np.ndarray],
                     vocab: Optional[Sequence[str]] = None) -> Optional[Unigram]:
    """The baseline of the held-out targets `held_out` (each an array of token ids) under the
    training targets' counts `train_counts` (indexed by id); None when either is empty."""
    targets = np.concatenate([np.asarray(t, np.int64).ravel() for t in held_out]) if held_out else np.zeros(0, int)
    total = int(train_counts.sum())
    if not total or not targets.size:
        return None
    size = max(len(train_counts), int(targets.max()) + 1)
    counts = np.zeros(size, np.float64)
    counts[: len(train_counts)] = train_counts
    top = int(np.argmax(counts))
    log_p = np.log(counts + 1.0) - math.log(total + size)
    return Unigram(accuracy=float(np.mean(targets == top)), loss=float(-log_p[targets].mean()),
                   train_accuracy=float(counts[top] / total),
                   token=vocab[top] if vocab is not None and top < len(vocab) else str(top), targets=int(targets.size))
