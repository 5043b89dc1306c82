"""bert.tasks.metrics against references written here from the definitions (numpy), not against the
library calls it makes: accuracy, F1 from TP/FP/FN, Gorodkin's R_K, Pearson from covariance,
Spearman as Pearson of average ranks, entity F1 from spans cut by an IOB2 chunker below."""
from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import scipy.stats
import seqeval.metrics

from bert.tasks.metrics import classification_scores, entity_scores, json_figures, regression_scores

TYPES = ("PER", "LOC", "ORG")


def _quietly(score, *args):
    """`score(*args)`, failing if any warning escapes to the console."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return score(*args)


def _close(actual: dict, expected: dict):
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert actual[name] == pytest.approx(value, rel=1e-9, abs=1e-12, nan_ok=True), \
            f"{name}: {actual[name]!r} != reference {value!r}"


def _f1(tp: int, fp: int, fn: int) -> float:
    """2PR/(P+R) = 2TP/(2TP+FP+FN); 0 where nothing was predicted or gold (zero_division=0)."""
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


def _classification_reference(p: np.ndarray, g: np.ndarray, k: int) -> dict:
    confusion = np.zeros((k, k), np.int64)  # (gold, predicted)
    np.add.at(confusion, (g, p), 1)
    tp = np.diag(confusion)
    fp, fn = confusion.sum(0) - tp, confusion.sum(1) - tp
    if k == 2:
        f1 = _f1(tp[1], fp[1], fn[1])
    else:  # sklearn scores a label absent from gold and predictions alike 0 (checked below)
        f1 = np.mean([_f1(*counts) for counts in zip(tp, fp, fn)])
    # Gorodkin (2004), R_K = (c s - t.p) / sqrt((s^2 - p.p)(s^2 - t.t)), 0 where undefined.
    s, c, t, q = confusion.sum(), np.trace(confusion), confusion.sum(1), confusion.sum(0)
    denominator = math.sqrt(float(s * s - q @ q) * float(s * s - t @ t))
    mcc = float(c * s - t @ q) / denominator if denominator else 0.0
    return {"accuracy": np.mean(p == g), "f1": f1, "matthews_correlation": mcc}


@pytest.mark.parametrize("num_labels", [2, 3, 5])
@pytest.mark.parametrize("n", [1, 7, 60, 1001])
def test_classification_matches_definitions(n, num_labels):
    rng = np.random.default_rng(n * 10 + num_labels)
    gold = rng.integers(0, num_labels, n)
    # Mostly right, so that the figures are far from chance and from each other.
    predicted = np.where(rng.random(n) < 0.6, gold, rng.integers(0, num_labels, n))
    _close(_quietly(classification_scores, predicted, gold, num_labels),
           _classification_reference(predicted, gold, num_labels))


@pytest.mark.parametrize("num_labels", [2, 3, 5])
@pytest.mark.parametrize("label", [0, 1])
def test_classification_one_class_only(label, num_labels):
    only = np.full(9, label)
    scores = _quietly(classification_scores, only, only, num_labels)
    # Binary F1 of label 1 is 1 when every example is a correct 1; the macro average counts the
    # labels absent from both sides 0, as sklearn does: only one label of num_labels scores.
    f1 = float(label == 1) if num_labels == 2 else 1 / num_labels
    assert scores == {"accuracy": 1.0, "f1": f1, "matthews_correlation": 0.0}
    _close(scores, _classification_reference(only, only, num_labels))


@pytest.mark.parametrize("num_labels", [2, 3, 5])
def test_classification_label_never_predicted(num_labels):
    rng = np.random.default_rng(num_labels)
    gold = rng.integers(0, num_labels, 40)
    predicted = np.where(gold == num_labels - 1, 0, gold)  # the last label is never predicted
    _close(_quietly(classification_scores, predicted, gold, num_labels),
           _classification_reference(predicted, gold, num_labels))


@pytest.mark.parametrize("predicted, gold, num_labels, message", [
    (np.array([], int), np.array([], int), 3, "no predictions to score"),
    (np.array([0, 1]), np.array([0]), 2, "one length"),
    (np.array([0, 3]), np.array([0, 1]), 3, r"outside \[0, 3\)"),
    (np.array([0.0, 1.0]), np.array([0, 1]), 2, "int label ids"),
])
def test_classification_refuses(predicted, gold, num_labels, message):
    with pytest.raises(ValueError, match=message):
        classification_scores(predicted, gold, num_labels)


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x - x.mean(), y - y.mean()
    return float(np.mean(x * y) / (x.std() * y.std()))


@pytest.mark.parametrize("n", [2, 3, 50, 1000])
def test_regression_matches_definitions(n):
    rng = np.random.default_rng(n)
    gold = np.round(rng.uniform(0, 5, n), 1)  # rounded: ties for the average ranks
    predicted = np.round(gold + rng.normal(0, 1, n), 1)
    if n == 2:
        predicted = gold + [0.0, 1.0]  # two distinct points: correlations are exactly ±1
    expected = {
        "pearson": _pearson(predicted, gold),
        "spearman": _pearson(scipy.stats.rankdata(predicted), scipy.stats.rankdata(gold)),
        "mse": float(np.mean((predicted - gold) ** 2)),
    }
    _close(_quietly(regression_scores, predicted, gold), expected)


@pytest.mark.parametrize("predicted, gold", [
    (np.full(6, 2.5), np.arange(6.0)),  # constant predictions
    (np.arange(6.0), np.full(6, 2.5)),  # constant gold
    (np.array([3.0]), np.array([1.0])),  # one pair: no correlation to speak of
])
def test_regression_undefined_correlation_is_nan(predicted, gold):
    scores = _quietly(regression_scores, predicted, gold)
    assert math.isnan(scores["pearson"]) and math.isnan(scores["spearman"])
    assert scores["mse"] == pytest.approx(np.mean((predicted - gold) ** 2))
    written = json.loads(json.dumps(json_figures(scores), allow_nan=False))
    assert written == {"pearson": None, "spearman": None, "mse": scores["mse"]}


def test_regression_refuses_empty():
    with pytest.raises(ValueError, match="no predictions to score"):
        regression_scores(np.array([]), np.array([]))


def _spans(sentences: list[list[str]]) -> set[tuple[int, str, int, int]]:
    """(sentence, type, start, end) of every entity in well-formed IOB2 tags."""
    spans = set()
    for i, tags in enumerate(sentences):
        start = None
        for j, tag in enumerate([*tags, "O"]):  # the "O" closes an entity at the end
            if start is not None and tag != f"I-{tags[start][2:]}":
                spans.add((i, tags[start][2:], start, j - 1))
                start = None
            if tag.startswith("B-"):
                start = j
    return spans


def _random_iob2(rng, length: int) -> list[str]:
    tags = []
    for _ in range(length):
        move = rng.integers(3)  # outside, begin, or (inside an entity) continue it
        if move == 2 and tags and tags[-1] != "O":
            tags.append(f"I-{tags[-1][2:]}")
        else:
            tags.append("O" if move == 0 else f"B-{TYPES[rng.integers(len(TYPES))]}")
    return tags


@pytest.mark.parametrize("sentences", [1, 5, 80])
def test_entities_match_spans(sentences):
    rng = np.random.default_rng(sentences)
    gold = [_random_iob2(rng, int(rng.integers(1, 12))) for _ in range(sentences)]
    # Half the sentences predicted anew: entities that match, shift, change type or go missing.
    predicted = [_random_iob2(rng, len(g)) if rng.random() < 0.5 else g for g in gold]
    predicted_spans, gold_spans = _spans(predicted), _spans(gold)
    hits = len(predicted_spans & gold_spans)
    precision = hits / len(predicted_spans) if predicted_spans else 0.0
    recall = hits / len(gold_spans) if gold_spans else 0.0
    expected = {"f1": _f1(hits, len(predicted_spans) - hits, len(gold_spans) - hits),
                "precision": precision, "recall": recall}
    _close(_quietly(entity_scores, predicted, gold), expected)


def test_entities_read_iob1_as_conlleval_does():
    # IOB1: I- opens an entity; B- only splits two adjacent entities of one type. Gold holds
    # PER 0-1, PER 2, LOC 4; the prediction PER 0-2, LOC 4: one hit of 2 predicted, 3 gold.
    gold = [["I-PER", "I-PER", "B-PER", "O", "I-LOC"]]
    predicted = [["I-PER", "I-PER", "I-PER", "O", "I-LOC"]]
    scores = _quietly(entity_scores, predicted, gold)
    _close(scores, {"f1": 0.4, "precision": 0.5, "recall": 1 / 3})
    assert scores["f1"] == seqeval.metrics.f1_score(gold, predicted)


@pytest.mark.parametrize("gold", [[["B-PER", "I-PER", "O"], ["O", "B-LOC"]], [["O", "O", "O"], ["O", "O"]]])
def test_entities_none_predicted_score_zero(gold):
    # With no gold entity either, the figures are 0 (seqeval's zero_division=0), not 1.
    predicted = [["O"] * len(tags) for tags in gold]
    assert _quietly(entity_scores, predicted, gold) == {"f1": 0.0, "precision": 0.0, "recall": 0.0}


@pytest.mark.parametrize("predicted, gold, message", [
    ([], [], "no sentences to score"),
    ([["O"]], [["O"], ["O"]], "1 predicted sentences against 2"),
    ([["O"], ["O", "O"]], [["O"], ["O"]], "sentence 1 has 2 predicted tags against 1"),
])
def test_entities_refuse(predicted, gold, message):
    with pytest.raises(ValueError, match=message):
        entity_scores(predicted, gold)


def test_a_model_that_learned_nothing_is_named_against_the_constant_baselines():
    """One class for every row, or an accuracy below scikit-learn's most-frequent dummy; one value,
    or a mean squared error above its mean dummy's; no entity where there are some."""
    from sklearn.dummy import DummyClassifier, DummyRegressor

    from bert.tasks.metrics import degenerate_classes, degenerate_tags, degenerate_values

    labels = ("neg", "pos", "neutral")
    gold = np.array([1, 1, 1, 0, 2, 1, 0, 1])
    majority = DummyClassifier(strategy="most_frequent").fit(np.zeros((8, 1)), gold).score(np.zeros((8, 1)), gold)
    assert degenerate_classes(np.full(8, 0), gold, labels) == "predicts one class ('neg') for all 8 dev rows"
    below = np.array([0, 1, 0, 1, 0, 0, 2, 2])  # 1 of 8 right, against the dummy's 5 of 8
    assert degenerate_classes(below, gold, labels) == (
        f"scores accuracy 0.1250, below always answering the dev set's most frequent class ('pos', {majority:.4f})")
    assert degenerate_classes(gold, gold, labels) is None

    targets = np.array([0.5, 2.0, 3.5, 1.0])
    dummy = DummyRegressor(strategy="mean").fit(np.zeros((4, 1)), targets)
    baseline = float(np.mean((dummy.predict(np.zeros((4, 1))) - targets) ** 2))
    assert degenerate_values(np.full(4, 1.7), targets) == "predicts one value (1.7) for all 4 dev rows"
    assert degenerate_values(np.array([3.5, 0.5, 1.0, 2.0]), targets).endswith(f"mean ({baseline:.4g})")
    assert degenerate_values(targets + 0.1, targets) is None

    tags = [["B-PER", "O"], ["O"]]
    assert degenerate_tags([["O", "O"], ["O"]], tags) == "predicts no entity in 2 dev sentences that hold some"
    assert degenerate_tags(tags, tags) is None and degenerate_tags([["O"]], [["O"]]) is None
