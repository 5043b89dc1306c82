"""GroupedConv1d in Triton: forward and both gradients in the (B, S, H) layout the model uses,
so that no transpose is needed (cuDNN's grouped conv wants (B, H, S); issue 54, item 3).

Letters as in custom_ops/grouped_conv1d.py: B batch, S sequence, H hidden, C channels per
group, G = H / C groups, K kernel width (odd, "same" padding P = K // 2), R = B·S rows.

Each program takes BLOCK rows of one group and does its work as one tensor-core GEMM over
all K taps at once, the taps unfolded into the inner dimension (k-major, so that each tap's
C channels are one contiguous load):

    forward   y[r, j]  = Σ_{k,c} x[r + k − P, c] · W[j, c, k]          (BLOCK, KP·CP) · (KP·CP, CP)
    dx        dx[r, c] = Σ_{k,j} dy[r − k + P, j] · W[j, c, k]         (BLOCK, KP·CP) · (KP·CP, CP)
    dW        dW[j, c, k] = Σ_r dy[r, j] · x[r + k − P, c]             (CP, BLOCK) · (BLOCK, KP·CP)

KP and CP are K and C rounded up to powers of two (and CP to at least 16, tl.dot's least);
the padding is loaded as zeros. A row's neighbour counts when it lies in the same sequence
row of x (0 ≤ s + k − P < S) and, with a mask, is not padding (the mask zeroes x before the
convolution; outputs are not zeroed); with packed sequence ids, when it belongs to the same
sequence and that sequence is not padding (id 0). dW is summed per chunk of rows into float32
partial sums that one torch sum adds up: no atomics, the same bits every run.

The kernels run on CUDA, and on the CPU under Triton's interpreter (TRITON_INTERPRET=1), which
is how the tests check them against the float64 reference without a GPU (custom_ops/triton_support.py).
Two faults of the interpreter (Triton 3.9.0) are stepped around there: its bf16/fp16 tl.dot
gives wrong values, so the operands are widened to float32 first (exact: a bf16 or fp16
product fits a float32, only the order of the float32 additions differs from the device's);
and its cast of float32 to bf16 truncates (rounding mode or not), so bf16 results are written
in float32 and rounded to nearest by torch.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from custom_ops.triton_support import load_kernels, triton_status

__all__ = ["KERNELS", "launch_facts", "launch_warps", "triton_conv1d"]

KERNELS = Path(__file__).with_name("_conv_kernels.py")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MIN_DOT = 16  # tl.dot's least dimension
_WIDE = 512  # KP·CP from which a tile takes 8 warps and 16 rows


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << (n - 1).bit_length())


def launch_facts(dtype: torch.dtype, weight_shape: tuple[int, ...], on_device: bool) -> dict:
    """The constexprs every kernel takes for x of `dtype` and a weight (H, C, K). The row block:
    16 under the interpreter (it runs a program at a time in numpy); on the device 64, or fewer
    where the unfolded tile would not fit the registers (`python -m custom_ops.triton_check`,
    sm_90: float32's IEEE dot at 64 rows spilled 3 KB a thread, C 64's 512-wide taps at 32)."""
    hidden, per_group, width = weight_shape
    cp, kp = _pow2(per_group, _MIN_DOT), _pow2(width)
    block = (16 if kp * cp >= _WIDE else 32 if dtype == torch.float32 else 64) if on_device else _MIN_DOT
    return dict(C=per_group, K=width, CP=cp, KP=kp, BLOCK=block, UPCAST=not on_device and dtype != torch.float32,
                IEEE=dtype == torch.float32)



def launch_warps(facts: dict, grad_weight: bool) -> int:
    """Warps per program: 8 for wide taps, and for the float32 weight gradient's accumulator; else 4."""
    return 8 if facts["KP"] * facts["CP"] >= _WIDE or (grad_weight and facts["IEEE"]) else 4


def _launch_facts(x: torch.Tensor, weight: torch.Tensor) -> dict:
    return launch_facts(x.dtype, tuple(weight.shape), x.device.type == "cuda")


def _mode(mask: Optional[torch.Tensor], sequence_ids: Optional[torch.Tensor], x: torch.Tensor):
    """(MODE, the tensor the kernels read as mask_ptr): 0 none, 1 a 0/1 mask, 2 sequence ids."""
    if sequence_ids is not None:
        return 2, sequence_ids.contiguous()
    if mask is not None:
        mask = mask.contiguous()
        return 1, mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    return 0, x


