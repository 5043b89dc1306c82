"""SQuAD v1.1 and v2.0: read the JSON, make features, turn logits into answers, score them.

Reading (`load_squad`) checks the file's structure before it uses it, naming the file and
the place of each fault (an article that is not an object, `answers` that is not a list,
an `is_impossible` that is not true or false), and follows the reference tooling's
leniency where it is sound: answer offsets are hints (a missing, null or misplaced
`answer_start` is found again from the answer text), and an answer that differs from
its context only in white space or case is aligned to the context's characters, as
google-research/bert's `read_squad_examples` aligns whitespace-normalised text. What it
kept, fixed and dropped is counted (`SquadData.summary`).

Questions are of three kinds: answerable (gold answers), unanswerable (SQuAD v2.0:
`is_impossible` true, or empty `answers` in a file that uses `is_impossible`), and
ungraded (no `answers` key, or empty `answers` in a file without `is_impossible`: the
questions a user serves). All three are answered; only graded ones are scored.

Answers are located by character offsets throughout: the `tokenizers` encoding of a
context carries each token's (start, end) span in the original text, so a feature's
gold span is the tokens that cover the answer's characters, and a predicted span is
cut from the original context with the same offsets (no re-alignment heuristics as
in google-research/bert's `get_final_text` are needed).

Feature layout: `[CLS] question [SEP] context window [SEP]` + padding, windows
`doc_stride` tokens apart. A token that appears in several windows is scored only
in the window where it has the most context on both sides (BERT's "max context").
Training features whose window misses the answer, and every window of an unanswerable
question, point at [CLS] (position 0): the null answer of SQuAD v2.0. Each distinct
context is tokenized once, and the windows and their max-context flags are computed
once per (context, question length) in time linear in the context's length.

Scoring follows the official evaluation scripts. v1.1 (`evaluate-v1.1.py`): answers
normalised (lower case, punctuation removed, articles a/an/the removed, white space
collapsed); exact match and token-level F1 take the maximum over the gold answers and
are averaged over all questions (×100), reported as `exact_match` and `f1`. v2.0
(`evaluate-v2.0.py`), for files with unanswerable questions: the same normalisation,
an unanswerable question's gold is the empty answer, F1 of two token lists one of
which is empty is 1 if both are, and the figures are `exact`, `f1`, `total`,
`HasAns_exact`, `HasAns_f1`, `HasAns_total`, `NoAns_exact`, `NoAns_f1`, `NoAns_total`;
given the no-answer probabilities (here the null score minus the best span score),
`best_exact`, `best_exact_thresh`, `best_f1`, `best_f1_thresh` as the script's threshold
search computes them. A question without a prediction scores 0.

From logits to scores is one path (`answer_questions`), whichever runtime made the
logits: fine-tuning's evaluation (the session) and infer.py (onnxruntime) both call it.
On a v2.0 dev set it picks the operating null threshold, the one with the best F1 on the
odds the model produces (`operating_null_threshold`: answering nothing and answering
everything included), rather than the official search's `best_f1_thresh`, which falls
back to its start value 0.0 (a probability's floor) when answering nothing is best:
on log-odds that threshold can answer almost every question.
"""

from __future__ import annotations

import bisect
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
    "Prediction",
    "SquadData",
    "load_squad",
    "locate_answer",
    "read_squad",
    "convert_examples_to_features",
    "feature_arrays",
    "Answers",
    "span_logits",
    "nbest_predictions",
    "postprocess",
    "apply_null_threshold",
    "answer_questions",
    "operating_null_threshold",
    "evaluate",
    "best_null_threshold",
    "normalize_answer",
    "exact_match_score",
    "f1_score",
    "f1_score_v2",
]


