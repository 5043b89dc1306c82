"""Portable export: an ONNX→ONNX rewrite of a project graph into standard ONNX for serving.

A training graph (a checkpoint's model.onnx) holds what only this project's session
runs: the custom `ai.groupbert::GroupedConv1d` node, PopART's placement attributes
(onnxruntime's extended fusions copy them into fused nodes and then reject them,
docs/design.md), label inputs and losses, dropout, and a position index that is a
constant of the training sequence length. `portable_model` rewrites all of that:

- GroupedConv1d(x, W, mask) → x · mask[..., None] → Transpose → Conv(group=H/C, pads=K//2)
  → Transpose: the same weight (H, C, K) is ONNX Conv's (M, C/group, K); a packed graph's
  GroupedConv1d (with sequence ids) is refused: serving runs the unpacked graph;
- the placement attributes leave the nodes and are recorded, per node name, as JSON in
  the model's metadata (`groupbert.placement`);
- only the serving outputs are kept (SQuAD: start/end logits; pre-training: MLM + NSP
  logits; or the encoder's sequence output) and everything they do not need is pruned:
  label inputs, losses, accuracies, unused weights; Dropout nodes (identity at inference)
  are removed;
- batch and sequence axes are dynamic: the position embeddings are the first S rows of
  the table, S read from the shape of `input_ids` (Shape → Slice) instead of a constant
  index of the training length (every Reshape target of the builder already uses 0/-1
  for B and S). Masked positions get a dynamic axis too.

`export_model` writes the result (weights inside the file, or beside it as external
data past 1 GiB so that models past protobuf's 2 GiB limit save), checks it with
`onnx.checker.check_model(full_check=True)` and loads it in onnxruntime with default
session options (all graph optimizations on). `portable=False` writes the graph as
it is, custom ops and placement included (the project's InferenceSession runs both).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from builder import IPU_NUMBER, PIPELINE_STAGE, RECOMPUTE
from custom_ops import DOMAIN, GROUPED_CONV1D
from session.lowering import needed_nodes
from session.model_io import ModelLike, load_model, save_model

__all__ = [
    "ENCODER", "HEADS", "METADATA_PREFIX", "SEQUENCE_OUTPUT", "export_model", "fold_weight_transposes", "metadata",
    "portable_model",
    "serving_outputs",
]

HEADS = "heads"  # the task's logits
ENCODER = "encoder"  # the encoder's sequence output only
SEQUENCE_OUTPUT = "sequence_output"
METADATA_PREFIX = "groupbert."
_PLACEMENT = (IPU_NUMBER, PIPELINE_STAGE, RECOMPUTE)

# Serving outputs per task, and the symbolic shape of each (V, H and 2 stay fixed).
_TASK_OUTPUTS = {
    "squad": ("start_logits", "end_logits"),
    "pretraining": ("mlm_logits", "nsp_logits"),
}
_DYNAMIC_DIMS = {
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
    raise ValueError(f"the graph's outputs {sorted(names)} are neither a SQuAD nor a pre-training model's; "
                     f"export with outputs={ENCODER!r} for the sequence output")


def portable_model(model: ModelLike, *, outputs: str = HEADS, extra_metadata: Optional[Mapping[str, str]] = None) -> onnx.ModelProto:
    """The standard-ONNX serving graph of a project graph (see the module docstring)."""
    source = load_model(model)
    out = onnx.ModelProto()
    out.CopyFrom(source)
    graph = out.graph
    keep = serving_outputs(source, outputs)
    if outputs == ENCODER:
        _add_sequence_output(graph)
    _remove_dropout(graph)
    placement = _strip_placement(graph)
    _rewrite_grouped_conv(graph)
    _positions_from_input_shape(graph)
    _prune(graph, keep)
    _make_axes_dynamic(graph)
    del graph.value_info[:]  # recorded for the training length; onnxruntime infers its own
    opsets = [o for o in out.opset_import if o.domain not in (DOMAIN,)]
    del out.opset_import[:]
    out.opset_import.extend(opsets)
    meta = {"placement": json.dumps(placement, separators=(",", ":")), "outputs": ",".join(keep)}
    meta.update(extra_metadata or {})
    _set_metadata(out, meta)
    return out


def fold_weight_transposes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Store Wᵀ for every Transpose(W, [1, 0]) of a 2-D weight (in place; returns the model).

    The builder applies dense weights as MatMul(x, Transpose(W)) so that W keeps torch's
    (out, in) layout and HuggingFace names; onnxruntime folds these transposes itself, but
    its quantizer only takes a MatMul whose weight is an initializer.
    """
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    folded, kept = [], []
    for n in graph.node:
        w = weights.get(n.input[0]) if n.op_type == "Transpose" and n.input else None
        perm = next((list(a.ints) for a in n.attribute if a.name == "perm"), None)
        if w is not None and len(w.dims) == 2 and perm == [1, 0]:
            folded.append(numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(w).T), n.output[0]))
        else:
            kept.append(n)
    del graph.node[:]
    graph.node.extend(kept)
    graph.initializer.extend(folded)
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    for i in reversed(range(len(graph.initializer))):
        if graph.initializer[i].name not in used:
            del graph.initializer[i]
    return model


