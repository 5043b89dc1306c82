"""GroupedConv1d: GroupBERT's grouped 1-D convolution over the sequence.

Letters: B batch, S sequence, H hidden, C channels per group, G = H / C groups,
K kernel width (odd; "same" zero padding K // 2 each side, stride 1, no bias).

`grouped_conv1d(x, weight, mask, sequence_ids)` runs the compiled op
`torch.ops.groupbert.grouped_conv1d` (custom_ops/csrc/grouped_conv1d.cpp) when the
library is built, and an equivalent `F.conv1d(groups=G)` otherwise; `implementation`
"triton" runs the Triton kernels (custom_ops/grouped_conv1d_triton.py) on a GPU. This module also
gives the compiled op its autograd formula (the C++ backward op) and its fake kernel,
so autograd, `torch.compile` and `torch.library.opcheck` work through it.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from custom_ops._library import MAX_CHANNELS_PER_GROUP, load_library

__all__ = ["MAX_CHANNELS_PER_GROUP", "compiled_available", "grouped_conv1d"]
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

_OP = "groupbert::grouped_conv1d"
_BACKWARD_OP = "groupbert::grouped_conv1d_backward"


def grouped_conv1d(
    x: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor | None = None, sequence_ids: torch.Tensor | None = None,
    *, implementation: str = "compiled",
) -> torch.Tensor:
    """Grouped convolution of channels-last activations along the sequence.

    x: (B, S, H) float32, float64, bfloat16 or float16; weight: (H, C, K), laid out
    like `F.conv1d`'s weight with groups = H // C; mask: optional (B, S), bool or x's
    dtype holding only 0 and 1 (any other value is a ValueError, on every path).
    Returns (B, S, H), equal to the convolution of `x * mask[..., None]`: padded
    positions contribute nothing (their own outputs are not zeroed).

    sequence_ids: optional (B, S) int64, instead of a mask, for rows that hold several
    packed sequences (1, 2, ... per sequence, 0 on padding): each sequence is convolved
    as if alone, zero padded at its boundaries, and rows of id 0 give zero.
    `implementation` (the session's kernel policy decides, session/kernels.py): "compiled",
    the compiled kernels, or torch's convolution where they are not built; "torch", torch's
    convolution; "triton", the Triton kernels (CUDA, or the CPU under TRITON_INTERPRET=1;
    float32, bfloat16 and float16).
    """
    _check(x, weight, mask, sequence_ids)
    if implementation not in ("compiled", "torch", "triton"):
        raise ValueError(f"grouped_conv1d: implementation must be compiled, torch or triton, got {implementation!r}")
    if implementation == "triton" and x.numel():  # nothing to convolve: the other paths' empty answer
        from custom_ops.grouped_conv1d_triton import triton_conv1d

        if mask is not None:
            _check_mask_values(mask)
        return triton_conv1d(x, weight, mask, sequence_ids)
    if implementation != "torch" and compiled_available():
        return torch.ops.groupbert.grouped_conv1d(x, weight, mask, sequence_ids)
    return _grouped_conv1d_torch(x, weight, mask, sequence_ids)


def _check(x: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor | None,
           sequence_ids: torch.Tensor | None = None) -> None:
    if x.dim() != 3 or weight.dim() != 3:
        raise ValueError(f"grouped_conv1d: x must be (B, S, H) and weight (H, C, K); got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    hidden, per_group, width = weight.shape
    if hidden != x.shape[2] or per_group < 1 or hidden % per_group != 0 or width % 2 == 0:
        raise ValueError(f"grouped_conv1d: weight {tuple(weight.shape)} must be (H, C, K) with H = x.shape[2], "
                         f"C >= 1 dividing H and K odd; x is {tuple(x.shape)}")
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
    if sequence_ids is not None:
        if mask is not None:
            raise ValueError("grouped_conv1d: pass either mask or sequence_ids, not both (sequence id 0 marks padding)")
        if tuple(sequence_ids.shape) != tuple(x.shape[:2]):
            raise ValueError(f"grouped_conv1d: sequence_ids must be (B, S) = {tuple(x.shape[:2])}, got "
                             f"{tuple(sequence_ids.shape)} for x {tuple(x.shape)}")
        if sequence_ids.dtype != torch.int64:
            raise ValueError(f"grouped_conv1d: sequence_ids must be int64, got {sequence_ids.dtype}; "
                             "pass sequence_ids.long()")


def _check_mask_values(mask: torch.Tensor) -> None:
    """A float mask holds only 0 and 1, as the compiled op requires (the message is the same)."""
    if mask.dtype == torch.bool:
        return
    bad = (mask != 0) & (mask != 1)
    # No data-dependent Python branch in a traced graph; no read-back on a GPU, which would stop
    # the host until the device's queue had drained: the device checks it.
    if torch.compiler.is_compiling() or mask.device.type != "cpu":
        torch._assert_async(~bad.any(), "grouped_conv1d: mask must hold only 0 and 1 (it marks padded positions)")
        return
    if bad.any():
        b, s = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"grouped_conv1d: mask must hold only 0 and 1 (it marks padded positions), found "
                         f"{mask[b, s].item():g} at (b, s) = ({b}, {s}); pass mask != 0 to treat every non-zero "
                         "value as 1")


def _grouped_conv1d_torch(x: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor | None,
                          sequence_ids: torch.Tensor | None = None) -> torch.Tensor:
    """torch's convolution: where the kernel policy prefers it, or the library is not built."""
    hidden, per_group, width = weight.shape
    if x.numel() == 0:
        # No rows, positions or channels (H = 0: 0 groups): the compiled op's empty output, where
        # torch's conv1d refuses 0 groups and a sequence shorter than the kernel. In the graph, so
        # x and the weight get their (zero) gradients, as from the compiled op.
        return (x + weight.sum() * 0).contiguous()  # (B, S, H)
    if sequence_ids is not None:
        return _packed_conv_torch(x, weight, sequence_ids)
    if mask is not None:
        _check_mask_values(mask)
        x = x * mask[..., None].to(x.dtype)
    y = F.conv1d(x.transpose(1, 2), weight, padding=width // 2, groups=hidden // per_group)  # (B, H, S)
    return y.transpose(1, 2).contiguous()  # (B, S, H)


def _packed_conv_torch(x: torch.Tensor, weight: torch.Tensor, sequence_ids: torch.Tensor) -> torch.Tensor:
    """Each window of K rows, with the rows of other sequences (and padding) zeroed, times
    the weight: K times the activations in memory, the price of a fallback."""
    hidden, per_group, width = weight.shape
    b, s, _ = x.shape
    groups, p = hidden // per_group, width // 2
    windows = F.pad(x, (0, 0, p, p)).unfold(1, width, 1)  # (B, S, H, K): row s + k - P at [b, s, :, k]
    neighbours = F.pad(sequence_ids, (p, p)).unfold(1, width, 1)  # (B, S, K)
    same = (neighbours == sequence_ids[..., None]) & (sequence_ids[..., None] != 0)  # (B, S, K)
    windows = windows * same[:, :, None, :].to(x.dtype)
    y = torch.einsum("bsgck,gjck->bsgj", windows.reshape(b, s, groups, per_group, width),
                     weight.reshape(groups, per_group, per_group, width))  # (B, S, G, C)
    return y.reshape(b, s, hidden)


# --- Python-side kernels of the compiled op -----------------------------------------


def _fake_forward(x: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor | None = None,
                  sequence_ids: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fake_backward(grad_out, x, weight, mask, output_mask, sequence_ids=None):
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format) if output_mask[0] else None
    grad_w = torch.empty_like(weight, memory_format=torch.contiguous_format) if output_mask[1] else None
    return grad_x, grad_w


def _setup_context(ctx, inputs, output) -> None:
    x, weight, mask, sequence_ids = (*inputs, None, None)[:4]  # the schema defaults both to None
    ctx.save_for_backward(x, weight, mask, sequence_ids)


def _backward(ctx, grad_out: torch.Tensor):
    x, weight, mask, sequence_ids = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_x or need_w):
        return None, None, None, None
    grad_x, grad_w = torch.ops.groupbert.grouped_conv1d_backward(grad_out, x, weight, mask, [need_x, need_w],
                                                                 sequence_ids)
    # The mask and the sequence ids are data, never trained: no gradient flows to them.
    return grad_x, grad_w, None, None


def _op_is_loaded() -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(_OP, "")
    except RuntimeError:
        return False
    return True


def compiled_available() -> bool:
    """True once the compiled op is loaded and its autograd and fake kernels registered."""
    return _load_and_register()


# torch.compile calls `compiled_available` eagerly and folds the answer into the graph: the
# mark that torch.compiler.assume_constant_result sets (torch/_dynamo/decorators.py), set without the
# decorator, whose import of torch._dynamo costs every process importing this module over a
# second (a third of a benchmark child's start-up). test_torch_compile_traces_through (a full
# graph) fails should torch stop reading it.
compiled_available._dynamo_marked_constant = True  # type: ignore[attr-defined]


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
    compiled_available()
