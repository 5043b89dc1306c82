"""Opening and checking pre-training shards (NVIDIA BERT HDF5 layout).

`inspect_shard` reads a shard's headers (datasets, shapes, attributes) and its last
row; `check_samples` reads every row once and checks the values the model will
index with, so bad data stops the loader when it opens the shard, naming the
shard, the dataset and the first bad row, instead of training on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from data.pretraining import SAMPLE_KEYS


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    num_samples: int
    seq_len: int
    max_predictions: int
    attrs: dict
    chunk_rows: int | None  # HDF5 chunk height (None: contiguous storage)

    def block_rows(self, at_least: int) -> int:
        """Rows per read: at least `at_least`, a whole number of chunks."""
        if self.chunk_rows is None:
            return max(at_least, 1)
        return self.chunk_rows * max(1, -(-at_least // self.chunk_rows))


def _fail(path: Path, what: str) -> ValueError:
    return ValueError(f"shard {path}: {what}; re-create it with data/create_pretraining_data.py")


def inspect_shard(path: str | Path, *, read_tail: bool = True) -> ShardInfo:
    """Open `path`, check the six datasets agree, and (optionally) read the last row.

    Reading the last row of every dataset catches truncated and most corrupt files
    at start-up instead of hours into a run.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"shard {path} does not exist")
    if path.stat().st_size == 0:
        raise _fail(path, "the file is empty")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise _fail(path, f"not a readable HDF5 file, corrupt or truncated ({e})") from None
    with f:
        missing = [k for k in SAMPLE_KEYS if k not in f]
        if missing:
            raise _fail(path, f"missing dataset(s) {', '.join(missing)}")
        try:
            shapes = {k: f[k].shape for k in SAMPLE_KEYS}
        except (OSError, RuntimeError, KeyError) as e:
            raise _fail(path, f"unreadable dataset header ({e})") from None
        n = shapes["input_ids"][0]
        if len(shapes["input_ids"]) != 2:
            raise _fail(path, f"input_ids must be 2-D (N, S), found shape {shapes['input_ids']}")
        seq_len = shapes["input_ids"][1]
        p = shapes["masked_lm_positions"]
        if len(p) != 2:
            raise _fail(path, f"masked_lm_positions must be 2-D (N, P), found shape {p}")
        expect = {
            "input_mask": (n, seq_len),
            "segment_ids": (n, seq_len),
            "masked_lm_positions": (n, p[1]),
            "masked_lm_ids": (n, p[1]),
            "next_sentence_labels": (n,),
        }
        for k, shape in expect.items():
            if shapes[k] != shape:
                raise _fail(path, f"dataset {k} has shape {shapes[k]}, expected {shape}")
        attrs = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in f.attrs.items()}
        for key, value in (("seq_len", seq_len), ("max_predictions", p[1])):
            if key in attrs and int(attrs[key]) != value:
                raise _fail(path, f"attribute {key}={attrs[key]} disagrees with the data ({value})")
        if read_tail and n:
            for k in SAMPLE_KEYS:
                try:
                    f[k][n - 1]
                except (OSError, RuntimeError, ValueError) as e:
                    raise _fail(path, f"dataset {k} cannot be read, corrupt or truncated ({e})") from None
        chunk = f["input_ids"].chunks
    return ShardInfo(path, n, seq_len, p[1], attrs, None if chunk is None else chunk[0])


# Rows of one read while checking: about 4 M token ids (16 MB of int32) at a time.
_CHECK_ELEMENTS = 1 << 22


