"""batch.micro_batch_size auto (bert/run/fit.py): the largest micro batch that divides the
replica's share of the global batch and fits the memory, chosen from a step measured at
micro batches 1 and 2, the run then training as one given that split."""
from __future__ import annotations

import pytest
import torch

from bert import config_from_dict
from bert.run.fit import GIB, fit_micro_batch, measure_memory
from bert.run.rundir import starting_checkpoint
from bert.tasks.pretraining import make_session, train
from tests.tiny_runs import one_thread  # noqa: F401  (autouse)

MODEL = dict(architecture="groupbert", hidden_size=48, num_layers=2, num_heads=3, vocab_size=300,
             sequence_length=32, max_predictions=5, max_positions=64)


def raw(out, **batch) -> dict:
    return {"name": "fit", "model": MODEL, "data": {"source": "synthetic"},
            "training": {"steps": 3, "output_dir": str(out), "log_every": 1, "seed": 3},
            "optimizer": {"name": "lamb", "learning_rate": 0.01}, "schedule": {"warmup_steps": 1},
            "batch": batch or {"micro_batch_size": "auto", "global_batch_size": 24}}


@pytest.fixture(scope="module")
def memory():
    """The step's memory as the tiny model's probe measures it."""
    probe = config_from_dict(raw("unused", micro_batch_size=1))
    return measure_memory(probe, torch.device("cpu"), make_session, rows=(1, 2))


def test_the_measured_memory_grows_by_the_same_bytes_for_every_row(memory):
    probe = config_from_dict(raw("unused", micro_batch_size=1))
    at_3_and_6 = measure_memory(probe, torch.device("cpu"), make_session, rows=(3, 6))
    assert memory.per_row > 0 and memory.fixed > 0
    # What a forward pass saves for backward is the same per row at 1, 2, 3 and 6 rows: the
    # straight line through 1 and 2 predicts 6 rows' peak to within 2 %.
    assert at_3_and_6.peak(6) == pytest.approx(memory.peak(6), rel=0.02)
    assert at_3_and_6.per_row == pytest.approx(memory.per_row, rel=0.02)
    # Weights, gradients and two LAMB moments in fp32: at least 4 × 4 bytes a parameter.
    with make_session(probe) as session:
        parameters = sum(p.numel() for _, p in session.named_weights())
    assert memory.fixed >= 16 * parameters


def test_auto_takes_the_largest_divisor_that_fits_and_trains_as_that_split_given(memory, tmp_path, capsys):
    # Between the peaks of micro batches 8 and 12: of 24's divisors (24, 12, 8, 6, ...) 8 fits.
    limit = (memory.peak(8) + memory.peak(12)) / 2
    auto = config_from_dict(raw(tmp_path / "auto", micro_batch_size="auto", global_batch_size=24,
                                auto_memory_gib=limit / GIB))
    fitted, line = fit_micro_batch(auto, 1, None, make_session)
    assert (fitted.batch.micro_batch_size, fitted.batch.gradient_accumulation) == (8, 3)
    assert "auto: 8 (gradient accumulation 3 × 1 replica(s) = global batch 24)" in line and "12 would need" in line
    ran = train(auto, progress=False)
    out = capsys.readouterr().out
    assert line.split(":", 1)[0] in out and "micro batch 8 × gradient accumulation 3" in out
    given = train(config_from_dict(raw(tmp_path / "given", micro_batch_size=8, gradient_accumulation=3)),
                  progress=False)
    assert [r["loss"] for r in ran.metrics] == [r["loss"] for r in given.metrics]
    assert len(ran.metrics) == 3


def test_a_limit_above_the_whole_share_takes_it_in_one_micro_batch(memory):
    auto = config_from_dict(raw("x", micro_batch_size="auto", global_batch_size=24,
                                auto_memory_gib=memory.peak(24) * 1.01 / GIB))
    fitted, line = fit_micro_batch(auto, 2, None, make_session)  # 2 replicas: 12 rows each
    assert (fitted.batch.micro_batch_size, fitted.batch.gradient_accumulation) == (12, 1)
    assert "would need" not in line


