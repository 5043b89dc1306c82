"""Multi-label classification (model.task multi_label: bert/tasks/targets.py LabelSets), end to
end against independent references: HuggingFace's BertForSequenceClassification with
problem_type multi_label_classification (the same starting weights, files, batches and AdamW:
the losses of every step), torch's BCEWithLogitsLoss (the loss and its gradient, also where a
logit is exactly 0), scikit-learn's F1 and subset accuracy on the exported model's logits,
the export to transformers, serving (infer.py), a sweep and a comparison's stage.
"""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
import yaml

import infer
from bert.tasks.labelled import fine_tune
from bert.config import Task
from tests.test_classify import (S, STEPS, check_hf_export, hf_directory, hf_losses, our_losses, run_config, sentence,
                                 tiny_groupbert)
from tests.tiny_runs import ROOT, bert_cli, one_thread  # noqa: F401 (an autouse fixture)

LABELS = ["animal", "colour", "place"]
KINDS = {"animal": {"cat", "dog", "bird"}, "colour": {"red", "green", "blue"}, "place": {"paris", "london", "town"}}


def label_sets(rng, count):
    """Rows whose labels are the kinds of word they hold (any number, at least one)."""
    rows = []
    while len(rows) < count:
        text = sentence(rng)
        names = [k for k, words in KINDS.items() if words & set(text.split())]
        if names:
            rows.append((text, names))
    return rows


def write_rows(path, rows):
    path.write_text("sentence\tlabels\n" + "".join(f"{a}\t{','.join(y)}\n" for a, y in rows))
    return path


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_multi_label_trains_as_hf_with_binary_cross_entropy(tmp_path, packed):
    """The losses of every step equal transformers' multi-label head's; the export loads in
    transformers as that head (problem_type, id2label) with the session's logits."""
    rows = label_sets(np.random.default_rng(5), 8)
    assert any(len(y) > 1 for _, y in rows), "rows with two labels or more: the case that differs from classification"
    train = write_rows(tmp_path / "train.tsv", rows)
    hf = hf_directory(tmp_path, transformers.BertForSequenceClassification, LABELS)
    config = run_config(tmp_path, hf, "multi_label", {"train_file": str(train), "text_columns": ["sentence"],
                                                      "label_column": "labels"}, packed=packed)
    ours = our_losses(fine_tune(config, progress=False))

    tokenizer = transformers.BertTokenizerFast(vocab=str(hf / "vocab.txt"), do_lower_case=True)
    batch = tokenizer([a for a, _ in rows], truncation=True, max_length=S, padding="max_length", return_tensors="pt")
    batch["labels"] = torch.tensor([[float(n in y) for n in LABELS] for _, y in rows])
    model = transformers.BertForSequenceClassification.from_pretrained(hf, problem_type="multi_label_classification")
    reference = hf_losses(model, dict(batch))
    assert len(ours) == STEPS
    np.testing.assert_allclose(ours, reference, rtol=1e-5)
    assert reference[-1] < reference[0], "the steps learnt nothing: the comparison would be weak"
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert saved["task"] == "multi_label" and saved["labels"] == LABELS and saved["packed"] is packed
    if not packed:
        check_hf_export(tmp_path, tmp_path / "run", transformers.AutoModelForSequenceClassification, batch, LABELS)
        exported = json.loads((tmp_path / "hf_export" / "config.json").read_text())
        assert exported["problem_type"] == "multi_label_classification"
        assert exported["architectures"] == ["BertForSequenceClassification"]


def test_the_loss_and_its_gradient_are_bce_with_logits_also_at_a_logit_of_zero():
    """The graph's loss against torch's binary_cross_entropy_with_logits on the graph's own
    logits, and the classifier's gradients against autograd through it: with random weights,
    and with a zeroed classifier (every logit exactly 0, where the loss's kink would be)."""
    from bert import build_model
    from session import LoweredGraph
    from tests.helpers import random_batch, tiny_config

    cfg = tiny_config("bert", task="multi_label", labels=tuple(LABELS))
    for zeroed in (False, True):
        graph = LoweredGraph(build_model(cfg, seed=4).builder.model_proto())
        if zeroed:
            with torch.no_grad():
                for name, w in graph.named_weights():
                    if name.startswith("classifier."):
                        w.zero_()
        feeds = {k: torch.from_numpy(v) for k, v in random_batch(cfg, 6, seed=2).items() if k in graph.input_names}
        labels = torch.from_numpy(np.random.default_rng(3).integers(0, 2, (6, 3)).astype(np.float32))
        out = graph({**feeds, "labels": labels})
        logits = out["logits"].detach().requires_grad_(True)
        want = F.binary_cross_entropy_with_logits(logits, labels)
        want.backward()
        out["loss"].backward()
        torch.testing.assert_close(out["loss"], want, rtol=1e-6, atol=1e-7)
        bias = dict(graph.named_weights())["classifier.bias"]
        torch.testing.assert_close(bias.grad, logits.grad.sum(0), rtol=1e-5, atol=1e-7)
        if zeroed:
            assert (out["logits"] == 0).all()
            torch.testing.assert_close(bias.grad, (0.5 - labels).mean(0) / 3, rtol=1e-6, atol=1e-8)


