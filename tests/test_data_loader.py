"""PretrainingLoader: coverage, replica shares, resume, dynamic masking, packing, bad shards."""

import json
from collections import Counter

import h5py
import numpy as np
import pytest
import torch

import data.pretraining
from data import PretrainingLoader
from data.create_pretraining_data import create_pretraining_data
from data.demo import generate_documents, write_corpus
from data.masking import unmask_rows
from data.pretraining import SAMPLE_KEYS, CreateOptions
from tests.helpers import write_small_corpus

SEQ, P = 64, 10


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    files, vocab = write_small_corpus(d, [120, 160, 200], [7, 8, 9], 500)
    mp = pytest.MonkeyPatch()
    mp.setattr(data.pretraining, "CHUNK_ROWS", 16)  # many small blocks to shuffle
    try:
        r = create_pretraining_data(files, d / "out", vocab=vocab.path, progress=False,
                                    options=CreateOptions(seq_len=SEQ, max_predictions=P, seed=1))
    finally:
        mp.undo()
    return r.shards, vocab


def _all_rows(paths):
    arrays = {k: [] for k in SAMPLE_KEYS}
    for p in paths:
        with h5py.File(p) as f:
            for k in SAMPLE_KEYS:
                arrays[k].append(f[k][:])
    return {k: np.concatenate(v) for k, v in arrays.items()}


def _key(ids, pos):
    return ids.astype(np.int64).tobytes() + pos.astype(np.int64).tobytes()


def _epoch_rows(loader):
    """Row keys of one epoch (drop_last=False), consumed until the epoch counter moves."""
    keys = []
    start = loader.epoch
    for batch in loader:
        keys += [_key(i.numpy(), p.numpy()) for i, p in zip(batch["input_ids"], batch["masked_lm_positions"])]
        if loader.epoch == start + 1:
            return keys


def _take(loader, n):
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == n:
            return out


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


def test_batches_have_the_interface(shards):
    paths, vocab = shards
    loader = PretrainingLoader(paths, 8, seed=0)
    batch = next(iter(loader))
    assert set(batch) == set(SAMPLE_KEYS)
    assert batch["input_ids"].shape == (8, SEQ) and batch["masked_lm_positions"].shape == (8, P)
    assert batch["next_sentence_labels"].shape == (8,)
    assert all(v.dtype == torch.int64 for v in batch.values())
    assert (loader.seq_len, loader.max_predictions, loader.vocab_size) == (SEQ, P, vocab.size)
    json.dumps(loader.state_dict())
    loader.close()


def test_epoch_sees_every_sample_once_and_reshuffles(shards):
    paths, _ = shards
    rows = _all_rows(paths)
    everything = Counter(_key(i, p) for i, p in zip(rows["input_ids"], rows["masked_lm_positions"]))
    loader = PretrainingLoader(paths, 7, seed=3, shuffle_buffer=50, block_rows=16, drop_last=False)
    first = _epoch_rows(loader)
    assert Counter(first) == everything
    second = _epoch_rows(loader)  # epoch 1 → 2
    assert Counter(second) == everything and second != first
    other_seed = _epoch_rows(PretrainingLoader(paths, 7, seed=4, shuffle_buffer=50, block_rows=16, drop_last=False))
    assert other_seed != first
    # Samples from different shards mix within the first batches.
    sources = np.repeat(np.arange(len(paths)), [len(_all_rows([p])["input_ids"]) for p in paths])
    index = {k: s for k, s in zip((_key(i, p) for i, p in zip(rows["input_ids"], rows["masked_lm_positions"])), sources)}
    assert len({index[k] for k in first[:60]}) > 1


@pytest.mark.parametrize("replicas", [2, 3])
def test_replica_shares_are_disjoint_and_complete(shards, replicas):
    paths, _ = shards
    rows = _all_rows(paths)
    everything = Counter(_key(i, p) for i, p in zip(rows["input_ids"], rows["masked_lm_positions"]))
    shares = [Counter(_epoch_rows(PretrainingLoader(paths, 5, seed=2, replica_rank=r, replica_count=replicas,
                                                    shuffle_buffer=40, block_rows=16, drop_last=False)))
              for r in range(replicas)]
    assert sum(shares, Counter()) == everything
    for a in range(replicas):
        for b in range(a + 1, replicas):
            assert not (shares[a] & shares[b]), "replica shares overlap"
    # drop_last: every replica yields the same number of batches per epoch.
    counts = []
    for r in range(replicas):
        loader = PretrainingLoader(paths, 5, seed=2, replica_rank=r, replica_count=replicas)
        n = 0
        for _ in loader:
            if loader.epoch == 1:
                break
            n += 1
        counts.append(n + 1)
    assert len(set(counts)) == 1 and counts[0] == loader.batches_per_epoch


