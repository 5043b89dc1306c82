"""A node's attributes as Python values: the one reader of every module that inspects a graph
(the lowering, the fusions, the pipeline plan, the exporter, the summary, inference checks).
Strings come back as `str` (ONNX stores them as bytes)."""
from __future__ import annotations

from typing import Any

import onnx
from onnx import helper

__all__ = ["attribute", "attributes"]


def attributes(node: onnx.NodeProto) -> dict[str, Any]:
    """{name: value} of every attribute of `node`."""
    return {a.name: _decoded(helper.get_attribute_value(a)) for a in node.attribute}


def attribute(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """The value of `node`'s attribute `name`, `default` where it has none."""
    for a in node.attribute:
        if a.name == name:
            return _decoded(helper.get_attribute_value(a))
    return default


def _decoded(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value
