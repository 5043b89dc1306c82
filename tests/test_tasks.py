"""The task specs (bert/tasks/spec.py) against facts found elsewhere: transformers' own head
classes and the problem type they set, the figures each task's evaluation produces, and the
entry points bert.py reaches."""
from __future__ import annotations

import ast
import importlib
import json
import sys

import numpy as np
import pytest
import torch

from bert.config import ModelConfig, Task
from bert.tasks import SPECS, TaskSpec
from tests.tiny_runs import ROOT, bert_cli, one_thread  # noqa: F401 (an autouse fixture)

IDS = [s.task.value for s in SPECS]


def test_every_task_has_one_spec_and_the_spec_is_its_own():
    assert [s.task for s in SPECS] == list(Task), "one spec per Task, in the enum's order"
    for task in Task:
        assert isinstance(task.spec, TaskSpec) and task.spec.task is task
        assert task.labelled == task.spec.labelled
    assert {t.value for t in Task if t.labelled} == {"classification", "regression", "tokens", "multi_label"}


def _loaded_imports(path) -> set[str]:
    """The top-level packages a module imports when it is loaded: its module-level imports,
    not those inside functions (made when called) or under `if TYPE_CHECKING:`."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module)
    return found


def test_the_spec_modules_load_only_the_standard_library_and_numpy():
    # A config is checked without torch, onnx or the builder; the entry points, readers,
    # metrics and graph ops load when called.
    allowed = set(sys.stdlib_module_names) | {"__future__", "numpy"}
    spec = _loaded_imports(ROOT / "bert" / "tasks" / "spec.py")
    assert {m.split(".")[0] for m in spec - {"bert.tasks.targets"}} <= allowed, spec
    targets = _loaded_imports(ROOT / "bert" / "tasks" / "targets.py")
    assert {m.split(".")[0] for m in targets} <= allowed, targets


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_the_best_and_secondary_metrics_are_among_the_scores(spec):
    assert spec.best_metric in spec.scores
    assert set(spec.secondary_metrics) <= set(spec.scores) - {spec.best_metric}
    assert len(set(spec.scores)) == len(spec.scores)
    assert spec.minimize == spec.best_metric.endswith("loss"), "a loss is lowered; accuracy, F1, correlation raised"


def _model(task: Task, labels=None) -> ModelConfig:
    return ModelConfig(architecture="bert", task=task, vocab_size=101, hidden_size=48, num_layers=2, num_heads=3,
                       labels=labels)


def _labelled_figures(spec: TaskSpec) -> dict:
    """The figures bert/tasks/labelled.py's `figures` (the run's evaluation, infer.py --score) gives."""
    from bert.tasks.labelled import Rows, figures

    if spec.per_token:
        model = _model(spec.task, ("B-PER", "I-PER", "O"))
        rows = Rows("dev", [1], {"word_index": np.array([[-1, 0, 1, -1]])}, [["B-PER", "O"]], [["Ann", "ran"]])
        logits = np.eye(3)[[2, 0, 2, 2]][None]  # (1, S, L): B-PER at the first word, O at the second
    elif not spec.named_outputs:  # regression's one value
        model, rows, logits = _model(spec.task), Rows("dev", [1, 2], {}, np.array([0.5, 2.0])), np.array([[0.4], [1.9]])
    elif spec.problem_type == "multi_label_classification":  # a set of labels per row
        model = _model(spec.task, ("a", "b", "c"))
        rows = Rows("dev", [1, 2], {}, np.array([[1.0, 0, 1], [0, 1, 0]], np.float32))
        logits = np.array([[2.0, -1, 0.5], [-1, 1.0, 1]])
    else:
        model = _model(spec.task, ("a", "b", "c"))
        rows, logits = Rows("dev", [1, 2], {}, np.array([0, 2])), np.array([[2.0, 0, 0], [0, 0, 1.0]])
    return figures(model, rows, logits)[0]


def _squad_figures() -> set[str]:
    """The official scores (data/squad/scoring.py) of a v1.1 file and of a v2.0 file with the
    threshold search, as the SQuAD run's evaluation reports them."""
    from data.squad.scoring import evaluate

    question = {"id": "1", "question": "what?", "answers": [{"text": "big", "answer_start": 2}]}
    article = {"title": "t", "paragraphs": [{"context": "a big cat", "qas": [question]}]}
    v1 = evaluate({"data": [article]}, {"1": "big"})
    impossible = {"id": "2", "question": "who?", "answers": [], "is_impossible": True}
    article["paragraphs"][0]["qas"].append(impossible)
    v2 = evaluate({"data": [article]}, {"1": "big", "2": ""}, {"1": 0.1, "2": 0.9})
    assert Task.SQUAD.spec.best_metric in v1 and Task.SQUAD.spec.best_metric in v2
    return set(v1) | set(v2)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_the_scores_are_what_the_tasks_evaluation_produces(spec):
    if spec.labelled:
        assert set(spec.scores) == set(_labelled_figures(spec))
    elif spec.head == "span":
        assert set(spec.scores) <= _squad_figures()
    else:  # the evaluation record of a pre-training run (bert/tasks/pretraining.py Pretraining.evaluate)
        record = next(json.loads(line) for line in
                      (ROOT / "tests/fixtures/checkpoint_format3/metrics.jsonl").read_text().splitlines()
                      if "eval_loss" in line)
        assert set(spec.scores) == set(record) - {"step"}
        assert all(s.startswith("eval_") for s in spec.scores), "held-out figures: the sweep's eval_* metrics"