@pytest.mark.parametrize(
    "kw", [{}, {"prefetch": 0}, {"replica_rank": 1, "replica_count": 2}, {"dynamic_masking": True},
           {"packing": True}, {"packing": True, "dynamic_masking": True, "drop_last": False},
           {"packing": True, "replica_rank": 1, "replica_count": 3, "max_sequences_per_pack": 5}],
    ids=["plain", "sync", "replica", "dynamic", "packed", "packed-dynamic-keep-last", "packed-replica"],
)
def test_resume_continues_exactly(shards, kw):
    paths, _ = shards
    make = lambda: PretrainingLoader(paths, 16, seed=5, shuffle_buffer=40, block_rows=16, verbose=False, **kw)  # noqa: E731
    total = 200
    probe = make()
    full = _take(probe, total)
    assert probe.epoch >= 1, "the run must cross an epoch boundary"
    for cut in (57, 130):  # inside the first epoch, and inside the second
        first = make()
        head = _take(first, cut)
        state = json.loads(json.dumps(first.state_dict()))
        first.close()
        resumed = make()
        resumed.load_state_dict(state)
        _same(head + _take(resumed, total - cut), full)


def _packed_keys(batch):
    """The key of every sequence of a packed batch: its tokens and masked positions as _key
    gives them for the unpacked row (padded to SEQ, P slots)."""
    b = {k: v.numpy() for k, v in batch.items()}
    keys = []
    for r in range(len(b["input_ids"])):
        for j in range(1, b["sequence_index"][r].max() + 1):
            where = np.flatnonzero(b["sequence_index"][r] == j)
            ids = np.zeros(SEQ, np.int64)
            ids[: len(where)] = b["input_ids"][r, where]
            mp = b["masked_lm_positions"][r]
            pos = np.zeros(P, np.int64)
            mine = mp[(mp >= where[0]) & (mp <= where[-1]) & (mp != 0)] - where[0]
            pos[: len(mine)] = mine
            keys.append(_key(ids, pos))
    return keys


@pytest.mark.parametrize("replicas", [2, 3])
def test_packed_replica_shares_are_disjoint_and_complete(shards, replicas):
    # Each replica packs its own share: together they hold every sample once per epoch.
    paths, _ = shards
    rows = _all_rows(paths)
    everything = Counter(_key(i, p) for i, p in zip(rows["input_ids"], rows["masked_lm_positions"]))
    shares = []
    for r in range(replicas):
        loader = PretrainingLoader(paths, 5, seed=2, replica_rank=r, replica_count=replicas, shuffle_buffer=40,
                                   block_rows=16, drop_last=False, packing=True, verbose=False)
        seen = Counter()
        for batch in loader:
            seen.update(_packed_keys(batch))
            if loader.epoch == 1:
                break
        shares.append(seen)
    assert sum(shares, Counter()) == everything
    for a in range(replicas):
        for b in range(a + 1, replicas):
            assert not (shares[a] & shares[b]), "replica shares overlap"


@pytest.mark.parametrize("packing", [False, True], ids=["plain", "packed"])
def test_replicas_see_the_rows_of_one_process_and_resume_with_any_count(shards, packing):
    """R replicas of batch b take the rows one process takes with batches of R·b, and a
    position written with one replica count resumes exactly with another."""
    paths, _ = shards

    def make(batch, rank, count):
        return PretrainingLoader(paths, batch, seed=5, shuffle_buffer=40, block_rows=16, verbose=False,
                                 replica_rank=rank, replica_count=count, packing=packing, max_sequences_per_pack=4)

    one = make(12, 0, 1)
    stream = _take(one, 9)
    three = [make(4, r, 3) for r in range(3)]
    per_replica = [_take(loader, 9) for loader in three]
    for step in range(9):
        _same([{k: torch.cat([b[step][k] for b in per_replica]) for k in stream[step]}], [stream[step]])
    # A position after 4 steps of 3 replicas, resumed by one process and by 2 replicas of 6.
    state = json.loads(json.dumps(make_after(make, 4, 3, 4)))
    resumed = make(12, 0, 1)
    resumed.load_state_dict(state)
    _same(_take(resumed, 5), stream[4:])
    two = [make(6, r, 2) for r in range(2)]
    for loader in two:
        loader.load_state_dict(state)
    halves = [_take(loader, 5) for loader in two]
    for step in range(5):
        _same([{k: torch.cat([h[step][k] for h in halves]) for k in stream[4 + step]}], [stream[4 + step]])


