"""The CPU's dense layers, forward and backward: the kernels the lowering's fusions run
(session/fusions.py) where torch's own are slower.

- `linear`: x @ Wᵀ + b;
- `grouped_linear`: per-group x · W on strided views, + b;
- `softmax_cross_entropy`: the MLM loss over (masked positions, vocabulary), through the
  compiled ops of custom_ops/softmax_xent.py (the kernel policy's cross_entropy=compiled).

oneDNN's fp32 inner product is reached through a private torch op
(`torch.ops.mkldnn._linear_pointwise`); `onednn_linear_available` probes it once against
F.linear, and the kernel policy (session/kernels.py) falls back to torch's GEMM, saying so,
where the probe fails.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from custom_ops.softmax_xent import softmax_xent_grad, softmax_xent_stats

__all__ = ["COMPILED_CROSS_ENTROPY_MIN_COLUMNS", "LinearFunction", "grouped_linear", "grouped_matmul_equation",
           "linear", "onednn_linear",
           "onednn_linear_available", "softmax_cross_entropy"]

# The fused linear layers (x @ Wᵀ + b) run forward and backward through `LinearFunction` on the
# CPU, its GEMMs from the kernel policy's `gemm`: oneDNN's inner product
# (torch.ops.mkldnn._linear_pointwise) or torch's matmul. Its backward differs from the
# one autograd derives for F.linear in two places, both measured (bench/linear.py):
#   db = dyᵀ · 1 as a GEMM: torch's column sum dy.sum(0) of a (4096, 1024) gradient takes
#        2x as long on one thread and up to 25x on two (Zen 4), fp32 and bf16 alike;
#   dW through oneDNN, whose inner product copies a transposed input to a contiguous one:
#        it copies the smaller of dyᵀ and xᵀ, computing dW = dyᵀ·x or (xᵀ·dy)ᵀ (0.6x the
#        time for the MLM decoder's (640, 30522)ᵀ · (640, 256)).
def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """x @ wᵀ + b by oneDNN's inner product (CPU, fp32), without autograd of its own."""
    if torch.compiler.is_compiling():  # inductor's own lowering of the private op wants frozen weights
        return torch.ops.groupbert_lowering.onednn_linear(x, w, b)
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


@torch.library.custom_op("groupbert_lowering::onednn_linear", mutates_args=())
def _onednn_linear_op(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """oneDNN's x @ wᵀ + b as an op torch.compile keeps whole (an extern kernel to inductor)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


@_onednn_linear_op.register_fake
def _(x, w, b):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def grouped_matmul_equation(equation: str) -> bool:
    """Whether an einsum is a block-diagonal (grouped) matmul: `...gi,gio->...go` in any letters."""
    inputs, _, out = equation.partition("->")
    operands = inputs.split(",")
    if len(operands) != 2 or "." in equation:
        return False
    x, w = operands
    if len(w) != 3 or len(x) < 2 or len(set(x + w[2])) != len(x) + 1:
        return False
    g, i, o = w
    return x[-2:] == g + i and out == x[:-2] + g + o


def _column_sums(y: torch.Tensor) -> torch.Tensor:
    """y (T, N) summed over T, as a (1, T) · (T, N) GEMM."""
    return torch.mm(y.new_ones(1, y.shape[0]), y).view(-1)


class LinearFunction(torch.autograd.Function):
    """x @ wᵀ + b, forward and backward (dx = dy·w, dw = dyᵀ·x, db = dyᵀ·1) through oneDNN or torch."""

    @staticmethod
    def forward(ctx, x, w, b, onednn: bool):
        ctx.save_for_backward(x, w)
        ctx.has_bias, ctx.onednn = b is not None, onednn
        return onednn_linear(x, w, b) if onednn else F.linear(x, w, b)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])  # (T, N), (T, K)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = onednn_linear(dy, w.t(), None) if ctx.onednn else torch.matmul(dy, w)
        if ctx.needs_input_grad[1]:
            if not ctx.onednn:
                dw = torch.mm(dy2.t(), x2)
            elif dy2.shape[1] > x2.shape[1]:  # N > K: copy xᵀ, the smaller
                dw = onednn_linear(x2.t(), dy2.t(), None).t()
            else:
                dw = onednn_linear(dy2.t(), x2.t(), None)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = _column_sums(dy2)
        return dx, dw, db, None


def linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None, *, onednn: bool = False) -> torch.Tensor:
    """F.linear, through `LinearFunction` on the CPU: oneDNN's GEMMs with `onednn` (fp32 only),
    torch's otherwise. Under autocast the operands are cast to its dtype first, as autocast
    casts F.linear's."""
    if x.device.type != "cpu":
        return F.linear(x, w, b)
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
        x, w, b = x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)
        with torch.autocast("cpu", enabled=False):
            return LinearFunction.apply(x, w, b, False)
    onednn = onednn and x.dtype == w.dtype == torch.float32 and (b is None or b.dtype == torch.float32)
    return LinearFunction.apply(x, w, b, onednn)


