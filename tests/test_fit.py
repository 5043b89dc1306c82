"""batch.micro_batch_size auto (bert/run/fit.py): the largest micro batch that divides the
replica's share of the global batch and fits the memory, chosen from a step measured at
micro batches 1 and 2, the run then training as one given that split."""
from __future__ import annotations

import json

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


def test_auto_is_refused_for_pipelines():
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


# ---------------------------------------------------------------- fine-tuning
def squad_file(path, rng) -> None:
    """A SQuAD v1.1 file of short contexts whose answers are words of them."""
    from tests.test_classify import sentence

    paragraphs = []
    for i in range(6):
        context = f"{sentence(rng, 8, 14)}. {sentence(rng, 8, 14)}."
        word = context.split()[int(rng.integers(0, 6))]
        paragraphs.append({"context": context, "qas": [{"id": f"q{i}", "question": f"where is {word}?",
                                                        "answers": [{"text": word, "answer_start": context.index(word)}]}]})
    path.write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": paragraphs}]}))


def fine_tune_raw(tmp_path, task: str, **batch) -> dict:
    """A tiny GroupBERT fine-tuning config of `task` from random weights, its files in `tmp_path`."""
    import numpy as np

    from tests.test_classify import labelled_rows, sentence, write_tsv, write_vocab

    rng = np.random.default_rng(4)
    tmp_path.mkdir(parents=True, exist_ok=True)
    vocab = write_vocab(tmp_path / "vocab.txt")
    if task == "classification":
        data = {"train_file": str(write_tsv(tmp_path / "train.tsv", labelled_rows(rng, 24))),
                "dev_file": str(write_tsv(tmp_path / "dev.tsv", labelled_rows(rng, 10))),
                "text_columns": ["sentence"], "label_column": "label"}
        labels = {"labels": ["no", "yes"]}
    elif task == "tokens":
        lines = ["\n".join(f"{w} {'B-PER' if w in ('john', 'mary') else 'O'}" for w in sentence(rng).split())
                 for _ in range(24)]
        (tmp_path / "train.conll").write_text("\n\n".join(lines) + "\n")
        data, labels = {"train_file": str(tmp_path / "train.conll")}, {"labels": ["B-PER", "O"]}
    else:
        squad_file(tmp_path / "train.json", rng)
        data, labels = {"source": "squad", "train_file": str(tmp_path / "train.json"), "doc_stride": 8,
                        "max_query_length": 6}, {}
    return {"version": 3, "name": task,
            "model": {"architecture": "groupbert", "task": task, "hidden_size": 32, "num_layers": 2, "num_heads": 2,
                      "vocab_size": 50, "sequence_length": 24, "max_positions": 32, **labels},
            "data": {"vocab_file": str(vocab), **data},
            "training": {"steps": 3, "output_dir": str(tmp_path / "run"), "log_every": 1, "seed": 5},
            "optimizer": {"name": "adamw", "learning_rate": 3e-3}, "schedule": {"warmup_steps": 1},
            "batch": batch or {"micro_batch_size": "auto", "global_batch_size": 12}}


def fine_tune_of(task: str):
    from bert.tasks import labelled, squad

    return squad.fine_tune if task == "squad" else labelled.fine_tune


@pytest.mark.parametrize("task", ["classification", "tokens", "squad"])
def test_a_fine_tune_takes_the_split_that_fits_once_its_model_is_sized_and_trains_as_that_split_given(
        tmp_path, capsys, task):
    """The probe is a session of the task's own graph (its head sized by the labels, random
    weights): under a limit between its peaks at 4 and 6 rows, auto splits 12 as 4 × 3, and
    the run's losses are those of the run given 4 × 3, bit for bit."""
    from bert.tasks.rows import probe_session

    given_raw = fine_tune_raw(tmp_path / "given", task, micro_batch_size=4, gradient_accumulation=3)
    fit = measure_memory(config_from_dict(given_raw), torch.device("cpu"), probe_session)
    auto_raw = fine_tune_raw(tmp_path / "auto", task, micro_batch_size="auto", global_batch_size=12,
                             auto_memory_gib=(fit.peak(4) + fit.peak(6)) / 2 / GIB)
    fine_tune = fine_tune_of(task)
    ran = fine_tune(config_from_dict(auto_raw), progress=False)
    out = capsys.readouterr().out
    assert "batch.micro_batch_size auto: 4 (gradient accumulation 3 × 1 replica(s) = global batch 12)" in out, out
    assert "6 would need" in out and "micro batch 4 × gradient accumulation 3" in out
    saved = json.loads((tmp_path / "auto" / "run" / "config.json").read_text())["batch"]
    assert (saved["micro_batch_size"], saved["gradient_accumulation"], saved["global_batch_size"]) == (4, 3, None)
    given = fine_tune(config_from_dict(given_raw), progress=False)
    losses = [[r["loss"] for r in result.metrics if "loss" in r] for result in (ran, given)]
    assert losses[0] == losses[1] and len(losses[0]) == 3


def test_eval_of_an_auto_fine_tune_config_scores_as_its_run(tmp_path, capsys):
    """`bert.py eval` of a config whose micro batch is auto chooses it for the scored model, as
    the run did, and gives the run's own dev figures."""
    from tests.tiny_runs import bert_cli

    config = tmp_path / "auto.json"
    config.write_text(json.dumps(fine_tune_raw(tmp_path, "classification", micro_batch_size="auto",
                                               global_batch_size=12, auto_memory_gib=64.0)))
    main = bert_cli()
    assert main(["train", "--config", str(config)]) == 0
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["eval", "--config", str(config), "--checkpoint-input", str(run / "checkpoint-final")]) == 0
    assert "batch.micro_batch_size auto: 12 (gradient accumulation 1" in capsys.readouterr().out
    (scored,) = run.glob("eval-checkpoint-final*")
    assert json.loads((scored / "eval_results.json").read_text()) == json.loads((run / "eval_results.json").read_text())


def test_a_fine_tune_resumed_with_more_room_keeps_its_checkpoints_split(tmp_path, capsys):
    """The split is the run's: a resume with room for all 12 rows takes the checkpoint's 4 × 3
    and ends where the uninterrupted run ends."""
    from bert.tasks.labelled import fine_tune
    from bert.tasks.rows import probe_session

    fit = measure_memory(config_from_dict(fine_tune_raw(tmp_path / "probe", "classification", micro_batch_size=4)),
                         torch.device("cpu"), probe_session)
    first = fine_tune_raw(tmp_path / "part", "classification", micro_batch_size="auto", global_batch_size=12,
                          auto_memory_gib=(fit.peak(4) + fit.peak(6)) / 2 / GIB)
    first["training"]["steps"] = 2
    fine_tune(config_from_dict(first), progress=False)
    roomy = {**first, "training": {**first["training"], "steps": 3},
             "batch": {**first["batch"], "auto_memory_gib": fit.peak(12) * 2 / GIB}}
    capsys.readouterr()
    resumed = fine_tune(config_from_dict(roomy), "auto", progress=False)
    assert "batch.micro_batch_size auto: 4, as " in capsys.readouterr().out
    whole = fine_tune(config_from_dict(fine_tune_raw(tmp_path / "whole", "classification", micro_batch_size=4,
                                                     gradient_accumulation=3)), progress=False)
    assert [r["loss"] for r in resumed.metrics if "loss" in r][-1] == [r["loss"] for r in whole.metrics
                                                                         if "loss" in r][-1]