def _output(like: torch.Tensor) -> torch.Tensor:
    """An empty result of `like`'s shape and dtype, float32 where the interpreter would truncate a bf16 one."""
    staged = like.device.type != "cuda" and like.dtype == torch.bfloat16
    return torch.empty_like(like, dtype=torch.float32 if staged else like.dtype)


def _forward(x, weight, mask, sequence_ids):
    kernels = load_kernels(KERNELS, x.device.type != "cuda")
    b, s, h = x.shape
    facts = _launch_facts(x, weight)
    mode, marks = _mode(mask, sequence_ids, x)
    y = _output(x)
    grid = ((b * s + facts["BLOCK"] - 1) // facts["BLOCK"], h // facts["C"])
    kernels.rows_pass[grid](x, weight, marks, y, b * s, s, h, MODE=mode, BACKWARD=False,
                            num_warps=launch_warps(facts, False), **facts)
    return y.to(x.dtype)


def _backward(dy, x, weight, mask, sequence_ids, need_x: bool, need_w: bool):
    kernels = load_kernels(KERNELS, x.device.type != "cuda")
    b, s, h = x.shape
    facts = _launch_facts(x, weight)
    mode, marks = _mode(mask, sequence_ids, x)
    rows, block, groups = b * s, facts["BLOCK"], h // facts["C"]
    dx = dw = None
    if need_x:
        dx = _output(x)
        kernels.rows_pass[((rows + block - 1) // block, groups)](dy, weight, marks, dx, rows, s, h, MODE=mode,
                                                                 BACKWARD=True, num_warps=launch_warps(facts, False),
                                                                 **facts)
        dx = dx.to(x.dtype)
    if need_w:
        # Chunks of rows per program: about 8 programs per group on the device, so that
        # G × chunks fills the SMs (GroupBERT-Large: 64 groups × 8); one chunk under the interpreter.
        blocks = (rows + block - 1) // block
        per_chunk = blocks if x.device.type != "cuda" else max(1, (blocks + 7) // 8)
        chunks = (blocks + per_chunk - 1) // per_chunk
        cp, kp, c, k = facts["CP"], facts["KP"], facts["C"], facts["K"]
        part = torch.empty(chunks, groups, cp, kp * cp, device=x.device, dtype=torch.float32)
        kernels.grad_w[(chunks, groups)](dy, x, marks, part, rows, s, h, BLOCKS=per_chunk, MODE=mode,
                                        num_warps=launch_warps(facts, True), **facts)
        summed = part.sum(0).view(groups, cp, kp, cp)[:, :c, :k, :c]  # (G, C out j, K, C in c)
        dw = summed.permute(0, 1, 3, 2).reshape(h, c, k).to(weight.dtype)
    return dx, dw


class _TritonConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, mask, sequence_ids):
        ctx.save_for_backward(x, weight, mask, sequence_ids)
        return _forward(x, weight, mask, sequence_ids)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mask, sequence_ids = ctx.saved_tensors
        dx, dw = _backward(dy.contiguous(), x, weight, mask, sequence_ids, ctx.needs_input_grad[0],
                           ctx.needs_input_grad[1])
        return dx, dw, None, None


def triton_conv1d(x: torch.Tensor, weight: torch.Tensor, mask: Optional[torch.Tensor] = None,
                  sequence_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The grouped convolution of custom_ops.grouped_conv1d by the Triton kernels (its checks
    done by the caller): x (B, S, H) float32, bfloat16 or float16 on CUDA (or the CPU under
    TRITON_INTERPRET=1), weight (H, C, K) of x's dtype, mask (B, S) bool or x's dtype of 0/1,
    or sequence_ids (B, S) int64."""
    if x.dtype not in _DTYPES:
        raise ValueError(f"grouped_conv1d: the Triton kernels take float32, bfloat16 or float16, got {x.dtype}; "
                         "use kernels conv=compiled or conv=torch")
    why = triton_status(x.device)
    if why is not None:
        raise RuntimeError(f"grouped_conv1d: the Triton kernels cannot run here: {why}")
    return _TritonConv1d.apply(x.contiguous(), weight.contiguous(), mask, sequence_ids)