def test_a_resume_takes_the_checkpoints_split_whatever_the_memory_now(memory, tmp_path, capsys):
    first = raw(tmp_path / "run", micro_batch_size="auto", global_batch_size=24,
                auto_memory_gib=(memory.peak(8) + memory.peak(12)) / 2 / GIB)
    first["training"]["steps"] = 2
    train(config_from_dict(first), progress=False)
    # With room for all 24 now, the resumed run still splits as its checkpoint did.
    resumed = {**first, "training": {**first["training"], "steps": 3},
               "batch": {**first["batch"], "auto_memory_gib": memory.peak(24) * 2 / GIB}}
    config = config_from_dict(resumed)
    checkpoint = starting_checkpoint(config, "auto")
    fitted, line = fit_micro_batch(config, 1, checkpoint, make_session)
    assert (fitted.batch.micro_batch_size, fitted.batch.gradient_accumulation) == (8, 3)
    assert f"auto: 8, as {checkpoint} was trained" in line
    capsys.readouterr()
    result = train(config, "auto", progress=False)
    assert [r["step"] for r in result.metrics] == [3]
    uninterrupted = raw(tmp_path / "whole", micro_batch_size=8, gradient_accumulation=3)
    assert result.metrics[-1]["loss"] == train(config_from_dict(uninterrupted), progress=False).metrics[-1]["loss"]


def test_what_auto_cannot_do_is_one_line_naming_what_to_change(memory):
    tight = config_from_dict(raw("x", micro_batch_size="auto", global_batch_size=24,
                                 auto_memory_gib=memory.peak(1) * 0.5 / GIB))
    with pytest.raises(ValueError, match=r"a micro batch of 1 needs about .* set batch.auto_memory_gib higher"):
        fit_micro_batch(tight, 1, None, make_session)
    with pytest.raises(ValueError, match="global_batch_size 24 does not split over 5 replicas"):
        fit_micro_batch(config_from_dict(raw("x")), 5, None, make_session)


@pytest.mark.parametrize("batch, words", [
    ({"micro_batch_size": "auto"}, "set it"),
    ({"micro_batch_size": "auto", "global_batch_size": 8, "gradient_accumulation": 2}, "chooses gradient_accumulation"),
    ({"micro_batch_size": 4, "global_batch_size": 8}, "read with micro_batch_size auto only"),
    ({"micro_batch_size": 4, "auto_memory_gib": 1.0}, "read with micro_batch_size auto only"),
    ({"micro_batch_size": "most"}, "micro_batch_size"),
])
def test_a_batch_section_auto_cannot_read_is_refused(batch, words):
    with pytest.raises(ValueError, match=words):
        config_from_dict(raw("x", **batch))


def test_auto_is_refused_for_fine_tuning_and_pipelines():
    labelled = {**raw("x"), "model": {**MODEL, "task": "classification", "num_labels": 2},
                "data": {"source": "files", "train_file": "t.csv"}}
    with pytest.raises(ValueError, match="auto applies to pre-training"):
        config_from_dict(labelled)
    piped = {**raw("x"), "model": {**MODEL, "layers_per_stage": [1, 1]}, "parallel": {"pipeline": True}}
    with pytest.raises(ValueError, match="with parallel.pipeline each stage holds a part"):
        config_from_dict(piped)


def test_a_steps_flops_and_a_budgets_steps_do_not_wait_for_the_split():
    from bert.run.budget import flops_per_step, resolve

    auto, given = config_from_dict(raw("x")), config_from_dict(raw("x", micro_batch_size=8, gradient_accumulation=3))
    # The global batch is the step's rows however many replicas share it.
    assert flops_per_step(auto, 2) == flops_per_step(auto, 1) == flops_per_step(given, 1) > 0
    budgeted = {"budget": {"flops": 40 * flops_per_step(given), "warmup": 0.1}, "schedule": {}}
    steps = [resolve(config_from_dict({**raw("x", **b), **budgeted}))[0].training.steps
             for b in ({"micro_batch_size": "auto", "global_batch_size": 24},
                       {"micro_batch_size": 8, "gradient_accumulation": 3})]
    assert steps == [40, 40]


@pytest.mark.slow
def test_torchruns_processes_each_measure_alone_and_agree_on_the_split(memory, tmp_path):
    """Under torchrun every process measures before the run's process group exists, on its own,
    and all take the same split: 24 over 2 replicas is 12 each, of which 6 fit here."""
    import json

    from tests.test_distributed import torchrun

    limit = (memory.peak(6) + memory.peak(12)) / 2 / GIB
    config = tmp_path / "config.json"
    config.write_text(json.dumps(raw(tmp_path / "run", micro_batch_size="auto", global_batch_size=24,
                                     auto_memory_gib=limit)))
    ran = torchrun(2, "bert.py", "train", "--config", str(config), "--training.steps", "2")
    assert ran.returncode == 0, ran.stdout[-3000:]
    assert ran.stdout.count("batch.micro_batch_size auto: 6 (gradient accumulation 2 × 2 replica(s)") == 1, (
        ran.stdout[-3000:])
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["batch"]
    assert (saved["micro_batch_size"], saved["gradient_accumulation"], saved["global_batch_size"]) == (6, 2, None)