@dataclass(frozen=True)
class Example:
    qas_id: str
    question: str
    context: str
    answers: tuple[str, ...]  # all gold answer texts (none: unanswerable or ungraded)
    answer_starts: tuple[int | None, ...]  # character offsets in `context` (None: text not found)
    title: str = ""
    is_impossible: bool = False  # SQuAD v2.0: the context holds no answer
    graded: bool = True  # False: asked without gold answers (served, not scored)
    # Character ends (exclusive) of the located answers; empty: start + len(text).
    answer_ends: tuple[int | None, ...] = ()

    @property
    def answer_span(self) -> tuple[int, int] | None:
        """(start, end) characters of the first gold answer in the context, if located."""
        if not self.answers or self.answer_starts[0] is None:
            return None
        start = self.answer_starts[0]
        end = self.answer_ends[0] if self.answer_ends else None
        return start, (start + len(self.answers[0]) if end is None else end)


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
    """What a SQuAD file holds, and what the reader did with it.

    `examples`: every question, in file order. `unanswerable`: ids of SQuAD v2.0
    questions without an answer; `ungraded`: ids asked without gold answers.
    `relocated`: ids whose answer_start was missing, null or wrong and was found by the
    answer text; `realigned`: ids whose answer differs from the context only in white
    space or case, aligned to the context's characters; `unlocated`: ids whose first
    answer text is not in the context (kept for scoring, dropped from training).
    """

    examples: list[Example]
    unanswerable: list[str]
    relocated: list[str]
    unlocated: list[str]
    realigned: list[str] = field(default_factory=list)
    ungraded: list[str] = field(default_factory=list)
    version_2: bool = False  # the file marks questions with is_impossible

    @property
    def answerable(self) -> list[Example]:
        return [e for e in self.examples if e.answers]

    @property
    def trainable(self) -> list[Example]:
        """Examples that give a span to learn: located answers, and v2.0's unanswerable ones."""
        return [e for e in self.examples if e.is_impossible or (e.answers and e.answer_starts[0] is not None)]

    def summary(self, where: str) -> str:
        """One line: the questions by kind, and the answers kept as written, fixed and dropped."""
        kinds = [f"{len(self.answerable)} answerable"]
        if self.unanswerable:
            kinds.append(f"{len(self.unanswerable)} unanswerable (SQuAD v2.0)")
        if self.ungraded:
            kinds.append(f"{len(self.ungraded)} without answers (answered, not scored)")
        fixed = set(self.relocated) | set(self.realigned)
        kept = len(self.answerable) - len(fixed) - len(self.unlocated)
        line = (f"{where}: {len(self.examples)} questions ({', '.join(kinds)}); answers: {kept} kept as written, "
                f"{len(fixed)} fixed ({len(self.relocated)} answer_start missing or wrong, found by the answer text; "
                f"{len(self.realigned)} differing from the context in white space or case, aligned), "
                f"{len(self.unlocated)} dropped from training")
        if self.unlocated:
            shown = ", ".join(self.unlocated[:10]) + (" ..." if len(self.unlocated) > 10 else "")
            line += f" (not in their context; still scored: {shown})"
        return line


def read_squad(path: str | Path, verbose: bool = True) -> list[Example]:
    """Every question of a SQuAD v1.1 or v2.0 file; prints what `load_squad` kept, fixed and dropped."""
    data = load_squad(path)
    if verbose:
        print(data.summary(str(path)), flush=True)
    return data.examples


