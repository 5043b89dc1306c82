"""Portable export: an ONNX→ONNX rewrite of a project graph into standard ONNX for serving.

A training graph (a checkpoint's model.onnx) holds what only this project's session
runs: the custom `ai.groupbert::GroupedConv1d` node, PopART's placement attributes
(onnxruntime's extended fusions copy them into fused nodes and then reject them,
docs/design.md), label inputs and losses, and dropout. `portable_model` rewrites all
of that, knowing nothing of the model it exports:

- the caller's model-specific `rewrites` run first (bert/io/export.py's make the
  position index dynamic and can expose the encoder's output);
- GroupedConv1d(x, W, mask) → x · mask[..., None] → Transpose → Conv(group=H/C, pads=K//2)
  → Transpose: the same weight (H, C, K) is ONNX Conv's (M, C/group, K); a packed graph's
  GroupedConv1d (with sequence ids) is refused: serving runs the unpacked graph;
- the placement attributes leave the nodes and are recorded, per node name, as JSON in
  the model's metadata (`groupbert.placement`);
- only the requested `outputs` are kept and everything they do not need is pruned
  (label inputs, losses, unused weights); Dropout nodes (identity at inference) are
  removed;
- the axes named in `dynamic_axes` ({value: (symbol or None per axis)}) become
  symbolic, so one file serves any batch (and, where the graph allows, any length).

`export_model` writes the result (weights inside the file, or beside it as external
data past 1 GiB so that models past protobuf's 2 GiB limit save), checks it with
`onnx.checker.check_model(full_check=True)` and loads it in onnxruntime with default
session options (all graph optimizations on). `portable=False` writes the graph as
it is, custom ops and placement included (the project's InferenceSession runs both);
with `onnxruntime_ops` it is a graph of onnxruntime's fused operators, which onnxruntime
must load.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence, Union

import numpy as np
import onnx
from onnx import numpy_helper

from fileio import DiskFull, disk_full, staged
from builder import IPU_NUMBER, PIPELINE_STAGE, RECOMPUTE, attribute, attributes
from custom_ops import DOMAIN
from custom_ops.schema import custom_op
from session.lowering import needed_nodes
from session.model_io import ModelLike, load_model, save_model

__all__ = ["METADATA_PREFIX", "Rewrite", "export_model", "fold_weight_transposes", "metadata", "portable_model",
           "quiet_logger"]

METADATA_PREFIX = "groupbert."
_PLACEMENT = (IPU_NUMBER, PIPELINE_STAGE, RECOMPUTE)

# A model-specific rewrite of the graph, in place.
Rewrite = Callable[[onnx.GraphProto], None]
DynamicAxes = Mapping[str, Sequence[Optional[str]]]


def portable_model(model: ModelLike, *, outputs: Optional[Sequence[str]] = None,
                   dynamic_axes: Optional[DynamicAxes] = None, rewrites: Sequence[Rewrite] = (),
                   extra_metadata: Optional[Mapping[str, str]] = None) -> onnx.ModelProto:
    """The standard-ONNX serving graph of a project graph (see the module docstring)."""
    source = load_model(model)
    out = onnx.ModelProto()
    out.CopyFrom(source)
    graph = out.graph
    for rewrite in rewrites:
        rewrite(graph)
    keep = tuple(outputs) if outputs is not None else tuple(o.name for o in graph.output)
    _remove_dropout(graph)
    placement = _strip_placement(graph)
    _rewrite_custom_ops(graph)
    _prune(graph, keep)
    _make_axes_dynamic(graph, dynamic_axes or {})
    del graph.value_info[:]  # recorded for the training shapes; onnxruntime infers its own
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
        perm = attribute(n, "perm")
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
    outputs: Optional[Sequence[str]] = None,
    dynamic_axes: Optional[DynamicAxes] = None,
    rewrites: Sequence[Rewrite] = (),
    extra_metadata: Optional[Mapping[str, str]] = None,
    check: bool = True,
    onnxruntime_ops: bool = False,
) -> Path:
    """Write `model` for serving at `path` and, with `check`, verify that the checker and
    onnxruntime (default options) accept it. `onnxruntime_ops`: a graph that holds
    onnxruntime's own operators (com.microsoft), which the ONNX checker does not know:
    written as it is, and onnxruntime must load it. Returns the path."""
    path = Path(path)
    if path.suffix != ".onnx":
        raise ValueError(f"export path {path} must end in .onnx")
    path.parent.mkdir(parents=True, exist_ok=True)
    if portable:
        proto = portable_model(model, outputs=outputs, dynamic_axes=dynamic_axes, rewrites=rewrites,
                               extra_metadata=extra_metadata)
    else:
        proto = load_model(model)
        if extra_metadata:
            copy = onnx.ModelProto()
            copy.CopyFrom(proto)
            _set_metadata(copy, extra_metadata)
            proto = copy
    # Staged (fileio): a failed export leaves no half-written file, and the checks run on the
    # file before it takes the name.
    try:
        with staged(path, replace=True) as tmp:
            save_model(proto, tmp)
            if check and portable:
                onnx.checker.check_model(str(tmp), full_check=True)
            if check and (portable or onnxruntime_ops):
                _check_onnxruntime(tmp)
    except OSError as e:  # onnx's writes name no file: say which, and that nothing was lost
        if disk_full(e):
            earlier = f", the earlier {path.name} is as it was" if path.exists() else ""
            raise DiskFull(f"the disk is full: cannot write the export {path} ({e.strerror}); nothing earlier was "
                             f"lost (the partial file was removed{earlier}): free space and run again") from None
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None
    return path


# ------------------------------------------------------------------ rewrites
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
        values = {k: v for k, v in attributes(n).items() if k in _PLACEMENT}
        if not values:
            continue
        record[n.name] = [values.get(k, -1) for k in _PLACEMENT]
        kept = [a for a in n.attribute if a.name not in _PLACEMENT]
        del n.attribute[:]
        n.attribute.extend(kept)
    return record


def _rewrite_custom_ops(graph: onnx.GraphProto) -> None:
    """Every custom node as the standard nodes its spec writes (custom_ops/, `portable`)."""
    shapes = {t.name: tuple(t.dims) for t in graph.initializer}
    nodes: list[onnx.NodeProto] = []
    for n in graph.node:
        op = custom_op(n)
        if op is not None:
            nodes.extend(op.portable(n, shapes))
        elif n.domain in ("", "ai.onnx"):
            nodes.append(n)
        else:
            raise ValueError(f"node {n.name} is {n.domain}::{n.op_type}, which the portable export cannot rewrite")
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


def _make_axes_dynamic(graph: onnx.GraphProto, dynamic_axes: DynamicAxes) -> None:
    """Give the named inputs' and outputs' axes their symbols (None keeps an axis as it is)."""
    for value in list(graph.input) + list(graph.output):
        dims = dynamic_axes.get(value.name)
        if dims is None:
            continue
        t = value.type.tensor_type
        if not t.HasField("shape") or len(t.shape.dim) != len(dims):
            raise ValueError(f"dynamic_axes gives {len(dims)} axes for {value.name!r}, whose declared shape has "
                             f"{len(t.shape.dim) if t.HasField('shape') else 'no'} axes")
        for dim, symbol in zip(t.shape.dim, dims):
            if symbol is not None:
                dim.dim_param = symbol

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


@contextlib.contextmanager
def quiet_logger(name: str = ""):
    """Only errors from the logger `name` (the root logger: "") within the block: onnxruntime's
    tools (the quantizer, the transformer optimizer) advise through logging on every call."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
