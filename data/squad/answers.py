"""From span logits to answers: the n-best spans of each question, the null answer of SQuAD
v2.0 and its operating threshold (see the package docstring)."""
from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from data.squad.features import feature_arrays
from data.squad.reading import Example, Feature
from data.squad.scoring import evaluate, raw_scores_v2


@dataclass(frozen=True)
class Prediction:
    """The best span of a question: its text, character span in the context, the
    probability among the n-best spans, and the null score minus the span's score
    (SQuAD v2.0: above the tuned threshold, the question is answered with "")."""

    text: str
    start: int | None
    end: int | None
    probability: float
    null_odds: float


def span_logits(features: Sequence[Feature], run, batch_size: int = 32,
                progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) logits (F, S) of every feature from any runtime: `run({input_ids,
    segment_ids, input_mask})` returns the (start, end) logits of a batch; features are
    run `batch_size` at a time."""
    from tqdm import tqdm

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch size must be a positive integer, got {batch_size!r}")
    arrays = feature_arrays(features)
    starts, ends = [], []
    for i in tqdm(range(0, len(features), batch_size), desc="SQuAD", unit="batch", disable=not progress):
        batch = {k: arrays[k][i : i + batch_size] for k in ("input_ids", "segment_ids", "input_mask")}
        start, end = run(batch)
        starts.append(np.asarray(start, np.float32))
        ends.append(np.asarray(end, np.float32))
    width = arrays["input_ids"].shape[1] if features else 0
    if not starts:
        return np.zeros((0, width), np.float32), np.zeros((0, width), np.float32)
    return np.concatenate(starts), np.concatenate(ends)


def postprocess(
    examples: Sequence[Example],
    features: Sequence[Feature],
    start_logits,
    end_logits,
    n_best: int = 20,
    max_answer_length: int = 30,
) -> dict[str, str]:
    """Best answer text per question id from per-feature start/end logits (F, S)."""
    return nbest_predictions(examples, features, start_logits, end_logits, n_best, max_answer_length)[0]


def nbest_predictions(
    examples: Sequence[Example],
    features: Sequence[Feature],
    start_logits,
    end_logits,
    n_best: int = 20,
    max_answer_length: int = 30,
    details: bool = False,
):
    """(best text per question id, up to `n_best` distinct answers per id), as BERT's
    run_squad.py writes predictions.json and nbest_predictions.json.

    A candidate is a start among the `n_best` highest start logits of a window and an end
    among its `n_best` highest end logits: context tokens only, the start where the token
    has its max context, end ≥ start, at most `max_answer_length` tokens; its score is the
    sum of the two logits. The n-best list keeps the best score of each distinct text, with
    softmax probabilities over the list. The null score of a question is the lowest
    [CLS]+[CLS] score over its windows; `details` returns `Prediction`s (span, probability
    and null score minus best span score) in place of the texts.
    """
    start_logits = np.asarray(start_logits, dtype=np.float64)
    end_logits = np.asarray(end_logits, dtype=np.float64)
    if start_logits.shape != end_logits.shape or start_logits.shape[0] != len(features):
        raise ValueError(
            f"logits of shape {start_logits.shape} / {end_logits.shape} do not match {len(features)} features"
        )
    by_example: dict[int, list[int]] = collections.defaultdict(list)
    for i, f in enumerate(features):
        by_example[f.example_index].append(i)
    predictions: dict = {}
    nbest: dict[str, list[dict]] = {}
    for ex_index, ex in enumerate(examples):
        # text → (score, start logit, end logit, character start, character end)
        best: dict[str, tuple[float, float, float, int, int]] = {}
        null = None
        for fi in by_example.get(ex_index, []):
            f = features[fi]
            s_log, e_log = start_logits[fi], end_logits[fi]
            null = s_log[0] + e_log[0] if null is None else min(null, s_log[0] + e_log[0])
            starts = np.argsort(-s_log, kind="stable")[:n_best]
            ends = np.argsort(-e_log, kind="stable")[:n_best]
            for s in starts:
                if s >= len(f.offsets) or f.offsets[s] is None or not f.max_context[s]:
                    continue
                for e in ends:
                    if e >= len(f.offsets) or f.offsets[e] is None or e < s or e - s + 1 > max_answer_length:
                        continue
                    score = s_log[s] + e_log[e]
                    a, b = f.offsets[s][0], f.offsets[e][1]
                    text = ex.context[a:b]
                    if text not in best or score > best[text][0]:
                        best[text] = (score, float(s_log[s]), float(e_log[e]), a, b)
        ranked = sorted(best.items(), key=lambda kv: -kv[1][0])[:n_best]
        if not ranked:
            ranked = [("", (0.0, 0.0, 0.0, None, None))]
        scores = np.array([v[0] for _, v in ranked])
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        text, (score, _, _, a, b) = ranked[0]
        null_odds = float(null - score) if null is not None and a is not None else float("inf")
        predictions[ex.qas_id] = Prediction(text, a, b, float(probs[0]), null_odds) if details else text
        nbest[ex.qas_id] = [
            {"text": t, "probability": float(p), "start_logit": v[1], "end_logit": v[2]}
            for (t, v), p in zip(ranked, probs)
        ]
    return predictions, nbest


def apply_null_threshold(predictions: Mapping[str, Prediction], threshold: float | None) -> dict[str, str]:
    """Texts of `predictions`; with a threshold (SQuAD v2.0), "" where the null score beats
    the best span by more than it (BERT's run_squad.py `null_score_diff_threshold`)."""
    return {qid: "" if threshold is not None and p.null_odds > threshold else p.text
            for qid, p in predictions.items()}


# The one path from span logits to answers and scores, whichever runtime made the logits
# (the training session's forward during fine-tuning, onnxruntime in infer.py).

# How far outside the dev odds the threshold of "answer nothing" / "answer everything" lies.
_END_MARGIN = 1.0


@dataclass(frozen=True)
class Answers:
    """What span logits answer, and how the answers score.

    `texts`: the answer of each question ("" where the null answer wins: SQuAD v2.0);
    `details`: each question's best span (`Prediction`, with its null odds); `nbest`: the
    n-best list per question (nbest_predictions.json); `scores`: the official figures of
    `texts` (None when no question has gold answers), and for a v2.0 set also the official
    threshold search's `best_exact(_thresh)` / `best_f1(_thresh)` and the `null_threshold`
    applied; `null_threshold`: the threshold on null odds `texts` follow (None: a span is
    always given)."""

    texts: dict[str, str]
    details: dict[str, Prediction]
    nbest: dict[str, list[dict]]
    scores: dict[str, float] | None
    null_threshold: float | None

    @property
    def null_odds(self) -> dict[str, float]:
        """{question id: null score − best span score} (evaluate-v2.0.py's --na-prob-file)."""
        return {q: p.null_odds for q, p in self.details.items()}


def answer_questions(
    examples: Sequence[Example],
    features: Sequence[Feature],
    start_logits,
    end_logits,
    *,
    null_threshold: float | None = None,
    tune_null_threshold: bool = False,
    n_best: int = 20,
    max_answer_length: int = 30,
) -> Answers:
    """Answers and official scores from per-feature span logits (F, S).

    `null_threshold` answers "" where a question's null odds exceed it. With
    `tune_null_threshold` on a set with unanswerable questions (a v2.0 dev file), it is
    chosen first: `operating_null_threshold`, the best F1 these odds can give.
    """
    details, nbest = nbest_predictions(examples, features, start_logits, end_logits, n_best, max_answer_length,
                                       details=True)
    version_2 = any(e.is_impossible for e in examples)
    if tune_null_threshold and version_2:
        null_threshold = operating_null_threshold(examples, details)
    texts = apply_null_threshold(details, null_threshold)
    if not any(e.graded for e in examples):
        return Answers(texts, details, nbest, None, null_threshold)
    scores = evaluate(examples, texts)
    if version_2:  # the official search on the spans before any threshold, as evaluate-v2.0.py reports it
        spans = apply_null_threshold(details, None)
        official = evaluate(examples, spans, na_probs={q: p.null_odds for q, p in details.items()})
        scores.update({k: v for k, v in official.items() if k.startswith("best_")})
        if null_threshold is not None:
            scores["null_threshold"] = null_threshold
    return Answers(texts, details, nbest, scores, null_threshold)


def operating_null_threshold(examples: Sequence[Example], details: Mapping[str, Prediction]) -> float | None:
    """The threshold on null odds that gives the best F1 on the graded `examples`.

    Every threshold the odds can tell apart is tried: below every odds (every question
    answered ""), between each two consecutive distinct odds, and above every odds (every
    question answered with its span). The official search (`best_null_threshold`) walks the
    same answers but reports, when answering nothing is best, its start value 0.0: a
    probability's floor, which on log-odds may lie anywhere among them. Between two odds
    the threshold is their midpoint, and beyond the ends it lies 1.0 outside, so float
    noise in another runtime does not flip a question. Ties keep the fewer answers, as the
    official search does. None when no graded question has a span.
    """
    graded = [e for e in examples if e.graded and e.qas_id in details]
    spans = {e.qas_id: details[e.qas_id].text for e in graded}
    _, f1_span = raw_scores_v2(graded, spans)
    _, f1_null = raw_scores_v2(graded, {q: "" for q in spans})
    gains: dict[float, float] = collections.defaultdict(float)  # answering a question instead of ""
    for q in spans:
        odds = details[q].null_odds
        if np.isfinite(odds):
            gains[odds] += f1_span[q] - f1_null[q]
    if not gains:
        return None
    odds = sorted(gains)
    total = best = 0.0
    cut = 0  # how many distinct odds, lowest first, are answered
    for k, value in enumerate(odds, 1):
        total += gains[value]
        if total > best:
            best, cut = total, k
    if cut == 0:
        return float(odds[0] - _END_MARGIN)
    if cut == len(odds):
        return float(odds[-1] + _END_MARGIN)
    return float((odds[cut - 1] + odds[cut]) / 2)
