"""`python bert.py --config ... --checkpoint-input DIR --export model.onnx`: the portable export of a run.

The weights come from `--checkpoint-input` (a checkpoint of this project) or
`training.init_from` (a checkpoint, an .onnx file or a HuggingFace BERT directory); the
graph is the configured model's inference graph. The export carries, in its metadata
(`groupbert.*`, see session/export.py), the task, the model config and the WordPiece
vocab with its casing, so `infer.py` needs no other file.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from bert.config import Config
from bert.finetune import EVAL_RESULTS
from bert.sources import HEAD_PREFIXES, build_with_weights, starting_point
from session.export import ENCODER, HEADS, export_model

__all__ = ["export_run"]


def export_run(config: Config, path: str, checkpoint_input: Optional[str] = None, outputs: str = HEADS) -> Path:
    source = checkpoint_input or config.training.init_from
    if source is None:
        raise ValueError("--export needs trained weights: pass --checkpoint-input DIR (a checkpoint of a run) or "
                         "--training.init_from DIR (a checkpoint or a HuggingFace BERT directory)")
    start = starting_point(config, source)
    if outputs not in (HEADS, ENCODER):
        raise ValueError(f"--export-outputs must be {HEADS!r} or {ENCODER!r}, got {outputs!r}")
    allow = HEAD_PREFIXES if outputs == ENCODER else ()
    try:
        proto, _ = build_with_weights(start.model, start, with_loss=False, seed=config.training.seed, allow_missing=allow)
    except ValueError as e:
        if outputs == HEADS:
            raise ValueError(f"{e}\n(a checkpoint without the {start.model.task.value} heads, e.g. a HuggingFace "
                             "BertModel, exports its sequence output with --export-outputs encoder)") from None
        raise
    meta = {"task": start.model.task.value if outputs == HEADS else ENCODER,
            "config": json.dumps(start.model.model_dump(mode="json")), "source": start.origin}
    if start.model.task.value == "squad" and outputs == HEADS:
        # The windowing the model was fine-tuned with, and the SQuAD v2.0 null threshold
        # tuned on its run's dev file; infer.py uses them by default.
        squad = {"doc_stride": config.data.doc_stride, "max_query_length": config.data.max_query_length}
        threshold = _null_threshold(Path(source))
        if threshold is not None:
            squad["null_threshold"] = threshold
        meta["squad"] = json.dumps(squad)
    if start.vocab is not None:
        meta.update(vocab=start.vocab.text, lower_case=json.dumps(start.vocab.lower_case))
    written = export_model(proto, path, outputs=outputs, extra_metadata=meta)
    vocab = "with its vocab" if start.vocab is not None else "without a vocab (infer.py --vocab then)"
    print(f"exported {start.model.architecture.value} {meta['task']} model from {start.origin} to {written} {vocab}")
    return written


def _null_threshold(source: Path) -> Optional[float]:
    """The null threshold a checkpoint's run tuned on a v2.0 dev file (its eval_results.json)."""
    results = source.parent / EVAL_RESULTS if source.is_dir() else None
    if results is None or not results.is_file():
        return None
    try:
        value = json.loads(results.read_text()).get("null_threshold")
    except (ValueError, AttributeError):
        raise ValueError(f"{results} is not valid JSON; it records the run's dev scores (delete it to export "
                         "without a null threshold)") from None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