class _GroupedLinear(torch.autograd.Function):
    """y (..., G·O) = x (..., G, I) · w (G, I, O) per group, + b (G·O,): one batched GEMM over
    the groups on strided views of x and y, where einsum permutes x to (G, T, I) and the
    result back (two copies each way); db as a GEMM, as in `LinearFunction`."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        *lead, g, i = x.shape
        x3 = x.reshape(-1, g, i)  # (T, G, I)
        y = x3.new_empty(x3.shape[0], g, w.shape[-1])  # (T, G, O)
        torch.bmm(x3.transpose(0, 1), w, out=y.transpose(0, 1))
        return y.view(*lead, -1).add_(b)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        *lead, g, i = x.shape
        x3, dy3 = x.reshape(-1, g, i), dy.reshape(-1, g, w.shape[-1])  # (T, G, I), (T, G, O)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = x3.new_empty(x3.shape)
            torch.bmm(dy3.transpose(0, 1), w.transpose(1, 2), out=dx.transpose(0, 1))
            dx = dx.view(x.shape)
        if ctx.needs_input_grad[1]:
            dw = torch.bmm(x3.permute(1, 2, 0), dy3.transpose(0, 1))  # (G, I, T) · (G, T, O)
        if ctx.needs_input_grad[2]:
            db = _column_sums(dy.reshape(-1, dy.shape[-1]))
        return dx, dw, db


def grouped_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Einsum('...gi,gio->...go') merged to (..., G·O), + b; under autocast in its dtype.
    Traced by torch.compile as the plain expression (inductor plans its own layouts, and
    dynamo cannot trace `out=` into strided views)."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return torch.einsum("...gi,gio->...go", x, w).flatten(-2) + b
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
        with torch.autocast("cpu", enabled=False):
            return _GroupedLinear.apply(x.to(dtype), w.to(dtype), b.to(dtype))
    return _GroupedLinear.apply(x, w, b)


class _SoftmaxCrossEntropy(torch.autograd.Function):
    """F.cross_entropy(scores.float(), labels, ignore_index=i), the mean over the labels kept,
    for scores (N, C) on the CPU, through custom_ops/softmax_xent.py: the forward keeps each
    row's maximum and log Σ exp (N × 2 floats), the backward writes softmax − one-hot,
    scaled, in the scores' dtype. F.cross_entropy of bf16 scores writes an (N, C) fp32 array
    four times (the cast, the log-probabilities, and in its backward a zero-filled gradient
    and log_softmax's backward over it) and casts the result back. (N, C) is (masked
    positions, vocabulary) for the MLM loss, the largest activation of a BERT step."""

    @staticmethod
    def forward(ctx, scores, labels, ignore_index: int):
        scores = scores.contiguous()
        kept = labels != ignore_index  # (N,)
        target = torch.where(kept, labels, -1)  # the ops subtract no one-hot where it is -1
        stats = softmax_xent_stats(scores)  # (N, 2): [max, log Σ exp(x − max)]
        picked = scores.gather(1, target.clamp(min=0)[:, None]).squeeze(1).float()
        logp = (picked - stats[:, 0]) - stats[:, 1]  # as ATen's log_softmax: (x − max) − log Σ
        count = kept.sum()
        ctx.save_for_backward(scores, stats, target, kept, count)
        # 0/0 = nan when every label is ignored, as F.cross_entropy gives (its gradient: zeros)
        return -(logp * kept).sum() / count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dloss):
        scores, stats, target, kept, count = ctx.saved_tensors
        scale = (kept * (dloss / count.clamp(min=1))).float()  # (N,): 0 on ignored rows
        return softmax_xent_grad(scores, stats, target, scale), None, None


@functools.lru_cache(maxsize=1)
def onednn_linear_available() -> bool:
    """Whether this torch has oneDNN's linear op and it computes F.linear (probed once)."""
    try:
        x = torch.arange(6.0).reshape(2, 3)
        w, b = torch.ones(4, 3), torch.arange(4.0)
        return torch.allclose(torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], ""), F.linear(x, w, b))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


# The kernel policy's cross_entropy=compiled takes scores of this many columns or more
# (session/lowering.py): a vocabulary, for the MLM loss. Narrower ones (the NSP and task heads)
# stay with F.cross_entropy, one call where the compiled ops cost about 0.12 ms more per call
# (the autograd function and a dozen small torch calls around the two ops): 0.4x its speed at
# 8 × 2, 0.9x at 40 × 4096, 1.9x at 640 × 30522 (bf16, forward + backward, Zen 4,
# 2 threads, 2026-11-30). By columns, not elements, so that every micro batch of a run,
# and the 1- and 2-row probes of batch.micro_batch_size auto, take the same path.
COMPILED_CROSS_ENTROPY_MIN_COLUMNS = 8192


def softmax_cross_entropy(scores: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """F.cross_entropy(scores.float(), labels, ignore_index=ignore_index), the mean over the
    labels kept, for fp32 or bf16 scores (N, C) on the CPU (see `_SoftmaxCrossEntropy`)."""
    return _SoftmaxCrossEntropy.apply(scores, labels, ignore_index)
