"""The rows of a fine-tuning run (SQuAD: bert/tasks/squad.py; labelled tasks: bert/tasks/labelled.py):
the training stream over rows held in memory, and the forward of a held-out set whose
outputs every replica computes a share of.

Training: each step takes the next `samples_per_replica × replicas` rows of one seeded
permutation per epoch, replica r its r-th share, so R replicas compute what one process
computes with R× the accumulation, and a run resumes exactly with any number of replicas.
"""
from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Callable, Optional, Sequence, TypeVar

import numpy as np
import torch

from bert.config import Config
from bert.run.loop import launch
from bert.run.rundir import RunPlan, configured_output_dir, fresh_output_dir, prepare_run_dir
from bert.io.sources import HEAD_PREFIXES, Start, build_with_weights, scored_source, starting_point
from bert.tasks.pretraining import drawn_graph, make_session
from data.vocab import make_tokenizer
from session.checkpoint import STATE_FILE
from session.training import TrainingSession

__all__ = ["EVAL_RESULTS", "INPUTS", "VOCAB_FILE", "epoch_order", "Features", "fine_tuning_session", "FineTuning",
           "forward_rows", "probe_session", "score_in_run_dir", "scored_start", "scores_config",
           "steps_for_epochs", "tokenizer_of"]

VOCAB_FILE = "vocab.txt"
EVAL_RESULTS = "eval_results.json"  # a fine-tuning run's dev figures
T = TypeVar("T")

# Graph inputs a row may carry (labels and bookkeeping arrays stay out of a forward).
INPUTS = ("input_ids", "segment_ids", "input_mask", "sequence_index", "position_ids", "cls_positions")


def epoch_order(seed: int, epoch: int, count: int) -> np.ndarray:
    """The training stream's order of `count` rows in `epoch`: one seeded permutation per epoch."""
    return np.random.default_rng([seed, epoch]).permutation(count)


class Features:
    """One replica's training rows: each step the next global batch of a seeded permutation per
    epoch, replica r taking its r-th share; the position (in global rows) resumes exactly
    with any number of replicas."""

    def __init__(self, arrays: dict[str, np.ndarray], batch_size: int, seed: int, replica: int = 0,
                 replicas: int = 1):
        self.arrays, self.batch_size, self.seed = arrays, batch_size, seed
        self.replica, self.replicas = replica, replicas
        self.count = len(arrays["input_ids"])
        if self.count < batch_size * replicas:
            raise ValueError(f"the training file gives {self.count} rows, fewer than one global batch of "
                             f"{batch_size * replicas}; lower batch.micro_batch_size or use a larger file")
        self.epoch, self.offset = 0, 0

    def __iter__(self):
        while True:
            size = self.batch_size * self.replicas
            if self.offset + size > self.count:  # the rest of an epoch waits for the next order
                self.epoch, self.offset = self.epoch + 1, 0
            order = epoch_order(self.seed, self.epoch, self.count)
            rows = order[self.offset + self.replica * self.batch_size : self.offset + (self.replica + 1) * self.batch_size]
            self.offset += size
            yield self.batch(rows)

    def batch(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        """The arrays at `rows`, this replica's rows of a step, as the graph takes them."""
        return {k: torch.from_numpy(v[rows]) for k, v in self.arrays.items()}

    @property
    def epochs(self) -> float:
        return self.epoch + self.offset / self.count

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])

    def close(self) -> None:  # the rows are in memory: nothing to release
        pass


class FineTuning:
    """What the fine-tuning jobs of bert/run/loop.py share (bert/tasks/squad.py, bert/tasks/labelled.py): a
    session from `source` with a fresh head, a stream of rows that resumes at a position in
    global rows (any replica count), the vocab written into the run directory, real tokens
    counted by the input mask, the loss on the console."""

    config: Config
    source: Start

    def session(self) -> TrainingSession:
        return fine_tuning_session(self.config, self.source)

    def restore_stream(self, stream: Features, extra: dict) -> None:
        stream.load_state_dict(extra["data"])  # a position in global rows: any replica count

    def start(self, output_dir: Path) -> None:
        self.source.vocab.write(output_dir / VOCAB_FILE)

    def tokens(self, batch: dict) -> int:
        return int((torch.as_tensor(batch["input_mask"]) != 0).sum())

    def postfix(self, record: dict) -> dict[str, str]:
        return {"loss": f"{record['loss']:.3f}"}

    def baseline(self) -> None:  # the labelled tasks' figures have no unigram plateau
        return None

    def evaluation_record(self) -> dict[str, float]:
        return {}


def steps_for_epochs(config: Config, rows: int) -> Config:
    """`config` with training.steps from training.epochs over `rows` training rows (said on
    the console); unchanged without epochs. A warm-up longer than those steps is refused."""
    t = config.training
    if t.epochs is None:
        return config
    from bert.data import data_share

    global_batch = config.batch.samples_per_replica * data_share(config)[1]
    steps = max(1, math.ceil(t.epochs * rows / global_batch))
    warmup = config.schedule.warmup_steps
    if warmup > steps:  # the check Config makes of training.steps, once epochs have decided them
        raise ValueError(f"schedule.warmup_steps {warmup} exceeds the {steps} steps of training.epochs {t.epochs} "
                         f"({rows} rows in global batches of {global_batch}): lower the warm-up or train longer")
    print(f"training.steps {steps}: {t.epochs} epoch(s) of {rows} rows in global batches of {global_batch}",
          flush=True)
    return config.model_copy(update={"training": t.model_copy(update={"steps": steps})})


