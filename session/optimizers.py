"""The optimizers' rules on flat buffers (session/flat.py): LAMB and AdamW (fused ops or pure torch), Lion.

LAMB follows You et al., "Large Batch Optimization for Deep Learning: Training BERT
in 76 minutes" (ICLR 2020, Algorithm 2) as PopART's `LambNoBias` runs it: Adam
moments with bias correction, decoupled weight decay, a per-tensor trust ratio
‖p‖/‖u‖; the tensors `no_decay` names (by default every tensor of fewer than two
dimensions: biases and normalisation scales; a model may pass its own rule, as
bert/model.py does with HuggingFace's names) take neither weight decay nor the trust
ratio (a plain Adam step). Moments stay in fp32 whatever the parameter dtype.
AdamW (Loshchilov & Hutter 2019) is the same step with the trust ratio off on every
tensor: p ← p − lr·(m̂/(√v̂ + ε) + wd·p), which is PopART's Adam with decoupled
weight decay, so both share one fused kernel and one state. Lion (Chen et al. 2023)
keeps one momentum and steps by its sign; SGD keeps one velocity and steps by it.

A rule names its state buffers (`state_kinds`) and its own hyperparameters (`hyperparameters`,
a declaration of session/hyperparameters.py, which it receives by those names), and
implements `_apply` on the buffers it is given: the whole flat buffers, or a replica's shard
of them under replicated tensor sharding (session.replication.ShardedBuffers), where the per-segment norms it computes
are partial sums that `holding.reduce_norms` all-reduces. `OPTIMIZERS` maps the names
configs use to the rules.
"""
from __future__ import annotations

from typing import Any

import torch

from custom_ops.lamb import lamb_stage1, lamb_stage1_fallback, lamb_stage2, lamb_stage2_fallback
from session.flat import FlatLayout, FlatOptimizer, NoDecay, fewer_than_two_dims, select_state
from session.hyperparameters import (HYPERPARAMETERS, AdamWHyperparameters, LambHyperparameters, LionHyperparameters,
                                     SGDHyperparameters)

__all__ = ["OPTIMIZERS", "SGD", "AdamW", "FlatLayout", "FlatOptimizer", "Lamb", "Lion", "NoDecay",
           "fewer_than_two_dims", "select_state"]


class Lamb(FlatOptimizer):
    """LAMB over flat buffers; `fused` picks the compiled ops or pure torch.

    Its own hyperparameters (LambHyperparameters, session/hyperparameters.py): `betas`, `eps`
    as in the paper, `max_trust_ratio` the trust ratio's upper bound (None: unbounded).
    `weight_decay` applies to every tensor for which `no_decay(name, shape)` is False, and the
    trust ratio to exactly those (PopART's LambNoBias).
    """

    name = "lamb"
    state_kinds = ("exp_avg", "exp_avg_sq")
    hyperparameters = LambHyperparameters
    trust_ratio = True  # False: AdamW

    def __init__(self, named_parameters, lr: float = 1e-3, weight_decay: float = 0.01, **options: Any) -> None:
        super().__init__(named_parameters, lr, weight_decay, **options)
        self._use_trust_ratio = self.decay.clone() if self.trust_ratio else torch.zeros_like(self.decay)

    @property
    def exp_avg(self) -> torch.Tensor:
        return self.flat_state["exp_avg"]

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        return self.flat_state["exp_avg_sq"]

    def _apply(self, params: torch.Tensor, update: torch.Tensor, segments: torch.Tensor, grad_scale: float) -> None:
        group = self.param_groups[0]
        stage1, stage2 = (lamb_stage1, lamb_stage2) if self.fused else (lamb_stage1_fallback, lamb_stage2_fallback)
        beta1, beta2 = group["betas"]
        weight_decay = (self.decay * torch.tensor(group["weight_decay"], dtype=torch.float32)).to(torch.float32)
        norms = stage1(params, update, self.exp_avg, self.exp_avg_sq, segments, weight_decay, beta1, beta2,
                       group["eps"], self._step, grad_scale)
        if self.trust_ratio:  # AdamW needs no norms: skip the collective
            norms = self.holding.reduce_norms(norms)
        # AdamW has no trust ratio to bound (and declares no max_trust_ratio).
        stage2(params, update, segments, norms, self._use_trust_ratio, group["lr"],
               group.get("max_trust_ratio") or 0.0, self._rounding_seed())