def make_after(make, batch, count, steps):
    """The state of replica 0 of `count` replicas after `steps` steps (all replicas' states are equal)."""
    loaders = [make(batch, r, count) for r in range(count)]
    for loader in loaders:
        _take(loader, steps)
    states = [loader.state_dict() for loader in loaders]
    assert all({k: v for k, v in st.items() if k != "replica_rank"} ==
               {k: v for k, v in states[0].items() if k != "replica_rank"} for st in states)
    return states[0]


def test_prefetch_does_not_change_the_stream(shards):
    paths, _ = shards
    a = _take(PretrainingLoader(paths, 9, seed=1, prefetch=0), 30)
    b = _take(PretrainingLoader(paths, 9, seed=1, prefetch=3), 30)
    _same(a, b)


def test_state_from_other_settings_is_refused(shards):
    paths, _ = shards
    state = PretrainingLoader(paths, 6, seed=5).state_dict()
    with pytest.raises(ValueError, match="seed=5 but this loader has 7"):
        PretrainingLoader(paths, 6, seed=7).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle_buffer=16384 but this loader has 40"):
        PretrainingLoader(paths, 6, seed=5, shuffle_buffer=40).load_state_dict(state)
    PretrainingLoader(paths, 8, seed=5).load_state_dict(state)  # another batch size: a place in the same stream


def test_dynamic_masking_remasks_consistently(shards):
    paths, vocab = shards
    rows = _all_rows(paths)
    originals = {unmask_rows(i[None], p[None], m[None])[0].tobytes()
                 for i, p, m in zip(rows["input_ids"], rows["masked_lm_positions"], rows["masked_lm_ids"])}
    loader = PretrainingLoader(paths, 16, seed=0, dynamic_masking=True)
    static = {_key(i, p) for i, p in zip(rows["input_ids"], rows["masked_lm_positions"])}
    n_masked = n_cand = changed = total = 0
    for batch in _take(loader, 40):
        ids, pos, lm = (batch[k].numpy() for k in ("input_ids", "masked_lm_positions", "masked_lm_ids"))
        tokens = unmask_rows(ids, pos, lm)
        for r in range(len(ids)):
            assert tokens[r].astype(np.int32).tobytes() in originals
            changed += _key(ids[r], pos[r]) not in static
            total += 1
        n_masked += (pos != 0).sum()
        n_cand += batch["input_mask"].sum().item() - 3 * len(ids)
        assert not np.isin(tokens[np.arange(len(ids))[:, None], pos][pos != 0], [vocab.cls_id, vocab.sep_id]).any()
    assert changed > 0.9 * total, "dynamic masking must draw new masks"
    assert abs(n_masked / n_cand - 0.15) < 0.02


def test_packing(shards, capsys):
    paths, vocab = shards
    rows = _all_rows(paths)
    originals = Counter(
        unmask_rows(i[None], p[None], m[None])[0][: int(k.sum())].astype(np.int64).tobytes()
        for i, p, m, k in zip(rows["input_ids"], rows["masked_lm_positions"], rows["masked_lm_ids"], rows["input_mask"])
    )
    loader = PretrainingLoader(paths, 4, seed=0, packing=True, drop_last=False)
    assert loader.max_predictions == P + 3
    seen = Counter()
    for batch in loader:
        b = {k: v.numpy() for k, v in batch.items()}
        n = len(b["input_ids"])  # the last batch of the epoch may be short (drop_last=False)
        assert b["next_sentence_labels"].shape == (n, 3) and b["nsp_positions"].shape == (n, 3)
        tokens = unmask_rows(b["input_ids"], b["masked_lm_positions"], b["masked_lm_ids"])
        for r in range(len(tokens)):
            si, pos_ids = b["sequence_index"][r], b["position_ids"][r]
            k = si.max()
            length = int((si > 0).sum())
            assert (si[:length] > 0).all() and (si[length:] == 0).all() and (np.diff(si[:length]) >= 0).all()
            assert (b["input_mask"][r] == (si > 0)).all()
            for j in range(1, k + 1):
                where = np.flatnonzero(si == j)
                start = where[0]
                assert (pos_ids[where] == np.arange(len(where))).all(), "positions restart per sequence"
                assert b["nsp_positions"][r, j - 1] == start and tokens[r, start] == vocab.cls_id
                assert b["next_sentence_labels"][r, j - 1] in (0, 1)
                seen[tokens[r, where].astype(np.int64).tobytes()] += 1
            assert (b["next_sentence_labels"][r, k:] == -100).all()
            mp = b["masked_lm_positions"][r]
            used = mp[mp != 0]
            assert (si[used] > 0).all() and not np.isin(tokens[r, used], [vocab.cls_id, vocab.sep_id]).any()
        if loader.epoch == 1:
            break
    assert seen == originals, "packing keeps every sequence exactly once per epoch"
    out = capsys.readouterr().out
    assert "packing" in out and "efficiency" in out
    unpacked = rows["input_mask"].mean()
    assert loader.packing_efficiency > unpacked + 0.05


