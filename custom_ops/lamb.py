"""Typed wrappers of the fused LAMB ops, with pure-torch fallbacks of identical semantics.

The ops work on flat 1-D buffers holding every parameter tensor back to back;
`segments` (int64, N + 1 offsets) says where each of the N tensors starts
(custom_ops/csrc/fused_lamb.cpp describes the two passes). With replicated tensor
sharding a replica passes its shard of the buffers and `shard_segments(...)` of the
table: the per-segment squared norms it gets back are partial sums that add up,
across replicas, to the norms of the whole tensors.

Each wrapper calls `torch.ops.groupbert.*` when the compiled library is loaded and
the pure-torch version (`*_fallback` here; `Lamb(fused=False)` and the tests call
them directly) otherwise.
"""
from __future__ import annotations


import torch

from custom_ops._library import loader_with_fakes

__all__ = ["lamb_sq_norms", "lamb_stage1", "lamb_stage2", "shard_segments"]

_MASK32 = 0xFFFFFFFF


def lamb_sq_norms(buf: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """Σx² of every segment of the flat `buf` (fp32 or bf16) as fp32 (N,), accumulated in double."""
    if _compiled():
        return torch.ops.groupbert.lamb_sq_norms(buf, segments)
    return lamb_sq_norms_fallback(buf, segments)


def lamb_stage1(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    segments: torch.Tensor,
    weight_decay: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    grad_scale: float = 1.0,
) -> torch.Tensor:
    """Adam moments and the LAMB update of every element; the update replaces `grad`.

    g ← grad·grad_scale; m ← β₁m + (1−β₁)g; v ← β₂v + (1−β₂)g²;
    u = m/(1−β₁ᵗ) / (√(v/(1−β₂ᵗ)) + eps) + wd·p, written into `grad`.
    `grad_scale` folds the loss-scale undo and the clipping factor in. Mutates grad,
    exp_avg, exp_avg_sq; returns fp32 (N, 2) per-segment [Σp², Σu²].
    """
    if _compiled():
        return torch.ops.groupbert.lamb_stage1(
            param, grad, exp_avg, exp_avg_sq, segments, weight_decay, beta1, beta2, eps, step, grad_scale
        )
    return lamb_stage1_fallback(
        param, grad, exp_avg, exp_avg_sq, segments, weight_decay, beta1, beta2, eps, step, grad_scale
    )


def lamb_stage2(
    param: torch.Tensor,
    update: torch.Tensor,
    segments: torch.Tensor,
    norms: torch.Tensor,
    use_trust_ratio: torch.Tensor,
    lr: float,
    max_trust_ratio: float = 0.0,
    seed: int = 0,
) -> None:
    """p ← p − lr·trust·u per segment, in place.

    trust = ‖p‖/‖u‖ from the (all-reduced) `norms` of lamb_stage1; 1 where either
    norm is 0 or `use_trust_ratio` is off; at most `max_trust_ratio` when it is > 0.
    bf16 `param` is rounded stochastically from random bits of (`seed`, element index).
    """
    if _compiled():
        torch.ops.groupbert.lamb_stage2(param, update, segments, norms, use_trust_ratio, lr, max_trust_ratio, seed)
        return
    lamb_stage2_fallback(param, update, segments, norms, use_trust_ratio, lr, max_trust_ratio, seed)


def shard_segments(segments: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The segment table of the shard [start, end) of the flat buffers (offsets relative to start).

    Segments outside the shard become empty, so N stays the same and the partial
    norms of every shard line up for the all-reduce.
    """
    if not 0 <= start <= end <= int(segments[-1]):
        raise ValueError(f"shard [{start}, {end}) is not inside the flat buffers [0, {int(segments[-1])})")
    return segments.clamp(start, end) - start


# ------------------------------------------------------------ input checks
# The conditions of the compiled op's checks (csrc/fused_lamb.cpp), in the same order,
# so a bad segment table or hyper-parameter tensor is the same ValueError, naming the
# same culprit, whichever path runs.


def _fail(message: str) -> None:
    raise ValueError(f"groupbert lamb: {message}")


def _check_flat(t: torch.Tensor, name: str, total: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dim() != 1 or not t.is_contiguous():
        _fail(f"`{name}` must be a contiguous 1-D buffer, got shape {tuple(t.shape)} strides {t.stride()}")
    if t.dtype not in dtypes:
        _fail(f"`{name}` has dtype {t.dtype}, which this op does not take")
    if t.numel() != total:
        _fail(f"`{name}` has {t.numel()} elements but the segment table covers {total}")


def _check_segments(segments: torch.Tensor, like: torch.Tensor) -> int:
    """Validates the segment table against the buffers and returns N, the number of segments."""
    if segments.dim() != 1 or segments.numel() < 1 or segments.dtype != torch.int64 or not segments.is_contiguous():
        _fail(f"`segments` must be a contiguous int64 1-D tensor of N + 1 offsets, got {segments.dtype} "
              f"{tuple(segments.shape)}")
    if segments.device != like.device:
        _fail(f"`segments` is on {segments.device} but the buffers are on {like.device}")
    n = segments.numel() - 1
    if segments.device.type == "cpu":  # as the compiled op: it reads a CPU table anyway
        seg = segments.tolist()
        if seg[0] != 0:
            _fail(f"`segments[0]` must be 0, got {seg[0]}")
        for s in range(n):
            if seg[s + 1] < seg[s]:
                _fail(f"`segments` must be non-decreasing, but segments[{s + 1}] = {seg[s + 1]} < "
                      f"segments[{s}] = {seg[s]}")
        if seg[n] != like.numel():
            _fail(f"the segment table covers {seg[n]} elements but the buffers hold {like.numel()}")
    return n


def _check_per_segment(t: torch.Tensor, name: str, n: int, dtype: torch.dtype, like: torch.Tensor) -> None:
    if t.dim() != 1 or t.numel() != n or t.dtype != dtype or not t.is_contiguous():
        _fail(f"`{name}` must be a contiguous {dtype} tensor of shape ({n},), got {t.dtype} {tuple(t.shape)}")
    if t.device != like.device:
        _fail(f"`{name}` is on {t.device} but the buffers are on {like.device}")


_PARAM_DTYPES = (torch.float32, torch.bfloat16)


def _check_stage1(param, grad, exp_avg, exp_avg_sq, segments, weight_decay, step) -> None:
    n = _check_segments(segments, param)
    total = param.numel()
    _check_flat(param, "param", total, _PARAM_DTYPES)
    for t, name in ((grad, "grad"), (exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")):
        _check_flat(t, name, total, (torch.float32,))
    for t in (grad, exp_avg, exp_avg_sq):
        if t.device != param.device:
            _fail(f"every buffer must be on {param.device}, found one on {t.device}")
    _check_per_segment(weight_decay, "weight_decay", n, torch.float32, param)
    if step < 1:
        _fail(f"`step` counts from 1 (bias correction), got {step}")


def _check_stage2(param, update, segments, norms, use_trust_ratio) -> None:
    n = _check_segments(segments, param)
    total = param.numel()
    _check_flat(param, "param", total, _PARAM_DTYPES)
    _check_flat(update, "update", total, (torch.float32,))
    if update.device != param.device:
        _fail(f"`update` is on {update.device} but `param` is on {param.device}")
    if (norms.dim() != 2 or tuple(norms.shape) != (n, 2) or norms.dtype != torch.float32
            or not norms.is_contiguous() or norms.device != param.device):
        _fail(f"`norms` must be the contiguous fp32 ({n}, 2) output of lamb_stage1 on {param.device}, got "
              f"{norms.dtype} {tuple(norms.shape)} on {norms.device}")
    if use_trust_ratio.dtype not in (torch.bool, torch.uint8):
        _fail(f"`use_trust_ratio` must be bool or uint8, got {use_trust_ratio.dtype}")
    _check_per_segment(use_trust_ratio, "use_trust_ratio", n, use_trust_ratio.dtype, param)


# ------------------------------------------------------------------ fallbacks


def _pieces(segments: torch.Tensor) -> list[int]:
    return torch.diff(segments).tolist()


def lamb_sq_norms_fallback(buf: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    _check_segments(segments, buf)
    _check_flat(buf, "buf", buf.numel(), _PARAM_DTYPES)
    parts = buf.split(_pieces(segments))
    return torch.stack([p.double().square().sum() for p in parts]).float() if parts else buf.new_zeros(0).float()


def lamb_stage1_fallback(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    segments: torch.Tensor,
    weight_decay: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    grad_scale: float = 1.0,
) -> torch.Tensor:
    _check_stage1(param, grad, exp_avg, exp_avg_sq, segments, weight_decay, step)
    # Same float32 expression, in the same order, as the compiled kernel.
    bias_correction1 = 1.0 / (1.0 - beta1**step)
    bias_correction2 = 1.0 / (1.0 - beta2**step)
    g = grad.mul_(grad_scale)
    exp_avg.mul_(beta1).add_(g, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (exp_avg_sq * bias_correction2).sqrt_().add_(eps)
    torch.mul(exp_avg, bias_correction1, out=grad).div_(denom)
    lengths = _pieces(segments)
    p32 = param.float()
    norms = []
    for u, p, wd in zip(grad.split(lengths), p32.split(lengths), weight_decay.tolist()):
        if wd != 0.0:
            u.add_(p, alpha=wd)
        norms.append(torch.stack([p.double().square().sum(), u.double().square().sum()]))
    return torch.stack(norms).float() if norms else grad.new_zeros(0, 2)


def _step_scales(norms: torch.Tensor, use_trust_ratio: torch.Tensor, lr: float, max_trust_ratio: float) -> list[float]:
    p_norm, u_norm = norms.double().sqrt().unbind(1)
    ratio = p_norm / u_norm
    if max_trust_ratio > 0:
        ratio = ratio.clamp(max=max_trust_ratio)
    trust = torch.where((p_norm > 0) & (u_norm > 0) & use_trust_ratio.bool(), ratio, 1.0)
    return (lr * trust).float().tolist()


def lamb_stage2_fallback(
    param: torch.Tensor,
    update: torch.Tensor,
    segments: torch.Tensor,
    norms: torch.Tensor,
    use_trust_ratio: torch.Tensor,
    lr: float,
    max_trust_ratio: float = 0.0,
    seed: int = 0,
) -> None:
    _check_stage2(param, update, segments, norms, use_trust_ratio)
    scales = _step_scales(norms, use_trust_ratio, lr, max_trust_ratio)
    lengths = _pieces(segments)
    if param.dtype == torch.float32:
        for p, u, a in zip(param.split(lengths), update.split(lengths), scales):
            p.sub_(u, alpha=a)
        return
    key = rounding_key(seed)
    offsets = segments.tolist()
    for p, u, a, start in zip(param.split(lengths), update.split(lengths), scales, offsets):
        updated = p.float() - torch.tensor(a, dtype=torch.float32) * u
        index = torch.arange(start, start + p.numel(), dtype=torch.int64, device=p.device)
        p.copy_(bf16_stochastic(updated, rounding_bits(key, index)))


# Counter-based random bits of stochastic rounding: the same integer hash as the
# kernels (custom_ops/csrc/fused_lamb_cuda.h), in int64 arithmetic on 32-bit values.


def _mul32(x: torch.Tensor | int, c: int) -> torch.Tensor | int:
    """(x · c) mod 2³², with 16-bit halves so int64 never overflows."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _lowbias32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def rounding_key(seed: int) -> int:
    seed &= (1 << 64) - 1
    return _lowbias32((seed & _MASK32) ^ _lowbias32((seed >> 32) ^ 0x85EBCA6B))


def rounding_bits(key: int, index: torch.Tensor) -> torch.Tensor:
    return _lowbias32(_lowbias32((index & _MASK32) ^ key) ^ 0x27D4EB2D)


def bf16_stochastic(x: torch.Tensor, random_bits: torch.Tensor) -> torch.Tensor:
    """fp32 → bf16 rounding up with probability (dropped bits)/2¹⁶: unbiased in expectation."""
    bits = x.view(torch.int32).to(torch.int64) & _MASK32
    rounded = ((bits + (random_bits & 0xFFFF)) >> 16) & 0xFFFF
    rounded = torch.where(x.isnan(), (bits >> 16) | 0x0040, rounded)
    # Back to fp32 with the low half zero (exact in bf16), as a signed 32-bit pattern.
    f32 = (rounded << 16) - ((rounded >> 15) << 32)
    return f32.to(torch.int32).view(torch.float32).to(torch.bfloat16)


# ------------------------------------------------------------- fake kernels


def _register_fakes() -> None:
    @torch.library.register_fake("groupbert::lamb_sq_norms")
    def _(buf, segments):
        return buf.new_empty((segments.shape[0] - 1,), dtype=torch.float32)

    @torch.library.register_fake("groupbert::lamb_stage1")
    def _(param, grad, exp_avg, exp_avg_sq, segments, weight_decay, beta1, beta2, eps, step, grad_scale):
        return param.new_empty((segments.shape[0] - 1, 2), dtype=torch.float32)

    @torch.library.register_fake("groupbert::lamb_stage2")
    def _(param, update, segments, norms, use_trust_ratio, lr, max_trust_ratio, seed):
        return None


_compiled = loader_with_fakes(_register_fakes)
