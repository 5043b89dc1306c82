"""Shared test helpers: comparisons that print the worst element, tiny configs, batches."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from bert import ModelConfig
from bert.config import OLD_KEYS

ROOT = Path(__file__).resolve().parents[1]


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py as a module named bench_<name>, without putting bench/ on sys.path."""
    if f"bench_{name}" not in sys.modules:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules[f"bench_{name}"]


def tiny_bert_source(directory: Path, words: int = 90) -> list[str]:
    """bert.py arguments whose weights are a bare tiny BERT written into `directory` (an .onnx
    as training.init_from: hidden 48, 1 layer, vocab 101, sequence 24) and whose vocab has the
    five special tokens and `words` more (over 96: more tokens than the embedding has rows)."""
    from bert import build_model

    model = ModelConfig(architecture="bert", hidden_size=48, num_layers=1, num_heads=3, vocab_size=101,
                        sequence_length=24, max_predictions=5, max_positions=40)
    onnx_file = directory / "bare.onnx"
    onnx_file.write_bytes(build_model(model, with_loss=False).builder.model_proto().SerializeToString())
    vocab = directory / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(words)]) + "\n")
    return ["--config", str(ROOT / "configs/bert_tiny.json"), "--model.num_layers", "1", "--model.hidden_size", "48",
            "--model.num_heads", "3", "--model.vocab_size", "101", "--model.max_positions", "40",
            "--model.sequence_length", "24", "--training.init_from", str(onnx_file), "--data.vocab_file", str(vocab)]


def read_pins(path: Path) -> dict[str, str]:
    """{normalised name: version} of a requirements file's `name==version` lines, following
    `-r FILE`; comments, options and the commented-out names of a lock's unsafe section skipped."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            pins.update(read_pins(path.parent / line[3:].strip()))
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if match:
            pins[normalise_name(match.group(1))] = match.group(2)
    return pins


def normalise_name(name: str) -> str:
    """A distribution name as PEP 503 compares them (`PyYAML`, `pyyaml`, `py_yaml` are one)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def assert_close(actual, expected, rtol: float, name: str = "", atol: float = 0.0) -> None:
    """max |a - e| <= rtol * max |e| + atol (tensor-relative), naming the worst element.

    A small atol is for references that are zero in exact arithmetic (the gradient of an
    attention key bias, which softmax cancels), where both sides are rounding noise.
    """
    a = torch.as_tensor(actual).detach().double().cpu()
    e = torch.as_tensor(expected).detach().double().cpu()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    if not e.numel():
        return
    diff = (a - e).abs()
    scale = e.abs().max().item() or 1.0
    worst = diff.max().item() if diff.numel() else 0.0
    if worst > rtol * scale + atol:
        idx = np.unravel_index(int(diff.argmax()), tuple(diff.shape))
        raise AssertionError(
            f"{name}: max |diff| {worst:.3e} > {rtol:.0e} x max |expected| {scale:.3e} "
            f"(relative {worst / scale:.3e}); worst at {tuple(int(i) for i in idx)}: "
            f"actual {a[idx].item():.8g}, expected {e[idx].item():.8g}"
        )


def sections(**settings) -> dict[str, dict]:
    """Training settings given flat (`learning_rate=0.01, steps=6`) as the config sections that hold
    them: {"training": {"steps": 6}, "optimizer": {"learning_rate": 0.01}} (bert.config.OLD_KEYS)."""
    placed: dict[str, dict] = {"training": {}}
    for key, value in settings.items():
        section, leaf = OLD_KEYS.get(f"training.{key}", f"training.{key}").split(".")
        placed.setdefault(section, {})[leaf] = value
    return placed


def merge_settings(raw: dict, **settings) -> dict:
    """`raw` (a config dict) with flat training settings merged into their sections (`sections`)."""
    for section, values in sections(**settings).items():
        raw[section] = {**raw.get(section, {}), **values}
    return raw


