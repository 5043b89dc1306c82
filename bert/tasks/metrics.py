"""Evaluation figures of the fine-tuning tasks, computed by the libraries that define them:
scikit-learn for classification, scipy for regression, seqeval for token tagging (entities).

Every figure is a plain `float`; an undefined correlation is NaN, which `json_figures` writes
as null. Degenerate inputs follow the libraries' own conventions and never warn on the console.

A model that learned nothing of its task (one class for every dev row, below the constant
baseline, no entity predicted) is named by `degenerate_classes`, `degenerate_values` and
`degenerate_tags`: its run says so, and a comparison does not rank it.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional, Sequence

import numpy as np
import scipy.stats
import seqeval.metrics
import sklearn.metrics

__all__ = ["classification_scores", "degenerate_classes", "degenerate_tags", "degenerate_values", "entity_scores",
           "json_figures", "regression_scores"]


def _paired(predicted, gold) -> tuple[np.ndarray, np.ndarray]:
    """`predicted` and `gold` as 1-D arrays of one length, refusing empty input."""
    predicted, gold = np.asarray(predicted), np.asarray(gold)
    if predicted.ndim != 1 or predicted.shape != gold.shape:
        raise ValueError(f"predicted {predicted.shape} and gold {gold.shape} must be 1-D arrays of one length")
    if predicted.size == 0:
        raise ValueError("no predictions to score")
    return predicted, gold


def classification_scores(predicted: np.ndarray, gold: np.ndarray, num_labels: int) -> dict[str, float]:
    """`accuracy`, `f1` and `matthews_correlation` of int label ids in [0, num_labels).

    `f1` is binary F1 of label 1 when num_labels == 2 (GLUE's MRPC/QQP convention: label id 1 is
    the positive class), else the macro average over every label in range(num_labels).

    Degenerate values are scikit-learn's (zero_division=0):
    - a class's precision with no prediction of it, its recall with no gold example of it, and its
      F1 when both are undefined are 0, so a label absent from gold and predictions alike counts
      0 in the macro average, and binary F1 is 0 when label 1 is neither gold nor predicted;
    - `matthews_correlation` is 0 when gold or predictions hold one class only.
    """
    predicted, gold = _paired(predicted, gold)
    for name, labels in (("predicted", predicted), ("gold", gold)):
        if not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"{name} holds {labels.dtype} values; pass int label ids (argmax the logits first)")
        if labels.min() < 0 or labels.max() >= num_labels:
            raise ValueError(f"{name} label ids span [{labels.min()}, {labels.max()}], outside [0, {num_labels}): "
                             "check num_labels against the task's label list")
    if num_labels == 2:
        f1 = sklearn.metrics.f1_score(gold, predicted, average="binary", pos_label=1, zero_division=0)
    else:
        f1 = sklearn.metrics.f1_score(gold, predicted, average="macro", labels=range(num_labels), zero_division=0)
    with warnings.catch_warnings():
        # matthews_corrcoef takes no `labels`, so its confusion matrix warns when one class is
        # all there is; the figure is then 0 by its own convention (see the docstring).
        warnings.filterwarnings("ignore", message="A single label was found", category=UserWarning)
        mcc = sklearn.metrics.matthews_corrcoef(gold, predicted)
    return {
        "accuracy": float(sklearn.metrics.accuracy_score(gold, predicted)),
        "f1": float(f1),
        "matthews_correlation": float(mcc),
    }


def regression_scores(predicted: np.ndarray, gold: np.ndarray) -> dict[str, float]:
    """`pearson`, `spearman` correlation and mean squared error `mse` of float predictions.

    A correlation is undefined, and NaN here, when either input is constant (scipy returns NaN
    and warns ConstantInputWarning; the warning is kept off the console) or holds one value only.
    """
    predicted, gold = _paired(predicted, gold)
    predicted, gold = predicted.astype(np.float64), gold.astype(np.float64)
    pearson = spearman = float("nan")
    if predicted.size >= 2:  # scipy.stats.pearsonr refuses fewer than two pairs
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", scipy.stats.ConstantInputWarning)
            pearson = float(scipy.stats.pearsonr(predicted, gold).statistic)
            spearman = float(scipy.stats.spearmanr(predicted, gold).statistic)
    return {"pearson": pearson, "spearman": spearman, "mse": float(np.mean((predicted - gold) ** 2))}


def entity_scores(predicted: list[list[str]], gold: list[list[str]]) -> dict[str, float]:
    """Entity-level micro `f1`, `precision` and `recall` of tag sequences (seqeval's default,
    conlleval-compatible mode, which reads IOB1 and IOB2 alike; an entity counts only when its
    type, start and end all match).

    Degenerate values are seqeval's with zero_division=0: precision is 0 when no entity is
    predicted, recall 0 when there is no gold entity, and F1 0 when either is 0 — so a set with
    no gold entity and none predicted scores 0, not 1.
    """
    if len(predicted) != len(gold):
        raise ValueError(f"{len(predicted)} predicted sentences against {len(gold)} gold sentences")
    if not gold:
        raise ValueError("no sentences to score")
    for i, (p, g) in enumerate(zip(predicted, gold)):
        if len(p) != len(g):
            raise ValueError(f"sentence {i} has {len(p)} predicted tags against {len(g)} gold tags")
    return {
        name: float(score(gold, predicted, zero_division=0))
        for name, score in (("f1", seqeval.metrics.f1_score),
                            ("precision", seqeval.metrics.precision_score),
                            ("recall", seqeval.metrics.recall_score))
    }


def degenerate_classes(predicted: np.ndarray, gold: np.ndarray, labels: Sequence[str]) -> Optional[str]:
    """Why a classifier's dev predictions show it learned nothing, or None: one class for every
    row, or an accuracy below always answering the dev set's most frequent class."""
    predicted, gold = _paired(predicted, gold)
    counts = np.bincount(gold, minlength=len(labels))
    majority = counts.max() / gold.size
    accuracy = float((predicted == gold).mean())
    if np.unique(predicted).size == 1:
        return f"predicts one class ({labels[int(predicted[0])]!r}) for all {predicted.size:,} dev rows"
    if accuracy < majority:
        return (f"scores accuracy {accuracy:.4f}, below always answering the dev set's most frequent class "
                f"({labels[int(counts.argmax())]!r}, {majority:.4f})")
    return None


