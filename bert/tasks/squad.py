"""SQuAD v1.1 / v2.0 fine-tuning: the job behind `python bert.py --config configs/squad_*.json`.

    training.init_from   a pre-training checkpoint (directory or .onnx) or a HuggingFace
                         BERT directory: its encoder weights start the run; the span head
                         `qa_outputs` starts from random values
    --checkpoint-input   resumes exactly (weights, optimizer, step, RNG, data position)
    bert.py eval         scores the starting weights on data.dev_file, no training

The run itself is bert/run/loop.py's, as pre-training's: processes, run directory, faults,
metrics. What is SQuAD's own: its features (data/squad/), the span head, the stream
of training features (one seeded permutation per epoch; each step takes the next
`samples_per_replica × replicas` features of it and replica r its r-th share, so R
replicas compute what one process computes with R× the accumulation, and a run resumes
exactly with any number of replicas), and its evaluation: the dev file answered and
scored with the official script's figures (exact match and F1 for v1.1; exact, F1,
HasAns/NoAns for v2.0) every `evaluation.every` steps and at every checkpoint, each
replica answering a share of the dev features; `best.json` follows F1. After the last
step the run directory gets `predictions.json`, `nbest_predictions.json` and
`eval_results.json` (and, for v2.0, `null_odds.json`).

SQuAD v2.0: unanswerable training questions are trained on, every window pointing at
[CLS] (the null answer); on a v2.0 dev file the threshold on (null score − best span
score) is the one that gives the best dev F1 on the odds the model produces
(data/squad `operating_null_threshold`), the predictions use it, and it is recorded
(`null_threshold` in eval_results.json, and so in an export of the run's checkpoints,
where infer.py applies it); the official search's `best_*` figures are reported beside.

The logits come from the session's own forward (`TrainingSession.evaluate`, the
training weights in eval mode), in training and in `bert.py eval` alike; from logits on,
answers and scores are data.squad's `answer_questions`, which infer.py runs on
onnxruntime's logits.

Packed (`model.packed: true`): training and dev features are packed into rows of up to
`max_sequences_per_pack` questions (data/packing.py); the span logits come back per
feature for the same scoring.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from bert.run.budget import Budget
from bert.config import Config, Task
from bert.run.fit import fitted, run_batch
from bert.run.loop import DataSizes, RunResult, round_figure, run
from bert.tasks.rows import (EVAL_RESULTS, Features, FineTuning, forward_rows, probe_session,
                             score_in_run_dir, scored_start, steps_for_epochs, tokenizer_of)
from bert.io.sources import starting_point
from fileio import write_atomically
from data.packing import pack_squad_features, unpack_span_logits
from data.squad import Answers, SquadData, answer_questions, convert_examples_to_features, feature_arrays, load_squad
from session.training import TrainingSession


__all__ = ["EVAL_RESULTS", "DevSet", "Squad", "evaluate_only", "fine_tune"]

_LOGITS = ("start_logits", "end_logits")


class DevSet:
    """The dev file of a run, answered by the session: its features (packed rows for a
    packed model) are made once; each replica answers a share, rank 0 gathers the logits
    and turns them into answers and scores (data/squad `answer_questions`)."""

    def __init__(self, config: Config, data: SquadData, tokenizer):
        self.config, self.data, self.tokenizer = config, data, tokenizer
        self._rows: Optional[tuple] = None

    def answer(self, session: TrainingSession) -> Optional[Answers]:
        """The answers and official scores of the session's weights (collective; rank 0, None elsewhere)."""
        examples, features, rows = self.features()
        start, end = _span_logits(session, rows, len(features), self.config)
        if session.topology.rank != 0:
            return None
        return answer_questions(examples, features, start, end, tune_null_threshold=True)

    def features(self) -> tuple:
        """(examples, features, graph rows) of the dev file, made on first use."""
        if self._rows is None:
            path = self.config.data.dev_file
            examples, features = _features(self.config, self.data, path, self.tokenizer, training=False)
            self._rows = (examples, features, _rows(self.config, feature_arrays(features)))
        return self._rows