def load_squad(path: str | Path) -> SquadData:
    """Read a SQuAD JSON file (`{"data": [{"paragraphs": ...}]}`) as users have them.

    Offsets are hints: an `answer_start` that is missing, null or a few characters off is
    replaced by the occurrence of the answer text nearest to it (or the first, without a
    hint); white space and case may differ from the context. Every structural fault is a
    ValueError naming the file and where in it.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"SQuAD file {path} does not exist" if not path.exists()
                         else f"SQuAD file {path} is not a file")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"SQuAD file {path} cannot be read ({e.strerror})") from None
    if not raw.strip():
        raise ValueError(f"SQuAD file {path} is empty")
    try:
        blob = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"SQuAD file {path}, line {line}: not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"SQuAD file {path}, line {e.lineno}: invalid JSON ({e.msg})") from None
    except RecursionError:
        raise ValueError(f"SQuAD file {path}: JSON nested too deeply to be a SQuAD file") from None
    if not isinstance(blob, Mapping) or not isinstance(blob.get("data"), list):
        raise ValueError(f"{path}: not a SQuAD file (no top-level 'data' list)")
    return _parse_articles(blob["data"], str(path))


def locate_answer(context: str, text: str, hint: int | None) -> tuple[int, int] | None:
    """(start, end) characters of `text` in `context`, or None if it is not there.

    At `hint` when the text is there (exactly, or with other white space or case);
    otherwise, with a hint, the occurrence nearest to it (exact before loose at equal
    distance); without one, the first exact occurrence, else the first loose one.
    The offset is the annotator's: a loose match at the offset beats an exact one far away.
    """
    words = text.split()
    if not words:
        return None
    if hint is not None and context.startswith(text, hint):
        return hint, hint + len(text)
    exact = [(m.start(), m.end()) for m in re.finditer(re.escape(text), context)]
    if hint is None and exact:
        return exact[0]
    loose = [(m.start(), m.end()) for m in
             re.finditer(r"\s+".join(re.escape(w) for w in words), context, flags=re.IGNORECASE)]
    if hint is None:
        return loose[0] if loose else None
    candidates = [(abs(s - hint), 0, s, e) for s, e in exact] + [(abs(s - hint), 1, s, e) for s, e in loose]
    if not candidates:
        return None
    _, _, start, end = min(candidates)
    return start, end


def _parse_articles(articles, where: str) -> SquadData:
    if not isinstance(articles, list):
        raise ValueError(f"{where}: SQuAD data must be a list of articles, got {type(articles).__name__}")
    version_2 = any(isinstance(qa, Mapping) and "is_impossible" in qa
                    for article in articles if isinstance(article, Mapping)
                    for para in _list(article.get("paragraphs"))
                    if isinstance(para, Mapping) for qa in _list(para.get("qas")))
    examples, unanswerable, relocated, unlocated, realigned, ungraded = [], [], [], [], [], []
    for a_index, article in enumerate(articles):
        at = f"{where}: data[{a_index}]"
        if not isinstance(article, Mapping):
            raise ValueError(f"{at} is a {_kind(article)}, not an article object "
                             '{"title": ..., "paragraphs": [...]}')
        title = article.get("title", "")
        title = title if isinstance(title, str) else str(title)
        paragraphs = article.get("paragraphs")
        if not isinstance(paragraphs, list):
            raise ValueError(f"{at} ({title!r}) has no 'paragraphs' list (got {_kind(paragraphs)})")
        for p_index, para in enumerate(paragraphs):
            pat = f"{at}, paragraph {p_index}"
            if not isinstance(para, Mapping):
                raise ValueError(f"{pat} is a {_kind(para)}, not an object with 'context' and 'qas'")
            context = para.get("context")
            if not isinstance(context, str):
                raise ValueError(f"{pat} has no 'context' text (got {_kind(context)})")
            qas = para.get("qas", [])
            if not isinstance(qas, list):
                raise ValueError(f"{pat}: 'qas' must be a list of questions, got {_kind(qas)}")
            for q_index, qa in enumerate(qas):
                qat = f"{pat}, question {q_index}"
                if not isinstance(qa, Mapping):
                    raise ValueError(f"{qat} is a {_kind(qa)}, not an object with 'id', 'question' and 'answers'")
                if "id" not in qa or "question" not in qa:
                    raise ValueError(f"{qat} lacks 'id' or 'question'")
                qid, question = qa["id"], qa["question"]
                if isinstance(qid, bool) or not isinstance(qid, (str, int)):
                    raise ValueError(f"{qat}: 'id' must be a string, got {_kind(qid)}")
                if not isinstance(question, str):
                    raise ValueError(f"{qat} (id {qid!r}): 'question' must be text, got {_kind(question)}")
                qid = str(qid)
                impossible = qa.get("is_impossible", False)
                if not isinstance(impossible, bool):
                    raise ValueError(f"{qat} (id {qid!r}): 'is_impossible' must be true or false, got "
                                     f"{json.dumps(impossible)} ({_kind(impossible)}); write the JSON literal")
                answers = _answers(qa, f"{qat} (id {qid!r})")
                if impossible and answers:
                    raise ValueError(f"{qat} (id {qid!r}) has 'is_impossible': true and answers {answers[:2]}; "
                                     "an unanswerable question has none (SQuAD v2.0 puts them in 'plausible_answers')")
                if impossible or (not answers and version_2 and "answers" in qa):
                    unanswerable.append(qid)
                    examples.append(Example(qid, question, context, (), (), title, is_impossible=True))
                    continue
                if not answers:
                    ungraded.append(qid)
                    examples.append(Example(qid, question, context, (), (), title, graded=False))
                    continue
                texts = tuple(t for t, _ in answers)
                spans = [locate_answer(context, t, h) for t, h in answers]
                starts = tuple(s[0] if s else None for s in spans)
                ends = tuple(s[1] if s else None for s in spans)
                if spans[0] is None:
                    unlocated.append(qid)
                else:
                    if starts[0] != answers[0][1]:
                        relocated.append(qid)
                    if context[starts[0] : ends[0]] != texts[0]:
                        realigned.append(qid)
                examples.append(Example(qid, question, context, texts, starts, title, answer_ends=ends))
    return SquadData(examples, unanswerable, relocated, unlocated, realigned, ungraded, version_2)


def _answers(qa: Mapping, at: str) -> list[tuple[str, int | None]]:
    """(text, offset hint) of each gold answer with text; [] when there are none."""
    answers = qa.get("answers")
    if answers is None:
        return []
    if not isinstance(answers, list):
        raise ValueError(f"{at}: 'answers' must be a list of {{\"text\", \"answer_start\"}} objects, got "
                         f"{_kind(answers)} {_short(answers)}")
    out = []
    for i, answer in enumerate(answers):
        if not isinstance(answer, Mapping):
            raise ValueError(f"{at}: answers[{i}] must be an object {{\"text\", \"answer_start\"}}, got "
                             f"{_kind(answer)} {_short(answer)}")
        text = answer.get("text")
        if text is None:
            continue
        if not isinstance(text, str):
            raise ValueError(f"{at}: answers[{i}]['text'] must be text, got {_kind(text)} {_short(text)}")
        if text.strip():
            out.append((text, _offset(answer.get("answer_start"))))
    return out


def _offset(value) -> int | None:
    """An answer_start as written by other tools: an int, a numeric string, null or absent."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and not value.is_integer():
        return None
    try:
        offset = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return offset if offset >= 0 else None


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _kind(value) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null",
            int: "number", float: "number"}.get(type(value), type(value).__name__)


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