def degenerate_values(predicted: np.ndarray, gold: np.ndarray) -> Optional[str]:
    """Why a regressor's dev predictions show it learned nothing, or None: one value for every
    row, or a mean squared error above always predicting the dev targets' mean (their variance)."""
    predicted, gold = _paired(predicted, gold)
    predicted, gold = predicted.astype(np.float64), gold.astype(np.float64)
    if predicted.size > 1 and np.ptp(predicted) <= 1e-6 * max(np.abs(predicted).max(), 1.0):
        return f"predicts one value ({predicted[0]:.4g}) for all {predicted.size:,} dev rows"
    mse, variance = float(np.mean((predicted - gold) ** 2)), float(gold.var())
    if mse > variance:
        return f"has a mean squared error {mse:.4g}, above always predicting the dev targets' mean ({variance:.4g})"
    return None


def degenerate_tags(predicted: list[list[str]], gold: list[list[str]]) -> Optional[str]:
    """Why a tagger's dev predictions show it learned nothing, or None: no entity predicted in
    a dev set that has some."""
    if not any(t != "O" for tags in predicted for t in tags) and any(t != "O" for tags in gold for t in tags):
        return f"predicts no entity in {len(predicted):,} dev sentences that hold some"
    return None


def json_figures(scores: dict[str, float]) -> dict[str, float | None]:
    """`scores` ready for json.dump (eval_results.json): NaN and infinities become null."""
    return {name: value if math.isfinite(value) else None for name, value in scores.items()}
