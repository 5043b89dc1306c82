"""Scoring as the official evaluation scripts do (see the package docstring)."""
from __future__ import annotations

import collections
import re
import string
from collections.abc import Mapping, Sequence
from pathlib import Path

from data.squad.reading import Example, SquadData, parse_articles, load_squad


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Official SQuAD normalisation (v1.1 and v2.0 alike): lower case, drop punctuation,
    drop articles, collapse white space (in that order)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match_score(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    """Official v1.1 token F1 (0 when nothing is shared, empty lists included)."""
    pred = normalize_answer(prediction).split()
    ref = normalize_answer(gold).split()
    common = collections.Counter(pred) & collections.Counter(ref)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred), overlap / len(ref)
    return 2 * precision * recall / (precision + recall)


def f1_score_v2(prediction: str, gold: str) -> float:
    """Official v2.0 token F1: as v1.1, except that when either side has no tokens the
    score is 1 if both have none (a correct "no answer"), else 0."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    return f1_score(prediction, gold)


def _examples(dataset) -> tuple[list[Example], bool]:
    """(examples, is a v2.0 file) of a path, parsed JSON, its data list, SquadData or Examples."""
    if isinstance(dataset, SquadData):
        return dataset.examples, dataset.version_2
    if isinstance(dataset, (str, Path)):
        data = load_squad(dataset)
        return data.examples, data.version_2
    if isinstance(dataset, Mapping):
        if not isinstance(dataset.get("data"), list):
            raise ValueError("dataset: not a SQuAD file (no top-level 'data' list)")
        data = parse_articles(dataset["data"], "dataset")
        return data.examples, data.version_2
    dataset = list(dataset)
    if dataset and isinstance(dataset[0], Mapping):
        data = parse_articles(dataset, "dataset")
        return data.examples, data.version_2
    return dataset, any(e.is_impossible for e in dataset)


def evaluate(dataset, predictions: Mapping[str, str], na_probs: Mapping[str, float] | None = None,
             na_prob_thresh: float = 1.0) -> dict[str, float]:
    """Scores (percent) of `predictions` {question id: text} under the official definition.

    `dataset` is a SQuAD JSON path, its parsed dict, its `["data"]` list of articles (the
    official script's `evaluate(dataset_json["data"], predictions)`), SquadData, or
    Examples. Only the answer texts count, never their offsets; questions without gold
    answers are not scored. A v1.1 file gives {exact_match, f1}; a file with unanswerable
    questions the v2.0 script's figures (module docstring). With `na_probs` {id: no-answer
    score}, as the v2.0 script with `--na-prob-file`: a question whose score is above
    `na_prob_thresh` counts as answered "no answer", and the best thresholds are searched.
    """
    examples, version_2 = _examples(dataset)
    graded = [e for e in examples if e.graded]
    if not graded:
        raise ValueError("no questions with gold answers to score (the file has questions only); "
                         "the answers are printed and written, not scored")
    if not version_2:
        em = f1 = 0.0
        for ex in graded:
            if ex.qas_id not in predictions:
                continue  # the official script scores a missing prediction as 0
            pred = predictions[ex.qas_id]
            em += max(exact_match_score(pred, g) for g in ex.answers)
            f1 += max(f1_score(pred, g) for g in ex.answers)
        return {"exact_match": 100.0 * em / len(graded), "f1": 100.0 * f1 / len(graded)}
    has_answer = {e.qas_id: bool(e.answers) for e in graded}
    exact, f1 = raw_scores_v2(graded, predictions)
    if na_probs is not None:  # the script's apply_no_ans_threshold
        exact_t, f1_t = ({q: float(not has_answer[q]) if na_probs.get(q, 0.0) > na_prob_thresh else v
                          for q, v in raw.items()} for raw in (exact, f1))
    else:
        exact_t, f1_t = exact, f1
    scores = _mean_scores(exact_t, f1_t, list(has_answer))
    for name, wanted in (("HasAns", True), ("NoAns", False)):
        ids = [q for q, h in has_answer.items() if h is wanted]
        if ids:
            scores.update({f"{name}_{k}": v for k, v in _mean_scores(exact_t, f1_t, ids).items()})
    if na_probs is not None:
        for key, raw in (("exact", exact), ("f1", f1)):
            best, thresh = best_null_threshold(predictions, raw, na_probs, has_answer)
            scores[f"best_{key}"], scores[f"best_{key}_thresh"] = best, thresh
    return scores


def raw_scores_v2(graded: Sequence[Example], predictions: Mapping[str, str]) -> tuple[dict, dict]:
    """Per-question exact match and F1 by qas_id, as the SQuAD v2.0 script's get_raw_scores."""
    exact, f1 = {}, {}
    for ex in graded:
        golds = [a for a in ex.answers if normalize_answer(a)] or [""]
        pred = predictions.get(ex.qas_id)
        if pred is None:  # the v2.0 script stops on a missing prediction; scored 0 here, as v1.1 does
            exact[ex.qas_id] = f1[ex.qas_id] = 0.0
            continue
        exact[ex.qas_id] = max(exact_match_score(pred, g) for g in golds)
        f1[ex.qas_id] = max(f1_score_v2(pred, g) for g in golds)
    return exact, f1


def _mean_scores(exact: Mapping[str, float], f1: Mapping[str, float], ids: Sequence[str]) -> dict[str, float]:
    return {"exact": 100.0 * sum(exact[i] for i in ids) / len(ids), "f1": 100.0 * sum(f1[i] for i in ids) / len(ids),
            "total": len(ids)}


def best_null_threshold(predictions: Mapping[str, str], raw: Mapping[str, float], na_probs: Mapping[str, float],
                        has_answer: Mapping[str, bool]) -> tuple[float, float]:
    """(best score, its threshold) as evaluate-v2.0.py's `find_best_thresh` computes them.

    Start from every question answered "" (the unanswerable ones right); walk the
    questions in increasing no-answer score, answering each with its text: an answerable
    one adds its raw score, an unanswerable one answered with text takes 1 away. The best
    running total gives the score, the no-answer score where it was reached the threshold.
    """
    score = current = float(sum(not h for h in has_answer.values()))
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda q: na_probs[q]):
        if qid not in raw:
            continue
        if has_answer[qid]:
            current += raw[qid]
        elif predictions.get(qid):
            current -= 1
        if current > score:
            score, best_thresh = current, na_probs[qid]
    return 100.0 * score / len(raw), float(best_thresh)
