"""InferenceSession: run a graph forward (PopART's InferenceSession).

`run` checks every input against the graph before running it, and names the input in
each error: the names (none unknown, none missing), the rank and each dimension
against the graph's declared shape (a symbolic dimension such as "batch" takes one
size across all inputs; nothing is broadcast), the element type (integer ids must be
integers: a float array is never rounded), and the values where the graph implies a
range:

* an index into a Gather table (token ids → word embedding rows, segment ids → token
  type rows) or, through Unsqueeze, into a GatherND axis (masked positions → the
  sequence): [0, size of that axis);
* the labels of a SoftmaxCrossEntropyLoss: [0, classes) or its ignore_index;
* an integer input cast to float and used as a mask (the mask of GroupedConv1d, or
  `1 - mask` for the attention bias): 0 or 1;
* a dimension whose size slices a table (`Slice(table, 0, Shape(input)[axis])`, the
  positions of a portable export): at most the table's rows, so a sequence longer than
  the position table is refused here rather than failing inside the graph.

The ranges are read from the graph's structure and its recorded shapes (the
builder's value_info), not from input names. The caller's arrays are never changed:
an input of another integer width is converted into a new tensor.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Union

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from builder import attribute
from custom_ops.schema import custom_op
from session.export import export_model
from session.kernel_tuning import conv_shape
from session.kernels import choose_kernels
from session.lowering import TORCH_DTYPE, LoweredGraph
from session.model_io import ModelLike, load_model
from session.options import SessionOptions


Dim = Union[int, str, None]  # a size, a symbol ("batch"), or unknown

_INTEGER_TYPES = {onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.INT16, onnx.TensorProto.INT8,
                  onnx.TensorProto.UINT8, onnx.TensorProto.UINT16, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64}
# Ops that pass an integer input's values on unchanged (data input 0).
_SAME_VALUES = {"Reshape", "Unsqueeze", "Squeeze", "Identity", "Flatten"}


@dataclass(frozen=True)
class InputSpec:
    """What a graph input accepts: dtype, declared dims, and (integer inputs) value range."""

    name: str
    dtype: torch.dtype
    dims: tuple[Dim, ...]
    high: Optional[int] = None  # values in [0, high), when the graph implies a bound
    why: str = ""  # what bounds it, for messages
    ignore: Optional[int] = None  # a value allowed outside the range (a loss's ignore_index)
    binary: bool = False  # a 0/1 mask
    limits: tuple[tuple[int, int, str], ...] = ()  # (axis, most entries, what bounds it)

    @property
    def integer(self) -> bool:
        return not (self.dtype.is_floating_point or self.dtype.is_complex or self.dtype == torch.bool)

    def shape_text(self) -> str:
        return "(" + ", ".join("?" if d is None else str(d) for d in self.dims) + ("," if len(self.dims) == 1 else "") + ")"


def input_specs(model: onnx.ModelProto) -> dict[str, InputSpec]:
    """The spec of every graph input, ranges derived from how the graph uses it."""
    graph = model.graph
    shapes: dict[str, tuple[Dim, ...]] = {t.name: tuple(int(d) for d in t.dims) for t in graph.initializer}
    for info in list(graph.value_info) + list(graph.input) + list(graph.output):
        if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
            shapes[info.name] = tuple(_dim(d) for d in info.type.tensor_type.shape.dim)
    constants = {n.output[0]: numpy_helper.to_array(attribute(n, "value"))
                 for n in graph.node if n.op_type == "Constant" and n.domain == "" and attribute(n, "value") is not None}
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
    for node in graph.node:
        for i, name in enumerate(node.input):
            consumers[name].append((node, i))

    specs = {}
    for inp in graph.input:
        elem = inp.type.tensor_type.elem_type
        if elem not in TORCH_DTYPE:
            raise ValueError(f"graph input {inp.name!r} has ONNX element type {elem}, which the session cannot feed")
        spec = InputSpec(inp.name, TORCH_DTYPE[elem], shapes.get(inp.name, ()))
        if elem in _INTEGER_TYPES:
            spec = _with_range(spec, shapes, constants, consumers)
        limits = _axis_limits(inp.name, shapes, constants, consumers)
        if limits:
            spec = replace(spec, limits=limits)
        specs[inp.name] = spec
    return specs


def _axis_limits(name: str, shapes, constants, consumers) -> tuple[tuple[int, int, str], ...]:
    """(axis, limit, why) for each axis of `name` whose size is the end of a Slice of a table
    (Shape(name, start=a, end=a+1) → Slice(data, 0, that, [axis])): at most the table's size."""
    limits = []
    for shape_node, _ in consumers.get(name, ()):
        if shape_node.op_type != "Shape":
            continue
        axis = attribute(shape_node, "start", 0)
        if attribute(shape_node, "end", None) != axis + 1:
            continue
        for node, i in consumers.get(shape_node.output[0], ()):
            if node.op_type != "Slice" or i != 2 or len(node.input) < 4 or node.input[3] not in constants:
                continue
            data = shapes.get(node.input[0], ())
            sliced = int(np.asarray(constants[node.input[3]]).reshape(-1)[0])
            if data and isinstance(data[sliced], int):
                limits.append((axis, data[sliced], f"the {data[sliced]} rows of {node.input[0]}"))
    return tuple(limits)