def metadata(model: Union[onnx.ModelProto, str, os.PathLike]) -> dict[str, str]:
    """The `groupbert.*` metadata of an export (prefix removed). Reads no weights from a path."""
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model), load_external_data=False)
    return {p.key[len(METADATA_PREFIX):]: p.value for p in model.metadata_props if p.key.startswith(METADATA_PREFIX)}


def export_model(
    model: ModelLike,
    path: Union[str, os.PathLike],
    *,
    portable: bool = True,
    outputs: str = HEADS,
    extra_metadata: Optional[Mapping[str, str]] = None,
    check: bool = True,
) -> Path:
    """Write `model` for serving at `path` and, with `check`, verify that the checker and
    onnxruntime (default options) accept it. Returns the path."""
    path = Path(path)
    if path.suffix != ".onnx":
        raise ValueError(f"export path {path} must end in .onnx")
    path.parent.mkdir(parents=True, exist_ok=True)
    if portable:
        proto = portable_model(model, outputs=outputs, extra_metadata=extra_metadata)
    else:
        proto = load_model(model)
        if extra_metadata:
            copy = onnx.ModelProto()
            copy.CopyFrom(proto)
            _set_metadata(copy, extra_metadata)
            proto = copy
    # Written under a temporary name and renamed: a failed export leaves no half-written file.
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        save_model(proto, tmp / path.name)
        if check and portable:
            onnx.checker.check_model(str(tmp / path.name), full_check=True)
            _check_onnxruntime(tmp / path.name)
        for f in tmp.iterdir():
            f.replace(path.parent / f.name)
    finally:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return path


# ------------------------------------------------------------------ rewrites
def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    users: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    return users


def _weight_names(graph: onnx.GraphProto) -> set[str]:
    return {t.name for t in graph.initializer}


def _add_sequence_output(graph: onnx.GraphProto) -> None:
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
    graph.node.append(helper.make_node("Identity", [source], [SEQUENCE_OUTPUT], name=f"{SEQUENCE_OUTPUT}/Identity"))
    graph.output.append(helper.make_tensor_value_info(SEQUENCE_OUTPUT, TensorProto.FLOAT, None))


def _remove_dropout(graph: onnx.GraphProto) -> None:
    """Dropout is the identity at inference: its consumers read its input instead."""
    rename = {}
    kept = []
    for n in graph.node:
        if n.op_type == "Dropout" and n.domain == "":
            rename[n.output[0]] = n.input[0]
        else:
            kept.append(n)
    for n in kept:
        for k, name in enumerate(n.input):
            while name in rename:
                name = rename[name]
            n.input[k] = name
    graph_outputs = {o.name for o in graph.output}
    if graph_outputs & set(rename):
        raise ValueError(f"a Dropout output is a graph output ({sorted(graph_outputs & set(rename))}); cannot remove it")
    del graph.node[:]
    graph.node.extend(kept)


def _strip_placement(graph: onnx.GraphProto) -> dict[str, list[int]]:
    """Remove PopART's placement attributes; returns {node: [ipu, stage, recompute]} (-1: unset)."""
    record = {}
    for n in graph.node:
        values = {a.name: a.i for a in n.attribute if a.name in _PLACEMENT}
        if not values:
            continue
        record[n.name] = [values.get(k, -1) for k in _PLACEMENT]
        kept = [a for a in n.attribute if a.name not in _PLACEMENT]
        del n.attribute[:]
        n.attribute.extend(kept)
    return record