# --------------------------------------------------------------------------- features


def _windows(tokens: int, window_len: int, doc_stride: int) -> list[tuple[int, int]]:
    """(start, length) of each window over `tokens` context tokens."""
    windows, start = [], 0
    while True:
        length = min(window_len, tokens - start)
        windows.append((start, length))
        if start + length >= tokens:
            return windows
        start += min(length, doc_stride)


def _max_context(windows: Sequence[tuple[int, int]], tokens: int) -> list[np.ndarray]:
    """Per window, which of its tokens have their most context there (BERT's run_squad.py:
    score min(left, right) + 0.01 × window length, the first window winning ties). One pass
    over the windows' tokens: linear in the context's length."""
    best = np.full(max(tokens, 1), -1.0)
    owner = np.full(max(tokens, 1), -1, dtype=np.int64)
    for w, (start, length) in enumerate(windows):
        i = np.arange(length)
        score = np.minimum(i, length - 1 - i) + 0.01 * length
        better = score > best[start : start + length]
        best[start : start + length][better] = score[better]
        owner[start : start + length][better] = w
    return [owner[start : start + length] == w for w, (start, length) in enumerate(windows)]


class _Context:
    """A context tokenized once: ids, offsets, token boundaries, and its windowings."""

    def __init__(self, encoding):
        self.ids = list(encoding.ids)
        self.offsets = [tuple(o) for o in encoding.offsets]
        self.starts = [o[0] for o in self.offsets]
        self.ends = [o[1] for o in self.offsets]
        self._windowings: dict[int, tuple[list[tuple[int, int]], list[list[bool]]]] = {}

    def windowing(self, window_len: int, doc_stride: int):
        if window_len not in self._windowings:
            windows = _windows(len(self.ids), window_len, doc_stride)
            flags = [m.tolist() for m in _max_context(windows, len(self.ids))]
            self._windowings[window_len] = (windows, flags)
        return self._windowings[window_len]

    def token_span(self, start: int, end: int) -> tuple[int, int] | None:
        """Smallest token span covering characters [start, end), by binary search."""
        first = bisect.bisect_right(self.ends, start)  # first token ending after `start`
        last = bisect.bisect_left(self.starts, end) - 1  # last token starting before `end`
        return (first, last) if first <= last else None


