"""Packing on the data side (data/packing.py, PretrainingLoader(packing=True)): the packer's
limits and fill, SQuAD features packed and read back, and a packed pre-training run that
resumes exactly. The model's side is tests/test_packing.py."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from bert import build_model, config_from_dict
from bert.tasks.pretraining import train
from data.create_pretraining_data import create_pretraining_data
from data.packing import best_fit_decreasing, pack_squad_features, packing_efficiency, unpack_span_logits
from data.pretraining import CreateOptions
from data.squad import convert_examples_to_features, feature_arrays, load_squad
from data.vocab import make_tokenizer
from session import LoweredGraph
from tests.helpers import assert_close, tiny_config, write_small_corpus
from tests.squad_data import write_tiny_squad
from tests.tiny_runs import one_thread  # noqa: F401 (fixture)

S = 256


def test_best_fit_decreasing_keeps_its_limits_and_fills_rows():
    # Lengths like the demo corpus at S = 512 (mean about 71, a long tail), 15 % masked.
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(4.1, 0.6, 5000).astype(np.int64), 3, 512)
    masks = np.maximum(1, np.round(0.15 * lengths)).astype(np.int64)
    packs = best_fit_decreasing(lengths, 512, 16, masks, 96)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths))), "every sequence exactly once"
    assert max(len(p) for p in packs) <= 16
    assert max(lengths[p].sum() for p in packs) <= 512 and max(masks[p].sum() for p in packs) <= 96
    efficiency = lengths.sum() / (len(packs) * 512)
    assert efficiency >= 0.95, f"efficiency {efficiency:.3f}"
    # The count limit binds when it is below S / mean length: 3 per row fill about 3 × 71 / 512.
    assert lengths.sum() / (len(best_fit_decreasing(lengths, 512, 3)) * 512) < 0.5
    with pytest.raises(ValueError, match="a sequence of 513 tokens cannot be packed into rows of 512"):
        best_fit_decreasing(np.array([5, 513]), 512, 3)


@pytest.fixture(scope="module")
def squad_arrays(tmp_path_factory):
    train_file, _, vocab = write_tiny_squad(tmp_path_factory.mktemp("squad"), train_docs=40, dev_docs=2)
    examples = load_squad(train_file).examples
    features = convert_examples_to_features(examples, make_tokenizer(vocab.path), max_seq_length=S, doc_stride=48,
                                            max_query_length=16)
    return feature_arrays(features)


def test_pack_squad_features_keeps_every_feature_and_its_span(squad_arrays):
    a = squad_arrays
    packed = pack_squad_features(a, max_sequences_per_pack=3)
    rows = len(packed["input_ids"])
    assert packed["start_positions"].shape == packed["feature_index"].shape == (rows, 3)
    assert packing_efficiency(packed["sequence_index"]) > a["input_mask"].mean() + 0.2
    assert sorted(packed["feature_index"][packed["feature_index"] >= 0]) == list(range(len(a["input_ids"])))
    for r, k in zip(*np.nonzero(packed["feature_index"] >= 0)):
        f = packed["feature_index"][r, k]
        where = np.flatnonzero(packed["sequence_index"][r] == k + 1)
        length = int(a["input_mask"][f].sum())
        assert len(where) == length and (np.diff(where) == 1).all()
        for key in ("input_ids", "segment_ids"):
            assert (packed[key][r, where] == a[key][f, :length]).all(), key
        assert (packed["position_ids"][r, where] == np.arange(length)).all()
        for key in ("start_positions", "end_positions"):
            assert packed[key][r, k] == where[0] + a[key][f], "labels move with the feature (0: its own [CLS])"
    unused = packed["feature_index"] < 0
    assert (packed["start_positions"][unused] == -100).all() and (packed["end_positions"][unused] == -100).all()
    assert (packed["input_mask"] == (packed["sequence_index"] > 0)).all()
    with pytest.raises(ValueError, match="feature 1: input_mask must be 1s then 0s"):
        bad = dict(a, input_mask=a["input_mask"].copy())
        bad["input_mask"][1, 0] = 0
        pack_squad_features(bad)


def test_packed_squad_rows_give_every_feature_its_own_logits(squad_arrays):
    # pack_squad_features → the packed graph → unpack_span_logits gives each feature the
    # logits the unpacked graph gives it, on its context and its [CLS] (what
    # post-processing reads); the rest of its row is masked.
    a = {k: v[:24] for k, v in squad_arrays.items()}
    cfg = tiny_config("groupbert", task="squad", vocab_size=700, sequence_length=S, max_positions=S, packed=True,
                      max_sequences_per_pack=3)
    packed_graph = LoweredGraph(build_model(cfg, with_loss=False, seed=3).builder.model_proto()).eval()
    plain_graph = LoweredGraph(build_model(cfg.unpacked(), with_loss=False, seed=3).builder.model_proto()).eval()
    packed = pack_squad_features(a, 3)
    with torch.no_grad():
        out = packed_graph({k: torch.from_numpy(packed[k]) for k in packed_graph.input_names})
        want = plain_graph({k: torch.from_numpy(a[k]) for k in plain_graph.input_names})
    for name in ("start_logits", "end_logits"):
        got = unpack_span_logits(out[name].numpy(), packed, len(a["input_ids"]))
        answerable = (a["segment_ids"] == 1) & (a["input_mask"] == 1)
        answerable[:, 0] = True
        assert_close(got[answerable], want[name].numpy()[answerable], 1e-5, name)
        assert (got[~answerable] < -5000).all()


def test_packed_pretraining_run_resumes_exactly(tmp_path, capsys):
    # bert.py's run on packed rows from shards of natural lengths: the loader packs, prints
    # its efficiency, and a run resumed from a checkpoint continues bit for bit.
    files, vocab = write_small_corpus(tmp_path, [80, 80], [3, 4], 300)
    create_pretraining_data(files, tmp_path / "shards", vocab=vocab.path, progress=False,
                            options=CreateOptions(seq_len=48, max_predictions=6, natural_lengths=True, seed=2))
    cfg = config_from_dict({
        "name": "packed",
        "model": dict(architecture="groupbert", hidden_size=48, num_layers=2, num_heads=3, vocab_size=300,
                      sequence_length=48, max_predictions=6, max_positions=64, packed=True, max_sequences_per_pack=4),
        "training": dict(steps=6, micro_batch_size=4, learning_rate=0.01, warmup_steps=2, checkpoint_every=3,
                         output_dir=str(tmp_path / "run"), log_every=1),
        "data": dict(source="shards", files=[str(tmp_path / "shards" / "*.hdf5")], shuffle_buffer=64, prefetch=2),
    })
    full = train(cfg, progress=False)
    assert "PretrainingLoader packing:" in capsys.readouterr().out
    shutil.rmtree(full.output_dir / "checkpoint-final")
    resumed = train(cfg, checkpoint_input=str(full.output_dir / "checkpoint-3"), progress=False)
    assert [m["step"] for m in resumed.metrics] == [4, 5, 6]
    for a, b in zip(full.metrics[3:], resumed.metrics):
        for key in ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy"):
            assert a[key] == b[key], f"step {a['step']} {key}: {a[key]!r} uninterrupted vs {b[key]!r} resumed"
    assert all(np.isfinite(m["loss"]) for m in full.metrics)


def test_packed_config_needs_the_packing_loader():
    with pytest.raises(ValueError, match="model.packed takes its rows from the packing loader"):
        config_from_dict({"name": "x", "model": dict(architecture="bert", hidden_size=48, num_layers=1, num_heads=3,
                                                     packed=True), "data": {"source": "synthetic"}})
