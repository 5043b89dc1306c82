"""Where a run's starting weights and its vocab come from.

A source is a checkpoint directory of this project (its model.onnx), an .onnx file,
or a HuggingFace directory of a BERT, or of a GroupBERT that `bert.py export-hf` wrote
(bert/io/hf.py: its sizes then define the network).

The vocab travels with the weights, because the embedding rows follow it: a HuggingFace
directory's vocab.txt (or its tokenizer.json); a checkpoint's run directory's `vocab.txt` (written by SQuAD
fine-tuning, with `vocab.json` for its casing) or else the vocab of the data its run
was configured with (the run's config.json: demo corpus, shards, `data.vocab_file`); an
export's `groupbert.vocab` metadata. `data.vocab_file` names the vocab only where the
source holds none (random initialisation, a bare .onnx); naming one that differs from
the source's own is an error, never a silent replacement.
"""
from __future__ import annotations

import dataclasses
import glob
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import onnx

from bert.config import Config, ModelConfig
from bert.io.hf import is_hf_directory, load_hf_checkpoint
from bert.model import build_model
from session import checkpoint as checkpoints

__all__ = ["HEAD_PREFIXES", "Start", "Vocabulary", "build_with_weights", "scored_source", "starting_point",
           "trained_start"]

# Weights of the task heads (pre-training: MLM, pooler + NSP; SQuAD: the span head; labelled tasks: the classifier).
HEAD_PREFIXES = ("cls.", "bert.pooler.", "qa_outputs.", "classifier.")
VOCAB_RECORD = "vocab.json"  # beside a run's vocab.txt: its casing and origin
# Sizes a checkpoint's run config fixes (the weights' shapes follow them).
_SIZES = ("hidden_size", "num_layers", "num_heads", "vocab_size", "ffn_multiplier", "max_positions",
          "type_vocab_size", "layer_norm_eps")


@dataclass(frozen=True)
class Vocabulary:
    text: str  # vocab.txt, one token per line
    lower_case: bool
    origin: str

    def write(self, path: Path) -> Path:
        """vocab.txt at `path`, and its casing in vocab.json beside it."""
        path.write_text(self.text, encoding="utf-8")
        (path.parent / VOCAB_RECORD).write_text(json.dumps({"lower_case": self.lower_case, "origin": self.origin})
                                                + "\n")
        return path

    @staticmethod
    def of_run(run: Path) -> Optional["Vocabulary"]:
        """The vocab a run directory records: its vocab.txt (+ vocab.json), or its config's data."""
        text = run / "vocab.txt"
        if text.is_file():
            lower_case = True
            record = run / VOCAB_RECORD
            if record.is_file():
                try:
                    lower_case = json.loads(record.read_text())["lower_case"]
                except (ValueError, KeyError, TypeError):
                    raise ValueError(f"{record} is not a vocab record ({{\"lower_case\": true|false}})") from None
                if not isinstance(lower_case, bool):
                    raise ValueError(f"{record}: lower_case must be true or false, got {lower_case!r}")
            return Vocabulary(_read_text(text), lower_case, str(text))
        saved = run / "config.json"
        if saved.is_file():
            from bert.config import load_config

            try:
                return _data_vocab(load_config(saved))
            except ValueError:  # a run of an older config format: no vocab recorded
                return None
        return None


@dataclass(frozen=True)
class Start:
    """The network (sizes from a HuggingFace config when importing), its weights, its vocab."""

    model: ModelConfig
    weights: Optional[dict[str, np.ndarray]]
    vocab: Optional[Vocabulary]
    origin: str


