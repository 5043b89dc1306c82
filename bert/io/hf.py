"""Import of HuggingFace BERT checkpoint directories into BERT-mode graphs, and of GroupBERT
ones (model_type "groupbert", the classes `bert.py export-hf` ships: bert/hf_groupbert/) into
GroupBERT graphs.

A directory written by `transformers` (`save_pretrained`) holds config.json,
model.safetensors or pytorch_model.bin, and the tokenizer's vocab: vocab.txt, or a WordPiece
tokenizer.json (transformers 5 saves no vocab.txt). The graph's weight names are the
`BertForPreTraining` state-dict names (bert/model.py), and GroupBERT's classes use the
graph's names, so weights load by name; this module only maps config.json onto ModelConfig
and normalises the few spellings in which BERT checkpoints differ: `BertModel` saves
without the `bert.` prefix, old TensorFlow conversions say `LayerNorm.gamma/beta`, and the
tied MLM decoder (the word embedding and `cls.predictions.bias` again) is not a weight of
its own here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from bert.config import Architecture, ModelConfig

__all__ = ["HFCheckpoint", "is_hf_directory", "load_hf_checkpoint", "model_config_from_hf"]

CONFIG = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_ENCODER_PREFIXES = ("embeddings.", "encoder.", "pooler.")
_TIED = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")
_BUFFERS = ("bert.embeddings.position_ids",)
_MODEL_TYPES = {Architecture.BERT: "bert", Architecture.GROUPBERT: "groupbert"}
# GroupBertConfig's keys for the GroupBERT structure, and its defaults (ModelConfig's).
_GROUPBERT_KEYS = {"conv_kernel_size": ("conv_kernel", 7), "conv_group_size": ("conv_group_size", 16),
                   "ffn_groups": ("ffn_groups", 4)}


@dataclass(frozen=True)
class HFCheckpoint:
    directory: Path
    hf_config: dict
    weights: dict[str, np.ndarray]  # graph names
    vocab_text: str  # one token a line
    vocab_path: Path  # vocab.txt or tokenizer.json
    lower_case: bool

    def model_config(self, base: ModelConfig) -> ModelConfig:
        return model_config_from_hf(self.hf_config, base, where=str(self.directory / CONFIG))


def is_hf_directory(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / CONFIG).is_file() and any((path / f).is_file() for f in WEIGHT_FILES)


def model_config_from_hf(hf: dict, base: ModelConfig, where: str = CONFIG) -> ModelConfig:
    """`base` (task, sequence length, dropout of the run) with the sizes of a HF BERT config, or
    of a GroupBERT one (GroupBertConfig, from `bert.py export-hf`) for a GroupBERT run.

    Refuses, naming the key, what the run's graph cannot hold.
    """
    def refuse(what: str) -> ValueError:
        return ValueError(f"{where}: {what}; only BERT checkpoints (model_type 'bert', erf GELU, absolute "
                          "positions) import, into a BERT-mode graph (model.architecture 'bert'), and GroupBERT "
                          "ones (model_type 'groupbert', as bert.py export-hf writes them) into a GroupBERT graph")

    model_type, wanted = hf.get("model_type"), _MODEL_TYPES[base.architecture]
    if model_type not in _MODEL_TYPES.values():
        raise refuse(f"model_type is {model_type!r}")
    if model_type != wanted:
        raise ValueError(f"{where}: model_type is {model_type!r} and the run's model.architecture "
                         f"{base.architecture.value!r}: a {model_type} checkpoint imports into a {model_type} graph "
                         f"only: run with --model.architecture {model_type} (or a {model_type} config)")
    if hf.get("hidden_act", "gelu") != "gelu":
        raise refuse(f"hidden_act is {hf.get('hidden_act')!r}")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise refuse(f"position_embedding_type is {hf.get('position_embedding_type')!r}")
    try:
        hidden, intermediate = int(hf["hidden_size"]), int(hf["intermediate_size"])
        sizes = dict(
            hidden_size=hidden, num_layers=int(hf["num_hidden_layers"]), num_heads=int(hf["num_attention_heads"]),
            vocab_size=int(hf["vocab_size"]), max_positions=int(hf.get("max_position_embeddings", 512)),
            type_vocab_size=int(hf.get("type_vocab_size", 2)), layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        )
    except KeyError as e:
        raise ValueError(f"{where} lacks {e.args[0]!r}: not a {wanted} config") from None
    if intermediate % hidden:
        raise refuse(f"intermediate_size {intermediate} is not a multiple of hidden_size {hidden} "
                     "(the graph's FFN width is ffn_multiplier x hidden_size)")
    sizes["ffn_multiplier"] = intermediate // hidden
    if base.architecture is Architecture.GROUPBERT:
        for key, (field, default) in _GROUPBERT_KEYS.items():
            value = hf.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{where}: {key} is {value!r}, not a whole number")
            sizes[field] = value
    return base.with_sizes(sizes, where)


def load_hf_checkpoint(directory: str | Path) -> HFCheckpoint:
    """Read config.json, the vocab and the weights (safetensors preferred) of a HF directory."""
    directory = Path(directory)
    if not is_hf_directory(directory):
        raise ValueError(f"{directory} is not a HuggingFace checkpoint directory: it needs {CONFIG} and one of "
                         f"{', '.join(WEIGHT_FILES)}")
    hf_config = _read_json(directory / CONFIG)
    if not isinstance(hf_config, dict):
        raise ValueError(f"{directory / CONFIG} holds a JSON {type(hf_config).__name__}, not a BERT config object")
    vocab_text, vocab_path = _read_vocab(directory)
    lower_case = True
    tokenizer_config = directory / "tokenizer_config.json"
    if tokenizer_config.is_file():
        settings = _read_json(tokenizer_config)
        lower_case = settings.get("do_lower_case", True) if isinstance(settings, dict) else True
        if not isinstance(lower_case, bool):
            raise ValueError(f"{tokenizer_config}: do_lower_case must be true or false, got {lower_case!r}")
    return HFCheckpoint(directory, hf_config, _graph_names(_read_weights(directory), directory), vocab_text,
                        vocab_path, lower_case)


def _read_vocab(directory: Path) -> tuple[str, Path]:
    """The WordPiece vocab (one token a line, in id order) and the file it is read from: vocab.txt,
    else the vocab of a WordPiece tokenizer.json (what transformers 5's tokenizer saves)."""
    path = directory / "vocab.txt"
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8"), path
        except UnicodeDecodeError as e:
            raise ValueError(f"vocab {path} is not UTF-8 text (byte {e.start})") from None
    path = directory / "tokenizer.json"
    tokenizer = _read_json(path) if path.is_file() else None
    model = tokenizer.get("model") if isinstance(tokenizer, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) and model.get("type") == "WordPiece" else None
    if not isinstance(vocab, dict):
        raise ValueError(f"{directory} has no vocab.txt nor a WordPiece tokenizer.json (a WordPiece vocab is needed to "
                         "tokenize for this model): save the tokenizer there too (tokenizer.save_pretrained(DIR))")
    tokens = sorted(vocab, key=vocab.get)
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise ValueError(f"{path}: the WordPiece vocab's ids are not 0 .. {len(tokens) - 1}, one per token")
    return "".join(f"{token}\n" for token in tokens), path


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path} is not valid JSON ({e})") from None


