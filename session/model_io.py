"""Reading and writing ONNX models, with external data when the weights are large.

Weights are read one tensor at a time (`WeightReader`), so a process that runs some of
a graph's stages materialises only their weights: an initializer's values come from
the proto itself, from its external data file (only that tensor's bytes are read), or,
for an initializer the proto only declares (name, type and dims, no data: what
`Builder.model_proto(with_weights=False, declare_weights=True)` writes), from a
callable given by the caller (the builder's seeded initial values).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np
import onnx
from onnx import numpy_helper

from session.lowering import needed_nodes

__all__ = ["ModelLike", "ModelSkeleton", "WeightReader", "is_declared", "load_model", "load_without_data", "save_model"]

ModelLike = Union[onnx.ModelProto, str, os.PathLike]

# protobuf cannot serialise a message over 2 GiB: keep weights beside the graph then.
_EXTERNAL_DATA_THRESHOLD = 1 << 30


def load_model(model: ModelLike) -> onnx.ModelProto:
    """`model` itself, or the model at a path, checked (onnx.checker: every node's inputs
    defined, known op types and attributes) before anything uses it; a damaged or
    inconsistent file is a ValueError naming it."""
    if isinstance(model, onnx.ModelProto):
        return model
    path = Path(model)
    if not path.exists():
        raise ValueError(f"ONNX model {path} does not exist")
    try:
        proto = onnx.load(str(path))
        onnx.checker.check_model(str(path))  # by path: also for models past protobuf's 2 GiB
    except Exception as e:  # protobuf and the checker raise several types for a damaged file
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise ValueError(f"{path} is not a readable ONNX model ({type(e).__name__}: {first})") from None
    return proto


def load_without_data(path: Union[str, os.PathLike]) -> onnx.ModelProto:
    """The model at `path` with its external data left on disk (read later by `WeightReader`)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"ONNX model {path} does not exist (or is not a file)")
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as e:
        raise ValueError(f"{path} is not a readable ONNX model ({type(e).__name__}: {e})") from None


def save_model(model: onnx.ModelProto, path: Union[str, os.PathLike]) -> None:
    """Save `model` at path; weights go to `<name>.data` beside it when they pass 1 GiB."""
    path = Path(path)
    large = sum(len(t.raw_data) for t in model.graph.initializer) > _EXTERNAL_DATA_THRESHOLD
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=large,
        all_tensors_to_one_file=True,
        location=path.name + ".data",
        size_threshold=1024,
    )


def is_declared(tensor: onnx.TensorProto) -> bool:
    """An initializer that names a weight but carries no values (nor a reference to them)."""
    external = tensor.data_location == onnx.TensorProto.EXTERNAL
    return not external and not tensor.raw_data and not _typed_data(tensor) and any(d > 0 for d in tensor.dims)


def _typed_data(tensor: onnx.TensorProto) -> bool:
    return bool(tensor.float_data or tensor.int32_data or tensor.int64_data or tensor.double_data
                or tensor.uint64_data or tensor.string_data)


class WeightReader:
    """Reads one initializer's values: inline, from its external data file, or from `declared`.

    `base` is the directory external data locations are relative to (the model file's);
    `declared(name)` gives the values of declared-only initializers. Every problem is a
    ValueError naming the tensor and the file.
    """

    def __init__(self, base: Optional[Union[str, os.PathLike]] = None,
                 declared: Optional[Callable[[str], np.ndarray]] = None, source: str = "the model"):
        self.base = Path(base) if base is not None else None
        self.declared = declared
        self.source = source

    def __call__(self, tensor: onnx.TensorProto) -> np.ndarray:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            return self._external(tensor)
        if is_declared(tensor):
            if self.declared is None:
                raise ValueError(f"weight {tensor.name!r} of {self.source} has no values (it is only declared) and "
                                 "no source of initial values was given")
            value = np.asarray(self.declared(tensor.name), dtype=np.float32)
            if tuple(value.shape) != tuple(tensor.dims):
                raise ValueError(f"weight {tensor.name!r}: {self.source} declares {tuple(tensor.dims)}, its initial "
                                 f"value is {tuple(value.shape)}")
            return value
        return numpy_helper.to_array(tensor).copy()

    def _external(self, tensor: onnx.TensorProto) -> np.ndarray:
        info = {e.key: e.value for e in tensor.external_data}
        if self.base is None or "location" not in info:
            raise ValueError(f"weight {tensor.name!r} of {self.source} lies in external data, but no directory to "
                             "read it from was given")
        path = (self.base / info["location"]).resolve()
        if self.base.resolve() not in path.parents:
            raise ValueError(f"weight {tensor.name!r} of {self.source}: external data location {info['location']!r} "
                             "points outside the model's directory")
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).newbyteorder("<")
        count = int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1
        offset, length = int(info.get("offset", 0)), info.get("length")
        if length is not None and int(length) != count * dtype.itemsize:
            raise ValueError(f"weight {tensor.name!r} of {self.source}: {path.name} records {length} bytes for "
                             f"{tuple(tensor.dims)} {dtype} ({count * dtype.itemsize} bytes)")
        try:
            size = path.stat().st_size
        except OSError:
            raise ValueError(f"weight {tensor.name!r} of {self.source}: its data file {path} is missing") from None
        if offset + count * dtype.itemsize > size:
            raise ValueError(f"weight {tensor.name!r} of {self.source}: {path} ends at byte {size}, before the "
                             f"tensor's end at {offset + count * dtype.itemsize} (a truncated file)")
        value = np.fromfile(path, dtype=dtype, count=count, offset=offset)
        return value.astype(dtype.newbyteorder("="), copy=False).reshape(tuple(tensor.dims))


class ModelSkeleton:
    """The model without its weights' values: its structure (to write checkpoints and to
    plan evaluation graphs from), every weight's name, shape, order and virtual graph."""

    def __init__(self, proto: onnx.ModelProto, placement: dict[str, int]):
        self.weights = [(t.name, tuple(t.dims)) for t in proto.graph.initializer]
        self.order = {name: i for i, (name, _) in enumerate(self.weights)}
        self.placement = placement
        self.skeleton = onnx.ModelProto()
        _copy_fields(proto, self.skeleton, skip="graph")
        _copy_fields(proto.graph, self.skeleton.graph, skip="initializer")

    def with_weights(self, values: Optional[dict[str, np.ndarray]] = None) -> onnx.ModelProto:
        """The graph with each weight's values, or only declared (name and dims) without them."""
        model = onnx.ModelProto()
        model.CopyFrom(self.skeleton)
        for name, shape in self.weights:
            tensor = model.graph.initializer.add()
            tensor.name, tensor.data_type = name, onnx.TensorProto.FLOAT
            tensor.dims.extend(shape)
            if values is not None:
                tensor.raw_data = np.ascontiguousarray(values[name], dtype="<f4").tobytes()
        return model

    def declared_for(self, outputs: Sequence[str]) -> onnx.ModelProto:
        """The declared graph reading only the inputs `outputs` need."""
        model = self.with_weights()
        needed = needed_nodes(model.graph, outputs)
        read = {i for n in model.graph.node if n.name in needed for i in n.input}
        for i in reversed(range(len(model.graph.input))):
            if model.graph.input[i].name not in read:
                del model.graph.input[i]
        return model


def _copy_fields(source, target, skip: str) -> None:
    """Copy the set fields of one protobuf message into another, all but `skip`."""
    for field, value in source.ListFields():
        if field.name == skip:
            continue
        if hasattr(value, "extend"):  # a repeated field
            getattr(target, field.name).extend(value)
        elif field.message_type is not None:
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)
