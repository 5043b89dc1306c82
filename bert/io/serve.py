"""The labelled tasks served from an export (`infer.py --task classify` and `--task tokens`).

    classify   texts, or sentence pairs, to the top-k labels with their probabilities (a
               regression model: its value); tokenized, truncated and paired as fine-tuning
               did (data/labelled.py)
    tokens     texts to named entities: the words are the tokenizer's own pre-tokenization,
               each word takes the tag predicted at its first sub-word (as fine-tuning
               labels them), and the IOB tags are grouped into entities as seqeval groups
               them; each entity with its character span in the text
    score      a labelled file in the run's format (the export's `groupbert.data`: format and
               columns) scored with the run's own metrics (bert/tasks/labelled.py `figures`), so
               the figures are the run's evaluation, through onnxruntime

`model` is anything with infer.py's OnnxModel interface: `run(feeds) -> outputs`,
`tokenizer`, `config` (the export's model config) and `meta` (its metadata). Batches are
cut to their longest row (the export takes any length): the same logits as full-length rows.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from bert.config import Config, DataConfig, ModelConfig, Task
from bert.tasks import SPECS
from bert.tasks.targets import softmax
from data.labelled import sentence_features, text_word_features

__all__ = ["Entity", "classify", "served_model", "score_file", "tag", "text_columns"]

_FEEDS = ("input_ids", "segment_ids", "input_mask")


@dataclass(frozen=True)
class Entity:
    """A named entity found in a text: its type, its text and character span, and the mean
    probability of its words' tags."""

    type: str
    text: str
    start: int
    end: int
    score: float


def served_model(model: Any, kind: str) -> ModelConfig:
    """The export's model config, which must be of the kind of task asked for."""
    try:
        config = ModelConfig(**model.config)
    except (TypeError, ValueError):
        raise ValueError(f"{model.path}: its groupbert.config metadata is not a model config; export it again") from None
    if config.task.spec.serve != kind:  # the tasks whose spec this kind serves
        wanted = " or ".join(s.task.value for s in SPECS if s.serve == kind)
        raise ValueError(f"{model.path} is a {config.task.value} model; --task {kind} needs a {wanted} export "
                         "(python bert.py export of a run fine-tuned on that task)")
    if config.task.spec.named_outputs and not config.labels:
        raise ValueError(f"{model.path} names no labels (groupbert.config); export the run again")
    return config


def logits_of(model: Any, arrays: dict[str, np.ndarray], batch_size: int, progress: bool = False,
              what: str = "rows") -> np.ndarray:
    """The model's logits for every row of `arrays`, batch by batch, each batch cut to its
    longest row; per-token logits padded back to the arrays' length. The bar counts rows."""
    from tqdm import tqdm

    count, length = arrays["input_ids"].shape
    found = []
    with tqdm(total=count, desc=what, unit="row", disable=not progress) as bar:
        for i in range(0, count, batch_size):
            part = {k: arrays[k][i : i + batch_size] for k in _FEEDS}
            longest = max(int(part["input_mask"].sum(1).max()), 1)
            logits = model.run({k: v[:, :longest] for k, v in part.items()})["logits"]
            if logits.ndim == 3:  # (B, S, L): the cut positions are padding, predicted nothing
                logits = np.pad(logits, ((0, 0), (0, length - logits.shape[1]), (0, 0)))
            found.append(logits)
            bar.update(len(part["input_ids"]))
    return np.concatenate(found)


def classify(model: Any, texts: Sequence[tuple[str, ...]], top_k: int = 5, batch_size: int = 32,
             progress: bool = False) -> list[dict]:
    """Per text (or pair): {"labels": [(label, probability), ...]} best first, top_k of them,
    or a regression model's {"value": v}."""
    config = served_model(model, "classify")
    if not texts:
        return []
    if len({len(t) for t in texts}) != 1:
        raise ValueError("give every text its pair, or none: a batch holds single texts or pairs")
    columns = text_columns(model)
    if columns is not None and len(columns) != len(texts[0]):
        if len(columns) == 2:
            raise ValueError(f"{model.path} classifies sentence pairs (its run's text columns {list(columns)}); give "
                             "each text its pair (--pair, or a tab between the two texts of a --file line)")
        raise ValueError(f"{model.path} classifies single texts (its run's text column {columns[0]!r}), not pairs; "
                         "drop --pair")
    arrays = sentence_features(model.tokenizer, list(texts), config.sequence_length)
    logits = logits_of(model, arrays, batch_size, progress, "classify")
    return config.task.spec.targets.served(config, logits, top_k)


def text_columns(model: Any) -> Optional[tuple]:
    """The text columns of the run a classification export was fine-tuned on (one, or two for
    sentence pairs), from its `groupbert.data`; None for an export that does not record them."""
    try:
        columns = json.loads(model.meta.get("data", "{}")).get("text_columns")
    except (ValueError, AttributeError):
        return None
    return tuple(columns) if isinstance(columns, list) and 1 <= len(columns) <= 2 else None


def tag(model: Any, texts: Sequence[str], batch_size: int = 32, progress: bool = False) -> list[list[Entity]]:
    """Per text, its named entities in order."""
    from seqeval.metrics.sequence_labeling import get_entities

    config = served_model(model, "tokens")
    if not texts:
        return []
    arrays, spans = text_word_features(model.tokenizer, list(texts), config.sequence_length)
    probs = softmax(logits_of(model, arrays, batch_size, progress, "tokens"))  # (N, S, L)
    found = []
    for row, (text, words) in enumerate(zip(texts, spans)):
        first = np.nonzero(arrays["word_index"][row] >= 0)[0]  # each word's first sub-word, in word order
        best = probs[row, first].argmax(-1)
        tags = [config.labels[j] for j in best]
        sure = probs[row, first, best]
        found.append([Entity(kind, text[words[a][0] : words[b][1]], words[a][0], words[b][1],
                             float(sure[a : b + 1].mean()))
                      for kind, a, b in get_entities(tags)])
    return found


def score_file(model: Any, path: str, batch_size: int = 32, progress: bool = False,
               fmt: Optional[str] = None) -> dict[str, Any]:
    """The run's figures on a labelled file of its format (the dev file's, say), or of `fmt`
    (infer.py's --format: tsv, csv, jsonl, conll or auto, by suffix)."""
    from bert.tasks.labelled import encode, figures, read_rows
    from bert.tasks.metrics import json_figures

    spec = Task(model.config.get("task")).spec
    config = served_model(model, spec.serve if spec.labelled else "classify")  # another task's: refused as classify's
    if "data" not in model.meta and not spec.per_token:  # tokens: CoNLL's columns by default
        raise ValueError(f"{model.path} does not record its files' columns (groupbert.data): export the run again with "
                         "python bert.py export")
    try:
        data = json.loads(model.meta.get("data", "{}"))
    except ValueError:
        raise ValueError(f"{model.path}: its groupbert.data metadata is not JSON; export it again") from None
    if fmt is not None:
        data = {**data, "format": fmt}
    run = Config(model=config, data=DataConfig(source="files", train_file=path, **data))
    rows = encode(run, read_rows(run, path, format_option="--format"), model.tokenizer)
    scores, _ = figures(config, rows, logits_of(model, rows.arrays, batch_size, progress, "score"))
    return {**json_figures(scores), "rows": len(rows)}

