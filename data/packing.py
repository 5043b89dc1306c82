"""Sequence packing: several sequences per row, after Graphcore's packed BERT (Krell et al.
2021, "Efficient Sequence Packing without Cross-contamination").

Real text is ragged: at sequence length 512 most of a padded row is padding, and a
padded token costs as much compute as a real one. A packed row holds up to K sequences
back to back, then padding, described by

    sequence_index (M, S)  1, 2, ... for the row's sequences, 0 on padding
    position_ids   (M, S)  0, 1, ... restarting at each sequence

and the graph of `model.packed: true` (bert/model.py) keeps the sequences apart
(block-diagonal attention, the convolution restarting at each boundary), so each
sequence computes what it computes alone.

The packer is best-fit decreasing: sequences longest first, each into the open row it
fills most tightly, within a count (K) and, for pre-training, a masked-token budget.
On the demo corpus at S = 512 (mean 71 tokens) it fills 97.8 % of the tokens with
K = 16 (95.7 % with K = 12, 88.6 % with K = 8: there the count binds); the loader
reads, masks and packs 15-19k sequences per second in its one thread (bench/packing.py,
on a loaded 2-core VM).

Users: `PretrainingLoader(packing=True)` (per shuffle window, data/loader.py),
`pack_squad_features` for SQuAD fine-tuning (with `unpack_span_logits` to read the
logits of a packed batch per feature) and `pack_labelled_rows` for classification,
regression and tagging (bert/tasks/labelled.py: each micro-batch's rows packed, so a step
trains on the rows it trains on unpacked; `unpack_rows` reads the logits per row).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["PackLayout", "best_fit_decreasing", "pack_labelled_rows", "pack_squad_features", "packing_efficiency",
           "pad_packed_rows", "unpack_rows", "unpack_span_logits"]

IGNORE_INDEX = -100  # labels of unused slots, ignored by the losses


def best_fit_decreasing(lengths: np.ndarray, seq_len: int, max_per_pack: int, n_masks: Optional[np.ndarray] = None,
                        max_masks: Optional[int] = None) -> list[list[int]]:
    """Pack sample indices into rows of `seq_len` tokens: longest first, each into the
    open row it fills most tightly (at most `max_per_pack` samples and, with `n_masks`,
    `max_masks` masked positions per row)."""
    lengths = np.asarray(lengths, np.int64)
    if len(lengths) and lengths.max() > seq_len:
        raise ValueError(f"a sequence of {lengths.max()} tokens cannot be packed into rows of {seq_len}")
    masks_of = np.zeros_like(lengths) if n_masks is None else np.asarray(n_masks, np.int64)
    budget = int(masks_of.max(initial=0)) if max_masks is None else max_masks
    order = np.argsort(-lengths, kind="stable")
    packs: list[list[int]] = []
    room: list[int] = []
    masks: list[int] = []
    by_room: list[list[int]] = [[] for _ in range(seq_len + 1)]  # open rows by free tokens
    for i in order.tolist():
        n, c = int(lengths[i]), int(masks_of[i])
        target = -1
        for free in range(n, seq_len + 1):
            for p in by_room[free]:
                if masks[p] + c <= budget:
                    target = p
                    break
            if target >= 0:
                by_room[free].remove(target)
                break
        if target < 0:
            target = len(packs)
            packs.append([])
            room.append(seq_len)
            masks.append(0)
        packs[target].append(i)
        room[target] -= n
        masks[target] += c
        if len(packs[target]) < max_per_pack and room[target] > 0:
            by_room[room[target]].append(target)
    return packs


def ranges(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For counts [2, 3]: owners [0, 0, 1, 1, 1] and indices [0, 1, 0, 1, 2]."""
    owner = np.repeat(np.arange(len(counts)), counts)
    index = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, index