def check_samples(info: ShardInfo, vocab_size: int | None = None) -> None:
    """Read every row of the shard once and check the values (format: docs/data.md).

    Integer datasets only (a float id would be rounded; input_mask may be bool); ids
    and masked_lm_ids in [0, vocab_size) (the model's vocab; the shard's `vocab_size`
    attribute when not given); input_mask 0/1 with the padding after the real tokens; segment_ids and
    next_sentence_labels 0/1; masked positions in [0, seq_len), used slots first and
    each on a real token. Vectorised per dataset, in blocks of whole HDF5 chunks.
    """
    path = info.path
    made_with = info.attrs.get("vocab_size")
    vocab = None
    if vocab_size is not None:
        vocab = (vocab_size, f"the model's vocab [0, {vocab_size}) (model.vocab_size"
                             + (f"; the shard was made with {made_with} tokens)" if made_with is not None else ")"))
    elif made_with is not None:
        vocab = (int(made_with), f"the shard's vocab [0, {made_with})")
    with h5py.File(path, "r") as f:
        for key in SAMPLE_KEYS:
            dtype = f[key].dtype
            if dtype.kind not in ("biu" if key == "input_mask" else "iu"):
                raise _fail(path, f"dataset {key} holds {dtype} values; ids, masks and labels must be "
                                  "integers (they are never rounded)")
        step = info.block_rows(max(1, _CHECK_ELEMENTS // info.seq_len))
        for start in range(0, info.num_samples, step):
            end = min(start + step, info.num_samples)
            rows = {}
            for key in SAMPLE_KEYS:
                try:
                    rows[key] = f[key][start:end]
                except (OSError, RuntimeError, ValueError) as e:
                    raise _fail(path, f"dataset {key}, rows {start}:{end} cannot be read, corrupt or "
                                      f"truncated ({e})") from None
            problem = _first_bad_row(rows, info.seq_len, vocab)
            if problem is not None:
                key, row, what = problem
                raise _fail(path, f"dataset {key}, row {start + row}: {what}")


# The largest vocab counted from a shard's own `vocab_size` attribute (a loader without a model's
# vocab): 4 M ids, 32 MB of counts. A larger recorded size is taken for corrupt, and not counted.
MAX_COUNTED_VOCAB = 1 << 22


def target_counts(info: ShardInfo, size: int) -> np.ndarray:
    """How often each token id in [0, size) is a masked-LM target of the shard (its used slots),
    a (size,) int64 array: the unigram counts behind a run's plateau baseline (bert/tasks/unigram.py).
    Reads `masked_lm_ids` and `masked_lm_positions` only, in blocks of whole chunks; ids outside
    the range are not counted (check_samples names them)."""
    counts = np.zeros(size, np.int64)
    with h5py.File(info.path, "r") as f:
        step = info.block_rows(max(1, _CHECK_ELEMENTS // max(info.max_predictions, 1)))
        for start in range(0, info.num_samples, step):
            ids = f["masked_lm_ids"][start : start + step].astype(np.int64)
            counted = (f["masked_lm_positions"][start : start + step] != 0) & (ids >= 0) & (ids < size)
            counts += np.bincount(ids[counted], minlength=size)
    return counts


def scored_target_counts(shards: list[ShardInfo], size: int) -> tuple[np.ndarray, int]:
    """(how often each token id in [0, size) is a scored masked-LM target of `shards`, their [UNK]
    targets): [UNK] (the shards' `unk_id`) is never scored, so its count is moved out
    (data.masking)."""
    counts = sum((target_counts(info, size) for info in shards), np.zeros(size, np.int64))
    unk = shards[0].attrs.get("unk_id") if shards else None
    if not isinstance(unk, int) or not 0 <= unk < size:
        return counts, 0
    unk_targets, counts[unk] = int(counts[unk]), 0
    return counts, unk_targets


def counted_vocab(info: ShardInfo) -> int:
    """The vocab size to count a shard's targets over when no model says it: its recorded
    `vocab_size`, 0 (nothing counted) when it records none or an implausible one."""
    size = info.attrs.get("vocab_size")
    return size if isinstance(size, int) and 0 < size <= MAX_COUNTED_VOCAB else 0


def _first_bad_row(
    rows: dict[str, np.ndarray], seq_len: int, vocab: tuple[int, str] | None
) -> tuple[str, int, str] | None:
    """(dataset, row, what is wrong) of the first row that breaks a rule, or None.

    vocab: (size, how to name it) or None when unknown (then ids need only be >= 0).
    """
    ids, mask, segments = rows["input_ids"], rows["input_mask"], rows["segment_ids"]
    positions, labels, nsp = rows["masked_lm_positions"], rows["masked_lm_ids"], rows["next_sentence_labels"]
    top, vocab_name = vocab if vocab is not None else (np.iinfo(np.int64).max, "[0, ...)")
    in_range = (positions >= 0) & (positions < seq_len)
    on_token = np.take_along_axis(mask, np.where(in_range, positions, 0), axis=1) == 1
    used = positions != 0
    # (dataset, element-wise violation (N, ...), description of the offending value)
    rules = (
        ("input_ids", (ids < 0) | (ids >= top), f"token id {{v}} (column {{c}}) is outside {vocab_name}"),
        ("input_mask", (mask != 0) & (mask != 1), "mask value {v} (column {c}) is not 0 or 1"),
        ("input_mask", np.diff(mask.astype(np.int8), axis=1) > 0,
         "a real token (column {c1}) follows padding; padding must come last"),
        ("segment_ids", (segments != 0) & (segments != 1), "segment id {v} (column {c}) is not 0 or 1"),
        ("masked_lm_positions", ~in_range, f"position {{v}} (slot {{c}}) is outside the sequence [0, {seq_len})"),
        ("masked_lm_positions", used & in_range & ~on_token, "position {v} (slot {c}) points at padding"),
        ("masked_lm_positions", np.diff(used.astype(np.int8), axis=1) > 0,
         "a used slot ({c1}) follows an unused one (position 0); used slots come first"),
        ("masked_lm_ids", (labels < 0) | (labels >= top), f"id {{v}} (slot {{c}}) is outside {vocab_name}"),
        ("next_sentence_labels", (nsp != 0) & (nsp != 1), "label {v} is not 0 or 1"),
    )
    first: tuple[int, str, str] | None = None
    for key, bad, what in rules:
        per_row = bad.reshape(len(bad), -1).any(axis=1)
        if per_row.any():
            row = int(per_row.argmax())
            if first is None or row < first[0]:
                column = int(bad[row].argmax()) if bad.ndim > 1 else 0
                value = rows[key][row, column] if bad.ndim > 1 and rows[key].ndim > 1 else rows[key][row]
                first = (row, key, what.format(v=value, c=column, c1=column + 1))
    return None if first is None else (first[1], first[0], first[2])


def read_vocab_text(path: str | Path) -> str | None:
    """The vocab stored in a shard by create_pretraining_data (None for foreign shards)."""
    with h5py.File(path, "r") as f:
        if "vocab" not in f:
            return None
        v = f["vocab"][()]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)
