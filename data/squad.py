"""SQuAD v1.1: read the JSON, make features, turn logits into answers, score them.

Files are read as users have them (`load_squad`): answer offsets are only hints (a
missing, null or misplaced `answer_start` is found again from the answer text), and
SQuAD v2.0 files load with their unanswerable questions counted and left out.

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
    "SquadData",
    "load_squad",
    "locate_answer",
    "read_squad",
    "convert_examples_to_features",
    "feature_arrays",
    "nbest_predictions",
    "predict_answers",
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
    answer_starts: tuple[int | None, ...]  # character offsets in `context` (None: text not found)
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


@dataclass(frozen=True)
class SquadData:
    """What a SQuAD file holds: the answerable questions, and what the reader had to mend.

    `unanswerable`: ids of SQuAD v2.0 questions with `is_impossible` or no answers, left
    out of `examples` (v1.1 training and scoring). `relocated`: ids whose answer_start was
    missing, null or wrong and was found by the answer text. `unlocated`: ids whose first
    answer text does not occur in the context (kept for scoring, skipped for training).
    """

    examples: list[Example]
    unanswerable: list[str]
    relocated: list[str]
    unlocated: list[str]

    def summary(self, where: str) -> str:
        parts = [f"{where}: {len(self.examples)} answerable questions"]
        if self.unanswerable:
            parts.append(f"{len(self.unanswerable)} unanswerable (SQuAD v2.0) left out")
        if self.relocated:
            parts.append(f"{len(self.relocated)} answer_start missing or wrong, found by the answer text")
        if self.unlocated:
            shown = ", ".join(self.unlocated[:10]) + (" ..." if len(self.unlocated) > 10 else "")
            parts.append(f"{len(self.unlocated)} answers not in their context (scored, not trained on: {shown})")
        return "; ".join(parts)


def read_squad(path: str | Path, verbose: bool = True) -> list[Example]:
    """Answerable examples of a SQuAD v1.1 or v2.0 file; prints what `load_squad` mended."""
    data = load_squad(path)
    if verbose and (data.unanswerable or data.relocated or data.unlocated):
        print(data.summary(str(path)), flush=True)
    return data.examples


def load_squad(path: str | Path) -> SquadData:
    """Read a SQuAD JSON file (`{"data": [{"paragraphs": ...}]}`) as users have them.

    Offsets are hints: an `answer_start` that is missing, null or a few characters off is
    replaced by the occurrence of the answer text nearest to it (or the first, without a
    hint). v2.0 files load; their unanswerable questions are counted and left out.
    """
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
    if not isinstance(blob, Mapping) or not isinstance(blob.get("data"), list):
        raise ValueError(f"{path}: not a SQuAD file (no top-level 'data' list)")
    return _parse_articles(blob["data"], str(path))


def locate_answer(context: str, text: str, hint: int | None) -> int | None:
    """Character start of `text` in `context`: at `hint` if it is there, else the occurrence
    nearest to `hint` (the first without one), else case-insensitively; None if absent."""
    if not text:
        return None
    if hint is not None and context[hint : hint + len(text)] == text:
        return hint
    for haystack, needle in ((context, text), (context.lower(), text.lower())):
        starts = [m.start() for m in re.finditer(re.escape(needle), haystack)]
        if starts:
            return starts[0] if hint is None else min(starts, key=lambda s: abs(s - hint))
    return None


def _parse_articles(articles, where: str) -> SquadData:
    if not isinstance(articles, list):
        raise ValueError(f"{where}: SQuAD data must be a list of articles, got {type(articles).__name__}")
    examples, unanswerable, relocated, unlocated = [], [], [], []
    for a_index, article in enumerate(articles):
        title = article.get("title", "")
        for p_index, para in enumerate(article.get("paragraphs", [])):
            context = para.get("context")
            if not isinstance(context, str):
                raise ValueError(f"{where}: article {a_index}, paragraph {p_index} has no 'context' text")
            for qa in para.get("qas", []):
                if "id" not in qa or "question" not in qa:
                    raise ValueError(f"{where}: article {a_index}, paragraph {p_index}: a question lacks 'id' or 'question'")
                qid = str(qa["id"])
                answers = [a for a in (qa.get("answers") or []) if isinstance(a, Mapping) and a.get("text")]
                if qa.get("is_impossible") or not answers:
                    unanswerable.append(qid)
                    continue
                texts = tuple(str(a["text"]) for a in answers)
                hints = [_offset(a.get("answer_start")) for a in answers]
                starts = tuple(locate_answer(context, t, h) for t, h in zip(texts, hints))
                if starts[0] is None:
                    unlocated.append(qid)
                elif starts[0] != hints[0]:
                    relocated.append(qid)
                examples.append(Example(qid, qa["question"], context, texts, starts, title))
    return SquadData(examples, unanswerable, relocated, unlocated)


def _offset(value) -> int | None:
    """An answer_start as written by other tools: an int, a numeric string, null or absent."""
    try:
        offset = int(value)
    except (TypeError, ValueError):
        return None
    return offset if offset >= 0 else None


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
    if a0 is None:
        return None
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


def feature_arrays(features: Sequence[Feature]) -> dict[str, np.ndarray]:
    """The graph inputs (and span labels) of features, as (F, S) / (F,) int64 arrays."""
    return {
        "input_ids": np.array([f.input_ids for f in features], np.int64),
        "segment_ids": np.array([f.segment_ids for f in features], np.int64),
        "input_mask": np.array([f.input_mask for f in features], np.int64),
        "start_positions": np.array([f.start_position for f in features], np.int64),
        "end_positions": np.array([f.end_position for f in features], np.int64),
    }


# --------------------------------------------------------------------------- answers


def predict_answers(
    examples: Sequence[Example],
    features: Sequence[Feature],
    run,
    batch_size: int = 32,
    progress: bool = False,
    n_best: int = 20,
    max_answer_length: int = 30,
) -> tuple[dict[str, str], dict[str, list[dict]]]:
    """Answers from any runtime: `run({input_ids, segment_ids, input_mask})` returns the
    (start, end) logits of a batch; features are run `batch_size` at a time."""
    from tqdm import tqdm

    arrays = feature_arrays(features)
    starts, ends = [], []
    for i in tqdm(range(0, len(features), batch_size), desc="SQuAD", unit="batch", disable=not progress):
        batch = {k: arrays[k][i : i + batch_size] for k in ("input_ids", "segment_ids", "input_mask")}
        start, end = run(batch)
        starts.append(np.asarray(start, np.float32))
        ends.append(np.asarray(end, np.float32))
    width = arrays["input_ids"].shape[1] if features else 0
    start = np.concatenate(starts) if starts else np.zeros((0, width))
    end = np.concatenate(ends) if ends else np.zeros((0, width))
    return nbest_predictions(examples, features, start, end, n_best, max_answer_length)


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
) -> tuple[dict[str, str], dict[str, list[dict]]]:
    """(best text per question id, up to `n_best` distinct answers per id), as BERT's
    run_squad.py writes predictions.json and nbest_predictions.json.

    A candidate is a start among the `n_best` highest start logits of a window and an end
    among its `n_best` highest end logits: context tokens only, the start where the token
    has its max context, end ≥ start, at most `max_answer_length` tokens; its score is the
    sum of the two logits. The n-best list keeps the best score of each distinct text, with
    probabilities from a softmax over the scores kept.
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
    predictions: dict[str, str] = {}
    nbest: dict[str, list[dict]] = {}
    for ex_index, ex in enumerate(examples):
        best: dict[str, tuple[float, float, float]] = {}  # text → (score, start logit, end logit)
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
                    text = ex.context[f.offsets[s][0] : f.offsets[e][1]]
                    if text not in best or score > best[text][0]:
                        best[text] = (score, float(s_log[s]), float(e_log[e]))
        ranked = sorted(best.items(), key=lambda kv: -kv[1][0])[:n_best]
        if not ranked:
            ranked = [("", (0.0, 0.0, 0.0))]
        scores = np.array([v[0] for _, v in ranked])
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        predictions[ex.qas_id] = ranked[0][0]
        nbest[ex.qas_id] = [
            {"text": text, "probability": float(p), "start_logit": v[1], "end_logit": v[2]}
            for (text, v), p in zip(ranked, probs)
        ]
    return predictions, nbest


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

    `dataset` is a SQuAD JSON path, its parsed dict, its `["data"]` list of articles (the
    official script's `evaluate(dataset_json["data"], predictions)`), or Examples. Only the
    answer texts count, never their offsets; unanswerable (v2.0) questions are left out.
    """
    if isinstance(dataset, (str, Path)):
        examples = read_squad(dataset, verbose=False)
    elif isinstance(dataset, Mapping):
        if not isinstance(dataset.get("data"), list):
            raise ValueError("dataset: not a SQuAD file (no top-level 'data' list)")
        examples = _parse_articles(dataset["data"], "dataset").examples
    else:
        dataset = list(dataset)
        if dataset and isinstance(dataset[0], Mapping):
            examples = _parse_articles(dataset, "dataset").examples
        else:
            examples = dataset
    if not examples:
        raise ValueError("no answerable questions to evaluate")
    em = f1 = 0.0
    for ex in examples:
        if ex.qas_id not in predictions:
            continue  # the official script scores a missing prediction as 0
        pred = predictions[ex.qas_id]
        golds = ex.answers or ("",)
        em += max(exact_match_score(pred, g) for g in golds)
        f1 += max(f1_score(pred, g) for g in golds)
    return {"exact_match": 100.0 * em / len(examples), "f1": 100.0 * f1 / len(examples)}
