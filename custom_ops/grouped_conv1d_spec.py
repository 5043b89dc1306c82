"""GroupedConv1d as an ONNX node (custom_ops/spec.py): its shape rule, lowering, portable
rewrite, FLOPs, mask input and kernel choice. The torch op is custom_ops/grouped_conv1d.py.

`GroupedConv1d(x, weight[, mask][, sequence_ids])`: x (B, S, H) channels-last, weight
(H, C, K) as torch's conv1d weight with H / C groups, K odd, same padding; mask (B, S)
zeroes padded positions before the convolution; or, for rows of packed sequences,
sequence_ids (B, S) int64 (0 on padding) keeps each sequence's convolution to its own
rows, as if alone and zero padded (the mask input is then empty). Output (B, S, H).
"""
from __future__ import annotations

import math

from custom_ops._library import GROUPED_CONV1D
from custom_ops.spec import CustomOp


def _shape(inputs, attrs, value_of):
    from builder import INT64, ShapeError

    x, weight = inputs[0], inputs[1]
    mask = inputs[2] if len(inputs) > 2 else None
    sequence_ids = inputs[3] if len(inputs) > 3 else None
    if x.rank != 3 or weight.rank != 3:
        raise ShapeError(f"GroupedConv1d wants x (B, S, H) and weight (H, C, K), got {x.describe()}, {weight.describe()}")
    h, c, k = weight.shape
    if x.shape[2] != h or c < 1 or h % c or k % 2 == 0:
        raise ShapeError(
            f"GroupedConv1d weight {weight.describe()} does not fit x {x.describe()} "
            "(need weight (H, C, K) with H the channels of x, C >= 1, H % C == 0, K odd)"
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


def _lower(attrs: dict, implementation: str):
    import torch

    from custom_ops.grouped_conv1d import grouped_conv1d

    def conv(x, weight, mask=None, sequence_ids=None):
        if torch.is_autocast_enabled(x.device.type):
            # Custom ops are not on autocast's lists: run in the autocast dtype here.
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
        if mask is not None:
            # A mask the session checked when it was fed (session/lowering.py `_cast_of_input`)
            # goes as bool, which the op takes unchecked; another is checked to hold only 0 and 1.
            mask = mask != 0 if 2 in attrs.get("_fed_masks", ()) else mask.to(x.dtype)
        weight = weight.to(x.dtype)
        # torch's convolution cannot keep packed sequences apart: ids take ours.
        chosen = "compiled" if sequence_ids is not None and implementation == "torch" else implementation
        return grouped_conv1d(x, weight, mask, sequence_ids, implementation=chosen)

    return conv


def _portable(node, shapes: dict[str, tuple[int, ...]]) -> list:
    """Mul by the mask, Transpose to (B, H, S), Conv(group=H/C, pads=K//2), Transpose back."""
    import numpy as np
    from onnx import helper, numpy_helper

    x, weight, name = node.input[0], node.input[1], node.name
    if weight not in shapes:
        raise ValueError(f"{name}: the convolution weight {weight!r} is not an initializer")
    if len(node.input) > 3 and node.input[3]:
        # Standard ONNX has no convolution that restarts at sequence boundaries, and
        # serving is one sequence per row: the export is the model's unpacked graph.
        raise ValueError(f"{name} keeps packed sequences apart (a graph of model.packed: true), which "
                         "standard ONNX cannot express; export the unpacked graph of the same weights "
                         "(bert.py export does, from ModelConfig.unpacked())")
    h, c, k = shapes[weight]
    nodes = []
    if len(node.input) > 2 and node.input[2]:  # padded positions are zeroed before the convolution
        axes = f"{name}/axes"
        nodes.append(helper.make_node("Constant", [], [axes], name=axes,
                                      value=numpy_helper.from_array(np.array([-1], np.int64), axes)))
        nodes.append(helper.make_node("Unsqueeze", [node.input[2], axes], [f"{name}/mask"], name=f"{name}/Unsqueeze"))
        nodes.append(helper.make_node("Mul", [x, f"{name}/mask"], [f"{name}/masked"], name=f"{name}/Mul"))
        x = f"{name}/masked"
    nodes.append(helper.make_node("Transpose", [x], [f"{name}/BHS"], name=f"{name}/Transpose_in", perm=[0, 2, 1]))
    nodes.append(helper.make_node(
        "Conv", [f"{name}/BHS", weight], [f"{name}/conv"], name=f"{name}/Conv",
        group=h // c, kernel_shape=[k], pads=[k // 2, k // 2], strides=[1], dilations=[1],
    ))  # (B, H, S)
    nodes.append(helper.make_node("Transpose", [f"{name}/conv"], [node.output[0]], name=f"{name}/Transpose_out",
                                  perm=[0, 2, 1]))  # (B, S, H)
    return nodes


def _flops(inputs, outputs) -> int:
    """Each output element is a dot product of C channels over K taps."""
    _, c, k = inputs[1]
    return 2 * math.prod(outputs[0]) * c * k


GROUPED_CONV1D_OP = CustomOp(GROUPED_CONV1D, shape=_shape, lower=_lower, portable=_portable, flops=_flops,
                             kernel="conv", implementations=("compiled", "torch", "triton"), mask_inputs=(2,))