def test_a_model_that_learned_nothing_is_named():
    """One label set for every row, or fewer whole sets right than the most frequent set."""
    from bert.tasks.labelled import Rows
    from bert.config import ModelConfig

    model = Task.MULTI_LABEL.spec.targets
    cfg = ModelConfig(architecture="bert", task="multi_label", hidden_size=48, num_layers=2, num_heads=3,
                      labels=("a", "b", "c"))
    rows = Rows("dev", [1, 2, 3], {}, np.array([[1, 0, 0], [1, 0, 0], [0, 1, 1]], np.float32))
    assert model.degenerate(cfg, rows, np.array([[1, 1, 0]] * 3)) == "predicts one label set ('a,b') for all 3 dev rows"
    assert model.degenerate(cfg, rows, np.array([[0, 1, 0], [1, 0, 0], [0, 0, 1]])) == (
        "scores accuracy 0.3333 (whole sets), below always answering the dev set's most frequent set ('a', 0.6667)")
    assert model.degenerate(cfg, rows, np.array([[1, 0, 0], [1, 0, 0], [0, 1, 0]])) is None


def _run(tmp_path):
    """A tiny GroupBERT multi-label run through bert.py, with a dev file: its directory and argv."""
    rng = np.random.default_rng(6)
    train = write_rows(tmp_path / "train.tsv", label_sets(rng, 24))
    dev = write_rows(tmp_path / "dev.tsv", label_sets(rng, 10))
    argv = tiny_groupbert(tmp_path, "multi_label", train, dev, text_columns=["sentence"], label_column="labels")
    argv += ["--training.steps", "40", "--checkpoint.every", "20"]
    assert bert_cli()(argv) == 0
    return tmp_path / "run", argv, dev