def scored_source(config: Config, checkpoint_input: Optional[str]) -> Optional[str]:
    """The weights `bert.py eval` scores: `checkpoint_input`, else training.init_from; "auto" is,
    as for a run, the newest checkpoint of the config's run directory that verifies."""
    if checkpoint_input != "auto":
        return checkpoint_input or config.training.init_from
    from bert.run.rundir import configured_output_dir, newest_checkpoint

    run_dir = configured_output_dir(config)
    newest = newest_checkpoint(run_dir)
    if newest is None:
        held = "does not exist" if not run_dir.exists() else "holds no checkpoint that verifies"
        raise ValueError(f"--checkpoint-input auto scores the newest checkpoint of the run directory {run_dir} "
                         f"(training.output_dir), which {held}: train first, or name a checkpoint directory "
                         "with --checkpoint-input")
    print(f"scoring {newest}, the newest checkpoint of {run_dir}", flush=True)
    return str(newest)


def starting_point(config: Config, source: Optional[str]) -> Start:
    if source is None:
        return Start(config.model, None, _data_vocab(config), "random initialisation")
    path = Path(source)
    if is_hf_directory(path):
        hf = load_hf_checkpoint(path)
        model = _hf_labels(hf.model_config(config.model), hf.hf_config, hf.weights)
        _print_size_changes(model, config.model, path / "config.json")
        vocab = Vocabulary(hf.vocab_text, hf.lower_case, str(hf.vocab_path))
        return Start(model, hf.weights, _own_vocab(config, vocab), f"HuggingFace checkpoint {path}")
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
    model, vocab = config.model, None
    if path.is_dir():  # a checkpoint: its run directory records the sizes and the vocab
        model = _run_model(path.parent, config.model)
        vocab = Vocabulary.of_run(path.parent)
    else:
        meta = {p.key: p.value for p in proto.metadata_props}
        if "groupbert.vocab" in meta:
            vocab = Vocabulary(meta["groupbert.vocab"], json.loads(meta.get("groupbert.lower_case", "true")),
                               str(onnx_file))
    if vocab is None:
        return Start(model, weights, _data_vocab(config), f"checkpoint {onnx_file}")
    return Start(model, weights, _own_vocab(config, vocab), f"checkpoint {onnx_file}")


def trained_start(config: Config, checkpoint_input: Optional[str], flag: str) -> Start:
    """The trained weights an export (`flag`: export, export-hf) writes: --checkpoint-input
    (a checkpoint of a run) or training.init_from, on one sequence per row: a packed model's
    weights are its unpacked graph's (docs/packing.md)."""
    source = checkpoint_input or config.training.init_from
    if source is None:
        raise ValueError(f"{flag} needs trained weights: pass --checkpoint-input DIR (a checkpoint of a run) or "
                         "--training.init_from DIR (a checkpoint or a HuggingFace BERT or GroupBERT directory)")
    if Path(source).is_dir() and not is_hf_directory(Path(source)):
        saved = _saved_model(Path(source).parent) or {}
        task = saved.get("task")
        if isinstance(task, str) and task != config.model.task.value:
            raise ValueError(f"{source} was trained for model.task {task!r} (its run's config.json) and the config "
                             f"given to {flag} says {config.model.task.value!r}: pass --model.task {task}, or the "
                             "config of that run")
    start = starting_point(config, source)
    model = start.model.unpacked()
    if model.task.spec.named_outputs and model.labels is None and model.outputs:
        # A head whose labels were never named (transformers' LABEL_0, ...): served by those names.
        model = model.model_copy(update={"labels": tuple(f"LABEL_{i}" for i in range(model.outputs))})
        print(f"note: the labels of {start.origin} are not named: exported as LABEL_0 ... LABEL_{model.outputs - 1} "
              "(name them with --model.labels)", flush=True)
    return dataclasses.replace(start, model=model)


def _own_vocab(config: Config, own: Vocabulary) -> Vocabulary:
    """The source's own vocab; a data.vocab_file that says otherwise is an error."""
    named = config.data.vocab_file
    if not named:
        return own
    if not Path(named).is_file():
        raise ValueError(f"data.vocab_file {named} does not exist; the starting weights ({own.origin}) bring their "
                         "own vocab: remove data.vocab_file")
    if _read_text(Path(named)).split() != own.text.split():
        raise ValueError(f"data.vocab_file {named} is not the vocab of the starting weights ({own.origin}), whose "
                         "embedding rows follow their own vocab: remove data.vocab_file (the weights' vocab is used)")
    return own