class Squad(FineTuning):
    """The SQuAD fine-tuning job of bert/run/loop.py. Everything that can reject the config
    (files, vocab, features) runs when it is made, before anything is written."""

    def __init__(self, config: Config, checkpoint_input: Optional[str] = None):
        """`checkpoint_input`: where the run starts from (bert/run/loop.py `run`), which decides
        its batch with the model (bert/run/fit.py `run_batch`)."""
        _check(config)
        t, d = config.training, config.data
        self.source = starting_point(config, t.init_from)
        config = config.model_copy(update={"model": self.source.model})  # sizes of an imported HF checkpoint
        if self.source.vocab is None:
            raise ValueError("no vocab for the SQuAD files: set data.vocab_file, or start from a HuggingFace "
                             "directory (training.init_from) that holds vocab.txt")
        train_data = _load(d.train_file)
        dev = _load(d.dev_file, scored=True) if d.dev_file else None
        config = run_batch(config, checkpoint_input, probe_session)  # once the files have been read and checked
        self.tokenizer = tokenizer_of(self.source)
        _, features = _features(config, train_data, d.train_file, self.tokenizer, training=True)
        self.arrays = _rows(config, feature_arrays(features))
        self.config = config = steps_for_epochs(config, len(self.arrays["input_ids"]))
        self.dev = DevSet(config, dev, self.tokenizer) if dev is not None else None
        self.best_metric = config.model.task.spec.best if self.dev is not None else None
        self.budget = Budget()
        self._last: Optional[Answers] = None  # the last evaluation's

    def stream(self, replica: int, replicas: int) -> Features:
        config = self.config
        return Features(self.arrays, config.batch.samples_per_replica, config.training.seed, replica, replicas)

    def evaluate(self, session: TrainingSession) -> dict[str, float]:
        if self.dev is None:
            return {}
        self._last = self.dev.answer(session)
        return session.broadcast(_figures(self._last) if self._last is not None else None)

    def finish(self, session: TrainingSession, output_dir: Optional[Path]) -> dict[str, Any]:
        if output_dir is not None and self._last is not None:
            _write_predictions(self.config, output_dir, self._last)
            print(_score_line(self.config.data.dev_file, self._last.scores), flush=True)
        return {}

    def data_sizes(self) -> DataSizes:
        rows = len(self.arrays["input_ids"])
        dev = len(self.dev.features()[2]["input_ids"]) if self.dev is not None else 0
        return DataSizes(rows, f"{'packed rows of ' if self.config.model.packed else ''}SQuAD training features",
                         dev, "dev features" + (", packed" if self.config.model.packed else ""))


