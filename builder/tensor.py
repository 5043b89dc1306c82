"""Typed graph values: a name, a shape and an ONNX element type, known when created."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import numpy as np
from onnx import TensorProto, helper

if TYPE_CHECKING:
    from builder.builder import Builder

# A dimension is a known size or a symbolic name ("batch").
Dim = Union[int, str]
Shape = tuple[Dim, ...]

FLOAT = TensorProto.FLOAT
FLOAT16 = TensorProto.FLOAT16
BFLOAT16 = TensorProto.BFLOAT16
DOUBLE = TensorProto.DOUBLE
INT64 = TensorProto.INT64
INT32 = TensorProto.INT32
BOOL = TensorProto.BOOL


def dtype_name(dtype: int) -> str:
    return TensorProto.DataType.Name(dtype).lower()


def numpy_dtype(dtype: int) -> np.dtype:
    return helper.tensor_dtype_to_np_dtype(dtype)


def onnx_dtype(dtype: np.dtype | type) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


@dataclass(frozen=True, eq=False)
class Tensor:
    """A value in the graph under construction. Shapes are checked as ops are added."""

    name: str
    shape: Shape
    dtype: int
    builder: "Builder"

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        return f"Tensor({self.name!r}, ({dims}), {dtype_name(self.dtype)})"

    def describe(self) -> str:
        return f"{self.name} {tuple(self.shape)} {dtype_name(self.dtype)}"
