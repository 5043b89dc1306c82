"""What the project knows of one task, in one object that every consumer reads (STYLE.md 27;
custom_ops/spec.py does the same for the custom ops).

A `TaskSpec` per `Task` value, in `SPECS`; `task.spec` is its spec. Each field is a fact
that some module used to branch on the task's name for:

    source         the data.source a fine-tune reads (bert/config: its default, the checks):
                   `squad` (SQuAD files), `files` (labelled rows, bert/tasks/labelled.py); None:
                   pre-training's samples (data.source demo, shards, synthetic, ...), which
                   the packing loader packs, held-out shards evaluate and a budget may size
    head           the graph's head (bert/model.py): `pretraining` (MLM + NSP), `span`
                   (SQuAD's start/end), `sequence` (the pooled [CLS]), `token` (every position)
    targets        what a labelled task predicts (bert/tasks/targets.py: Classes, Values,
                   Tags): its file's reader and gold, the head's width, the graph's labels
                   and loss, the figures and degenerate models, the predictions file and
                   serving's answer; None for pre-training and SQuAD
    pack_slots     sequences per packed row unless model.max_sequences_per_pack says: 3 for
                   pre-training and SQuAD (a graph shape: NSP and masked slots), 16 for rows
    best_metric    the figure that picks the best checkpoint (best.json) and ranks compare's
                   fine-tunes; `minimize`: lower is better
    secondary_metrics  the other figures compare's report shows beside it
    scores         every figure the task's evaluation logs (bert/tasks/metrics.py, data/squad's
                   official scores, the pre-training evaluation): what a sweep may optimise
    hf_class       transformers' head class without its model prefix: BERT's is
                   "Bert" + hf_class, GroupBERT's "GroupBert" + hf_class (bert/io/hf_export.py)
    problem_type   HF's `config.problem_type` of a sequence head; None where HF sets none
    serve          infer.py's --task that serves an export of the task (bert/io/serve.py)
    train, evaluate  the job's entry points, "module:function", imported when called (so
                   this module imports nothing of the project, and no cycle appears):
                   train(config, checkpoint_input, use_wandb, progress, on_log) -> RunResult,
                   evaluate(config, checkpoint_input) -> RunResult

This module imports no project module but bert/tasks/targets.py (which loads nothing of the
project until called), and no torch or onnx, so a config is checked without them.
"""
from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass
from typing import Callable, Literal, Optional

from bert.tasks.targets import Classes, LabelSets, Tags, Targets, Values

__all__ = ["LABELLED", "SPECS", "Task", "TaskSpec", "named"]

Head = Literal["pretraining", "span", "sequence", "token"]


class Task(str, enum.Enum):
    PRETRAINING = "pretraining"
    SQUAD = "squad"
    CLASSIFICATION = "classification"
    REGRESSION = "regression"
    TOKENS = "tokens"
    MULTI_LABEL = "multi_label"

    @property
    def spec(self) -> "TaskSpec":
        return _BY_TASK[self]

    @property
    def labelled(self) -> bool:
        """A task of labelled rows (bert/tasks/labelled.py): sequences or tokens, from data.train_file."""
        return self.spec.labelled


@dataclass(frozen=True)
class TaskSpec:
    task: Task
    description: str  # what the task trains, for the config's reference and --help
    source: Optional[Literal["squad", "files"]]
    head: Head
    best_metric: str
    secondary_metrics: tuple[str, ...]
    scores: tuple[str, ...]
    hf_class: str
    serve: Literal["mlm", "squad", "classify", "tokens"]
    train: str
    evaluate: str
    targets: Optional[Targets] = None
    minimize: bool = False
    pack_slots: int = 3
    problem_type: Optional[Literal["single_label_classification", "regression", "multi_label_classification"]] = None

    @property
    def labelled(self) -> bool:
        """Rows of a labelled file (data.source `files`), the head's outputs named by its labels."""
        return self.source == "files"

    @property
    def fine_tuning(self) -> bool:
        """Reads its own files (data.source `squad` or `files`) for steps or training.epochs;
        pre-training reads samples, for steps or a budget."""
        return self.source is not None

    @property
    def best(self) -> tuple[str, bool]:
        """(best_metric, minimize): what a job gives the loop as its `best_metric`."""
        return self.best_metric, self.minimize

    @property
    def per_token(self) -> bool:
        """A prediction per position (logits (B, S, L)), not per sequence."""
        return self.head == "token"

    @property
    def named_outputs(self) -> bool:
        """A labelled head whose outputs model.labels names (not regression's one value)."""
        return self.targets is not None and self.targets.named

    def train_entry(self) -> Callable:
        """The job's training function (bert.py train, a sweep's trial)."""
        return _resolve(self.train)

    def evaluate_entry(self) -> Callable:
        """The job's scoring of trained weights without training (bert.py eval)."""
        return _resolve(self.evaluate)


