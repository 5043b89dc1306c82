"""Masked-LM masking, vectorised over a batch of rows.

One implementation serves both static masking (create_pretraining_data) and the
loader's dynamic masking, so the two cannot drift apart. The rule is BERT's
(Devlin et al. 2019, section 3.1 and appendix A.1; google-research/bert
`create_masked_lm_predictions`):

* candidates are the real tokens other than [CLS], [SEP] and [UNK] (an [UNK] stands for
  any word the vocab cannot spell: a model that learns to answer it learns nothing, and
  in a corpus such as WikiText, whose `<unk>` marks every rare word, it can become the
  most frequent target of all);
* per row, `n = min(max_predictions, max(1, round(candidates * masked_lm_prob)))`
  tokens are chosen uniformly at random; with whole-word masking the unit is the
  word (a token plus the `##` pieces that follow it) and whole words are taken in
  random order while they fit in `n` (the first word that would overflow ends the
  choice, so a row may get slightly fewer than `n`);
* a chosen token becomes [MASK] with probability 0.8, a random ordinary token with
  probability 0.1, and stays itself with probability 0.1;
* the chosen positions are listed in increasing order in `masked_lm_positions`,
  their original ids in `masked_lm_ids`; unused slots hold position 0 and id 0
  (position 0 is [CLS], never a candidate, so 0 means "no prediction").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MaskingSpec:
    masked_lm_prob: float
    max_predictions: int
    mask_id: int
    cls_id: int
    sep_id: int
    # Ids a "random" replacement is drawn from (the vocab minus control tokens).
    random_ids: np.ndarray
    # (V,) bool, True for `##` pieces; None disables whole-word masking.
    continuation: np.ndarray | None = None
    # [UNK], never a candidate; None when the vocab has none (shards made elsewhere).
    unk_id: int | None = None


def mask_rows(
    tokens: np.ndarray, input_mask: np.ndarray, spec: MaskingSpec, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mask a batch of rows.

    tokens: (N, S) original ids; input_mask: (N, S) 1 for real tokens.
    Returns (input_ids (N, S), masked_lm_positions (N, P), masked_lm_ids (N, P)).
    """
    n_rows, seq_len = tokens.shape
    p = spec.max_predictions
    candidate = (input_mask != 0) & (tokens != spec.cls_id) & (tokens != spec.sep_id)  # (N, S)
    if spec.unk_id is not None:
        candidate &= tokens != spec.unk_id
    n_cand = candidate.sum(axis=1)
    budget = np.minimum(p, np.maximum(1, np.rint(n_cand * spec.masked_lm_prob))).astype(np.int64)
    budget[n_cand == 0] = 0

    col = np.broadcast_to(np.arange(seq_len), (n_rows, seq_len))
    key = rng.random((n_rows, seq_len))
    if spec.continuation is not None:
        # A word starts at a candidate that is not a `##` piece, or at a `##` piece
        # whose left neighbour is no candidate; its pieces share the start's key.
        cont = spec.continuation[tokens] & candidate
        prev_cand = np.zeros_like(candidate)
        prev_cand[:, 1:] = candidate[:, :-1]
        start = candidate & ~(cont & prev_cand)
        start_col = np.maximum.accumulate(np.where(start, col, 0), axis=1)
        key = np.take_along_axis(key, start_col, axis=1)
        group = start_col
    else:
        group = col
    key = np.where(candidate, key, np.inf)

    # Sort by (key, column): a word's pieces are adjacent and in order.
    order = np.lexsort((col, key), axis=1)  # (N, S)
    sorted_cand = np.take_along_axis(candidate, order, axis=1)
    sorted_group = np.take_along_axis(group, order, axis=1)
    count = np.cumsum(sorted_cand, axis=1)
    # Cumulative count at the last piece of each token's word.
    is_end = np.ones_like(sorted_cand)
    is_end[:, :-1] = sorted_group[:, 1:] != sorted_group[:, :-1]
    end_idx = np.where(is_end, col, seq_len - 1)
    end_idx = np.minimum.accumulate(end_idx[:, ::-1], axis=1)[:, ::-1]
    count_at_end = np.take_along_axis(count, end_idx, axis=1)
    chosen_sorted = sorted_cand & (count_at_end <= budget[:, None])
    chosen = np.zeros_like(candidate)
    np.put_along_axis(chosen, order, chosen_sorted, axis=1)

    # Positions in increasing order, padded with 0.
    pos_order = np.argsort(~chosen, axis=1, kind="stable")[:, :p]  # chosen columns first
    n_chosen = chosen.sum(axis=1)
    valid = np.arange(p)[None, :] < n_chosen[:, None]
    positions = np.where(valid, pos_order, 0)
    ids = np.where(valid, np.take_along_axis(tokens, positions, axis=1), 0)

    # 80 / 10 / 10 replacement.
    r = rng.random((n_rows, seq_len))
    random_tok = spec.random_ids[rng.integers(0, len(spec.random_ids), (n_rows, seq_len))]
    out = tokens.copy()
    out = np.where(chosen & (r < 0.8), spec.mask_id, out)
    out = np.where(chosen & (r >= 0.8) & (r < 0.9), random_tok, out)
    return out.astype(tokens.dtype, copy=False), positions, ids


def drop_targets(positions: np.ndarray, ids: np.ndarray, dropped: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows' masked-LM slots without the targets `dropped` (shards masked before [UNK] stopped
    being a candidate): the other used slots move up in order, the freed ones become unused
    (position 0, id 0). The token stays masked in `input_ids`, only unscored."""
    keep = (positions != 0) & (ids != dropped)
    order = np.argsort(~keep, axis=1, kind="stable")  # kept slots first, in their order
    kept = np.take_along_axis(keep, order, axis=1)
    return (np.where(kept, np.take_along_axis(positions, order, axis=1), 0),
            np.where(kept, np.take_along_axis(ids, order, axis=1), 0))


def unmask_rows(input_ids: np.ndarray, positions: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Original tokens of masked rows: put `masked_lm_ids` back at their positions."""
    tokens = input_ids.copy()
    valid = positions != 0
    rows = np.broadcast_to(np.arange(len(tokens))[:, None], positions.shape)
    tokens[rows[valid], positions[valid]] = ids[valid]
    return tokens
