"""`python bert.py export --config ... --checkpoint-input DIR --output model.onnx`: the portable export of a run.

The weights come from `--checkpoint-input` (a checkpoint of this project) or
`training.init_from` (a checkpoint, an .onnx file or a HuggingFace BERT directory); the
graph is the configured model's inference graph, unpacked (a model trained on packed
rows serves one sequence per row, with the same weights). The export carries, in its metadata
(`groupbert.*`, see session/export.py), the task, the model config and the WordPiece
vocab with its casing, so `infer.py` needs no other file; a labelled task's export also
carries its label names (`groupbert.labels`, in the head's order) and how its files are read
(`groupbert.data`: format and columns), so `infer.py --score` reads a dev file as the run did.

`--optimize` then runs onnxruntime's transformer optimizer over the export (`optimize_serving`):
every layer's attention becomes one `com.microsoft::Attention` node (the graph writes its mask
and scaling in the form the optimizer recognises, bert/model.py), the residual adds and
LayerNorms `SkipLayerNormalization`, bias and GELU `BiasGelu`. The file then runs in
onnxruntime only (CPU and CUDA providers), faster; its metadata counts the fused nodes.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Mapping, Optional, Union

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bert.config import Config, DataConfig, ModelConfig
from bert.tasks.squad import EVAL_RESULTS
from bert.io.hf import is_hf_directory
from bert.run.outputs import check_output
from bert.io.sources import HEAD_PREFIXES, build_with_weights, trained_start
from session.export import METADATA_PREFIX, export_model, fold_weight_transposes, metadata, quiet_logger
from session.model_io import ModelLike, load_model, save_model

__all__ = ["ENCODER", "HEADS", "SEQUENCE_OUTPUT", "export_run", "export_serving", "optimize_serving",
           "serving_outputs"]

HEADS = "heads"  # the task's logits
ENCODER = "encoder"  # the encoder's sequence output only
SEQUENCE_OUTPUT = "sequence_output"

# Serving outputs per task, and the symbolic axes of each input and output (V, H and 2 stay fixed).
_TASK_OUTPUTS = {
    "squad": ("start_logits", "end_logits"),
    "pretraining": ("mlm_logits", "nsp_logits"),
    "labelled": ("logits",),
}
DYNAMIC_AXES = {
    "input_ids": ("batch", "sequence"),
    "segment_ids": ("batch", "sequence"),
    "input_mask": ("batch", "sequence"),
    "masked_lm_positions": ("batch", "predictions"),
    "start_logits": ("batch", "sequence"),
    "end_logits": ("batch", "sequence"),
    "mlm_logits": ("batch", "predictions", None),
    "nsp_logits": ("batch", None),
    SEQUENCE_OUTPUT: ("batch", "sequence", None),
}
_LOGITS_AXES = {2: ("batch", None), 3: ("batch", "sequence", None)}  # a sequence's labels / a token's


def serving_outputs(model: onnx.ModelProto, outputs: str = HEADS) -> tuple[str, ...]:
    """The outputs an export keeps: the task's logits (HEADS) or the sequence output (ENCODER)."""
    if outputs == ENCODER:
        return (SEQUENCE_OUTPUT,)
    if outputs != HEADS:
        raise ValueError(f"outputs must be {HEADS!r} (the task's logits) or {ENCODER!r} (sequence output), got {outputs!r}")
    names = {o.name for o in model.graph.output}
    for wanted in _TASK_OUTPUTS.values():
        if set(wanted) <= names:
            return wanted
    raise ValueError(f"the graph's outputs {sorted(names)} are not those of a pre-training, SQuAD or labelled model; "
                     f"export with outputs={ENCODER!r} for the sequence output")


def export_serving(model: ModelLike, path: Union[str, os.PathLike], *, outputs: str = HEADS,
                   extra_metadata: Mapping[str, str] | None = None, portable: bool = True, check: bool = True) -> Path:
    """The portable export of a BERT/GroupBERT graph for serving: the task's logits (or the
    sequence output) with dynamic batch and sequence axes (session.export does the rest)."""
    source = load_model(model)
    keep = serving_outputs(source, outputs)
    rewrites = [positions_from_input_shape] + ([add_sequence_output] if outputs == ENCODER else [])
    axes = dict(DYNAMIC_AXES)
    for o in source.graph.output:
        if o.name == "logits":
            axes["logits"] = _LOGITS_AXES[len(o.type.tensor_type.shape.dim)]
    return export_model(source, path, portable=portable, outputs=keep, dynamic_axes=axes, rewrites=rewrites,
                        extra_metadata=extra_metadata, check=check)


