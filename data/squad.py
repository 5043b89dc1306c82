"""SQuAD v1.1: read the JSON, make features, turn logits into answers, score them.

Answers are located by character offsets throughout: the `tokenizers` encoding of a
context carries each token's (start, end) span in the original text, so a feature's
gold span is the tokens that cover the answer's characters, and a predicted span is
cut from the original context with the same offsets (no re-alignment heuristics as
in google-research/bert's `get_final_text` are needed).

Feature layout: `[CLS] question [SEP] context window [SEP]` + padding, windows
`doc_stride` tokens apart. A token that appears in several windows is scored only
in the window where it has the most context on both sides (BERT's "max context").
Training features whose window misses the answer point at [CLS] (position 0).

Scoring follows the official v1.1 evaluation: answers are normalised (lower case,
punctuation removed, articles a/an/the removed, white space collapsed); exact match
and token-level F1 take the maximum over the gold answers and are averaged over all
questions (×100); a question without a prediction scores 0.
"""

from __future__ import annotations

import collections
import json
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = [
    "Example",
    "Feature",
    "read_squad",
    "convert_examples_to_features",
    "postprocess",
    "evaluate",
    "normalize_answer",
    "exact_match_score",
    "f1_score",
]


@dataclass(frozen=True)
class Example:
    qas_id: str
    question: str
    context: str
    answers: tuple[str, ...]  # all gold answer texts
    answer_starts: tuple[int, ...]  # character offsets in `context`
    title: str = ""

    @property
    def answer_text(self) -> str | None:
        return self.answers[0] if self.answers else None


@dataclass
class Feature:
    unique_id: int
    example_index: int
    window_index: int
    input_ids: list[int]
    input_mask: list[int]
    segment_ids: list[int]
    # For each position: (start, end) character offsets in the example's context,
    # or None for question, special and padding tokens.
    offsets: list[tuple[int, int] | None]
    max_context: list[bool]
    start_position: int = 0
    end_position: int = 0
    extra: dict = field(default_factory=dict)


def read_squad(path: str | Path) -> list[Example]:
    """Examples of an official SQuAD v1.1 JSON file (`{"data": [{"paragraphs": ...}]}`)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"SQuAD file {path} does not exist")
    raw = path.read_bytes()
    if not raw.strip():
        raise ValueError(f"SQuAD file {path} is empty")
    try:
        blob = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"SQuAD file {path}, line {line}: not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"SQuAD file {path}, line {e.lineno}: invalid JSON ({e.msg})") from None
    return _examples_from_json(blob, str(path))


def _examples_from_json(blob: Mapping, where: str) -> list[Example]:
    if not isinstance(blob, Mapping) or not isinstance(blob.get("data"), list):
        raise ValueError(f"{where}: not a SQuAD file (no top-level 'data' list)")
    examples = []
    for article in blob["data"]:
        title = article.get("title", "")
        for para in article.get("paragraphs", []):
            context = para["context"]
            for qa in para.get("qas", []):
                answers = qa.get("answers", [])
                texts = tuple(a["text"] for a in answers)
                starts = tuple(int(a["answer_start"]) for a in answers)
                for t, s in zip(texts, starts):
                    if context[s : s + len(t)] != t:
                        raise ValueError(
                            f"{where}: question {qa['id']}: answer {t!r} is not at character {s} of its context"
                        )
                examples.append(Example(str(qa["id"]), qa["question"], context, texts, starts, title))
    return examples


# --------------------------------------------------------------------------- features


def convert_examples_to_features(
    examples: Sequence[Example],
    tokenizer,
    max_seq_length: int = 384,
    doc_stride: int = 128,
    max_query_length: int = 64,
) -> list[Feature]:
    """Sliding-window features; `tokenizer` is a `tokenizers` BertWordPiece tokenizer."""
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    pad_id = tokenizer.token_to_id("[PAD]")
    if None in (cls_id, sep_id, pad_id):
        raise ValueError("the tokenizer's vocab lacks [CLS], [SEP] or [PAD]")
    questions = tokenizer.encode_batch([e.question for e in examples], add_special_tokens=False)
    contexts = tokenizer.encode_batch([e.context for e in examples], add_special_tokens=False)
    features: list[Feature] = []
    for ex_index, (ex, q_enc, c_enc) in enumerate(zip(examples, questions, contexts)):
        q_ids = q_enc.ids[:max_query_length]
        c_ids, c_offsets = c_enc.ids, c_enc.offsets
        window_len = max_seq_length - len(q_ids) - 3
        if window_len < 1:
            raise ValueError(f"max_seq_length={max_seq_length} leaves no room for the context")
        gold = _gold_token_span(ex, c_offsets)
        windows = []
        start = 0
        while True:
            length = min(window_len, len(c_ids) - start)
            windows.append((start, length))
            if start + length >= len(c_ids):
                break
            start += min(length, doc_stride)
        for w_index, (w_start, w_len) in enumerate(windows):
            ids = [cls_id, *q_ids, sep_id, *c_ids[w_start : w_start + w_len], sep_id]
            segs = [0] * (len(q_ids) + 2) + [1] * (w_len + 1)
            ctx_at = len(q_ids) + 2
            offsets: list[tuple[int, int] | None] = [None] * ctx_at + [
                tuple(o) for o in c_offsets[w_start : w_start + w_len]
            ] + [None]
            max_ctx = [False] * ctx_at + [
                _is_max_context(windows, w_index, w_start + i) for i in range(w_len)
            ] + [False]
            pad = max_seq_length - len(ids)
            feature = Feature(
                unique_id=1_000_000_000 + len(features),
                example_index=ex_index,
                window_index=w_index,
                input_ids=ids + [pad_id] * pad,
                input_mask=[1] * len(ids) + [0] * pad,
                segment_ids=segs + [0] * pad,
                offsets=offsets + [None] * pad,
                max_context=max_ctx + [False] * pad,
            )
            if gold is not None and w_start <= gold[0] and gold[1] < w_start + w_len:
                feature.start_position = gold[0] - w_start + ctx_at
                feature.end_position = gold[1] - w_start + ctx_at
            features.append(feature)
    return features


def _gold_token_span(ex: Example, offsets: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """Smallest token span covering the first gold answer's characters."""
    if not ex.answers:
        return None
    a0 = ex.answer_starts[0]
    a1 = a0 + len(ex.answers[0])
    inside = [i for i, (s, e) in enumerate(offsets) if s < a1 and e > a0]
    if not inside:
        return None
    return inside[0], inside[-1]