def convert_examples_to_features(
    examples: Sequence[Example],
    tokenizer,
    max_seq_length: int = 384,
    doc_stride: int = 128,
    max_query_length: int = 64,
) -> list[Feature]:
    """Sliding-window features; `tokenizer` is a `tokenizers` BertWordPiece tokenizer."""
    for name, value in (("max_seq_length", max_seq_length), ("doc_stride", doc_stride),
                        ("max_query_length", max_query_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    pad_id = tokenizer.token_to_id("[PAD]")
    if None in (cls_id, sep_id, pad_id):
        raise ValueError("the tokenizer's vocab lacks [CLS], [SEP] or [PAD]")
    questions = tokenizer.encode_batch([e.question for e in examples], add_special_tokens=False)
    distinct = list(dict.fromkeys(e.context for e in examples))  # each context tokenized once
    contexts = dict(zip(distinct, (_Context(c) for c in tokenizer.encode_batch(distinct, add_special_tokens=False))))
    features: list[Feature] = []
    for ex_index, (ex, q_enc) in enumerate(zip(examples, questions)):
        q_ids = q_enc.ids[:max_query_length]
        ctx = contexts[ex.context]
        window_len = max_seq_length - len(q_ids) - 3
        if window_len < 1:
            raise ValueError(f"max_seq_length={max_seq_length} leaves no room for the context after a question "
                             f"of {len(q_ids)} tokens; raise it or lower max_query_length")
        windows, max_flags = ctx.windowing(window_len, doc_stride)
        span = ex.answer_span
        gold = ctx.token_span(*span) if span is not None and not ex.is_impossible else None
        ctx_at = len(q_ids) + 2
        head = [cls_id, *q_ids, sep_id]
        for w_index, (w_start, w_len) in enumerate(windows):
            ids = head + ctx.ids[w_start : w_start + w_len] + [sep_id]
            pad = max_seq_length - len(ids)
            feature = Feature(
                unique_id=1_000_000_000 + len(features),
                example_index=ex_index,
                window_index=w_index,
                input_ids=ids + [pad_id] * pad,
                input_mask=[1] * len(ids) + [0] * pad,
                segment_ids=[0] * ctx_at + [1] * (w_len + 1) + [0] * pad,
                offsets=[None] * ctx_at + ctx.offsets[w_start : w_start + w_len] + [None] * (pad + 1),
                max_context=[False] * ctx_at + max_flags[w_index] + [False] * (pad + 1),
            )
            if gold is not None and w_start <= gold[0] and gold[1] < w_start + w_len:
                feature.start_position = gold[0] - w_start + ctx_at
                feature.end_position = gold[1] - w_start + ctx_at
            features.append(feature)
    return features


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


# --------------------------------------------------------------------------- scoring

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
        data = _parse_articles(dataset["data"], "dataset")
        return data.examples, data.version_2
    dataset = list(dataset)
    if dataset and isinstance(dataset[0], Mapping):
        data = _parse_articles(dataset, "dataset")
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
    exact, f1 = _raw_scores_v2(graded, predictions)
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


def _raw_scores_v2(graded: Sequence[Example], predictions: Mapping[str, str]) -> tuple[dict, dict]:
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


# --------------------------------------------------------------- logits → scores
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
    _, f1_span = _raw_scores_v2(graded, spans)
    _, f1_null = _raw_scores_v2(graded, {q: "" for q in spans})
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