def _dim(d) -> Dim:
    if d.HasField("dim_value"):
        return int(d.dim_value)
    return d.dim_param or None


def _with_range(spec: InputSpec, shapes, constants, consumers) -> InputSpec:
    """Bound an integer input by the tensors it indexes and the losses it labels."""
    high, why, ignore, binary = None, "", None, False
    seen, frontier = set(), [(spec.name, False)]  # (value name, reached through Unsqueeze)
    while frontier:
        value, unsqueezed = frontier.pop()
        if value in seen:
            continue
        seen.add(value)
        for node, i in consumers.get(value, ()):
            bound = None
            if node.op_type in _SAME_VALUES and i == 0:
                frontier.append((node.output[0], unsqueezed or node.op_type == "Unsqueeze"))
            elif node.op_type == "Where" and i in (1, 2):
                frontier.append((node.output[0], unsqueezed))
            elif node.op_type == "Gather" and i == 1:
                data = shapes.get(node.input[0], ())
                axis = attribute(node, "axis", 0)
                if data and isinstance(data[axis], int):
                    bound = (data[axis], f"the {data[axis]} rows of {node.input[0]}" if axis == 0
                             else f"the {data[axis]} entries along axis {axis} of {node.input[0]}")
            elif node.op_type == "GatherND" and i == 1 and unsqueezed:
                data = shapes.get(node.input[0], ())
                axis = attribute(node, "batch_dims", 0)
                if len(data) > axis and isinstance(data[axis], int):
                    bound = (data[axis], f"the {data[axis]} positions along axis {axis} of {node.input[0]}")
            elif node.op_type == "SoftmaxCrossEntropyLoss" and i == 1:
                scores = shapes.get(node.input[0], ())
                if len(scores) > 1 and isinstance(scores[1], int):
                    bound = (scores[1], f"the {scores[1]} classes of the loss on {node.input[0]}")
                    ignore = attribute(node, "ignore_index", None)
            elif node.op_type == "Cast" and value == spec.name:
                binary = binary or _used_as_mask(node.output[0], constants, consumers)
            if bound is not None and (high is None or bound[0] < high):
                high, why = bound
    if binary and high is None:
        high, why = 2, "a 0/1 mask"
    return InputSpec(spec.name, spec.dtype, spec.dims, high, why, ignore, binary)


def _used_as_mask(value: str, constants, consumers) -> bool:
    """`value` is a mask input of a custom node (GroupedConv1d's), or is subtracted from 1 (1 - mask)."""
    for node, i in consumers.get(value, ()):
        op = custom_op(node)
        if op is not None and i in op.mask_inputs:
            return True
        if node.op_type == "Sub" and i == 1 and node.input[0] in constants and constants[node.input[0]].size == 1 \
                and float(constants[node.input[0]].reshape(())) == 1.0:
            return True
    return False


def check_feeds(batch: Mapping[str, Any], specs: Mapping[str, InputSpec], device: torch.device) -> dict[str, torch.Tensor]:
    """Check `batch` against the specs (see the module docstring) → tensors on `device`."""
    if not isinstance(batch, Mapping):
        raise ValueError(f"inputs must be a mapping from input name to array, got {type(batch).__name__}; "
                         f"the graph takes {list(specs)}")
    unknown = [k for k in batch if k not in specs]
    missing = [k for k in specs if k not in batch]
    if unknown or missing:
        parts = ([f"unknown input(s) {unknown}"] if unknown else []) + ([f"missing input(s) {missing}"] if missing else [])
        raise ValueError(f"{' and '.join(parts)}; the graph takes exactly {list(specs)}")
    symbols: dict[str, tuple[int, str]] = {}
    feeds = {}
    for name, spec in specs.items():
        tensor = _as_tensor(name, batch[name])
        _check_dtype(spec, tensor)
        _check_shape(spec, tensor, symbols)
        _check_values(spec, tensor)
        feeds[name] = tensor.to(device=device, dtype=spec.dtype)  # a new tensor where either differs
    return feeds


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    if torch.is_tensor(value):
        return value.detach()
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as e:  # ragged lists
        raise ValueError(f"input {name!r} is not a rectangular array ({e})") from None
    if array.dtype.kind not in "biuf":
        raise ValueError(f"input {name!r} holds {array.dtype} values; pass a numeric array or tensor")
    return torch.from_numpy(np.ascontiguousarray(array))  # shares memory with a contiguous array; never written