def _is_max_context(windows: Sequence[tuple[int, int]], w_index: int, pos: int) -> bool:
    """Is window `w_index` the one giving token `pos` the most context (min of left/right,
    plus a small bonus for longer windows), as in BERT's run_squad.py?"""
    best, best_score = None, None
    for i, (start, length) in enumerate(windows):
        end = start + length - 1
        if not start <= pos <= end:
            continue
        score = min(pos - start, end - pos) + 0.01 * length
        if best_score is None or score > best_score:
            best, best_score = i, score
    return best == w_index


# --------------------------------------------------------------------------- answers


def postprocess(
    examples: Sequence[Example],
    features: Sequence[Feature],
    start_logits,
    end_logits,
    n_best: int = 20,
    max_answer_length: int = 30,
) -> dict[str, str]:
    """Best answer text per question id from per-feature start/end logits (F, S)."""
    start_logits = np.asarray(start_logits, dtype=np.float64)
    end_logits = np.asarray(end_logits, dtype=np.float64)
    if start_logits.shape != end_logits.shape or start_logits.shape[0] != len(features):
        raise ValueError(
            f"logits of shape {start_logits.shape} / {end_logits.shape} do not match {len(features)} features"
        )
    by_example: dict[int, list[int]] = collections.defaultdict(list)
    for i, f in enumerate(features):
        by_example[f.example_index].append(i)
    predictions: dict[str, str] = {}
    for ex_index, ex in enumerate(examples):
        best_score, best_span = -np.inf, None
        for fi in by_example.get(ex_index, []):
            f = features[fi]
            s_log, e_log = start_logits[fi], end_logits[fi]
            starts = np.argsort(-s_log, kind="stable")[:n_best]
            ends = np.argsort(-e_log, kind="stable")[:n_best]
            for s in starts:
                if s >= len(f.offsets) or f.offsets[s] is None or not f.max_context[s]:
                    continue
                for e in ends:
                    if e >= len(f.offsets) or f.offsets[e] is None or e < s or e - s + 1 > max_answer_length:
                        continue
                    score = s_log[s] + e_log[e]
                    if score > best_score:
                        best_score, best_span = score, (f.offsets[s][0], f.offsets[e][1])
        predictions[ex.qas_id] = "" if best_span is None else ex.context[best_span[0] : best_span[1]]
    return predictions


# --------------------------------------------------------------------------- scoring

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Official SQuAD v1.1 normalisation: lower case, drop punctuation, drop articles,
    collapse white space (in that order)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match_score(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    pred = normalize_answer(prediction).split()
    ref = normalize_answer(gold).split()
    common = collections.Counter(pred) & collections.Counter(ref)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred), overlap / len(ref)
    return 2 * precision * recall / (precision + recall)


def evaluate(dataset, predictions: Mapping[str, str]) -> dict[str, float]:
    """Exact match and F1 (percent) of `predictions` {question id: text}.

    `dataset` is a SQuAD JSON path, its parsed dict, or a list of Examples.
    """
    if isinstance(dataset, (str, Path)):
        examples = read_squad(dataset)
    elif isinstance(dataset, Mapping):
        examples = _examples_from_json(dataset, "dataset")
    else:
        examples = list(dataset)
    if not examples:
        raise ValueError("no questions to evaluate")
    em = f1 = 0.0
    for ex in examples:
        if ex.qas_id not in predictions:
            continue  # the official script scores a missing prediction as 0
        pred = predictions[ex.qas_id]
        golds = ex.answers or ("",)
        em += max(exact_match_score(pred, g) for g in golds)
        f1 += max(f1_score(pred, g) for g in golds)
    return {"exact_match": 100.0 * em / len(examples), "f1": 100.0 * f1 / len(examples)}
