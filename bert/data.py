"""The data a run reads, checked before any model is built.

`check_data(config)` looks at what a run will read without importing torch: that each
shard glob matches files whose shapes (sequence length, masks per sequence) and vocab
fit the model, and that the held-out set is held out (`check_held_out`: no file the run
trains on, the model's shapes, the training shards' vocabulary by its recorded hash).
`bert.py` calls it right after reading the config, so a missing file costs a second, not
a model; the demo's own shards are checked the same way once they are built
(`eval_files`), before the first step. `make_data` then opens this replica's stream
(every row of every shard is checked as it opens: data.loader).

Sources: HDF5 shards (`data.files`), the built-in demo corpus (`data.directory`),
or random tokens in the shapes of real batches (`synthetic`, for benchmarks).
"""
from __future__ import annotations

import filecmp
import glob
import json
import os
from pathlib import Path
from typing import Any, Iterator, Optional

from bert.config import Config, DataConfig, ModelConfig
from session.ranks import RankLayout, nodes_from_env, rank_layout, world_size_from_env

__all__ = ["SyntheticData", "check_data", "check_held_out", "data_share", "demo_data", "eval_files", "make_data",
           "run_layout", "shard_files", "synthetic_batch", "train_files"]


def shard_files(config: Config) -> list[str]:
    """The files `data.files` matches (each glob must match one), or a ValueError saying what to do."""
    return _globs(config.data.files, "data.files",
                  "create shards with data/create_pretraining_data.py, or correct the pattern")


def _globs(patterns, key: str, fix: str) -> list[str]:
    """The sorted files of `patterns`; a pattern that matches nothing is an error, even beside
    others that match (a typo would silently drop a part of the data)."""
    found = {pattern: glob.glob(pattern) for pattern in patterns}
    missing = [pattern for pattern, files in found.items() if not files]
    if missing and len(missing) == len(found):
        raise ValueError(f"{key} {list(patterns)} match no file; {fix}")
    if missing:
        raise ValueError(f"{key} pattern {missing[0]!r} matches no file, although the others match (a mistyped "
                         f"pattern would leave out part of the data); {fix}")
    return sorted({f for files in found.values() for f in files})


def train_files(config: Config) -> list[str]:
    """The shards the run trains on: `data.files`, or the demo's training shards (built once);
    [] for random tokens."""
    if config.data.source == "demo":
        return [str(f) for f in demo_data(config).train_files]
    if config.data.source == "shards":
        return shard_files(config)
    return []


def eval_files(config: Config) -> list[str]:
    """The held-out shards of the run's evaluation (`data.eval_files`; the demo's held-out
    shard by default), checked against what the run trains on (`check_held_out`); [] without
    evaluation."""
    d = config.data
    if d.eval_samples == 0 or config.model.task.spec.fine_tuning:
        return []
    if d.eval_files:
        files = _eval_globs(d)
    elif d.source == "demo":
        files = [str(f) for f in demo_data(config).eval_files]
    else:
        return []
    check_held_out(config, train_files(config), files)
    return files


def _eval_globs(d: DataConfig) -> list[str]:
    return _globs(d.eval_files, "data.eval_files",
                  "create held-out shards with data/create_pretraining_data.py --held-out-fraction, correct the "
                  "pattern, or set data.eval_samples 0 to train without evaluation")


def check_held_out(config: Config, train: list[str], held_out: list[str]) -> None:
    """The held-out shards are held out and score the model the run trains (headers only, no
    torch): no file trained on (the same path, the same file under another name, or the same
    bytes), sequences and masks of the model's shapes, and the training data's vocabulary,
    identified by the hash the shards record (`vocab_sha256`), not by its size. Each error
    names the held-out file."""
    from data.shards import inspect_shard

    cfg = config.model
    by_size: dict[int, list[tuple[str, os.stat_result]]] = {}
    for path in train:
        info = os.stat(path)
        by_size.setdefault(info.st_size, []).append((path, info))
    vocab = _training_vocab(train)
    for path in held_out:
        info = os.stat(path)
        for other, other_info in by_size.get(info.st_size, ()):
            same = None
            if os.path.samestat(info, other_info):
                same = ("is one" if os.path.realpath(path) == os.path.realpath(other) else
                        f"is the same file as {other}, one")
            elif filecmp.cmp(path, other, shallow=False):
                same = f"holds the same bytes as {other}, one"
            if same:
                raise ValueError(f"held-out shard {path} {same} the run trains on ({_training_source(config)}): "
                                 "evaluation must use samples the run does not train on; point data.eval_files at "
                                 "held-out shards (data/create_pretraining_data.py --held-out-fraction writes them)")
        shard = inspect_shard(path, read_tail=False)
        _fits(cfg, shard.seq_len, shard.max_predictions, cfg.max_predictions, shard.attrs.get("vocab_size"),
              f"held-out shard {path}")
        if vocab is not None:
            mine = _vocab_of(shard.attrs, path)
            if mine is None:
                raise ValueError(f"held-out shard {path} records no vocabulary (no vocab_sha256 attribute), while the "
                                 f"training shards were made with {_name_vocab(vocab)}: its figures could not be "
                                 "trusted; re-create it with data/create_pretraining_data.py --vocab and the training "
                                 "shards' vocab.txt")
            if mine[0] != vocab[0]:
                raise ValueError(f"held-out shard {path} was made with another vocabulary ({_name_vocab(mine)}) than "
                                 f"the training shards ({_name_vocab(vocab)}): its token ids mean other words and "
                                 "every eval_* figure would be meaningless; re-create it with "
                                 "data/create_pretraining_data.py --vocab and the training shards' vocab.txt")


