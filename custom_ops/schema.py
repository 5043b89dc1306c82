"""The custom nodes of the project's ONNX domain, one `CustomOp` each (custom_ops/spec.py):
the builder takes their shape rules, the session their lowerings and kernel choices, the
exporter their portable rewrites, the summary their FLOPs, the input checks their masks."""
from __future__ import annotations

from custom_ops._library import DOMAIN
from custom_ops.grouped_conv1d_spec import GROUPED_CONV1D_OP
from custom_ops.spec import CustomOp

__all__ = ["CUSTOM_OPS", "RULES", "custom_op"]

CUSTOM_OPS: dict[str, CustomOp] = {op.op_type: op for op in (GROUPED_CONV1D_OP,)}
RULES = {op.op_type: op.shape for op in CUSTOM_OPS.values()}


def custom_op(node) -> CustomOp | None:
    """The spec of an ONNX node of the project's domain; None for a standard node."""
    return CUSTOM_OPS.get(node.op_type) if node.domain == DOMAIN else None
