"""Reading and writing ONNX models, with external data when the weights are large."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import onnx

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
