"""Opening and checking pre-training shards (NVIDIA BERT HDF5 layout)."""

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


def read_vocab_text(path: str | Path) -> str | None:
    """The vocab stored in a shard by create_pretraining_data (None for foreign shards)."""
    with h5py.File(path, "r") as f:
        if "vocab" not in f:
            return None
        v = f["vocab"][()]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)
