"""ONNX-side definition of the project's custom nodes: their shape rules for the builder.

`GroupedConv1d(x, weight[, mask][, sequence_ids])`: x (B, S, H) channels-last, weight
(H, C, K) as torch's conv1d weight with H / C groups, K odd, same padding; mask (B, S)
zeroes padded positions before the convolution; or, for rows of packed sequences,
sequence_ids (B, S) int64 (0 on padding) keeps each sequence's convolution to its own
rows, as if alone and zero padded (the mask input is then empty). Output (B, S, H).
"""
from __future__ import annotations

from builder import INT64, Rule, ShapeError
from custom_ops._library import GROUPED_CONV1D


def _grouped_conv1d(inputs, attrs, value_of):
    x, weight = inputs[0], inputs[1]
    mask = inputs[2] if len(inputs) > 2 else None
    sequence_ids = inputs[3] if len(inputs) > 3 else None
    if x.rank != 3 or weight.rank != 3:
        raise ShapeError(f"GroupedConv1d wants x (B, S, H) and weight (H, C, K), got {x.describe()}, {weight.describe()}")
    h, c, k = weight.shape
    if x.shape[2] != h or h % c or k % 2 == 0:
        raise ShapeError(
            f"GroupedConv1d weight {weight.describe()} does not fit x {x.describe()} "
            "(need weight (H, C, K) with H the channels of x, H % C == 0, K odd)"
        )
    if mask is not None and mask.shape != x.shape[:2]:
        raise ShapeError(f"GroupedConv1d mask {mask.describe()} must be (B, S) of x {x.describe()}")
    if sequence_ids is not None:
        if mask is not None:
            raise ShapeError("GroupedConv1d takes a mask or sequence ids, not both (sequence id 0 marks padding)")
        if sequence_ids.shape != x.shape[:2] or sequence_ids.dtype != INT64:
            raise ShapeError(f"GroupedConv1d sequence_ids {sequence_ids.describe()} must be int64 (B, S) of x {x.describe()}")
    if x.dtype != weight.dtype:
        raise ShapeError(f"GroupedConv1d x {x.describe()} and weight {weight.describe()} differ in type")
    return [(x.shape, x.dtype)]


RULES: dict[str, Rule] = {GROUPED_CONV1D: _grouped_conv1d}
