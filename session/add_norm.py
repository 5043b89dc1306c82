"""Residual add and layer norm in one pass (issue 54, item 4: on an H200 a BERT-Large step ran 447
add kernels and 2.2 ms of layer norm backward): `LayerNormalization(Add(a, b))` of the graph,
fused by the lowering (session/fusions.py, `add_norm`) where the kernel policy says
norm=triton, runs as one Triton kernel forward and one backward.

Forward, per row of H: s = a + b, rounded to the sum's dtype as torch's add rounds it (kept
when other nodes read the sum, and for the backward), then layer norm(s) in float32 with the
row's mean and 1/σ stored, rounded to the dtype F.layer_norm gives under the session's autocast
(float32 on CUDA, the input's on the CPU). Backward, per row: layer norm's input gradient plus
the sum's gradient from its other readers, one rounding, and per program the float32 sums of
dy·ŝ and dy that one torch sum turns into the weight's and the bias's gradients (no atomics).
Against the unfused ops: s bit for bit, the rest within a rounding (float32: the order of the
row sums).

The kernels (session/_add_norm_kernels.py) run on CUDA and, for the tests, on the CPU under
Triton's interpreter (custom_ops/triton_support.py); rows of another shape (a broadcast add)
take torch's ops.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from custom_ops.triton_support import load_kernels, triton_status

__all__ = ["KERNELS", "add_layer_norm", "triton_block"]

KERNELS = Path(__file__).with_name("_add_norm_kernels.py")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ROWS = 16  # rows per program of the backward: its partial sums of the weight's gradient


@functools.cache
def _norm_dtype(device_type: str, dtype: torch.dtype, autocast: Optional[torch.dtype]) -> torch.dtype:
    """What F.layer_norm returns on `device_type` for a `dtype` input under autocast to `autocast`
    (None: off): float32 under CUDA's autocast, the input's under the CPU's."""
    with torch.no_grad(), torch.autocast(device_type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        return F.layer_norm(torch.zeros(1, 1, dtype=dtype, device=device_type), (1,)).dtype


def _autocast(device_type: str) -> Optional[torch.dtype]:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class _AddNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, weight, bias, eps: float, keep_sum: bool, out_dtype: torch.dtype):
        kernels = load_kernels(KERNELS, a.device.type != "cuda")
        hidden = a.shape[-1]
        rows = a.numel() // hidden
        s = torch.empty(a.shape, device=a.device, dtype=torch.result_type(a, b))
        y = torch.empty(a.shape, device=a.device, dtype=out_dtype)
        mean = torch.empty(rows, device=a.device, dtype=torch.float32)
        rstd = torch.empty_like(mean)
        block = triton_block(hidden)
        kernels.forward[(rows,)](a.contiguous(), b.contiguous(), weight, bias, s, y, mean, rstd, hidden, eps,
                                 BLOCK=block)
        ctx.save_for_backward(s, weight, mean, rstd)
        ctx.set_materialize_grads(False)
        ctx.dtypes = (a.dtype, b.dtype, weight.dtype, bias.dtype)
        return (y, s) if keep_sum else y

    @staticmethod
    def backward(ctx, dy, ds_extra=None):
        s, weight, mean, rstd = ctx.saved_tensors
        a_dtype, b_dtype, w_dtype, bias_dtype = ctx.dtypes
        if dy is None:  # only the sum was read: its gradient passes through the add
            return ds_extra.to(a_dtype), ds_extra.to(b_dtype), None, None, None, None, None
        kernels = load_kernels(KERNELS, s.device.type != "cuda")
        hidden = s.shape[-1]
        rows = s.numel() // hidden
        programs = (rows + _ROWS - 1) // _ROWS
        block = triton_block(hidden)
        ds = torch.empty_like(s)
        part = torch.empty(programs, 2, block, device=s.device, dtype=torch.float32)
        extra = ds_extra.contiguous() if ds_extra is not None else ds
        kernels.backward[(programs,)](dy.contiguous(), s, weight, mean, rstd, extra, ds, part, rows, hidden, _ROWS,
                                      BLOCK=block, EXTRA=ds_extra is not None)
        sums = part.sum(0)[:, :hidden]
        return (ds.to(a_dtype), ds.to(b_dtype), sums[0].to(w_dtype), sums[1].to(bias_dtype), None, None, None)


def triton_block(hidden: int) -> int:
    """The row's block: H rounded up to a power of two."""
    return 1 << (hidden - 1).bit_length()


def add_layer_norm(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                   keep_sum: bool = False, triton: bool = True):
    """layer norm over the last axis of a + b, and the sum too with `keep_sum`: the Triton kernels
    with `triton` where they run and a and b have one shape and a dtype they take, torch's ops
    otherwise."""
    fused = (triton and a.shape == b.shape and a.dtype in _DTYPES and b.dtype in _DTYPES and a.numel()
             and triton_status(a.device) is None)
    if not fused:
        s = a + b
        y = F.layer_norm(s, s.shape[-1:], weight, bias, eps)
        return (y, s) if keep_sum else y
    out_dtype = _norm_dtype(a.device.type, torch.result_type(a, b), _autocast(a.device.type))
    return _AddNorm.apply(a, b, weight.contiguous(), bias.contiguous(), eps, keep_sum, out_dtype)