def tiny_config(architecture: str = "groupbert", **overrides) -> ModelConfig:
    """Small, oddly sized (STYLE.md 9): hidden 48, 2 layers, 3 heads, vocab 101."""
    fields = dict(
        architecture=architecture, vocab_size=101, hidden_size=48, num_layers=2, num_heads=3,
        sequence_length=19, max_predictions=5, max_positions=40, layer_norm_eps=1e-12,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def random_batch(cfg: ModelConfig, batch: int, seed: int = 0, pad_from: int | None = None) -> dict[str, np.ndarray]:
    """Token ids, a padding tail per row, distinct masked positions (0 marks an unused slot)."""
    rng = np.random.default_rng(seed)
    s, p = cfg.sequence_length, cfg.max_predictions
    ids = rng.integers(5, cfg.vocab_size, (batch, s), dtype=np.int64)
    mask = np.ones((batch, s), np.int64)
    segments = np.zeros((batch, s), np.int64)
    positions = np.zeros((batch, p), np.int64)
    for r in range(batch):
        length = s if pad_from is None else max(p + 2, s - pad_from - r)
        mask[r, length:] = 0
        ids[r, length:] = 0
        segments[r, length // 2 : length] = 1
        used = p - (r % 2)  # odd rows leave one slot unused
        positions[r, :used] = np.sort(rng.choice(np.arange(1, length), used, replace=False))
    labels = np.where(positions > 0, rng.integers(5, cfg.vocab_size, (batch, p)), 0).astype(np.int64)
    return {
        "input_ids": ids, "segment_ids": segments, "input_mask": mask, "masked_lm_positions": positions,
        "masked_lm_ids": labels, "next_sentence_labels": rng.integers(0, 2, batch).astype(np.int64),
    }


INFERENCE_INPUTS = ("input_ids", "segment_ids", "input_mask", "masked_lm_positions")


def inference_feeds(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inputs of a graph built without its loss: `batch` less the labels."""
    return {k: batch[k] for k in INFERENCE_INPUTS}


def write_small_corpus(directory, doc_counts, seeds, vocab_size: int):
    """Generated structured text files (one per count) and a WordPiece vocab trained on them.

    Returns (files, vocab) with vocab a data.vocab.Vocab.
    """
    from pathlib import Path

    from data.corpus import read_documents
    from data.demo import generate_documents, write_corpus
    from data.vocab import train_vocab

    files = []
    for i, (count, seed) in enumerate(zip(doc_counts, seeds)):
        path = Path(directory) / f"part{i}.txt"
        write_corpus(path, generate_documents(count, seed=seed))
        files.append(path)
    sentences = (s for f in files for doc in read_documents(f) for s in doc)
    return files, train_vocab(sentences, vocab_size, Path(directory) / "vocab.txt")


def signal_a_run(config_path, run_dir, signum: int, root) -> tuple[int, str]:
    """Start `bert.py --config config_path`, send `signum` once its metrics.jsonl holds three
    records, and return (exit status, stderr)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    process = subprocess.Popen([sys.executable, "bert.py", "--config", str(config_path)], cwd=root, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        metrics = Path(run_dir) / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline and process.poll() is None, process.stderr.read()
            time.sleep(0.2)
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, stderr


def random_weights(proto: onnx.ModelProto, rng: np.random.Generator) -> onnx.ModelProto:
    """Every weight of `proto` replaced (in place; returns it) at a scale where every module moves
    the output: LayerNorms about 1, biases about 0.1, matrices 0.15 (so H·0.15² ≈ 1)."""
    for t in proto.graph.initializer:
        shape = tuple(t.dims)
        if t.name.endswith("LayerNorm.weight"):
            value = 1 + 0.2 * rng.standard_normal(shape)
        elif t.name.endswith("bias"):
            value = 0.1 * rng.standard_normal(shape)
        else:
            value = 0.15 * rng.standard_normal(shape)
        t.CopyFrom(numpy_helper.from_array(value.astype(np.float32), t.name))
    return proto
