"""The official SQuAD v2.0 evaluation (evaluate-v2.0.py, rajpurkar/SQuAD-explorer), written
out here from its definition, independently of data/squad/, as the tests' reference.

Its definition, step by step:
- normalise: lower case; drop every character of `string.punctuation`; replace the
  words a/an/the (regex `\\b(a|an|the)\\b`) by a space; split on white space and join
  with one space;
- gold answers of a question: the texts of `qa["answers"]` that normalise to something
  non-empty, or [""] when there are none (an unanswerable question);
  has-answer: `bool(qa["answers"])`;
- exact: max over golds of (normalised prediction == normalised gold);
- F1 over the tokens of the normalised texts: if either list is empty, 1 if both are,
  else 0; otherwise the harmonic mean of precision and recall of the shared tokens
  (a multiset intersection), 0 when nothing is shared; max over golds;
- with no-answer probabilities and a threshold (default 1.0): a question whose
  probability is above it scores float(not has-answer);
- figures: mean × 100 over all questions (`exact`, `f1`, `total`), over the answerable
  ones (`HasAns_*`) and the unanswerable ones (`NoAns_*`), each group only when it has
  questions;
- best threshold (with probabilities): start at the count of unanswerable questions;
  for questions sorted by probability (Python's stable sort of the probability dict's
  keys), add the raw score of an answerable one, subtract 1 for an unanswerable one
  whose prediction is non-empty, else add 0; keep the best running total and the
  probability where it was reached (0.0 at first); report 100 × best / questions.
"""
from __future__ import annotations

import collections
import re
import string


def normalize(text):
    text = text.lower()
    text = "".join(c for c in text if c not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def tokens(text):
    return normalize(text).split() if text else []


def exact(gold, pred):
    return int(normalize(gold) == normalize(pred))


def f1(gold, pred):
    g, p = tokens(gold), tokens(pred)
    if not g or not p:
        return int(g == p)
    shared = sum((collections.Counter(g) & collections.Counter(p)).values())
    if shared == 0:
        return 0
    precision, recall = shared / len(p), shared / len(g)
    return 2 * precision * recall / (precision + recall)


def official_v2(articles, predictions, na_probs=None, na_prob_thresh=1.0):
    """The script's output dict for `dataset_json["data"]` and {id: text} (every id predicted)."""
    has_answer, exact_raw, f1_raw = {}, {}, {}
    for article in articles:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                qid = qa["id"]
                has_answer[qid] = bool(qa["answers"])
                golds = [a["text"] for a in qa["answers"] if normalize(a["text"])] or [""]
                exact_raw[qid] = max(exact(g, predictions[qid]) for g in golds)
                f1_raw[qid] = max(f1(g, predictions[qid]) for g in golds)
    probs = na_probs if na_probs is not None else {k: 0.0 for k in predictions}

    def thresholded(raw):
        return {q: float(not has_answer[q]) if probs[q] > na_prob_thresh else s for q, s in raw.items()}

    exact_t, f1_t = thresholded(exact_raw), thresholded(f1_raw)

    def figures(ids):
        return {"exact": 100.0 * sum(exact_t[q] for q in ids) / len(ids),
                "f1": 100.0 * sum(f1_t[q] for q in ids) / len(ids), "total": len(ids)}

    out = figures(list(exact_t))
    for name, wanted in (("HasAns", True), ("NoAns", False)):
        ids = [q for q, h in has_answer.items() if h is wanted]
        if ids:
            out.update({f"{name}_{k}": v for k, v in figures(ids).items()})
    if na_probs is not None:
        for key, raw in (("exact", exact_raw), ("f1", f1_raw)):
            total = best = sum(1 for h in has_answer.values() if not h)
            threshold = 0.0
            for qid in sorted(na_probs, key=lambda k: na_probs[k]):
                if qid not in raw:
                    continue
                if has_answer[qid]:
                    total += raw[qid]
                else:
                    total += -1 if predictions[qid] else 0
                if total > best:
                    best, threshold = total, na_probs[qid]
            out[f"best_{key}"], out[f"best_{key}_thresh"] = 100.0 * best / len(raw), threshold
    return out