def forward_rows(session: TrainingSession, rows: dict[str, np.ndarray], names: Sequence[str],
                 config: Config) -> Optional[dict[str, np.ndarray]]:
    """The outputs `names` of every row, in row order, on rank 0 (None elsewhere): replica r
    computes batches r, r + R, ... of micro_batch_size rows (the session's weights in eval
    mode), `gradient_accumulation` of them per call; rank 0 gathers them."""
    topo, accumulation = session.topology, config.batch.gradient_accumulation
    count = len(rows["input_ids"])
    batch = config.batch.micro_batch_size
    inputs = {k: v for k, v in rows.items() if k in INPUTS}
    mine = list(range(topo.replica * batch, count, topo.replicas * batch))
    found: dict[int, list[np.ndarray]] = {}
    for first in range(0, len(mine), accumulation):
        starts = mine[first : first + accumulation]
        pieces = [np.arange(a, a + batch) % count for a in starts]  # the last batch wraps: its extra rows are dropped
        feed = {k: np.concatenate([v[i] for i in pieces]) for k, v in inputs.items()} if session.needs_data else None
        out = session.evaluate(feed, tuple(names), microbatches=len(pieces))
        if any(name not in out for name in names):  # a pipeline stage without the heads
            continue
        for i, a in enumerate(starts):
            found[a] = [out[name][i].float().cpu().numpy() for name in names]
    parts = session.gather(found)
    if parts is None:
        return None
    merged = {a: v for part in parts if part for a, v in part.items()}
    return {name: np.concatenate([merged[a][j] for a in sorted(merged)])[:count] for j, name in enumerate(names)}


def probe_session(config: Config) -> TrainingSession:
    """A session of the task's whole graph with random weights: what a step of it holds does
    not depend on the weights' values, so the source need not be read for the probe. Packed
    when model.packed is still to be decided (it is, with the micro batch): a packed row's
    step holds 1-3 % more (its mask between sequences; tiny models at sequence 24)."""
    model = config.model if config.model.packed is not None else config.model.model_copy(update={"packed": True})
    return make_session(config, *drawn_graph(model, config.training.seed))


def fine_tuning_session(config: Config, source: Start) -> TrainingSession:
    """The run's session over the task's graph with its loss, the encoder from `source` and a
    head the source lacks drawn from the run's seed (said on the console)."""
    proto, fresh = build_with_weights(config.model, source, with_loss=True, seed=config.training.seed,
                                      allow_missing=HEAD_PREFIXES)
    if source.weights is not None and fresh:
        print(f"from {source.origin}; new (random, seed {config.training.seed}) weights: {', '.join(fresh)}",
              flush=True)
    return make_session(config, proto)


def scores_config(config: Config, source: Optional[str]) -> Config:
    """Where `bert.py eval` writes its predictions and scores: when training.output_dir is the
    scored checkpoint's own run (its config.json's), inside that run in `eval-<checkpoint>` (a
    new directory each time), not a new run directory beside it; else (another output_dir, or
    weights of no run: HuggingFace, an .onnx file, random) in training.output_dir."""
    if source is None or not (Path(source) / STATE_FILE).is_file():
        return config
    checkpoint = Path(source).resolve()
    if configured_output_dir(config).resolve() != checkpoint.parent:
        return config  # the command names where the scores go
    beside = str(checkpoint.parent / f"eval-{checkpoint.name}").replace("{", "{{").replace("}", "}}")
    return config.model_copy(update={"training": config.training.model_copy(update={"output_dir": beside})})


def scored_start(config: Config, checkpoint_input: Optional[str], what: str) -> tuple[Config, Optional[str], Start]:
    """`bert.py eval`'s weights: (the config with their sizes, where they are, the start);
    data.dev_file, `what` the run scores, must be set."""
    if not config.data.dev_file:
        raise ValueError(f"bert.py eval scores data.dev_file: set it to {what}")
    source = scored_source(config, checkpoint_input)
    start = starting_point(config, source)
    return config.model_copy(update={"model": start.model}), source, start


def score_in_run_dir(config: Config, start: Start, source: Optional[str],
                     score: Callable[[TrainingSession], Optional[T]]) -> tuple[Optional[Path], Optional[T]]:
    """`bert.py eval`'s session over the start's weights, a fresh run directory for its files
    (rank 0: where `scores_config` says, with the vocab) and `score(session)` (collective;
    rank 0's result, None elsewhere): (the directory, the result)."""
    with launch(config), fine_tuning_session(config, start) as session:
        lead = session.topology.rank == 0
        output_dir = fresh_output_dir(scores_config(config, source)) if lead else None
        if lead:
            prepare_run_dir(RunPlan(output_dir), config)
            print(f"output_dir: {output_dir}", flush=True)
            start.vocab.write(output_dir / VOCAB_FILE)
        return output_dir, score(session)


def tokenizer_of(start: Start):
    """The WordPiece tokenizer of the start's vocab and casing."""
    with tempfile.TemporaryDirectory() as tmp:
        return make_tokenizer(start.vocab.write(Path(tmp) / VOCAB_FILE), lower_case=start.vocab.lower_case)
