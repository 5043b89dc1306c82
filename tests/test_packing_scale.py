"""Packed pre-training scaled out: 2 replicas with RTS, and 2 pipeline stages, train on the
loader's packed rows exactly as one process does (≤ 1e-5, fp32), and a resume on packed
rows continues exactly (real shards with natural lengths, real torchrun processes)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bert import config_from_dict
from bert.tasks.pretraining import train
from data.corpus import read_documents
from data.create_pretraining_data import create_pretraining_data
from data.pretraining import CreateOptions
from tests.helpers import sections, write_small_corpus
from tests.test_distributed import torchrun

STEPS = 4


@pytest.fixture(scope="module")
def natural_shards(tmp_path_factory):
    """Short documents (their first two sentences): rows of 2-3 sequences once packed."""
    root = tmp_path_factory.mktemp("packed")
    files, vocab = write_small_corpus(root, [200], [11], 300)
    short = root / "short.txt"
    short.write_text("\n\n".join("\n".join(doc[:2]) for doc in read_documents(files[0])) + "\n")
    create_pretraining_data([short], root / "shards", vocab=vocab.path, progress=False,
                            options=CreateOptions(seq_len=128, max_predictions=6, natural_lengths=True,
                                                  seed=3))
    return root / "shards"


def packed_config(shards: Path, out: Path, **training) -> dict:
    return {
        "name": "packed",
        "model": dict(architecture="groupbert", hidden_size=48, num_layers=2, num_heads=3, vocab_size=300,
                      sequence_length=128, max_predictions=6, max_positions=128, packed=True, max_sequences_per_pack=3),
        **sections(**{**dict(steps=STEPS, micro_batch_size=4, learning_rate=0.01, warmup_steps=1, output_dir=str(out),
                             log_every=1, eval_every=0), **training}),
        "data": dict(source="shards", files=[str(shards / "*.hdf5")], eval_samples=0, shuffle_buffer=64, prefetch=2),
    }


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def final_weights(run_dir: Path) -> np.ndarray:
    files = sorted((run_dir / "checkpoint-final").glob("weights.vg*.data"))
    return np.concatenate([np.frombuffer(f.read_bytes(), np.float32) for f in files])


def run_torchrun(tmp_path: Path, name: str, cfg: dict) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    result = torchrun(2, "bert.py", "--config", str(path))
    assert result.returncode == 0, result.stdout[-4000:]
    return Path(cfg["training"]["output_dir"])


@pytest.fixture(scope="module")
def one_process(natural_shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "run"
    result = train(config_from_dict(packed_config(natural_shards, out, gradient_accumulation=2, checkpoint_every=2)),
                   progress=False)
    assert len(losses(out)) == STEPS
    return result


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["replicas_rts", "pipeline"])
def test_packed_training_scaled_out_equals_one_process(natural_shards, one_process, tmp_path, mode):
    if mode == "replicas_rts":  # 2 replicas of micro batch 4: each takes half of every global batch
        cfg = packed_config(natural_shards, tmp_path / mode, replicated_tensor_sharding=True)
    else:  # 2 stages of one replica, the same 2 micro-batches per step
        cfg = packed_config(natural_shards, tmp_path / mode, gradient_accumulation=2, pipeline=True)
        cfg["model"]["layers_per_stage"] = [1, 1]
    out = run_torchrun(tmp_path, mode, cfg)
    expected = losses(one_process.output_dir)
    np.testing.assert_allclose(losses(out), expected, rtol=1e-5, err_msg=f"{mode}: losses on packed rows")
    ours, theirs = final_weights(one_process.output_dir), final_weights(out)
    if mode == "pipeline":  # per-stage files hold the same tensors in another grouping
        ours, theirs = np.sort(ours), np.sort(theirs)
    assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(ours).max(), f"{mode}: final weights"


@pytest.mark.slow
def test_a_packed_run_resumes_exactly_with_another_process_count(natural_shards, one_process, tmp_path):
    """Two replicas with RTS resume the one-process run's packed checkpoint at step 2: steps 3
    and 4 read the same packed rows and give the same losses and weights."""
    cfg = packed_config(natural_shards, one_process.output_dir, replicated_tensor_sharding=True)
    path = tmp_path / "resume.json"
    path.write_text(json.dumps(cfg))
    result = torchrun(2, "bert.py", "--config", str(path), "--checkpoint-input",
                      str(one_process.output_dir / "checkpoint-2"))
    assert result.returncode == 0, result.stdout[-4000:]
    branch = next(p for p in one_process.output_dir.parent.iterdir() if p.name.startswith("run.") and
                  (p / "metrics.jsonl").exists())
    np.testing.assert_allclose(losses(branch)[-2:], losses(one_process.output_dir)[-2:], rtol=1e-5)
    ours, theirs = final_weights(one_process.output_dir), final_weights(branch)
    assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(ours).max()
