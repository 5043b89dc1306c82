"""Features: `[CLS] question [SEP] context window [SEP]`, windows `doc_stride` apart, each
token scored in the window of its most context (see the package docstring)."""
from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from data.squad.reading import Example, Feature


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
