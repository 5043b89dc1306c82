"""The data a run reads, checked before any model is built.

`check_data(config)` looks at what a run will read without importing torch: that the
shard globs match files whose shapes (sequence length, masks per sequence) and vocab
fit the model. `bert.py` calls it right after reading the
config, so a missing file costs a second, not a model. `make_data` then opens this
replica's stream (every row of every shard is checked as it opens: data.loader).

Sources: HDF5 shards (`data.files`), the built-in demo corpus (`data.directory`),
or random tokens in the shapes of real batches (`synthetic`, for benchmarks).
"""
from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any, Iterator

from bert.config import Config, DataConfig, ModelConfig, Task
from session.ranks import RankLayout, rank_layout, world_size_from_env

__all__ = ["SyntheticData", "check_data", "data_share", "demo_data", "eval_files", "make_data", "run_layout",
           "shard_files", "synthetic_batch"]


def shard_files(config: Config) -> list[str]:
    """The files `data.files` matches, or a ValueError saying what to do."""
    d = config.data
    files = sorted({f for pattern in d.files for f in glob.glob(pattern)})
    if not files:
        raise ValueError(f"data.files {list(d.files)} match no file; create shards with data/create_pretraining_data.py")
    return files


def eval_files(config: Config) -> list[str]:
    """The held-out shards of the run's evaluation (`data.eval_files`; the demo's held-out
    shard by default), never one it trains on; [] without evaluation."""
    d = config.data
    if d.eval_samples == 0 or config.model.task is not Task.PRETRAINING:
        return []
    if d.eval_files:
        files = _eval_globs(d)
    elif d.source == "demo":
        files = [str(f) for f in demo_data(config).eval_files]
    else:
        return []
    if d.source == "shards":
        both = {os.path.realpath(f) for f in files} & {os.path.realpath(f) for f in shard_files(config)}
        if both:
            raise ValueError(f"{sorted(both)[0]} is in data.files and data.eval_files: evaluation must use samples "
                             "the run does not train on")
    return files


def _eval_globs(d: DataConfig) -> list[str]:
    files = sorted({f for pattern in d.eval_files for f in glob.glob(pattern)})
    if not files:
        raise ValueError(f"data.eval_files {list(d.eval_files)} match no file; create held-out shards with "
                         "data/create_pretraining_data.py --held-out-fraction, or set data.eval_samples 0 to train "
                         "without evaluation")
    return files


def check_data(config: Config) -> None:
    """What the run will read exists and fits the model (cheap: headers only, no torch)."""
    d, cfg = config.data, config.model
    if d.source != "shards" or cfg.task is not Task.PRETRAINING:  # SQuAD's files: bert/finetune.py
        return
    from data.shards import inspect_shard

    eval_globs = _eval_globs(d) if d.eval_files and d.eval_samples else []
    for path in shard_files(config) + eval_globs:  # shards hold one sequence per row, packed or not
        shard = inspect_shard(path, read_tail=False)
        _fits(cfg, shard.seq_len, shard.max_predictions, cfg.max_predictions, shard.attrs.get("vocab_size"), str(path))


def _fits(cfg: ModelConfig, seq_len: int, predictions: int, wanted: int, vocab_size: Any, where: str) -> None:
    if seq_len != cfg.sequence_length or predictions != wanted:
        packed = " + max_sequences_per_pack" if wanted != cfg.max_predictions else ""
        raise ValueError(
            f"{where} holds sequences of {seq_len} with {predictions} masks per row, the model wants "
            f"model.sequence_length {cfg.sequence_length} and {wanted} (model.max_predictions{packed})")
    if vocab_size is not None and int(vocab_size) > cfg.vocab_size:
        raise ValueError(f"{where}: the shards' vocab has {int(vocab_size)} tokens, more than model.vocab_size "
                         f"{cfg.vocab_size}")


def demo_data(config: Config):
    """The demo corpus and its shards, built once: the processes of a launched run take
    turns on a lock file, the first builds, the others find it built."""
    import fcntl

    from data import build_demo_data

    directory = Path(config.data.directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f".{directory.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build_demo_data(directory, seq_len=config.model.sequence_length,
                               max_predictions=config.model.max_predictions)


def run_layout(config: Config) -> RankLayout:
    """This process's place in a launched run (`session.ranks.rank_layout`, which the
    session's process groups come from too), from the config and the launcher's
    environment, without torch; a process count that does not fit is a ValueError naming
    the counts that do."""
    t = config.training
    stages = len(config.model.stages) if t.pipeline else 1
    return rank_layout(world_size_from_env(), stages, t.replication_factor, int(os.environ.get("RANK", "0")))


def data_share(config: Config) -> tuple[int, int]:
    """(this process's replica, replicas) of a launched run, known before any model is built."""
    layout = run_layout(config)
    return layout.replica, layout.replicas


def synthetic_batch(cfg: ModelConfig, batch_size: int, generator):
    """Random tokens in the shapes of a real batch: distinct sorted masked positions, two segments."""
    import torch

    b, s, p = batch_size, cfg.sequence_length, cfg.max_predictions
    positions = torch.sort(torch.rand(b, s - 1, generator=generator).argsort(dim=1)[:, :p] + 1, dim=1).values
    return {
        "input_ids": torch.randint(5, cfg.vocab_size, (b, s), generator=generator),
        "segment_ids": (torch.arange(s) >= s // 2).long().expand(b, s).contiguous(),
        "input_mask": torch.ones(b, s, dtype=torch.long),
        "masked_lm_positions": positions,
        "masked_lm_ids": torch.randint(5, cfg.vocab_size, (b, p), generator=generator),
        "next_sentence_labels": torch.randint(0, 2, (b,), generator=generator),
    }


class SyntheticData:
    """Random tokens in the shapes of real batches, for benchmarks (no learnable signal).

    Each step draws the rows of all replicas from one seed and replica r takes its slice,
    so the samples of a step do not depend on the number of replicas.
    """

    def __init__(self, config: Config, batch_size: int, seed: int, replica: int = 0, replicas: int = 1):
        self.cfg, self.batch_size, self.seed, self.position = config.model, batch_size, seed, 0
        self.replica, self.replicas = replica, replicas

    def __iter__(self) -> Iterator[dict]:
        import torch

        while True:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
            self.position += 1
            rows = synthetic_batch(self.cfg, self.batch_size * self.replicas, generator)
            mine = slice(self.replica * self.batch_size, (self.replica + 1) * self.batch_size)
            yield {k: v[mine] for k, v in rows.items()}

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def make_data(config: Config, batch_size: int, replica: int = 0, replicas: int = 1):
    """This replica's sample stream; real sources are checked against the model's shapes."""
    from data import PretrainingLoader

    d, cfg = config.data, config.model
    if d.source == "synthetic":
        return SyntheticData(config, batch_size, config.training.seed, replica, replicas)
    if d.source == "demo":
        files = demo_data(config).train_files
    else:
        files = shard_files(config)
    loader = PretrainingLoader(
        files, batch_size, seed=config.training.seed, shuffle_buffer=d.shuffle_buffer,
        prefetch=d.prefetch, dynamic_masking=d.dynamic_masking, model_vocab_size=cfg.vocab_size,
        replica_rank=replica, replica_count=replicas, verbose=replica == 0,
        packing=cfg.packed, max_sequences_per_pack=cfg.max_sequences_per_pack,
    )
    _fits(cfg, loader.seq_len, loader.max_predictions, cfg.predictions_per_row, loader.vocab_size, "the shards")
    return loader
