"""Fine-tuning on labelled rows: the job behind model.task `classification`, `regression`
and `tokens` (`python bert.py --config configs/classify_bert_base.json`).

    classification   a label per row: one text (`data.text_columns` names one column) or a
                     sentence pair (two columns: `[CLS] a [SEP] b [SEP]`, token types 0 and
                     1, the longer member truncated first); HF's BertForSequenceClassification
    regression       one number per row, the mean squared error as the loss
    tokens           a tag per word (IOB named entities), the first sub-word of each word
                     labelled and the rest ignored; HF's BertForTokenClassification

The files are as users have them (data/labelled.py): GLUE's TSVs with or without a
header, CSV, JSON lines, CoNLL columns. The labels are the training file's, sorted (or
model.labels), and go into the run's config.json, and so into its checkpoints and
exports; a dev label that training never saw is an error. Everything that can reject the
run (files, columns, labels, vocab) is read when the job is made, before anything is
written.

Short rows are packed (`model.packed`; unset: where a micro-batch needs PACKING_PAYS×
fewer rows): each micro-batch of a step packed on its own (data/packing.py), so a step
trains on the rows it trains on unpacked and has their loss; the classifier reads each
row's own [CLS] (bert/model.py).

The run is bert/run/loop.py's, as SQuAD's: `training.init_from` (a checkpoint of this project
or a HuggingFace directory: its sizes are adopted, a head it lacks starts from the run's
seed), replicas, RTS, pipelining, exact resume, `evaluation.every`, best.json on the
task's figure (accuracy, Pearson, entity F1). Its evaluation scores data.dev_file with
the metrics as the tasks define them (bert/tasks/metrics.py); after the last step the run
directory gets `eval_results.json` and the predictions (`predictions.tsv`, or for tokens
`predictions.conll`: word, gold tag, predicted tag, conlleval's input).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np
import torch

from bert.run.budget import Budget
from bert.config import Config, ModelConfig
from bert.run.loop import DataSizes, RunResult, round_figure, run
from bert.tasks.metrics import json_figures
from bert.run.fit import fitted, run_batch
from bert.tasks.rows import (EVAL_RESULTS, INPUTS, Features, FineTuning, epoch_order, forward_rows, probe_session,
                             score_in_run_dir, scored_start, steps_for_epochs, tokenizer_of)
from bert.io.sources import Start, starting_point
from bert.tasks import LABELLED, named
from bert.tasks.targets import Prediction
from data.labelled import Table, Tagged
from data.packing import best_fit_decreasing, pack_labelled_rows, pad_packed_rows, unpack_rows
from fileio import write_atomically
from session.training import TrainingSession

__all__ = ["EVAL_RESULTS", "Labelled", "Rows", "encode", "evaluate_only", "figures", "fine_tune", "read_rows"]

_TRAINED = (*INPUTS, "labels")  # what a training batch feeds the graph
PACKING_PAYS = 1.5  # model.packed unset: pack when a step's rows shrink by this factor at least


@dataclass(frozen=True)
class Rows:
    """One labelled file encoded for the graph: its arrays (inputs and labels) and what
    maps predictions back to its rows (tokens: each sentence's words and first sub-words)."""

    path: str
    lines: list[int]
    arrays: dict[str, np.ndarray]
    gold: Union[np.ndarray, list[list[str]]]  # label ids, targets, or each sentence's tags
    words: Optional[list[list[str]]] = None
    per_token: bool = False  # labels (N, S): a tag per position
    _packed: dict = field(default_factory=dict, compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.lines)

    def packed(self, slots: int) -> dict[str, np.ndarray]:
        """All the rows packed (made once): the forward of a packed model."""
        if slots not in self._packed:
            self._packed[slots] = pack_labelled_rows(self.arrays, slots, self.per_token)
        return self._packed[slots]


class PackedFeatures(Features):
    """The training stream of a packed model: the rows of each step are the rows the
    unpacked stream takes, each micro-batch's packed on its own (so a step trains on the
    same rows, and its loss, a mean over them, is theirs), every micro-batch of the step
    padded with empty rows to the same count."""

    def __init__(self, arrays: dict[str, np.ndarray], micro_batch_size: int, accumulation: int, slots: int,
                 seed: int, replica: int = 0, replicas: int = 1, per_token: bool = False):
        super().__init__(arrays, micro_batch_size * accumulation, seed, replica, replicas)
        self.micro_batch_size, self.slots, self.per_token = micro_batch_size, slots, per_token

    def batch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        size = self.micro_batch_size
        parts = [pack_labelled_rows({k: v[rows[i : i + size]] for k, v in self.arrays.items()}, self.slots,
                                    self.per_token)
                 for i in range(0, len(rows), size)]
        most = max(len(part["input_ids"]) for part in parts)
        parts = [pad_packed_rows(part, most) for part in parts]
        return {k: torch.from_numpy(np.concatenate([part[k] for part in parts])) for k in parts[0] if k in _TRAINED}


def read_rows(config: Config, path: str, format_option: str = "data.format") -> Union[Table, Tagged]:
    """The rows of a labelled file as the config's columns name them; `format_option`: the
    setting that gives data.format, as the reader's errors name it (infer.py's --format)."""
    return config.model.task.spec.targets.read(config, path, format_option)


def with_labels(model: ModelConfig, found: Union[Table, Tagged]) -> ModelConfig:
    """The model with its head's labels: model.labels, else the training file's, sorted."""
    return model.task.spec.targets.with_labels(model, found)


def encode(config: Config, found: Union[Table, Tagged], tokenizer) -> Rows:
    """A file's rows as graph arrays, truncated to model.sequence_length (said once per file)."""
    arrays, gold, words = config.model.task.spec.targets.features(config, found, tokenizer)
    return Rows(found.path, found.lines, arrays, gold, words, per_token=config.model.task.spec.per_token)


def with_packing(config: Config, train: Rows) -> Config:
    """model.packed unset: packed where it pays, i.e. where packing each micro-batch of the
    first epoch's order (as the stream will) needs PACKING_PAYS× fewer rows, said on the
    console either way; set, as it is."""
    model, batch = config.model, config.batch.micro_batch_size
    if model.packed is not None:
        return config
    lengths = train.arrays["input_mask"].sum(axis=1)
    order = epoch_order(config.training.seed, 0, len(lengths))
    steps = [order[i : i + batch] for i in range(0, len(order) - batch + 1, batch)] or [order]
    packed = sum(len(best_fit_decreasing(lengths[rows], model.sequence_length, model.pack_slots)) for rows in steps)
    saving = sum(len(rows) for rows in steps) / packed
    pack = saving >= PACKING_PAYS
    print(f"packing: rows of {lengths.mean():.0f} tokens on average in sequences of {model.sequence_length}: "
          + (f"packed, {saving:.2f}x fewer rows per micro-batch (model.packed false: one per row)" if pack else
             f"one per row (packing would save {saving:.2f}x; model.packed true packs anyway)"), flush=True)
    return config.model_copy(update={"model": model.model_copy(update={"packed": pack})})


class Labelled(FineTuning):
    """The labelled-rows job of bert/run/loop.py (every task whose spec has targets)."""

    def __init__(self, config: Config, checkpoint_input: Optional[str] = None):
        """`checkpoint_input`: where the run starts from (bert/run/loop.py `run`), which decides
        its batch with the model (bert/run/fit.py `run_batch`)."""
        _check(config)
        d = config.data
        self.source = starting_point(config, config.training.init_from)
        config = config.model_copy(update={"model": self.source.model})  # sizes of the starting weights
        self.tokenizer = _tokenizer(self.source)
        train = read_rows(config, d.train_file)
        config = config.model_copy(update={"model": with_labels(config.model, train)})
        _check_head(config.model, self.source)
        self.train = encode(config, train, self.tokenizer)
        self.dev = encode(config, read_rows(config, d.dev_file), self.tokenizer) if d.dev_file else None
        config = run_batch(config, checkpoint_input, probe_session)  # once the files have been read and checked
        self.config = steps_for_epochs(with_packing(config, self.train), len(self.train))
        self.best_metric = config.model.task.spec.best if self.dev is not None else None
        self.budget = Budget()
        self._last: Optional[tuple[dict, Prediction]] = None  # the last evaluation's figures and predictions

    def stream(self, replica: int, replicas: int) -> Features:
        arrays = {k: v for k, v in self.train.arrays.items() if k in _TRAINED}
        c = self.config
        if c.model.packed:
            return PackedFeatures(arrays, c.batch.micro_batch_size, c.batch.gradient_accumulation, c.model.pack_slots,
                                  c.training.seed, replica, replicas, self.train.per_token)
        return Features(arrays, c.batch.samples_per_replica, c.training.seed, replica, replicas)

    def evaluate(self, session: TrainingSession) -> dict[str, float]:
        if self.dev is None:
            return {}
        figures = score(session, self.config, self.dev)
        if figures is not None:
            self._last = figures
        return session.broadcast({k: v for k, v in json_figures(figures[0]).items() if v is not None}
                                 if figures is not None else None)

    def finish(self, session: TrainingSession, output_dir: Optional[Path]) -> dict[str, Any]:
        if output_dir is not None and self._last is not None:
            write_results(self.config, self.dev, output_dir, *self._last)
        return {}

    def data_sizes(self) -> DataSizes:
        return DataSizes(len(self.train), f"rows of {self.train.path}", len(self.dev) if self.dev else 0,
                         f"rows of {self.dev.path}" if self.dev else "", packed_per_step=bool(self.config.model.packed))


def score(session: TrainingSession, config: Config, dev: Rows) -> Optional[tuple[dict, Prediction]]:
    """The dev figures and predictions of the session's weights (collective; rank 0, None
    elsewhere): regression values, label ids, or each sentence's tags."""
    model = config.model
    rows = dev.packed(model.pack_slots) if model.packed else dev.arrays
    out = forward_rows(session, rows, ("logits",), config)
    if out is None:
        return None
    logits = out["logits"]
    if model.packed:
        logits = unpack_rows(logits, rows, len(dev), per_token=model.task.spec.per_token)
    return figures(model, dev, logits)


def figures(model: ModelConfig, rows: Rows, logits: np.ndarray) -> tuple[dict, Prediction]:
    """The task's figures on `rows` from their logits (one row each, unpacked), and the
    predictions: label ids, values, or each sentence's tags (bert/tasks/targets.py)."""
    return model.task.spec.targets.figures(model, rows, logits)


def write_results(config: Config, dev: Rows, output_dir: Path, figures: dict, predicted: Prediction) -> None:
    """eval_results.json (the figures under the metrics' names; NaN as null) and the predictions."""
    targets = config.model.task.spec.targets
    name, lines = targets.predictions(config.model, dev, predicted)
    write_atomically(output_dir / name, "\n".join(lines) + "\n")
    shown = {k: round_figure(v) if v is not None else None for k, v in json_figures(figures).items()}
    why = targets.degenerate(config.model, dev, predicted)
    write_atomically(output_dir / EVAL_RESULTS, json.dumps({"dev_file": dev.path, **shown,
                                                             **({"degenerate": why} if why else {})}, indent=2) + "\n")
    print(f"{dev.path}: " + ", ".join(f"{k} {v:.4f}" for k, v in figures.items()), flush=True)
    if why:
        print(f"warning: the model {why}: it has not learned the task (too few steps or too high a learning rate, "
              "most often; docs/finetuning.md). A comparison does not rank it", flush=True)


def _check(config: Config) -> None:
    if not config.model.task.labelled:
        raise ValueError(f"bert/tasks/labelled.py fine-tunes model.task {named(LABELLED)}, not "
                         f"{config.model.task.value!r}")


def _check_head(model: ModelConfig, start: Start) -> None:
    """A head the starting weights bring must be as wide as the run's."""
    head = (start.weights or {}).get("classifier.weight")
    if head is not None and head.shape[0] != model.outputs:
        named = f" (labels {list(model.labels)})" if model.labels else ""
        raise ValueError(f"{start.origin} brings a classifier of {head.shape[0]} outputs, the run's head has "
                         f"{model.outputs}{named}: set model.labels to the starting head's labels in its order to "
                         "go on training it, or start from weights without a classifier")


def _tokenizer(start: Start):
    if start.vocab is None:
        raise ValueError("no vocab for the labelled files: set data.vocab_file, or start from a checkpoint or "
                         "HuggingFace directory (training.init_from) that holds vocab.txt")
    return tokenizer_of(start)


def fine_tune(config: Config, checkpoint_input: Optional[str] = None, use_wandb: bool = False,
              progress: bool = True, on_log: Optional[Callable[[dict], None]] = None) -> RunResult:
    """Fine-tune `config` on its labelled files (bert/run/loop.py: the run, its directory, faults)."""
    return run(Labelled(config, checkpoint_input), checkpoint_input, use_wandb, progress, on_log)


def evaluate_only(config: Config, checkpoint_input: Optional[str] = None) -> RunResult:
    """`bert.py eval`: score the starting weights (`--checkpoint-input`, else training.init_from)
    on data.dev_file without training, as a run's evaluation scores them; the labels are the
    scored run's (its config.json), model.labels, or else data.train_file's."""
    _check(config)
    d = config.data
    config, source, start = scored_start(config, checkpoint_input, "a labelled file")
    tokenizer = _tokenizer(start)
    if config.model.outputs is None:  # a regression head has its one output
        if not d.train_file:
            raise ValueError("the head's labels are unknown: score a checkpoint of a fine-tuning run, or set "
                             "model.labels or data.train_file")
        config = config.model_copy(update={"model": with_labels(config.model, read_rows(config, d.train_file))})
    _check_head(config.model, start)
    config = fitted(config, probe_session)
    dev = encode(config, read_rows(config, d.dev_file), tokenizer)
    output_dir, found = score_in_run_dir(config, start, source, lambda session: score(session, config, dev))
    if found is None:
        return RunResult(Path(d.dev_file))
    write_results(config, dev, output_dir, *found)
    return RunResult(output_dir, evaluation=json_figures(found[0]))