# --------------------------------------------------------------------------- bad shards


def test_bad_shards_are_named(shards, tmp_path):
    paths, _ = shards
    good = paths[0].read_bytes()
    truncated = tmp_path / "truncated.hdf5"
    truncated.write_bytes(good[: len(good) // 2])
    garbage = tmp_path / "garbage.hdf5"
    garbage.write_bytes(b"this is not hdf5" * 100)
    empty = tmp_path / "empty.hdf5"
    empty.write_bytes(b"")
    for bad, what in ((truncated, "corrupt or truncated"), (garbage, "corrupt or truncated"), (empty, "empty")):
        with pytest.raises(ValueError, match=f"shard {bad}: .*{what}"):
            PretrainingLoader([paths[1], bad], 4)
    with pytest.raises(ValueError, match=f"{tmp_path / 'missing.hdf5'} does not exist"):
        PretrainingLoader([tmp_path / "missing.hdf5"], 4)
    incomplete = tmp_path / "incomplete.hdf5"
    with h5py.File(incomplete, "w") as f:
        f["input_ids"] = np.zeros((4, SEQ), np.int32)
    with pytest.raises(ValueError, match=f"shard {incomplete}: missing dataset.*input_mask"):
        PretrainingLoader([incomplete], 2)


def test_corrupt_chunk_is_named_when_opened_and_when_read(shards, tmp_path):
    paths, _ = shards
    raw = bytearray(paths[0].read_bytes())
    with h5py.File(paths[0]) as f:
        offset = f["input_ids"].id.get_chunk_info(0).byte_offset
    raw[offset : offset + 64] = b"\0" * 64  # break the first compressed chunk of input_ids
    bad = tmp_path / "bad_chunk.hdf5"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=f"shard {bad}: dataset input_ids, rows 0:.* cannot be read"):
        PretrainingLoader([bad], 4)
    # A file damaged after the loader opened it is named when its rows are read.
    later = tmp_path / "later.hdf5"
    later.write_bytes(paths[0].read_bytes())
    loader = PretrainingLoader([later], 4, shuffle_buffer=10_000)
    later.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=f"shard {later}: rows .* cannot be read"):
        _take(loader, 5)


def test_mixed_shapes_are_refused(shards, tmp_path):
    paths, vocab = shards
    f2 = tmp_path / "c.txt"
    write_corpus(f2, generate_documents(30, seed=1))
    r = create_pretraining_data([f2], tmp_path / "o", vocab=vocab.path, progress=False,
                                options=CreateOptions(seq_len=32, max_predictions=P))
    with pytest.raises(ValueError, match=f"shard {r.shards[0]} has seq_len=32"):
        PretrainingLoader([paths[0], r.shards[0]], 4)


def test_prefetch_thread_stops_when_iteration_stops(shards):
    import threading

    paths, _ = shards
    loader = PretrainingLoader(paths, 4, prefetch=2)
    for i, _ in enumerate(loader):
        if i == 3:
            break
    state = loader.state_dict()
    alive = [t for t in threading.enumerate() if t.name == "PretrainingLoader-prefetch" and t.is_alive()]
    assert not alive, "the prefetch thread must end with the iteration"
    assert (state["window"], state["offset"]) == (0, 16), "the position counts delivered batches only"
    old = iter(loader)
    next(old)
    new = iter(loader)  # supersedes `old`
    next(new)
    with pytest.raises(RuntimeError, match="superseded"):
        next(old)