@dataclass(frozen=True)
class PackLayout:
    """Where each packed sequence lies, as flat arrays with one entry per sequence q (in
    pack order), so that packing is index arithmetic rather than a loop over rows."""

    rows: int  # M packed rows
    member: np.ndarray  # (Q,) index of the sequence in the input
    row: np.ndarray  # (Q,) its row
    slot: np.ndarray  # (Q,) its place in the row, 0 .. K-1
    start: np.ndarray  # (Q,) its first token in the row
    length: np.ndarray  # (Q,) its tokens
    first: np.ndarray  # (M,) the q of each row's first sequence

    @classmethod
    def of(cls, packs: Sequence[Sequence[int]], lengths: np.ndarray) -> "PackLayout":
        sizes = np.array([len(p) for p in packs], np.int64)
        member = np.fromiter((i for p in packs for i in p), np.int64, int(sizes.sum()))
        row = np.repeat(np.arange(len(packs)), sizes)
        first = np.cumsum(sizes) - sizes
        length = np.asarray(lengths, np.int64)[member]
        return cls(len(packs), member, row, np.arange(len(member)) - first[row], cls.offsets(length, first, row),
                   length, first)

    @staticmethod
    def offsets(counts: np.ndarray, first: np.ndarray, row: np.ndarray) -> np.ndarray:
        """Exclusive running sum of `counts` (Q,), restarting at each row's first sequence."""
        before = np.cumsum(counts) - counts
        return before - before[first][row]

    def tokens(self, arrays: Mapping[str, np.ndarray], seq_len: int,
               fill: Optional[Mapping[str, int]] = None) -> dict[str, np.ndarray]:
        """(N, ≥ L) arrays of the input sequences (token j of sequence i at [i, j]) → (M,
        seq_len) packed rows, padding `fill[key]` (default 0); with `sequence_index`,
        `position_ids` and `input_mask` of the rows."""
        src, j = ranges(self.length)  # token j of packed sequence src
        r, c = self.row[src], self.start[src] + j
        out = {}
        for key, values in arrays.items():
            packed = np.full((self.rows, seq_len), (fill or {}).get(key, 0), np.int64)
            packed[r, c] = values[self.member[src], j]
            out[key] = packed
        out["sequence_index"] = np.zeros((self.rows, seq_len), np.int64)
        out["sequence_index"][r, c] = self.slot[src] + 1
        out["position_ids"] = np.zeros((self.rows, seq_len), np.int64)
        out["position_ids"][r, c] = j
        out["input_mask"] = (out["sequence_index"] > 0).astype(np.int64)
        return out

    def per_slot(self, values: np.ndarray, slots: int, fill: float) -> np.ndarray:
        """One value per packed sequence (Q, ...) → (M, slots, ...), `fill` in unused slots:
        int64, or the values' own float type."""
        values = np.asarray(values)
        out = np.full((self.rows, slots, *values.shape[1:]), fill, values.dtype if values.dtype.kind == "f" else np.int64)
        out[self.row, self.slot] = values
        return out


def packing_efficiency(sequence_index: np.ndarray) -> float:
    """Share of the tokens of packed rows that are real (not padding)."""
    return float((np.asarray(sequence_index) > 0).mean())


def pack_squad_features(arrays: Mapping[str, np.ndarray], max_sequences_per_pack: int = 3) -> dict[str, np.ndarray]:
    """SQuAD features (data.squad.feature_arrays: (F, S) input_ids, segment_ids,
    input_mask and, for training, (F,) start/end_positions) → packed rows for the graph
    of `model.packed: true`, task squad, with max_sequences_per_pack = K:

        input_ids, segment_ids, input_mask, sequence_index, position_ids   (M, S)
        start_positions, end_positions   (M, K) in row positions (a question's "no
                                         answer" is its own [CLS]), -100 in unused slots
        feature_index                    (M, K) the feature in each slot, -1 unused

    Deterministic (best-fit decreasing over all features); shuffle the rows per epoch.
    """
    ids = np.asarray(arrays["input_ids"])
    lengths = _lengths(arrays, max_sequences_per_pack, "feature")
    packs = best_fit_decreasing(lengths, ids.shape[1], max_sequences_per_pack)
    layout = PackLayout.of(packs, lengths)
    out = layout.tokens({k: np.asarray(arrays[k]) for k in ("input_ids", "segment_ids")}, ids.shape[1])
    k = max_sequences_per_pack
    for key in ("start_positions", "end_positions"):
        if key in arrays:
            out[key] = layout.per_slot(np.asarray(arrays[key])[layout.member] + layout.start, k, IGNORE_INDEX)
    out["feature_index"] = layout.per_slot(layout.member, k, -1)
    return out


def _lengths(arrays: Mapping[str, np.ndarray], max_sequences_per_pack: int, what: str) -> np.ndarray:
    """The real tokens of each (N, S) row, checked: input_mask 1s then 0s."""
    ids = np.asarray(arrays["input_ids"])
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be ({what}s, sequence), got shape {ids.shape}")
    if max_sequences_per_pack < 1:
        raise ValueError(f"max_sequences_per_pack must be at least 1, got {max_sequences_per_pack}")
    mask = np.asarray(arrays["input_mask"])
    lengths = mask.sum(axis=1).astype(np.int64)
    real = np.arange(ids.shape[1]) < lengths[:, None]
    if not (mask == real).all():
        bad = int(np.flatnonzero((mask != real).any(axis=1))[0])
        raise ValueError(f"{what} {bad}: input_mask must be 1s then 0s (the real tokens first), as the tokenizer "
                         "writes it")
    return lengths