class AdamW(Lamb):
    """AdamW with decoupled weight decay, none on the `no_decay` tensors: `Lamb` without the
    trust ratio. Its own hyperparameters (AdamWHyperparameters): `betas`, `eps`."""

    name = "adamw"
    hyperparameters = AdamWHyperparameters
    trust_ratio = False


class Lion(FlatOptimizer):
    """Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023, Algorithm 2):
    the sign of an interpolation of momentum and gradient, one state buffer.

        c = β₁m + (1−β₁)g;  p ← p − lr·(sign(c) + wd·p);  m ← β₂m + (1−β₂)g

    Every element of the update is ±lr (or 0), so Lion takes a learning rate 3-10× smaller
    than AdamW's and a weight decay as much larger (the paper's advice). Its own
    hyperparameters (LionHyperparameters): `beta1`, `beta2`, the paper's (0.9, 0.99) by
    default. The `no_decay` tensors take no weight decay.
    """

    name = "lion"
    state_kinds = ("exp_avg",)
    hyperparameters = LionHyperparameters

    def __init__(self, named_parameters, lr: float = 1e-4, weight_decay: float = 0.0, **options: Any) -> None:
        super().__init__(named_parameters, lr, weight_decay, **options)

    def _apply(self, params: torch.Tensor, update: torch.Tensor, segments: torch.Tensor, grad_scale: float) -> None:
        group = self.param_groups[0]
        momentum, gradient = self.flat_state["exp_avg"], update.mul_(grad_scale)
        direction = torch.lerp(momentum, gradient, 1.0 - group["beta1"])
        momentum.lerp_(gradient, 1.0 - group["beta2"])
        torch.sign(direction, out=update)
        _decoupled_decay(self, params, update, segments)
        self._write(params, update, segments, group["lr"])


class SGD(FlatOptimizer):
    """SGD with momentum and decoupled weight decay (SGDW: Loshchilov & Hutter 2019, Algorithm 1),
    one state buffer, the velocity:

        v ← μv + g;  d = g + μv (Nesterov) or v;  p ← p − lr·(d + wd·p)

    torch.optim.SGD's momentum step (dampening 0), with the weight decay decoupled as the other
    rules' is. Its own hyperparameters (SGDHyperparameters): `momentum`, `nesterov`. The
    `no_decay` tensors take no weight decay.
    """

    name = "sgd"
    state_kinds = ("momentum_buffer",)
    hyperparameters = SGDHyperparameters

    def __init__(self, named_parameters, lr: float = 1e-2, weight_decay: float = 0.0, **options: Any) -> None:
        super().__init__(named_parameters, lr, weight_decay, **options)

    def _apply(self, params: torch.Tensor, update: torch.Tensor, segments: torch.Tensor, grad_scale: float) -> None:
        group = self.param_groups[0]
        velocity, gradient = self.flat_state["momentum_buffer"], update.mul_(grad_scale)
        velocity.mul_(group["momentum"]).add_(gradient)
        if group["nesterov"]:
            update.add_(velocity, alpha=group["momentum"])
        else:
            update.copy_(velocity)
        _decoupled_decay(self, params, update, segments)
        self._write(params, update, segments, group["lr"])


def _decoupled_decay(optimizer: FlatOptimizer, params: torch.Tensor, update: torch.Tensor,
                     segments: torch.Tensor) -> None:
    """update += wd·p on the tensors that take weight decay (for the rules whose kernel does not)."""
    weight_decay = optimizer.param_groups[0]["weight_decay"]
    if weight_decay:
        per_tensor = optimizer.decay.to(torch.float32) * weight_decay
        decay = torch.repeat_interleave(per_tensor, segments.diff(), output_size=update.numel())
        update.addcmul_(params.float(), decay)


# The rules by the name configs and checkpoints use; each has its declaration and each
# declaration its rule (the config offers the declared ones).
OPTIMIZERS: dict[str, type[FlatOptimizer]] = {rule.name: rule for rule in (Lamb, AdamW, Lion, SGD)}
if OPTIMIZERS.keys() != HYPERPARAMETERS.keys() or any(r.hyperparameters.rule != n for n, r in OPTIMIZERS.items()):
    raise ImportError(f"session/optimizers.py's rules {sorted(OPTIMIZERS)} and session/hyperparameters.py's "
                      f"declarations {sorted(HYPERPARAMETERS)} differ: each rule needs its declaration")
