"""Where a run's starting weights and its vocab come from.

A source is a checkpoint directory of this project (its model.onnx), an .onnx file,
or a HuggingFace BERT directory (bert/hf.py: its sizes then define the network). The
vocab comes from the data the model was trained on (the demo corpus, the vocab stored
in HDF5 shards, `data.vocab_file`) or from the HuggingFace directory.
"""
from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import onnx

from bert.config import Config, ModelConfig
from bert.hf import is_hf_directory, load_hf_checkpoint
from bert.model import build_model
from session import checkpoint as checkpoints

__all__ = ["HEAD_PREFIXES", "Start", "Vocabulary", "build_with_weights", "starting_point"]

# Weights of the task heads (pre-training: MLM, pooler + NSP; SQuAD: the span head).
HEAD_PREFIXES = ("cls.", "bert.pooler.", "qa_outputs.")


@dataclass(frozen=True)
class Vocabulary:
    text: str  # vocab.txt, one token per line
    lower_case: bool
    origin: str

    def write(self, path: Path) -> Path:
        path.write_text(self.text, encoding="utf-8")
        return path


@dataclass(frozen=True)
class Start:
    """The network (sizes from a HuggingFace config when importing), its weights, its vocab."""

    model: ModelConfig
    weights: Optional[dict[str, np.ndarray]]
    vocab: Optional[Vocabulary]
    origin: str


def starting_point(config: Config, source: Optional[str]) -> Start:
    if source is None:
        return Start(config.model, None, _data_vocab(config), "random initialisation")
    path = Path(source)
    if is_hf_directory(path):
        hf = load_hf_checkpoint(path)
        model = hf.model_config(config.model)
        changed = [k for k in ("hidden_size", "num_layers", "num_heads", "vocab_size", "ffn_multiplier")
                   if getattr(model, k) != getattr(config.model, k)]
        if changed:
            print(f"model sizes from {path / 'config.json'}: " +
                  ", ".join(f"{k} {getattr(model, k)} (config: {getattr(config.model, k)})" for k in changed), flush=True)
        vocab = Vocabulary(hf.vocab_path.read_text(encoding="utf-8"), hf.lower_case, str(hf.vocab_path))
        if config.data.vocab_file:
            vocab = _data_vocab(config)
        return Start(model, hf.weights, vocab, f"HuggingFace checkpoint {path}")
    onnx_file = path / "model.onnx" if path.is_dir() else path
    if path.is_dir() and (path / checkpoints.CHECKSUMS_FILE).exists():
        checkpoints.verify(path, ("model.onnx",))  # a damaged checkpoint is named, never half-used
    if not onnx_file.is_file():
        raise ValueError(f"{source} is neither a checkpoint directory (with model.onnx), an .onnx file, nor a "
                         "HuggingFace directory (config.json + model.safetensors or pytorch_model.bin)")
    try:
        proto = onnx.load(str(onnx_file))
    except Exception as e:  # protobuf raises several types for a damaged file
        raise ValueError(f"{onnx_file} is not a readable ONNX model ({type(e).__name__}: {e})") from None
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    return Start(config.model, weights, _data_vocab(config), f"checkpoint {onnx_file}")


def build_with_weights(
    model: ModelConfig, start: Start, *, with_loss: bool, seed: int = 0, allow_missing: Sequence[str] = ()
) -> tuple[onnx.ModelProto, list[str]]:
    """The graph of `model` holding the start's weights; returns it and the weights that kept
    their random initial value (only names starting with `allow_missing` may)."""
    built = build_model(model, with_loss=with_loss, seed=seed)
    if start.weights is None:
        return built.builder.model_proto(), sorted(built.builder.weight_specs)
    names = set(built.builder.weight_specs)
    missing = sorted(names - set(start.weights))
    unexpected = [m for m in missing if not m.startswith(tuple(allow_missing))]
    if unexpected:
        raise ValueError(f"{start.origin} lacks {len(unexpected)} weights of this {model.architecture.value} graph, "
                         f"e.g. {unexpected[:3]}: it holds another architecture or task")
    try:
        built.builder.set_initial_values({k: v for k, v in start.weights.items() if k in names})
    except ValueError as e:
        raise ValueError(f"{start.origin} does not fit the configured model: {e}") from None
    return built.builder.model_proto(), missing


def _data_vocab(config: Config) -> Optional[Vocabulary]:
    d = config.data
    if d.vocab_file:
        path = Path(d.vocab_file)
        if not path.is_file():
            raise ValueError(f"data.vocab_file {path} does not exist")
        return Vocabulary(path.read_text(encoding="utf-8"), d.lower_case, str(path))
    if d.source == "demo":
        path = Path(d.directory) / "vocab.txt"
        return Vocabulary(path.read_text(encoding="utf-8"), True, str(path)) if path.is_file() else None
    if d.source == "shards":
        from data.shards import inspect_shard, read_vocab_text

        files = sorted({f for pattern in d.files for f in glob.glob(pattern)})
        text = read_vocab_text(files[0]) if files else None
        if not text:
            return None
        lower = bool(inspect_shard(files[0], read_tail=False).attrs.get("lower_case", True))
        return Vocabulary(text, lower, files[0])
    return None