def _figures(answers: Answers) -> dict[str, float]:
    """The evaluation figures of a run (metrics.jsonl, best.json): the numeric official scores."""
    return {k: v for k, v in answers.scores.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _rows(config: Config, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Feature arrays as the graph takes them: packed rows for a packed model."""
    if not config.model.packed:
        return arrays
    return pack_squad_features(arrays, max_sequences_per_pack=config.model.pack_slots)


def _span_logits(session: TrainingSession, rows: dict[str, np.ndarray], features: int,
                 config: Config) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """(start, end) logits (features, S) of every dev feature on rank 0 (None elsewhere)."""
    out = forward_rows(session, rows, _LOGITS, config)
    if out is None:
        return None, None
    start, end = out["start_logits"], out["end_logits"]
    if config.model.packed:
        return unpack_span_logits(start, rows, features), unpack_span_logits(end, rows, features)
    return start, end


def _write_predictions(config: Config, output_dir: Path, answers: Answers) -> None:
    """predictions.json, nbest_predictions.json, (v2.0) null_odds.json and eval_results.json."""
    files = {"predictions.json": json.dumps(answers.texts, indent=2, ensure_ascii=False),
             "nbest_predictions.json": json.dumps(answers.nbest, indent=2, ensure_ascii=False)}
    if answers.null_threshold is not None:  # as BERT's run_squad.py writes it: evaluate-v2.0.py --na-prob-file
        files["null_odds.json"] = json.dumps(
            {q: v if math.isfinite(v) else 1e9 for q, v in answers.null_odds.items()}, indent=2)
    # The figures as metrics.jsonl has them; the threshold exact (it is compared with odds).
    figures = {k: round_figure(v) if k != "null_threshold" else v for k, v in _figures(answers).items()}
    files[EVAL_RESULTS] = json.dumps({"dev_file": config.data.dev_file, **figures}, indent=2)
    for name, text in files.items():
        write_atomically(output_dir / name, text + "\n")


def _check(config: Config) -> None:
    if config.model.task is not Task.SQUAD:
        raise ValueError(f"fine-tuning needs model.task 'squad', the config says {config.model.task.value!r}")
    if config.data.source != "squad":
        raise ValueError(f"model.task 'squad' needs data.source 'squad' with data.train_file and data.dev_file, "
                         f"the config says data.source {config.data.source!r}")


def _features(config: Config, data: SquadData, path: str, tokenizer, training: bool):
    """(examples, features) of a loaded SQuAD file: for training the examples with a span to
    learn (located answers, and v2.0's unanswerable questions: the [CLS] null answer)."""
    cfg, d = config.model, config.data
    examples = data.trainable if training else data.examples
    if training and not examples:
        raise ValueError(f"SQuAD file {path} has no question to train on (no located answer, no unanswerable "
                         "question)")
    features = convert_examples_to_features(examples, tokenizer, max_seq_length=cfg.sequence_length,
                                            doc_stride=d.doc_stride, max_query_length=d.max_query_length)
    return examples, features


def _load(path: str, scored: bool = False) -> SquadData:
    data = load_squad(path)
    print(data.summary(path, training=not scored), flush=True)
    if scored and len(data.ungraded) == len(data.examples):
        raise ValueError(f"dev file {path} has no gold answers to score: add them, or answer its questions with "
                         "infer.py --task squad")
    return data


def _score_line(where: str, scores: dict) -> str:
    if "exact_match" in scores:
        return f"{where}: exact match {scores['exact_match']:.2f}, F1 {scores['f1']:.2f}"
    parts = [f"exact {scores['exact']:.2f}, f1 {scores['f1']:.2f}"]
    for group in ("HasAns", "NoAns"):
        if f"{group}_total" in scores:
            parts.append(f"{group}_exact {scores[group + '_exact']:.2f}, {group}_f1 {scores[group + '_f1']:.2f} "
                         f"({scores[group + '_total']} questions)")
    threshold = scores.get("null_threshold")
    return (f"{where} (official SQuAD v2.0): " + "; ".join(parts) +
            (f"; null threshold {threshold:.3f} (best F1 on these null odds; official search: best_f1 "
             f"{scores['best_f1']:.2f} at {scores['best_f1_thresh']:.3f})" if threshold is not None else ""))


def fine_tune(config: Config, checkpoint_input: Optional[str] = None, use_wandb: bool = False,
             progress: bool = True, on_log: Optional[Callable[[dict], None]] = None) -> RunResult:
    """Fine-tune `config` on SQuAD (bert/run/loop.py: the run, its directory, faults, evaluation)."""
    return run(Squad(config, checkpoint_input), checkpoint_input, use_wandb, progress, on_log)


def evaluate_only(config: Config, checkpoint_input: Optional[str] = None) -> RunResult:
    """`bert.py eval`: score the starting weights (`--checkpoint-input`, else
    `training.init_from`: a checkpoint or a HuggingFace directory) on data.dev_file without
    training, exactly as a run's evaluation scores them (the same session forward, with
    any number of processes); a span head the source lacks starts from the run's seeded
    random values (the "before fine-tuning" score). Writes its predictions and scores beside a
    checkpoint it scores, else into a fresh training.output_dir (bert/tasks/rows.py `scores_config`)."""
    _check(config)
    d = config.data
    config, source, start = scored_start(config, checkpoint_input, "a SQuAD JSON file with answers")
    if start.vocab is None:
        raise ValueError("no vocab for the SQuAD file: set data.vocab_file, or score a checkpoint or HuggingFace "
                         "directory that holds its vocab")
    config = fitted(config, probe_session)
    dev = DevSet(config, _load(d.dev_file, scored=True), tokenizer_of(start))
    dev.features()  # made (and so checked) before anything is written
    output_dir, answers = score_in_run_dir(config, start, source, dev.answer)
    if answers is None:
        return RunResult(Path(d.dev_file))
    _write_predictions(config, output_dir, answers)
    print(_score_line(d.dev_file, answers.scores), flush=True)
    return RunResult(output_dir, evaluation=_figures(answers))