def test_a_multi_label_run_scores_serves_and_evaluates_as_scikit_learn_says(tmp_path, capsys):
    """bert.py train writes the dev figures and predictions; `infer.py --score` of its export
    gives those figures, which are scikit-learn's on the export's own logits; `infer.py --task
    classify` gives each label's sigmoid; `bert.py eval` scores the checkpoint as the run did."""
    import onnxruntime as ort
    import sklearn.metrics

    from bert.tasks.labelled import encode, read_rows
    from bert.config import config_from_dict
    from data.labelled import sentence_features

    run, argv, dev = _run(tmp_path)
    expected = json.loads((run / "eval_results.json").read_text())
    assert set(expected) >= set(Task.MULTI_LABEL.spec.scores)
    model = tmp_path / "m.onnx"
    assert bert_cli()(["export", *argv[1:], "--checkpoint-input", str(run / "checkpoint-final"),
                       "--output", str(model)]) == 0
    capsys.readouterr()
    assert infer.main(["--model", str(model), "--task", "classify", "--score", str(dev), "--no-progress"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures.pop("rows") == 10
    assert figures == pytest.approx({k: expected[k] for k in Task.MULTI_LABEL.spec.scores}, abs=1e-6)

    # scikit-learn on the export's logits (onnxruntime), the gold read from the file here.
    config = config_from_dict(json.loads((run / "config.json").read_text()))
    served = infer.OnnxModel(str(model))
    rows = encode(config, read_rows(config, str(dev)), served.tokenizer)
    feeds = {k: rows.arrays[k] for k in ("input_ids", "segment_ids", "input_mask")}
    logits = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]
    gold = np.array([[n in y.split(",") for n in config.model.labels] for y in
                     (line.split("\t")[1] for line in dev.read_text().splitlines()[1:])], np.int64)
    predicted = (logits > 0).astype(np.int64)
    assert len({tuple(row) for row in predicted}) > 1, "one set for every row: too weak a check of the figures"
    assert expected["f1"] == pytest.approx(sklearn.metrics.f1_score(gold, predicted, average="micro",
                                                                    zero_division=0), abs=1e-4)
    assert expected["f1_macro"] == pytest.approx(sklearn.metrics.f1_score(gold, predicted, average="macro",
                                                                          zero_division=0), abs=1e-4)
    assert expected["accuracy"] == pytest.approx(sklearn.metrics.accuracy_score(gold, predicted), abs=1e-4)
    lines = (run / "predictions.tsv").read_text().splitlines()
    assert lines[0] == "line\tprediction\tlabel" and len(lines) == 11
    assert [line.split("\t")[1] for line in lines[1:]] == [
        ",".join(n for n, p in zip(config.model.labels, row) if p) for row in predicted]

    # Serving: every label with its own sigmoid, most probable first.
    text = dev.read_text().splitlines()[1].split("\t")[0]
    assert infer.main(["--model", str(model), "--task", "classify", "--text", text, "--top-k", "3",
                       "--output", str(tmp_path / "out.jsonl"), "--no-progress"]) == 0
    (answer,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    one = sentence_features(served.tokenizer, [(text,)], config.model.sequence_length)
    want = 1 / (1 + np.exp(-ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(
        ["logits"], {k: one[k] for k in feeds})[0][0].astype(np.float64)))
    got = dict(answer["labels"])
    assert sorted(got) == sorted(config.model.labels)
    assert [got[n] for n in config.model.labels] == pytest.approx(list(want), abs=1e-6)
    assert [p for _, p in answer["labels"]] == sorted(got.values(), reverse=True)

    capsys.readouterr()
    assert bert_cli()(["eval", *argv[1:], "--checkpoint-input", str(run / "checkpoint-final")]) == 0
    scored = sorted(run.glob("eval-checkpoint-final*"))
    assert json.loads((scored[0] / "eval_results.json").read_text()) == expected


def test_a_sweep_ranks_multi_label_runs_by_their_macro_f1(tmp_path):
    """A one-trial grid with metric f1_macro: the trial's value is its run's dev figure."""
    import optuna

    from bert.sweep import open_storage

    rng = np.random.default_rng(7)
    train = write_rows(tmp_path / "train.tsv", label_sets(rng, 16))
    dev = write_rows(tmp_path / "dev.tsv", label_sets(rng, 6))
    argv = tiny_groupbert(tmp_path, "multi_label", train, dev, text_columns=["sentence"], label_column="labels")
    sweep = tmp_path / "ml.yaml"
    sweep.write_text(yaml.safe_dump({
        "program": "bert.py", "name": "ml", "method": "grid", "metric": {"name": "f1_macro", "goal": "maximize"},
        "command": ["${env}", "${interpreter}", "${program}", "--config", argv[2], "${args}"],
        "parameters": {"training.steps": {"values": [3]}}}))
    out = tmp_path / "sweep"
    assert bert_cli()(["sweep", str(sweep), "--sweep-dir", str(out)]) == 0
    (trial,) = optuna.load_study(study_name="ml", storage=open_storage(str(out / "optuna.journal"))).get_trials()
    results = json.loads((Path(trial.user_attrs["output_dir"]) / "eval_results.json").read_text())
    assert trial.value == results["f1_macro"]


def test_a_comparison_fine_tunes_on_a_multi_label_task_and_ranks_by_its_f1(tmp_path, monkeypatch):
    """A comparison's `classify:` stage takes a multi-label config: its metric and figures are
    the task's (the stage holds no test of which task it has: tests/test_layout.py)."""
    from bert.compare import compare_from_dict

    monkeypatch.chdir(ROOT)
    rows = label_sets(np.random.default_rng(8), 12)
    train, dev = write_rows(tmp_path / "train.tsv", rows[:8]), write_rows(tmp_path / "dev.tsv", rows[8:])
    config = tmp_path / "ml.json"
    config.write_text(json.dumps({**json.loads((ROOT / "configs/classify_demo.json").read_text()),
                                  "model": {**json.loads((ROOT / "configs/classify_demo.json").read_text())["model"],
                                            "task": "multi_label"},
                                  "data": {"train_file": str(train), "dev_file": str(dev),
                                           "text_columns": ["sentence"], "label_column": "labels"}}))
    raw = yaml.safe_load((ROOT / "configs/compare/tiny.yaml").read_text())
    found = compare_from_dict({**raw, "classify": {"config": str(config)}, "squad": None}, "c.yaml")
    (task,) = [t for t in found.fine_tunes if t.task == "classify"]
    assert task.config.model.task is Task.MULTI_LABEL
    assert task.metric == "f1" and task.scores == ("f1", "f1_macro", "accuracy")
