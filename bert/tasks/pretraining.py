"""Pre-training: the job behind `python bert.py --config ...` (bert/run/loop.py runs it).

    train(config, checkpoint_input=None, use_wandb=False, progress=True, on_log=None)

What is pre-training's own: the MLM + NSP graph of `config.model` (each process draws
only its own stages' weights), its training stream (HDF5 shards, the demo corpus or
random tokens; each replica its share), and its held-out evaluation: `data.eval_files`
(the demo's held-out shard by default), never a file the run trains on. The evaluation
set is fixed: the first `data.eval_samples` samples of those files in a fixed order
with their stored masks (packed as training packs when the model is), in batches of
`batch.micro_batch_size`. Replica r evaluates batches r, r + R, ...; each batch's mean
loss and accuracy are weighted by its masked tokens (MLM) and sequences (NSP) and the
sums are reduced over all processes, so the figures are the exact per-token and
per-sequence means over the whole set whatever the number of replicas or stages:
`eval_loss` (= `eval_mlm_loss` + `eval_nsp_loss`, the training loss's definition),
`eval_mlm_loss`, `eval_mlm_accuracy`, `eval_nsp_loss`, `eval_nsp_accuracy`. Each is read
against the unigram plateau of the same held-out targets (bert/tasks/unigram.py), from the training
shards' target counts.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import onnx
import torch

from bert.run import budget
from bert.config import Config, ModelConfig
from bert.data import data_share, eval_files, make_data, train_files
from bert.errors import RunInterrupted, TrainingDiverged
from bert.run.loop import DataSizes, RunResult, launch, run, with_baseline
from bert.run.progress import round_figure
from bert.run.fit import fitted, run_batch
from bert.run.rundir import METRICS_FILE
from bert.io.sources import scored_source
from bert.model import build_model, no_weight_decay
from bert.tasks.unigram import Unigram, unigram_baseline
from session import SessionOptions
from session.schedules import Schedule
from session.training import OptimizerSpec, TrainingSession

__all__ = ["METRICS_FILE", "Pretraining", "RunInterrupted", "TrainingDiverged", "drawn_graph", "evaluate_only",
           "make_session", "train"]

_EVAL_OUTPUTS = ("mlm_loss", "mlm_accuracy", "nsp_loss", "nsp_accuracy")


def make_session(config: Config, model=None, weights=None, schedule=None) -> TrainingSession:
    """The configured TrainingSession over `model` (an ONNX graph; default: config.model's
    pre-training graph, whose weights each process draws only for its own stages) and its
    learning-rate `schedule` (default: the config's, over training.steps)."""
    t, o, s, par = config.training, config.optimizer, config.schedule, config.parallel
    if model is None and config.model.task.spec.fine_tuning:
        raise ValueError("bert.py trains model.task 'pretraining'; SQuAD fine-tuning has its own entry point")
    schedule = schedule or Schedule(
        base_lr=o.learning_rate, warmup_steps=s.warmup_steps, total_steps=t.steps, warmup=s.warmup,
        decay=s.decay, power=s.decay_power, end_lr=s.end_learning_rate,
    )
    spec = OptimizerSpec(kind=o.name, schedule=schedule, weight_decay=o.weight_decay, max_grad_norm=o.max_grad_norm,
                         hyperparameters=o.hyperparameters, no_decay=no_weight_decay)
    options = SessionOptions(
        device=t.device, precision=config.precision.dtype, loss_scaling=config.precision.loss_scaling,
        gradient_accumulation=config.batch.gradient_accumulation, recompute=t.recompute, compile=t.compile,
        replication_factor=par.replication_factor, replicated_tensor_sharding=par.replicated_tensor_sharding,
        pipelining=par.pipeline, gradient_bucket_mb=par.gradient_bucket_mb, kernels=dict(t.kernels),
    )
    if model is None:
        model, weights = drawn_graph(config.model, t.seed)
    return TrainingSession(model, optimizer=spec, options=options, seed=t.seed, weights=weights)


def drawn_graph(model: ModelConfig, seed: int) -> tuple[onnx.ModelProto, Callable[[str], np.ndarray]]:
    """`model`'s graph with its weights declared, and what draws them from `seed` (each process
    draws only those of its own stages)."""
    builder = build_model(model, seed=seed).builder
    return builder.model_proto(with_weights=False, declare_weights=True), builder.initial_value


class Pretraining:
    """The pre-training job of bert/run/loop.py."""

    def __init__(self, config: Config):
        replicas = data_share(config)[1]
        config, line = budget.resolve(config, replicas)  # a FLOPs budget sets the steps
        if line and int(os.environ.get("RANK", "0")) == 0:
            print(line, flush=True)
        self.config = config
        self.schedule = budget.schedule(config)
        self.budget = budget.Budget.of(config, replicas)
        self.eval_files = eval_files(config)
        self.best_metric = config.model.task.spec.best if self.eval_files else None
        self._eval_batches: Optional[list[dict[str, np.ndarray]]] = None
        self._train_samples: Optional[int] = None
        self._train_files: Optional[list[str]] = None  # the stream's (read_evaluation_set's when none)
        self._train_counts: Optional[np.ndarray] = None  # of the training targets (the loader's)
        self._baseline: Optional[Unigram] = None
        self._sampling_error: dict[str, float] = {}  # of the latest evaluation

    def session(self) -> TrainingSession:
        session = make_session(self.config, schedule=self.schedule)
        if self.config.training.init_from:  # phase 2 from phase 1: the weights only
            session.load_weights(self.config.training.init_from)
        return session

    def stream(self, replica: int, replicas: int):
        files = train_files(self.config)
        stream = make_data(self.config, self.config.batch.samples_per_replica, replica, replicas, files)
        self._train_samples = getattr(stream, "num_samples", None)  # None: synthetic, endless
        self._train_files = files
        self._train_counts = getattr(stream, "target_counts", None)
        self.read_evaluation_set()
        return stream

    def read_evaluation_set(self) -> None:
        """The fixed evaluation set, and its unigram baseline (with the training shards' counts
        the stream made, else counted here)."""
        if not self.eval_files:
            return
        from data.shards import inspect_shard, read_vocab_text, scored_target_counts

        self._eval_batches, note = _read_evaluation_set(self.config, self.eval_files)
        if note and int(os.environ.get("RANK", "0")) == 0:
            print(note, flush=True)
        if self._train_files is None:  # bert.py eval: no stream
            self._train_files = train_files(self.config)
        train = self._train_files
        if self._train_counts is None and train:  # bert.py eval: no stream
            shards = [inspect_shard(path, read_tail=False) for path in train]
            self._train_counts = scored_target_counts(shards, self.config.model.vocab_size)[0]
        if self._train_counts is not None:
            text = read_vocab_text(train[0])
            targets = [b["masked_lm_ids"][b["masked_lm_positions"] != 0] for b in self._eval_batches]
            self._baseline = unigram_baseline(self._train_counts, targets,
                                              text.rstrip("\n").split("\n") if text else None)

    def baseline(self) -> Optional[Unigram]:
        return self._baseline

    def restore_stream(self, stream: Any, extra: dict) -> None:
        # A position in the global stream: exact with any number of replicas (data/loader.py).
        stream.load_state_dict(extra["data"])

    def evaluate(self, session: TrainingSession) -> dict[str, float]:
        if not self._eval_batches:
            return {}
        topo, m = session.topology, self.config.batch.gradient_accumulation
        mine = self._eval_batches[topo.replica :: topo.replicas]
        # Σ mlm_loss·c, Σ mlm_accuracy·c, Σ c, Σ nsp_loss·n, Σ nsp_accuracy·n, Σ n, and for the
        # sampling error over batches: Σ (mlm_loss·c)², Σ mlm_loss·c², Σ (mlm_accuracy·c)²,
        # Σ mlm_accuracy·c², Σ c², batches
        sums = np.zeros(12)
        for first in range(0, len(mine), m):
            group = mine[first : first + m]
            batch = {k: np.concatenate([b[k] for b in group]) for k in group[0]} if session.needs_data else None
            out = session.evaluate(batch, _EVAL_OUTPUTS, microbatches=len(group))
            if not out:
                continue
            for i, b in enumerate(group):
                c, n = _counts(b)
                mlm, acc, nsp, nsp_acc = (float(out[name][i]) for name in _EVAL_OUTPUTS)
                if c:
                    sums[:3] += (mlm * c, acc * c, c)
                    sums[6:] += ((mlm * c) ** 2, mlm * c * c, (acc * c) ** 2, acc * c * c, c * c, 1)
                sums[3:6] += (nsp * n, nsp_acc * n, n)
        total = np.asarray(session.reduce_sum(sums), np.float64)
        mlm_loss, nsp_loss = total[0] / max(total[2], 1), total[3] / max(total[5], 1)
        accuracy = total[1] / max(total[2], 1)
        self._sampling_error = {"eval_mlm_targets": int(total[2]),
                                "eval_mlm_loss_se": _batch_error(mlm_loss, *total[[2, 6, 7, 10, 11]]),
                                "eval_mlm_accuracy_se": _batch_error(accuracy, *total[[2, 8, 9, 10, 11]])}
        return {"eval_loss": mlm_loss + nsp_loss, "eval_mlm_loss": mlm_loss,
                "eval_mlm_accuracy": accuracy, "eval_nsp_loss": nsp_loss,
                "eval_nsp_accuracy": total[4] / max(total[5], 1)}

    def evaluation_record(self) -> dict[str, float]:
        if self._baseline is None:
            return dict(self._sampling_error)
        return {**self._baseline.record(), **self._sampling_error}

    def start(self, output_dir: Path) -> None:
        pass

    def finish(self, session: TrainingSession, output_dir: Optional[Path]) -> dict[str, Any]:
        return {}

    def tokens(self, batch: dict) -> int:
        mask = batch["sequence_index"] if "sequence_index" in batch else batch["input_mask"]
        return int((torch.as_tensor(mask) != 0).sum())

    def postfix(self, record: dict) -> dict[str, str]:
        return {name: "nan" if record.get(key) is None else f"{record[key]:.3f}"
                for name, key in (("loss", "loss"), ("mlm_acc", "mlm_accuracy"), ("nsp_acc", "nsp_accuracy"))}

    def data_sizes(self) -> DataSizes:
        d, batch = self.config.data, self.config.batch
        rows = len(self._eval_batches or []) * batch.micro_batch_size
        held_out = f"{len(self.eval_files)} held-out shard{'s' if len(self.eval_files) != 1 else ''}"
        if self._train_samples is None:
            return DataSizes(None, "random tokens, data.source synthetic", rows, held_out)
        count = len(self._train_files or [])
        what = f"{count} shard{'s' if count != 1 else ''}" + (
            f" of the demo corpus in {d.directory}" if d.source == "demo" else "")
        packed = self.config.model.pack_slots if self.config.model.packed else 0
        return DataSizes(self._train_samples, what, rows, held_out, packed)


def _batch_error(mean: float, count: float, squares: float, cross: float, count_squares: float,
                 batches: float) -> float:
    """The standard error of a held-out mean over its batches: `mean` = Σ x_b·c_b / Σ c_b, with
    Σ (x_b·c_b)² (`squares`), Σ x_b·c_b² (`cross`), Σ c_b² (`count_squares`) of the batches'
    means x_b over c_b targets. Each batch is one draw of whole sequences (the targets of a
    sequence are not independent), the ratio estimator's variance (Cochran 1977, 6.9):
    k/(k-1) · Σ c_b² (x_b - mean)² / (Σ c_b)². NaN with fewer than two batches."""
    if batches < 2 or count <= 0:
        return float("nan")
    spread = max(squares - 2 * mean * cross + mean * mean * count_squares, 0.0)
    return round_figure(math.sqrt(batches / (batches - 1) * spread) / count)


def _counts(batch: dict[str, np.ndarray]) -> tuple[int, int]:
    """(masked tokens, sequences) a batch's mean losses and accuracies are over."""
    masked = int((batch["masked_lm_positions"] != 0).sum())  # slot position 0 ([CLS]) marks an unused slot
    labels = batch["next_sentence_labels"]
    return masked, int((labels != -100).sum())  # packed rows mark unused sequence slots -100


def _read_evaluation_set(config: Config, files: list[str]) -> tuple[list[dict[str, np.ndarray]], Optional[str]]:
    """The fixed evaluation set: whole batches of the first `data.eval_samples` samples, in a
    fixed order, the same in every process; and the note saying the files' [UNK] targets are
    ignored (None when they hold none)."""
    from data import PretrainingLoader
    from data.loader import unk_note

    d, cfg, batch = config.data, config.model, config.batch
    loader = PretrainingLoader(files, batch.micro_batch_size, seed=0, shuffle_buffer=d.shuffle_buffer, prefetch=0,
                               model_vocab_size=cfg.vocab_size, verbose=False, packing=cfg.packed,
                               max_sequences_per_pack=cfg.pack_slots)
    count, batches = max(1, d.eval_samples // batch.micro_batch_size), []
    try:
        for batch in loader:
            position = loader.state_dict()
            if position["epoch"] >= 1 and position["batches"] > 0:
                break  # a second pass over the files: the set holds each sample once
            batches.append({k: v.numpy() for k, v in batch.items()})
            if len(batches) == count or position["epoch"] >= 1:
                break
    finally:
        loader.close()
    if not batches:
        raise ValueError(f"data.eval_files {files} hold fewer than one batch of {batch.micro_batch_size} samples: add "
                         "held-out shards or lower batch.micro_batch_size")
    unk = loader.unk_targets
    return batches, unk_note(unk, int(loader.target_counts.sum()), len(files), held_out=True) if unk else None


def train(config: Config, checkpoint_input: Optional[str] = None, use_wandb: bool = False, progress: bool = True,
          on_log: Optional[Callable[[dict], None]] = None) -> RunResult:
    """Pre-train `config` (bert/run/loop.py: the run, its directory, faults, evaluation)."""
    return run(Pretraining(run_batch(config, checkpoint_input, make_session)), checkpoint_input, use_wandb, progress,
               on_log)


def evaluate_only(config: Config, checkpoint_input: Optional[str] = None) -> RunResult:
    """`bert.py eval` for pre-training: the held-out figures of the starting weights
    (`--checkpoint-input`, else `training.init_from`) on the run's evaluation set, exactly as
    a run measures them (with any number of processes), without training or writing."""
    source = scored_source(config, checkpoint_input)
    if not source:
        raise ValueError("bert.py eval scores weights: pass --checkpoint-input runs/<name>/checkpoint-<step> "
                         "(or set training.init_from)")
    config = fitted(config, make_session)
    job = Pretraining(config)
    if not job.eval_files:
        raise ValueError("bert.py eval needs held-out data: set data.eval_files (the demo corpus has its own) and "
                         "data.eval_samples above 0")
    job.read_evaluation_set()
    with launch(config), make_session(config) as session:
        session.load_weights(source)
        figures = job.evaluate(session)
        if session.topology.rank == 0:
            baseline = job.baseline()
            print(f"{source}: {with_baseline(figures, baseline)}", flush=True)
            if baseline is not None and baseline.verdict(figures):
                print(baseline.verdict(figures), flush=True)
    return RunResult(Path(source), evaluation=figures)
