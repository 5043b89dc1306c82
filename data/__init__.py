"""Pre-training and SQuAD data: corpus → WordPiece → MLM/NSP samples → HDF5 shards → batches.

Public names are imported lazily (PEP 562), so the shard-creation workers and the
SQuAD tools do not pay for importing torch.
"""

from __future__ import annotations

import importlib

__all__ = [
    "CreateOptions",
    "DemoData",
    "PretrainingLoader",
    "Vocab",
    "build_demo_data",
    "create_pretraining_data",
    "inspect_shard",
    "load_vocab",
    "make_tokenizer",
]

_WHERE = {
    "CreateOptions": "data.pretraining",
    "DemoData": "data.demo",
    "PretrainingLoader": "data.loader",
    "Vocab": "data.vocab",
    "build_demo_data": "data.demo",
    "create_pretraining_data": "data.create_pretraining_data",
    "inspect_shard": "data.shards",
    "load_vocab": "data.vocab",
    "make_tokenizer": "data.vocab",
}


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