def _hf_labels(model: ModelConfig, hf_config: dict, weights: dict[str, np.ndarray]) -> ModelConfig:
    """A labelled task's model with the labels of a HuggingFace head it starts from (a classifier
    fine-tuned there, or exported from here): its id2label, in the head's order, unless they
    are transformers' placeholder names (LABEL_0, ...) or model.labels names them."""
    head = weights.get("classifier.weight")
    names = hf_config.get("id2label")
    if not model.task.labelled or model.labels is not None or head is None or not isinstance(names, dict):
        return model
    try:
        labels = tuple(str(names[str(i)]) for i in range(head.shape[0]))
    except KeyError:
        return model
    if all(name == f"LABEL_{i}" for i, name in enumerate(labels)):
        return model if model.num_labels is not None else model.model_copy(update={"num_labels": len(labels)})
    return model.model_copy(update={"labels": labels, "num_labels": len(labels)})


def _run_model(run: Path, model: ModelConfig) -> ModelConfig:
    """`model` with the sizes of the run that wrote a checkpoint (from its config.json), e.g.
    a fine-tuning run whose sizes came from a HuggingFace import, and a labelled task's labels."""
    sizes = _saved_model(run)
    if sizes is None:
        return model  # the weights' shapes are checked when the graph takes them
    saved = run / "config.json"
    if sizes.get("architecture") != model.architecture.value:
        theirs = sizes.get("architecture")
        raise ValueError(f"the checkpoints of {run} are of a {theirs} (its config.json's model.architecture) and "
                         f"this run's model.architecture is {model.architecture.value!r}: set --model.architecture "
                         f"{theirs}, or start from a {model.architecture.value} checkpoint")
    resized = model.with_sizes({k: sizes[k] for k in _SIZES if k in sizes}, str(saved))
    _print_size_changes(resized, model, saved)
    if sizes.get("task") == model.task.value and model.task.labelled and model.labels is None and sizes.get("labels"):
        # The head of a labelled task: its outputs are the run's labels, in its order.
        resized = resized.model_copy(update={"labels": tuple(sizes["labels"]), "num_labels": len(sizes["labels"])})
    return resized


def _saved_model(run: Path) -> Optional[dict]:
    """The model section of the config.json of the run that wrote a checkpoint, or None."""
    saved = run / "config.json"
    if not saved.is_file():
        return None
    try:
        sizes = json.loads(saved.read_text())["model"]
    except (ValueError, KeyError, TypeError):
        return None
    return sizes if isinstance(sizes, dict) and isinstance(sizes.get("architecture"), str) else None


def _print_size_changes(model: ModelConfig, configured: ModelConfig, where: Path) -> None:
    changed = [k for k in ("hidden_size", "num_layers", "num_heads", "vocab_size", "ffn_multiplier", "sequence_length",
                           "max_predictions")
               if getattr(model, k) != getattr(configured, k)]
    if changed:
        print(f"model sizes from {where}: " + ", ".join(
            f"{k} {getattr(model, k)} (config: {getattr(configured, k)})" for k in changed), flush=True)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"vocab {path} is not UTF-8 text (byte {e.start})") from None


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
        return Vocabulary(_read_text(path), d.lower_case, str(path))
    if d.source == "demo":
        path = Path(d.directory) / "vocab.txt"
        return Vocabulary(_read_text(path), True, str(path)) if path.is_file() else None
    if d.source == "shards":
        from data.shards import inspect_shard, read_vocab_text

        files = sorted({f for pattern in d.files for f in glob.glob(pattern)})
        text = read_vocab_text(files[0]) if files else None
        if not text:
            return None
        lower = bool(inspect_shard(files[0], read_tail=False).attrs.get("lower_case", True))
        return Vocabulary(text, lower, files[0])
    return None