def _read_weights(directory: Path) -> dict[str, np.ndarray]:
    """The weight file's tensors; a damaged or truncated file is named, never half-read."""
    path = next(directory / f for f in WEIGHT_FILES if (directory / f).is_file())
    try:
        if path.suffix == ".safetensors":
            from safetensors.numpy import load_file

            return load_file(str(path))
        import torch

        state = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError("not a state dict of tensors")
        return {k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in state.items()}
    except Exception as e:  # safetensors, pickle and zip raise their own types for a damaged file
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
                         "; the file is damaged or truncated: save or copy the checkpoint again") from None


def _graph_names(state: dict[str, np.ndarray], directory: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, value in state.items():
        if name.startswith(_ENCODER_PREFIXES):
            name = "bert." + name
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if name in _BUFFERS:
            continue
        out[name] = np.asarray(value, dtype=np.float32)
    decoder: Optional[np.ndarray] = out.pop(_TIED[0], None)
    out.pop(_TIED[1], None)
    word = out.get("bert.embeddings.word_embeddings.weight")
    if word is None:
        raise ValueError(f"{directory}: no word embedding (bert.embeddings.word_embeddings.weight) among the weights")
    if decoder is not None and not np.array_equal(decoder, word):
        raise ValueError(f"{directory}: the MLM decoder is not tied to the word embedding; this graph's MLM head is tied")
    return out