def _resolve(entry: str) -> Callable:
    """`module:function`, looked up when called (tests may replace the function)."""
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


# SQuAD's dev scores under the official scripts' names (v1.1; v2.0 with its HasAns/NoAns parts
# and the threshold search: data/squad/scoring.py).
_SQUAD_SCORES = ("exact_match", "f1", "exact", "HasAns_exact", "HasAns_f1", "NoAns_exact", "NoAns_f1",
                 "best_exact", "best_f1")
_LABELLED_JOB = {"train": "bert.tasks.labelled:fine_tune", "evaluate": "bert.tasks.labelled:evaluate_only", "source": "files",
                 "pack_slots": 16}

SPECS = (
    # No secondary metrics: compare ranks pre-training by a metric of its own (bert/compare/spec.py METRICS).
    TaskSpec(Task.PRETRAINING, "MLM + NSP heads and losses (bert/tasks/pretraining.py)", source=None, head="pretraining",
             best_metric="eval_loss", minimize=True, secondary_metrics=(),
             scores=("eval_loss", "eval_mlm_loss", "eval_mlm_accuracy", "eval_nsp_loss", "eval_nsp_accuracy"),
             hf_class="ForPreTraining", serve="mlm", train="bert.tasks.pretraining:train", evaluate="bert.tasks.pretraining:evaluate_only"),
    TaskSpec(Task.SQUAD, "the span head on SQuAD v1.1 or v2.0 (bert/tasks/squad.py)", source="squad", head="span",
             best_metric="f1", secondary_metrics=("exact_match",), scores=_SQUAD_SCORES,
             hf_class="ForQuestionAnswering", serve="squad", train="bert.tasks.squad:fine_tune",
             evaluate="bert.tasks.squad:evaluate_only"),
    TaskSpec(Task.CLASSIFICATION, "a label per row, single sentences or pairs (bert/tasks/labelled.py)",
             head="sequence", targets=Classes(),
             best_metric="accuracy", secondary_metrics=("f1", "matthews_correlation"),
             scores=("accuracy", "f1", "matthews_correlation"),
             hf_class="ForSequenceClassification", problem_type="single_label_classification", serve="classify",
             **_LABELLED_JOB),
    TaskSpec(Task.REGRESSION, "a number per row: one output, mean squared error (bert/tasks/labelled.py)",
             head="sequence", targets=Values(),
             best_metric="pearson", secondary_metrics=("spearman", "mse"), scores=("pearson", "spearman", "mse"),
             hf_class="ForSequenceClassification", problem_type="regression", serve="classify", **_LABELLED_JOB),
    TaskSpec(Task.TOKENS, "a label per word: named entities (bert/tasks/labelled.py)", head="token", targets=Tags(),
             best_metric="f1", secondary_metrics=("precision", "recall"), scores=("f1", "precision", "recall"),
             hf_class="ForTokenClassification", serve="tokens", **_LABELLED_JOB),
    TaskSpec(Task.MULTI_LABEL, "any labels per row, joined by commas: a sigmoid each (bert/tasks/labelled.py)",
             head="sequence", targets=LabelSets(),
             best_metric="f1", secondary_metrics=("f1_macro", "accuracy"), scores=("f1", "f1_macro", "accuracy"),
             hf_class="ForSequenceClassification", problem_type="multi_label_classification", serve="classify",
             **_LABELLED_JOB),
)
_BY_TASK = {s.task: s for s in SPECS}
LABELLED = tuple(s.task for s in SPECS if s.labelled)  # the tasks of labelled files (bert/tasks/labelled.py)


def named(tasks, last: str = "or") -> str:
    """Task names for a message: `'classification', 'regression' or 'tokens'`."""
    names = [repr(t.value) for t in tasks]
    return ", ".join(names[:-1]) + f" {last} " + names[-1] if len(names) > 1 else "".join(names)
