"""The softmax cross-entropy of rows of scores, as the compiled ops compute it
(custom_ops/csrc/softmax_xent.cpp), with pure-torch fallbacks of the same semantics.

    softmax_xent_stats(scores) -> (N, 2) fp32   [m, log Σ exp(scores − m)] of each row,
                                                 m its maximum
    softmax_xent_grad(scores, stats, target, scale) -> (N, C) in the scores' dtype
        (softmax − one-hot(target)) · scale per row, computed in fp32 and rounded once

Row r's log-probability of column c is (scores[r, c] − m) − stats[r, 1], as ATen's
log_softmax computes it. Neither op holds an (N, C) fp32 array, which torch's CPU
cross-entropy of bf16 scores writes four times (the cast, the log-probabilities, and in
the backward their exponent and its scaling). CPU only; fp32 or bf16 scores.
"""
from __future__ import annotations


import torch

from custom_ops._library import loader_with_fakes

__all__ = ["softmax_xent_grad", "softmax_xent_stats"]


def softmax_xent_stats(scores: torch.Tensor) -> torch.Tensor:
    """[max, log Σ exp(x − max)] of each row of a contiguous (N, C) fp32 or bf16 array, fp32 (N, 2)."""
    if _compiled():
        return torch.ops.groupbert.softmax_xent_stats(scores)
    return softmax_xent_stats_fallback(scores)


def softmax_xent_grad(scores: torch.Tensor, stats: torch.Tensor, target: torch.Tensor,
                      scale: torch.Tensor) -> torch.Tensor:
    """(softmax(scores) − one_hot(target)) · scale per row, in the scores' dtype, from the
    rows' `stats`. A target outside [0, C) (an ignored row) subtracts nothing."""
    if _compiled():
        return torch.ops.groupbert.softmax_xent_grad(scores, stats, target, scale)
    return softmax_xent_grad_fallback(scores, stats, target, scale)


def softmax_xent_stats_fallback(scores: torch.Tensor) -> torch.Tensor:
    x = scores.float()
    top = x.amax(dim=-1)
    top = torch.where(top.isfinite(), top, torch.zeros_like(top))
    return torch.stack([top, (x - top[:, None]).exp_().sum(-1).log_()], dim=1)


def softmax_xent_grad_fallback(scores: torch.Tensor, stats: torch.Tensor, target: torch.Tensor,
                               scale: torch.Tensor) -> torch.Tensor:
    grad = (scores.float() - stats[:, :1]).sub_(stats[:, 1:]).exp_().mul_(scale[:, None])
    rows = ((target >= 0) & (target < scores.shape[1])).nonzero().squeeze(1)
    grad[rows, target[rows]] -= scale[rows]
    return grad.to(scores.dtype)


def _register_fakes() -> None:
    @torch.library.register_fake("groupbert::softmax_xent_stats")
    def _(scores):
        return scores.new_empty((scores.shape[0], 2), dtype=torch.float32)

    @torch.library.register_fake("groupbert::softmax_xent_grad")
    def _(scores, stats, target, scale):
        return torch.empty_like(scores)


_compiled = loader_with_fakes(_register_fakes)