def add_sequence_output(graph: onnx.GraphProto) -> None:
    """Expose the tensor the heads read (the encoder's output) as `sequence_output`."""
    producer = {o: n for n in graph.node for o in n.output}
    source = None
    for n in graph.node:
        if n.op_type == "GatherND":  # the MLM head gathers masked rows of the sequence output
            source = n.input[0]
            break
        if n.op_type == "MatMul":  # the span head: x @ Transpose(qa_outputs.weight)
            t = producer.get(n.input[1])
            if t is not None and t.op_type == "Transpose" and t.input[0].endswith("qa_outputs.weight"):
                source = n.input[0]
                break
    if source is None:
        raise ValueError("cannot find the encoder output in this graph (no MLM or SQuAD head reads it)")
    hidden = next(tuple(t.dims)[0] for t in graph.initializer if t.name.endswith("embeddings.LayerNorm.weight"))
    graph.node.append(helper.make_node("Identity", [source], [SEQUENCE_OUTPUT], name=f"{SEQUENCE_OUTPUT}/Identity"))
    graph.output.append(helper.make_tensor_value_info(SEQUENCE_OUTPUT, TensorProto.FLOAT, ["batch", "sequence", hidden]))


def positions_from_input_shape(graph: onnx.GraphProto) -> None:
    """Gather(position table, constant arange(S)) → Slice(table, 0, Shape(input_ids)[1]): any length S."""
    constants = {n.output[0]: n for n in graph.node if n.op_type == "Constant"}
    weights = {t.name for t in graph.initializer}
    found = False
    nodes: list[onnx.NodeProto] = []
    for n in graph.node:
        table = n.input[0] if n.op_type == "Gather" else ""
        if table.endswith("position_embeddings.weight") and table in weights and n.input[1] in constants:
            name = n.name
            zero = f"{name}/zero"
            nodes.append(helper.make_node("Constant", [], [zero], name=zero,
                                          value=numpy_helper.from_array(np.array([0], np.int64), zero)))
            nodes.append(helper.make_node("Shape", ["input_ids"], [f"{name}/S"], name=f"{name}/Shape", start=1, end=2))
            nodes.append(helper.make_node("Slice", [table, zero, f"{name}/S", zero], [n.output[0]], name=f"{name}/Slice"))
            found = True  # (S, H), added to the (B, S, H) word embeddings by broadcasting
        else:
            nodes.append(n)
    already = any(n.op_type == "Slice" and n.input[0].endswith("position_embeddings.weight") for n in nodes)
    if not (found or already):  # `already`: the graph is an export itself
        raise ValueError("no position-embedding Gather with a constant index found: not a graph of this project")
    del graph.node[:]
    graph.node.extend(nodes)


def export_run(config: Config, path: str, checkpoint_input: Optional[str] = None, outputs: str = HEADS,
               optimize: bool = False) -> Path:
    """`bert.py export` of a run: checked first (a place that can be written, not the weights it
    reads), then built and written under a temporary name renamed into place (session/export.py);
    an earlier export at `path` is replaced. `optimize`: onnxruntime's fused form (optimize_serving)."""
    source = checkpoint_input or config.training.init_from
    if source is not None:
        check_output(path, "export --output", inputs=[source, Path(source) / "model.onnx"], replace=True, suffix=".onnx")
    start = trained_start(config, checkpoint_input, "bert.py export")  # unpacked: serving takes one sequence per row
    if outputs not in (HEADS, ENCODER):
        raise ValueError(f"export --outputs must be {HEADS!r} or {ENCODER!r}, got {outputs!r}")
    allow = HEAD_PREFIXES if outputs == ENCODER else ()
    try:
        proto, _ = build_with_weights(start.model, start, with_loss=False, seed=config.training.seed, allow_missing=allow)
    except ValueError as e:
        if outputs == HEADS:
            raise ValueError(f"{e}\n(a checkpoint without the {start.model.task.value} heads, e.g. a HuggingFace "
                             "BertModel, exports its sequence output with --outputs encoder)") from None
        raise
    meta = {"task": start.model.task.value if outputs == HEADS else ENCODER,
            "config": json.dumps(start.model.model_dump(mode="json")), "source": start.origin}
    data = _run_data(source, config)
    if start.model.task.spec.head == "span" and outputs == HEADS:
        # The windowing the model was fine-tuned with, and the SQuAD v2.0 null threshold
        # tuned on its run's dev file; infer.py uses them by default.
        squad = {k: data[k] for k in ("doc_stride", "max_query_length")}
        threshold = _null_threshold(Path(source))
        if threshold is not None:
            squad["null_threshold"] = threshold
        meta["squad"] = json.dumps(squad)
    if start.model.task.labelled and outputs == HEADS:
        meta.update(labels=json.dumps(start.model.labels),
                    data=json.dumps({k: data[k] for k in ("format", "text_columns", "label_column", "header")}))
    if start.vocab is not None:
        meta.update(vocab=start.vocab.text, lower_case=json.dumps(start.vocab.lower_case))
    if not optimize:
        written = export_serving(proto, path, outputs=outputs, extra_metadata=meta)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            portable = export_serving(proto, Path(tmp) / "portable.onnx", outputs=outputs, extra_metadata=meta)
            del proto
            written = optimize_serving(portable, path, start.model)
    vocab = "with its vocab" if start.vocab is not None else "without a vocab (infer.py --vocab then)"
    form = ", fused for onnxruntime" if optimize else ""
    print(f"exported {start.model.architecture.value} {meta['task']} model from {start.origin} to {written} {vocab}"
          f"{form}")
    return written


