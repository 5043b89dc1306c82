"""Generic ONNX graph builder with PopART-style placement scopes. Knows nothing of BERT."""
from builder.attributes import attribute, attributes
from builder.builder import (
    IPU_NUMBER,
    ONNX_OPSET,
    PIPELINE_STAGE,
    RECOMPUTE,
    Builder,
    Initializer,
    RecomputeType,
    WeightSpec,
    normal,
    ones,
    zeros,
)
from builder.shapes import Rule, ShapeError
from builder.tensor import BOOL, FLOAT, INT64, Tensor

__all__ = [
    "BOOL", "FLOAT", "INT64", "IPU_NUMBER", "ONNX_OPSET", "PIPELINE_STAGE", "RECOMPUTE",
    "Builder", "Initializer", "RecomputeType", "Rule", "ShapeError", "Tensor", "WeightSpec",
    "attribute", "attributes", "normal", "ones", "zeros",
]