def _check_dtype(spec: InputSpec, tensor: torch.Tensor) -> None:
    dtype = tensor.dtype
    given, wanted = str(dtype).removeprefix("torch."), str(spec.dtype).removeprefix("torch.")
    if spec.integer:
        if dtype == torch.bool and spec.binary:
            return
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise ValueError(f"input {spec.name!r} holds {given} values, but the graph takes integers ({wanted}); "
                             "ids are never rounded: pass an integer array")
    elif not dtype.is_floating_point:
        raise ValueError(f"input {spec.name!r} holds {given} values, but the graph takes {wanted}")


def _check_shape(spec: InputSpec, tensor: torch.Tensor, symbols: dict[str, tuple[int, str]]) -> None:
    shape = tuple(tensor.shape)
    if len(shape) != len(spec.dims):
        raise ValueError(f"input {spec.name!r} has shape {shape} (rank {len(shape)}), but the graph declares "
                         f"{spec.shape_text()} (rank {len(spec.dims)}); nothing is broadcast")
    if 0 in shape:
        raise ValueError(f"input {spec.name!r} is empty (shape {shape})")
    for axis, (size, dim) in enumerate(zip(shape, spec.dims)):
        if isinstance(dim, int) and size != dim:
            raise ValueError(f"input {spec.name!r} has shape {shape}, but the graph declares {spec.shape_text()}: "
                             f"dimension {axis} must be {dim}")
        for limited, most, why in spec.limits:
            if limited == axis and size > most:
                raise ValueError(f"input {spec.name!r} has shape {shape}: {size} along dimension {axis}, but the graph "
                                 f"takes at most {most} ({why}); shorten the input (e.g. a longer text into windows)")
        if isinstance(dim, str):
            first = symbols.setdefault(dim, (size, spec.name))
            if first[0] != size:
                raise ValueError(f"input {spec.name!r} has {dim} = {size} (shape {shape}), but input {first[1]!r} "
                                 f"has {dim} = {first[0]}; every input must agree on {dim}")


def _check_values(spec: InputSpec, tensor: torch.Tensor) -> None:
    if spec.high is None or tensor.dtype == torch.bool:
        return
    bad = (tensor < 0) | (tensor >= spec.high)
    if spec.ignore is not None:
        bad &= tensor != spec.ignore
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        allowed = "0 or 1" if spec.binary else f"in [0, {spec.high})" + (
            f" or {spec.ignore}" if spec.ignore is not None else "")
        raise ValueError(f"input {spec.name!r} holds {int(tensor[where])} at {list(where)}; values must be "
                         f"{allowed} ({spec.why})")


class InferenceSession:
    def __init__(self, model: ModelLike, options: Optional[SessionOptions] = None):
        self.options = options or SessionOptions()
        self.device = torch.device(self.options.device)
        self.model = load_model(model)
        self.inputs = input_specs(self.model)
        self.policy = choose_kernels(self.device, self.options.precision, compile=self.options.compile,
                                     overrides=self.options.kernels, conv=conv_shape(self.model))
        if self.policy.graph == "measure":  # timed by training sessions only: serving runs eagerly
            self.policy = replace(self.policy, graph="eager")
        self.graph = LoweredGraph(self.model, policy=self.policy).to(self.device).eval()

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.graph.input_names

    @torch.no_grad()
    def run(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Outputs by name, as tensors on the session's device; inputs are checked first."""
        feeds = check_feeds(batch, self.inputs, self.device)
        with self.options.autocast():
            return self.graph(feeds)

    def export(self, path, portable: bool = True, **kwargs):
        """Write the graph for serving (session.export.export_model: standard ONNX when portable)."""
        return export_model(self.model, path, portable=portable, **kwargs)