def _hf_inputs(spec: TaskSpec, labels: int) -> dict:
    """A batch with the labels transformers' class for `spec` takes, in the dtype of the task."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 101, (2, 7), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if spec.head == "pretraining":
        return {**batch, "labels": ids, "next_sentence_label": torch.tensor([0, 1])}
    if spec.head == "span":
        return {**batch, "start_positions": torch.tensor([1, 2]), "end_positions": torch.tensor([3, 2])}
    if spec.head == "token":
        return {**batch, "labels": torch.randint(0, labels, (2, 7), generator=g)}
    if not spec.named_outputs:  # regression
        return {**batch, "labels": torch.tensor([0.5, 2.0])}
    if spec.problem_type == "multi_label_classification":  # HF's choice for float labels of several outputs
        return {**batch, "labels": torch.tensor([[1.0] + [0.0] * (labels - 1), [0.0] * (labels - 1) + [1.0]])}
    return {**batch, "labels": torch.tensor([0, labels - 1])}


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_the_hf_class_exists_and_sets_the_specs_problem_type(spec):
    transformers = pytest.importorskip("transformers")
    bert_class = getattr(transformers, "Bert" + spec.hf_class)
    modeling = importlib.import_module("bert.hf_groupbert.modeling_groupbert")
    assert issubclass(getattr(modeling, "GroupBert" + spec.hf_class), modeling.GroupBertPreTrainedModel)
    labels = 1 if spec.labelled and not spec.named_outputs else 2 if spec.head == "span" else 3  # the span head: start and end
    config = transformers.BertConfig(vocab_size=101, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                                     intermediate_size=96, num_labels=labels)
    model = bert_class(config).eval()
    with torch.no_grad():
        out = model(**_hf_inputs(spec, labels))
    assert out.loss is not None
    # transformers decides the problem type on the first forward with labels: ours must be its.
    assert model.config.problem_type == spec.problem_type, (spec.task, model.config.problem_type)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_the_entry_points_resolve_to_the_jobs_functions(spec):
    for entry in (spec.train_entry(), spec.evaluate_entry()):
        assert callable(entry)
    assert spec.train_entry().__name__ == spec.train.split(":")[1]
    assert spec.evaluate_entry().__name__ == spec.evaluate.split(":")[1]


_CONFIGS = {Task.PRETRAINING: ["--config", "configs/demo.json", "--data.source", "synthetic"],
            Task.SQUAD: ["--config", "configs/squad_tiny.json"],
            Task.CLASSIFICATION: ["--config", "configs/classify_demo.json"],
            Task.REGRESSION: ["--config", "configs/classify_demo.json", "--model.task", "regression"],
            Task.TOKENS: ["--config", "configs/tokens_demo.json"],
            Task.MULTI_LABEL: ["--config", "configs/classify_demo.json", "--model.task", "multi_label"]}


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("command", ["train", "eval"])
def test_bert_py_runs_the_specs_entry_point(spec, command, monkeypatch):
    monkeypatch.chdir(ROOT)
    entry = spec.train if command == "train" else spec.evaluate
    module, name = entry.split(":")
    called = []
    monkeypatch.setattr(importlib.import_module(module), name, lambda config, **kw: called.append(config))
    assert bert_cli()([command, *_CONFIGS[spec.task]]) == 0
    assert [c.model.task for c in called] == [spec.task]
