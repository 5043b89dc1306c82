"""GroupedConv1d: GroupBERT's grouped 1-D convolution over the sequence.

Letters: B batch, S sequence, H hidden, C channels per group, G = H / C groups,
K kernel width (odd; "same" zero padding K // 2 each side, stride 1, no bias).

`grouped_conv1d(x, weight, mask)` runs the compiled op
`torch.ops.groupbert.grouped_conv1d` (custom_ops/csrc/grouped_conv1d.cpp) when the
library is built, and an equivalent `F.conv1d(groups=G)` otherwise. This module also
gives the compiled op its autograd formula (the C++ backward op) and its fake kernel,
so autograd, `torch.compile` and `torch.library.opcheck` work through it.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from custom_ops._library import MAX_CHANNELS_PER_GROUP, load_library

__all__ = ["MAX_CHANNELS_PER_GROUP", "grouped_conv1d"]
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

_OP = "groupbert::grouped_conv1d"
_BACKWARD_OP = "groupbert::grouped_conv1d_backward"


def grouped_conv1d(x: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor | None = None, *,
                   compiled: bool = True) -> torch.Tensor:
    """Grouped convolution of channels-last activations along the sequence.

    x: (B, S, H) float32, float64, bfloat16 or float16; weight: (H, C, K), laid out
    like `F.conv1d`'s weight with groups = H // C; mask: optional (B, S), bool or x's
    dtype holding only 0 and 1 (any other value is a ValueError, on every path).
    Returns (B, S, H), equal to the convolution of `x * mask[..., None]`: padded
    positions contribute nothing (their own outputs are not zeroed).
    `compiled=False` runs torch's convolution instead of the compiled kernels (the
    session's kernel policy decides, session/kernels.py); it also runs when they are
    not built.
    """
    _check(x, weight, mask)
    if compiled and _compiled():
        return torch.ops.groupbert.grouped_conv1d(x, weight, mask)
    return _grouped_conv1d_torch(x, weight, mask)


def _check(x: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor | None) -> None:
    if x.dim() != 3 or weight.dim() != 3:
        raise ValueError(f"grouped_conv1d: x must be (B, S, H) and weight (H, C, K); got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    hidden, per_group, width = weight.shape
    if hidden != x.shape[2] or hidden % per_group != 0 or width % 2 == 0:
        raise ValueError(f"grouped_conv1d: weight {tuple(weight.shape)} must be (H, C, K) with H = x.shape[2], "
                         f"C dividing H and K odd; x is {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"grouped_conv1d: x must be float32, float64, bfloat16 or float16, got {x.dtype} "
                         f"(x {tuple(x.shape)})")
    if weight.dtype != x.dtype:
        raise ValueError(f"grouped_conv1d: weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    if mask is not None:
        if tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"grouped_conv1d: mask must be (B, S) = {tuple(x.shape[:2])}, got {tuple(mask.shape)} "
                             f"for x {tuple(x.shape)}")
        if mask.dtype not in (torch.bool, x.dtype):
            raise ValueError(f"grouped_conv1d: mask must be bool or {x.dtype}, got {mask.dtype}; "
                             "pass `mask.bool()` for an integer 0/1 mask")


def _check_mask_values(mask: torch.Tensor) -> None:
    """A float mask holds only 0 and 1, as the compiled op requires (the message is the same)."""
    if mask.dtype == torch.bool:
        return
    bad = (mask != 0) & (mask != 1)
    if torch.compiler.is_compiling():  # no data-dependent Python branch in a traced graph
        torch._assert_async(~bad.any(), "grouped_conv1d: mask must hold only 0 and 1 (it marks padded positions)")
        return
    if bad.any():
        b, s = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"grouped_conv1d: mask must hold only 0 and 1 (it marks padded positions), found "
                         f"{mask[b, s].item():g} at (b, s) = ({b}, {s}); pass mask != 0 to treat every non-zero "
                         "value as 1")


def _grouped_conv1d_torch(x: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """torch's convolution: where the kernel policy prefers it, or the library is not built."""
    hidden, per_group, width = weight.shape
    if mask is not None:
        _check_mask_values(mask)
        x = x * mask[..., None].to(x.dtype)
    y = F.conv1d(x.transpose(1, 2), weight, padding=width // 2, groups=hidden // per_group)  # (B, H, S)
    return y.transpose(1, 2).contiguous()  # (B, S, H)


# --- Python-side kernels of the compiled op -----------------------------------------


def _fake_forward(x: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fake_backward(grad_out, x, weight, mask, output_mask):
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format) if output_mask[0] else None
    grad_w = torch.empty_like(weight, memory_format=torch.contiguous_format) if output_mask[1] else None
    return grad_x, grad_w


def _setup_context(ctx, inputs, output) -> None:
    x, weight, mask = (*inputs, None)[:3]  # the schema defaults mask to None
    ctx.save_for_backward(x, weight, mask)


def _backward(ctx, grad_out: torch.Tensor):
    x, weight, mask = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_x or need_w):
        return None, None, None
    grad_x, grad_w = torch.ops.groupbert.grouped_conv1d_backward(grad_out, x, weight, mask, [need_x, need_w])
    # The mask is data (0/1), never trained: no gradient flows to it.
    return grad_x, grad_w, None


def _op_is_loaded() -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(_OP, "")
    except RuntimeError:
        return False
    return True


# torch.compile calls this eagerly and folds the answer into the graph.
@torch.compiler.assume_constant_result
def _compiled() -> bool:
    """True once the compiled op is loaded and its autograd and fake kernels registered."""
    return _load_and_register()


@functools.cache
def _load_and_register() -> bool:
    if not (_op_is_loaded() or load_library()):
        return False
    torch.library.register_fake(_OP, _fake_forward)
    torch.library.register_fake(_BACKWARD_OP, _fake_backward)
    torch.library.register_autograd(_OP, _backward, setup_context=_setup_context)
    return True


# The C++ library names this module as its Python home (set_python_module), so torch
# imports it when the op is traced without it: register the kernels right away then.
if _op_is_loaded():
    _compiled()