def _training_source(config: Config) -> str:
    d = config.data
    return "data.files" if d.source == "shards" else f"the demo's training shards in {d.directory}"


def _training_vocab(train: list[str]) -> Optional[tuple[str, str, Any, str]]:
    """(hash, vocab file, size, shard) of the training shards' one vocabulary; None when they
    record none (shards made elsewhere); a ValueError when two of them disagree."""
    from data.shards import inspect_shard

    found = None
    for path in train:
        attrs = inspect_shard(path, read_tail=False).attrs
        vocab = _vocab_of(attrs, path)
        if vocab is None:
            continue
        if found is not None and vocab[0] != found[0]:
            raise ValueError(f"training shard {path} was made with another vocabulary ({_name_vocab(vocab)}) than "
                             f"{found[3]} ({_name_vocab(found)}): a run trains on one vocabulary; re-create the shards "
                             "with one vocab.txt")
        found = found or vocab
    return found


def _vocab_of(attrs: dict, path: str) -> Optional[tuple[str, str, Any, str]]:
    digest = attrs.get("vocab_sha256")
    if not isinstance(digest, (str, bytes)) or not digest:
        return None
    digest = digest.decode() if isinstance(digest, bytes) else digest
    name = attrs.get("vocab_file")
    return digest, name.decode() if isinstance(name, bytes) else str(name or "vocab.txt"), attrs.get("vocab_size"), path


def _name_vocab(vocab: tuple[str, str, Any, str]) -> str:
    digest, name, size, _ = vocab
    return f"{name}, sha256 {digest[:12]}…" + (f", {int(size)} tokens" if size is not None else "")


def check_data(config: Config) -> None:
    """What the run will read exists and fits the model, and the held-out set is held out
    (cheap: headers only, no torch). The demo's own shards are checked when they are built
    (`eval_files`); held-out files given for the demo are checked here against its training
    shards when they exist."""
    d, cfg = config.data, config.model
    if cfg.task.spec.fine_tuning:  # a fine-tune's own files: its job reads and checks them
        return
    from data.shards import inspect_shard

    held_out = _eval_globs(d) if d.eval_files and d.eval_samples else []
    if d.source == "shards":
        train = shard_files(config)
        for path in train:  # shards hold one sequence per row, packed or not
            shard = inspect_shard(path, read_tail=False)
            _fits(cfg, shard.seq_len, shard.max_predictions, cfg.max_predictions, shard.attrs.get("vocab_size"),
                  str(path))
    elif d.source == "demo":
        train = _built_demo_train_files(config)
    else:
        train = []
    if held_out:
        check_held_out(config, train, held_out)


def _built_demo_train_files(config: Config) -> list[str]:
    """The demo's training shards when it is built (its manifest), without building it."""
    directory = Path(config.data.directory)
    try:
        record = json.loads((directory / "demo.json").read_text())["data"]["train_files"]
        return [str(directory / f) for f in record if (directory / f).is_file()]
    except (OSError, ValueError, KeyError, TypeError):
        return sorted(glob.glob(str(directory / "train" / "*.hdf5")))


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
    parallel = config.parallel
    stages = len(config.model.stages) if parallel.pipeline else 1
    return rank_layout(world_size_from_env(), stages, parallel.replication_factor, int(os.environ.get("RANK", "0")),
                       nodes_from_env())


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

    def close(self) -> None:  # drawn as it goes: nothing to release
        pass


def make_data(config: Config, batch_size: int, replica: int = 0, replicas: int = 1,
              files: Optional[list[str]] = None):
    """This replica's sample stream (of `files`, default `train_files`); real sources are
    checked against the model's shapes."""
    from data import PretrainingLoader

    d, cfg = config.data, config.model
    if d.source == "synthetic":
        return SyntheticData(config, batch_size, config.training.seed, replica, replicas)
    files = train_files(config) if files is None else files
    loader = PretrainingLoader(
        files, batch_size, seed=config.training.seed, shuffle_buffer=d.shuffle_buffer,
        prefetch=d.prefetch, dynamic_masking=d.dynamic_masking, model_vocab_size=cfg.vocab_size,
        replica_rank=replica, replica_count=replicas, verbose=replica == 0,
        packing=bool(cfg.packed), max_sequences_per_pack=cfg.pack_slots,
    )
    _fits(cfg, loader.seq_len, loader.max_predictions, cfg.predictions_per_row, loader.vocab_size, "the shards")
    return loader