def optimize_serving(source: Union[str, os.PathLike], path: Union[str, os.PathLike], model: ModelConfig) -> Path:
    """The portable export at `source` in onnxruntime's fused form, written to `path`: one
    `com.microsoft::Attention` per layer (refused otherwise: the graph's attention no longer has
    the form the optimizer fuses), SkipLayerNormalization, BiasGelu; the metadata is kept and
    `groupbert.fused` counts the fused nodes. onnxruntime must load the result."""
    from onnxruntime.transformers.optimizer import optimize_model

    with tempfile.TemporaryDirectory() as tmp:
        folded = Path(tmp) / "folded.onnx"  # the fusions take weights that are initializers, not Transpose(W)
        save_model(fold_weight_transposes(load_model(source)), folded)
        with quiet_logger("onnxruntime.transformers"):  # its notes on the producer name and shapes
            fused = optimize_model(str(folded), model_type="bert", num_heads=model.num_heads,
                                   hidden_size=model.hidden_size, opt_level=0)
    counts = {k: v for k, v in fused.get_fused_operator_statistics().items() if v}
    if counts.get("Attention", 0) != model.num_layers:
        raise RuntimeError(f"onnxruntime's transformer optimizer fused {counts.get('Attention', 0)} of the "
                           f"{model.num_layers} attention blocks (fused: {counts}); export without --optimize")
    proto = fused.model
    if not any(o.domain == "com.microsoft" for o in proto.opset_import):  # the optimizer adds none
        proto.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    props = {p.key: p.value for p in proto.metadata_props}
    props.update({f"{METADATA_PREFIX}{k}": v for k, v in metadata(source).items()})
    props[f"{METADATA_PREFIX}fused"] = json.dumps(counts)
    onnx.helper.set_model_props(proto, props)
    return export_model(proto, path, portable=False, onnxruntime_ops=True)


def _run_data(source: Optional[str], config: Config) -> dict:
    """The data settings the weights were trained with: a checkpoint's run config (its
    files' format and columns, SQuAD's windows), whatever the config given to the export
    says; the export's own config for other sources (a HuggingFace directory)."""
    data = config.data.model_dump(mode="json")
    run = source is not None and Path(source).is_dir() and not is_hf_directory(Path(source))
    saved = Path(source).parent / "config.json" if run else None
    if saved is None or not saved.is_file():
        return data
    try:
        from bert.config import load_config

        run = load_config(saved).data.model_dump(mode="json")
    except ValueError:
        return data  # a run of an older config format: the export's config speaks for it
    changed = [k for k in ("text_columns", "label_column", "header", "format", "doc_stride", "max_query_length")
               if run[k] != data[k] and data[k] != DataConfig.model_fields[k].default]
    if changed:
        print(f"note: data.{changed[0]} {data[changed[0]]!r} of the export's config is not its run's "
              f"({run[changed[0]]!r}, {saved}); the export records the run's", flush=True)
    return run


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
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    if not math.isfinite(value):  # Python's json reads NaN and Infinity; the metadata must stay standard JSON
        raise ValueError(f"{results} records the null threshold {value}, not a finite number; delete it (or its "
                         "null_threshold) to export without one")
    return float(value)
