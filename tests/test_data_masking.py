"""Masked-LM masking statistics (data.masking) against BERT's stated rates."""

import numpy as np
import pytest

from data.masking import MaskingSpec, drop_targets, mask_rows, unmask_rows

CLS, SEP, MASK, V = 2, 3, 4, 1000


def _rows(n, s, rng, min_len=10):
    lengths = rng.integers(min_len, s + 1, n)
    tokens = rng.integers(10, V, (n, s)).astype(np.int32)
    mask = (np.arange(s)[None, :] < lengths[:, None]).astype(np.int8)
    tokens[:, 0] = CLS
    tokens[np.arange(n), lengths - 1] = SEP
    mid = lengths // 2
    tokens[np.arange(n), mid] = SEP
    tokens[mask == 0] = 0
    return tokens, mask


def _spec(p, continuation=None):
    return MaskingSpec(0.15, p, MASK, CLS, SEP, np.arange(10, V), continuation)


def test_masking_rates_and_replacement_split():
    rng = np.random.default_rng(0)
    tokens, mask = _rows(4000, 128, rng)
    ids, pos, lm = mask_rows(tokens, mask, _spec(128), np.random.default_rng(1))
    cand = (mask == 1) & (tokens != CLS) & (tokens != SEP)
    chosen = pos != 0
    frac = chosen.sum() / cand.sum()
    assert abs(frac - 0.15) < 0.01, f"masked fraction {frac:.4f}, expected 0.15 ± 0.01"
    rows = np.broadcast_to(np.arange(len(ids))[:, None], pos.shape)[chosen]
    cols = pos[chosen]
    now, orig = ids[rows, cols], tokens[rows, cols]
    assert np.array_equal(lm[chosen], orig), "masked_lm_ids must be the original tokens"
    n = len(now)
    as_mask = (now == MASK).mean()
    kept = (now == orig).mean()
    rand = ((now != MASK) & (now != orig)).mean()
    for name, got, want in (("[MASK]", as_mask, 0.8), ("random", rand, 0.1), ("kept", kept, 0.1)):
        assert abs(got - want) < 0.02, f"{name} share {got:.4f} of {n} masked tokens, expected {want} ± 0.02"
    # Tokens that were not chosen are untouched.
    untouched = np.ones_like(mask, dtype=bool)
    untouched[rows, cols] = False
    assert np.array_equal(ids[untouched], tokens[untouched])


def test_positions_sorted_padded_and_capped():
    rng = np.random.default_rng(2)
    tokens, mask = _rows(500, 64, rng)
    p = 5
    ids, pos, lm = mask_rows(tokens, mask, _spec(p), np.random.default_rng(3))
    assert pos.shape == (500, p) and lm.shape == (500, p)
    for r in range(500):
        valid = pos[r] != 0
        k = valid.sum()
        assert valid[:k].all() and not valid[k:].any(), "used slots come first"
        assert (np.diff(pos[r, :k]) > 0).all(), "positions increase"
        assert (lm[r, k:] == 0).all()
        n_cand = ((mask[r] == 1) & (tokens[r] != CLS) & (tokens[r] != SEP)).sum()
        assert k == min(p, max(1, round(n_cand * 0.15)))
        assert np.array_equal(unmask_rows(ids[r : r + 1], pos[r : r + 1], lm[r : r + 1])[0], tokens[r])


def test_whole_word_masking_takes_whole_words():
    rng = np.random.default_rng(4)
    tokens, mask = _rows(1000, 128, rng)
    continuation = np.zeros(V, bool)
    continuation[500:] = True  # ids >= 500 are "##" pieces
    ids, pos, lm = mask_rows(tokens, mask, _spec(128, continuation), np.random.default_rng(5))
    cand = (mask == 1) & (tokens != CLS) & (tokens != SEP)
    chosen = np.zeros_like(cand)
    for r in range(len(pos)):
        chosen[r, pos[r][pos[r] != 0]] = True
    # A "##" piece is chosen exactly when the token before it (same word) is chosen.
    cont = continuation[tokens] & cand
    prev = np.zeros_like(cand)
    prev[:, 1:] = cand[:, :-1]
    inner = cont & prev
    left = np.zeros_like(chosen)
    left[:, 1:] = chosen[:, :-1]
    assert np.array_equal(chosen[inner], left[inner]), "a word is masked whole or not at all"
    frac = chosen.sum() / cand.sum()
    assert 0.12 < frac <= 0.155, f"whole-word masked fraction {frac:.4f}"


@pytest.mark.parametrize("seed", [0, 7])
def test_masking_is_deterministic(seed):
    tokens, mask = _rows(50, 32, np.random.default_rng(9))
    a = mask_rows(tokens, mask, _spec(6), np.random.default_rng(seed))
    b = mask_rows(tokens, mask, _spec(6), np.random.default_rng(seed))
    for x, y in zip(a, b):
        assert np.array_equal(x, y)


def test_unk_is_never_chosen_and_the_budget_counts_the_other_candidates():
    rng = np.random.default_rng(6)
    tokens, mask = _rows(2000, 64, rng)
    UNK = 1
    tokens = np.where((rng.random(tokens.shape) < 0.3) & (mask == 1) & (tokens >= 10), UNK, tokens)
    spec = MaskingSpec(0.15, 64, MASK, CLS, SEP, np.arange(10, V), unk_id=UNK)
    ids, pos, lm = mask_rows(tokens, mask, spec, np.random.default_rng(7))
    used = pos != 0
    assert not (lm[used] == UNK).any(), "an [UNK] target"
    assert np.array_equal(ids == UNK, tokens == UNK), "[UNK] tokens are neither masked nor replaced"
    n_cand = ((mask == 1) & (tokens != CLS) & (tokens != SEP) & (tokens != UNK)).sum(axis=1)
    assert np.array_equal(used.sum(axis=1), np.minimum(64, np.maximum(1, np.rint(n_cand * 0.15))) * (n_cand > 0))
    # Without unk_id (a vocab without [UNK]) it is an ordinary candidate, as before.
    _, pos, lm = mask_rows(tokens, mask, _spec(64), np.random.default_rng(7))
    assert (lm[pos != 0] == UNK).any()


def test_drop_targets_moves_the_kept_slots_up_in_order():
    positions = np.array([[3, 5, 9, 0], [2, 4, 0, 0], [7, 0, 0, 0]])
    ids = np.array([[11, 1, 12, 0], [1, 1, 0, 0], [13, 0, 0, 0]])
    pos, lm = drop_targets(positions, ids, 1)
    assert pos.tolist() == [[3, 9, 0, 0], [0, 0, 0, 0], [7, 0, 0, 0]]
    assert lm.tolist() == [[11, 12, 0, 0], [0, 0, 0, 0], [13, 0, 0, 0]]
    assert [a.tolist() for a in drop_targets(positions, ids, 99)] == [positions.tolist(), ids.tolist()]