def pack_labelled_rows(arrays: Mapping[str, np.ndarray], max_sequences_per_pack: int, per_token: bool = False
                       ) -> dict[str, np.ndarray]:
    """Labelled rows (data.labelled's sentence_features or token_features: (N, S)
    input_ids, segment_ids, input_mask, and labels (N, ...) per row, or (N, S) per token
    when `per_token`) →
    packed rows for the graph of `model.packed: true` with a classification, regression or
    tokens head, K = max_sequences_per_pack:

        input_ids, segment_ids, input_mask, sequence_index, position_ids   (M, S)
        cls_positions   (M, K) each slot's [CLS] in the row, 0 in unused slots
        labels          (M, K, ...) per row (-100 in unused slots; float targets 0.0, which
                        the loss leaves out: no token has the slot's sequence_index), or
                        (M, S) per token (-100 off the labelled positions)
        example_index   (M, K) the input row in each slot, -1 unused

    Best-fit decreasing, deterministic; `pad_packed_rows` makes the micro-batches of a
    step the same size.
    """
    ids = np.asarray(arrays["input_ids"])
    lengths = _lengths(arrays, max_sequences_per_pack, "row")
    layout = PackLayout.of(best_fit_decreasing(lengths, ids.shape[1], max_sequences_per_pack), lengths)
    keys = ("input_ids", "segment_ids")
    labels = np.asarray(arrays["labels"]) if "labels" in arrays else None
    per_token = labels is not None and per_token
    out = layout.tokens({**{k: np.asarray(arrays[k]) for k in keys}, **({"labels": labels} if per_token else {})},
                        ids.shape[1], fill={"labels": IGNORE_INDEX})
    k = max_sequences_per_pack
    out["cls_positions"] = layout.per_slot(layout.start, k, 0)
    out["example_index"] = layout.per_slot(layout.member, k, -1)
    if labels is not None and not per_token:  # float targets 0.0 in unused slots
        out["labels"] = layout.per_slot(labels[layout.member], k, 0.0 if labels.dtype.kind == "f" else IGNORE_INDEX)
    return out


def pad_packed_rows(packed: Mapping[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """pack_labelled_rows' arrays with empty rows (padding only, no sequence) added up to `rows`."""
    have = len(packed["input_ids"])
    if rows < have:
        raise ValueError(f"{have} packed rows do not fit in {rows}")
    fills = {"example_index": -1, "labels": IGNORE_INDEX}
    return {key: np.concatenate([v, np.full((rows - have, *v.shape[1:]), 0 if v.dtype.kind == "f" else
                                            fills.get(key, 0), v.dtype)]) if rows > have else v
            for key, v in packed.items()}


def unpack_rows(values: np.ndarray, packed: Mapping[str, np.ndarray], count: int, per_token: bool = False
                ) -> np.ndarray:
    """Outputs of packed rows back per input row: per slot (M, K, ...) → (count, ...) by
    example_index; per token (M, S, ...) → (count, S, ...), each row's tokens at its own
    positions (zeros past its end). `packed`: the rows' example_index, and for per-token
    values their sequence_index and position_ids."""
    values = np.asarray(values)
    where = packed["example_index"]
    if not per_token:
        out = np.zeros((count, *values.shape[2:]), values.dtype)
        used = where >= 0
        out[where[used]] = values[used]
        return out
    r, c = np.nonzero(packed["sequence_index"] > 0)
    owner = where[r, packed["sequence_index"][r, c] - 1]
    out = np.zeros((count, *values.shape[1:]), values.dtype)
    out[owner, packed["position_ids"][r, c]] = values[r, c]
    return out


def unpack_span_logits(logits: np.ndarray, packed: Mapping[str, np.ndarray], features: int) -> np.ndarray:
    """Span logits of packed rows (M, K, S), as the packed graph gives them, → (features,
    S) per feature, in the feature's own positions (its padding at -10000), for
    data.squad's post-processing. `packed`: the rows' sequence_index and feature_index."""
    logits = np.asarray(logits)
    rows, slots, width = logits.shape
    out = np.full((features, width), -10000.0, logits.dtype)
    for r, k in zip(*np.nonzero(packed["feature_index"] >= 0)):
        where = np.flatnonzero(packed["sequence_index"][r] == k + 1)
        out[packed["feature_index"][r, k], : len(where)] = logits[r, k, where]
    return out