def _rewrite_grouped_conv(graph: onnx.GraphProto) -> None:
    """GroupedConv1d(x (B,S,H), W (H,C,K), mask (B,S)) → standard Mul/Transpose/Conv/Transpose."""
    shapes = {t.name: tuple(t.dims) for t in graph.initializer}
    nodes: list[onnx.NodeProto] = []
    for n in graph.node:
        if not (n.domain == DOMAIN and n.op_type == GROUPED_CONV1D):
            if n.domain not in ("", "ai.onnx"):
                raise ValueError(f"node {n.name} is {n.domain}::{n.op_type}, which the portable export cannot rewrite")
            nodes.append(n)
            continue
        x, weight = n.input[0], n.input[1]
        if weight not in shapes:
            raise ValueError(f"{n.name}: the convolution weight {weight!r} is not an initializer")
        if len(n.input) > 3 and n.input[3]:
            # Standard ONNX has no convolution that restarts at sequence boundaries, and
            # serving is one sequence per row: the export is the model's unpacked graph.
            raise ValueError(f"{n.name} keeps packed sequences apart (a graph of model.packed: true), which "
                             "standard ONNX cannot express; export the unpacked graph of the same weights "
                             "(bert.py --export does, from ModelConfig.unpacked())")
        h, c, k = shapes[weight]
        name = n.name
        if len(n.input) > 2 and n.input[2]:
            # Padded positions are zeroed before the convolution (custom_ops/schema.py).
            axes = f"{name}/axes"
            nodes.append(helper.make_node("Constant", [], [axes], name=axes,
                                          value=numpy_helper.from_array(np.array([-1], np.int64), axes)))
            nodes.append(helper.make_node("Unsqueeze", [n.input[2], axes], [f"{name}/mask"], name=f"{name}/Unsqueeze"))
            nodes.append(helper.make_node("Mul", [x, f"{name}/mask"], [f"{name}/masked"], name=f"{name}/Mul"))
            x = f"{name}/masked"
        nodes.append(helper.make_node("Transpose", [x], [f"{name}/BHS"], name=f"{name}/Transpose_in", perm=[0, 2, 1]))
        nodes.append(helper.make_node(
            "Conv", [f"{name}/BHS", weight], [f"{name}/conv"], name=f"{name}/Conv",
            group=h // c, kernel_shape=[k], pads=[k // 2, k // 2], strides=[1], dilations=[1],
        ))  # (B, H, S)
        nodes.append(helper.make_node("Transpose", [f"{name}/conv"], [n.output[0]], name=f"{name}/Transpose_out",
                                      perm=[0, 2, 1]))  # (B, S, H)
    del graph.node[:]
    graph.node.extend(nodes)


def _positions_from_input_shape(graph: onnx.GraphProto) -> None:
    """Gather(position table, constant arange(S)) → Slice(table, 0, Shape(input_ids)[1])."""
    constants = {n.output[0]: n for n in graph.node if n.op_type == "Constant"}
    weights = _weight_names(graph)
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


def _prune(graph: onnx.GraphProto, outputs: Sequence[str]) -> None:
    """Keep the named outputs and only what they need: nodes, inputs, initializers."""
    by_name = {o.name: o for o in graph.output}
    missing = [o for o in outputs if o not in by_name]
    if missing:
        raise ValueError(f"{missing} are not outputs of the graph; it has {list(by_name)}")
    needed = needed_nodes(graph, outputs)  # by node name: the placement record keys on it too
    kept = [n for n in graph.node if n.name in needed]
    needed_values = set(outputs) | {i for n in kept for i in n.input if i}
    del graph.node[:]
    graph.node.extend(kept)
    for field, keep in (
        (graph.output, lambda v: v.name in outputs),
        (graph.input, lambda v: v.name in needed_values),
        (graph.initializer, lambda t: t.name in needed_values),
    ):
        # Deleted in place: initializers are never copied (GroupBERT-large holds 2 GB).
        for i in reversed(range(len(field))):
            if not keep(field[i]):
                del field[i]


def _make_axes_dynamic(graph: onnx.GraphProto) -> None:
    for value in list(graph.input) + list(graph.output):
        dims = _DYNAMIC_DIMS.get(value.name)
        if dims is None:
            raise ValueError(f"the portable export does not know the axes of {value.name!r}")
        t = value.type.tensor_type
        if not t.HasField("shape") or len(t.shape.dim) != len(dims):
            # Outputs added by the rewrite (the sequence output) carry no shape yet.
            t.ClearField("shape")
            for _ in dims:
                t.shape.dim.add()
        for dim, symbol in zip(t.shape.dim, dims):
            if symbol is not None:
                dim.dim_param = symbol
    _fill_fixed_dims(graph)


def _fill_fixed_dims(graph: onnx.GraphProto) -> None:
    """Fixed sizes of the outputs the rewrite added (H of the sequence output)."""
    for value in graph.output:
        if value.name != SEQUENCE_OUTPUT:
            continue
        hidden = next(tuple(t.dims)[0] for t in graph.initializer if t.name.endswith("embeddings.LayerNorm.weight"))
        value.type.tensor_type.shape.dim[2].dim_value = hidden


def _set_metadata(model: onnx.ModelProto, values: Mapping[str, str]) -> None:
    existing = {p.key: p for p in model.metadata_props}
    for key, value in values.items():
        full = key if key.startswith(METADATA_PREFIX) else METADATA_PREFIX + key
        if full in existing:
            existing[full].value = str(value)
        else:
            p = model.metadata_props.add()
            p.key, p.value = full, str(value)


def _check_onnxruntime(path: Path) -> None:
    """onnxruntime must load the export with default options (every graph optimization on)."""
    import onnxruntime as ort

    try:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types
        raise RuntimeError(f"onnxruntime rejects the export {path}: {e}") from e
