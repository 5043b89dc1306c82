"""A real (tiny) pre-training run on the built-in structured corpus must learn."""
import numpy as np
import pytest

from bert import config_from_dict
from bert.train import train


@pytest.mark.slow
def test_300_steps_on_the_demo_corpus_lower_the_mlm_loss_by_40_percent(tmp_path):
    cfg = config_from_dict({
        "name": "learns",
        "model": {"architecture": "groupbert", "hidden_size": 64, "num_layers": 2, "num_heads": 2,
                  "vocab_size": 2048, "sequence_length": 64, "max_predictions": 10},
        "training": {"steps": 300, "micro_batch_size": 16, "learning_rate": 0.01, "warmup": "sqrt",
                     "warmup_steps": 30, "decay": "polynomial", "output_dir": str(tmp_path / "run")},
        "data": {"source": "demo", "directory": str(tmp_path / "demo")},
    })
    result = train(cfg, progress=False)
    mlm = np.array([m["mlm_loss"] for m in result.metrics])
    assert len(mlm) == 300
    first, last = mlm[:5].mean(), mlm[-20:].mean()
    assert last <= 0.6 * first, f"MLM loss {first:.3f} → {last:.3f}: less than a 40% drop"
    accuracy = np.mean([m["mlm_accuracy"] for m in result.metrics[-20:]])
    assert accuracy > 50 / 2048, f"MLM accuracy {accuracy:.3f} is not well above chance (1/2048)"
