"""A real (tiny) pre-training run on the built-in structured corpus must learn: beat the
baselines of its own data by a wide margin, not just chance."""
import h5py
import numpy as np
import pytest

from bert import config_from_dict
from bert.tasks.pretraining import train
from bert.tasks.unigram import PLATEAU_FACTOR


def masked_token_baselines(shards) -> tuple[float, float]:
    """(accuracy of always guessing the most frequent masked token, unigram entropy in nats)
    over the masked tokens of `shards`: what a model learns from token counts alone."""
    labels = []
    for path in shards:
        with h5py.File(path) as f:
            labels.append(f["masked_lm_ids"][:][f["masked_lm_positions"][:] != 0])
    counts = np.bincount(np.concatenate(labels))
    p = counts[counts > 0] / counts.sum()
    return float(p.max()), float(-(p * np.log(p)).sum())


@pytest.mark.slow
def test_300_steps_on_the_demo_corpus_beat_the_unigram_baselines(tmp_path, capsys):
    cfg = config_from_dict({
        "name": "learns",
        "model": {"architecture": "groupbert", "hidden_size": 64, "num_layers": 2, "num_heads": 2,
                  "vocab_size": 2048, "sequence_length": 64, "max_predictions": 10},
        "training": {"steps": 300, "output_dir": str(tmp_path / "run"), "log_every": 1},
        "optimizer": {"learning_rate": 0.01},
        "schedule": {"warmup": "sqrt", "warmup_steps": 30, "decay": "polynomial"},
        "batch": {"micro_batch_size": 16},
        "data": {"source": "demo", "directory": str(tmp_path / "demo"), "eval_samples": 256},
        "evaluation": {"every": 75},
    })
    result = train(cfg)  # not a terminal: a line per record and evaluation
    out = capsys.readouterr().out
    evaluations = [m for m in result.metrics if "eval_mlm_accuracy" in m]
    result.metrics = [m for m in result.metrics if "loss" in m]  # the training steps' records
    assert len(result.metrics) == 300
    most_frequent, entropy = masked_token_baselines(sorted((tmp_path / "demo" / "train").glob("*.hdf5")))
    # On these shards: most frequent 0.098, entropy 4.99 nats; this run reached accuracy 0.38 and
    # MLM loss 3.32 over its last 20 steps (seed 0). The bars sit about a fifth of the gain below.
    accuracy = np.mean([m["mlm_accuracy"] for m in result.metrics[-20:]])
    loss = np.mean([m["mlm_loss"] for m in result.metrics[-20:]])
    assert accuracy >= most_frequent + 0.2, (
        f"MLM accuracy {accuracy:.3f}: not 0.2 above always guessing the most frequent token ({most_frequent:.3f})")
    assert loss <= entropy - 1.25, (
        f"MLM loss {loss:.3f} nats: not 1.25 below the unigram entropy of the masked tokens ({entropy:.3f})")
    # The run says so. It answers "." at every mask at step 75 (exactly the baseline), and is past
    # the plateau from step 150, half its steps (WARN_AFTER), on: never warned.
    assert "warning:" not in out, out
    assert f"(unigram {most_frequent:.3f})" in out, "the training accuracy beside the same baseline"
    assert "past the unigram plateau" in out, out
    assert [m["step"] for m in evaluations] == [75, 150, 225, 300]
    assert all(m["eval_mlm_accuracy"] >= PLATEAU_FACTOR * m["unigram_mlm_accuracy"] for m in evaluations[1:]), evaluations
