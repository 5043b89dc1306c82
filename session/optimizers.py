"""Optimizers of the training session: LAMB on flat buffers (fused op or pure torch) and AdamW.

LAMB follows You et al., "Large Batch Optimization for Deep Learning: Training BERT
in 76 minutes" (ICLR 2020, Algorithm 2) as PopART's `LambNoBias` runs it: Adam
moments with bias correction, decoupled weight decay, a per-tensor trust ratio
‖p‖/‖u‖; biases and LayerNorm weights take neither weight decay nor the trust
ratio (a plain Adam step). Moments stay in fp32 whatever the parameter dtype.

Flat buffers. `Lamb` moves every parameter into one flat buffer (each `param.data`
becomes a view of it) and every gradient into a second (`param.grad` views, which
autograd accumulates into in place), so one call of each fused op covers the whole
model. `segments` (int64, N + 1 offsets) says where each tensor starts.

Replicated tensor sharding. The step is written for a shard [start, end) of the flat
buffers: a replica runs `lamb_sq_norms` / `lamb_stage1` / `lamb_stage2` on its slices
with `custom_ops.lamb.shard_segments(segments, start, end)`, and the per-segment
squared norms those ops return are partial sums. `Lamb.reduce_norms` is the one place
where they meet: the identity here, an all-reduce (sum) over the replicas in a
sharded subclass. Everything after it (global grad norm, trust ratios) then sees the
norms of whole tensors, as PopART's RTS LAMB does (sum per shard, all-reduce, sqrt).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from custom_ops._library import load_library
from custom_ops.lamb import (
    lamb_sq_norms,
    lamb_sq_norms_fallback,
    lamb_stage1,
    lamb_stage1_fallback,
    lamb_stage2,
    lamb_stage2_fallback,
)

__all__ = ["Lamb", "adamw", "no_weight_decay"]

NamedParameters = Iterable[tuple[str, torch.nn.Parameter]]


def no_weight_decay(name: str) -> bool:
    """Biases and LayerNorm weights (HuggingFace names): no weight decay, no trust ratio."""
    return name == "bias" or name.endswith(".bias") or "LayerNorm" in name


def adamw(
    named_parameters: NamedParameters,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.01,
) -> torch.optim.AdamW:
    """torch.optim.AdamW with two groups: decayed weights, then biases and LayerNorm (decay 0)."""
    decay, no_decay = [], []
    for name, p in named_parameters:
        if p.requires_grad:
            (no_decay if no_weight_decay(name) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError("adamw got no parameters that require grad")
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


class Lamb(torch.optim.Optimizer):
    """LAMB over one flat parameter buffer; `fused` picks the compiled ops or pure torch.

    Args:
        named_parameters: (name, parameter) pairs, e.g. `model.named_parameters()`;
            parameters that do not require grad are left out. All must share a device.
        lr, betas, eps, weight_decay: as in the paper; `weight_decay` applies to every
            tensor for which `no_weight_decay(name)` is False.
        max_grad_norm: clip the global gradient norm to this before the step (None: off).
        max_trust_ratio: upper bound of the trust ratio (None: unbounded).
        param_dtype: torch.bfloat16 stores the parameters in bf16 and rounds each update
            stochastically (unbiased); None keeps the parameters' own dtype (fp32 or bf16).
        fused: True requires the compiled ops, False uses the pure-torch versions, None
            (default) uses the compiled ops when `make` has built them.
        seed: seeds the stochastic rounding of bf16 parameters (one stream per step).

    After `step()` the gradient buffer holds the LAMB update, not the gradient (it is
    reused to save memory and bandwidth): call `zero_grad()` before the next backward.
    `zero_grad()` zeroes the buffer and never sets `.grad` to None, so the views stay.

    Non-finite gradients (fp16 loss-scale overflow) skip the step, leaving parameters,
    moments and the step count untouched, whenever the global gradient norm is
    computed: with clipping on or a loss scale other than 1. `skipped` and `grad_norm`
    report the last step.
    """

    def __init__(
        self,
        named_parameters: NamedParameters,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        max_grad_norm: float | None = None,
        max_trust_ratio: float | None = None,
        param_dtype: torch.dtype | None = None,
        fused: bool | None = None,
        seed: int = 0,
    ) -> None:
        _check_hyperparameters(lr, betas, eps, weight_decay, max_grad_norm, max_trust_ratio)
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        if not named:
            raise ValueError("Lamb got no parameters that require grad")
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            raise ValueError(f"Lamb got repeated parameter names: {sorted({n for n in names if names.count(n) > 1})}")
        if len({id(p) for _, p in named}) != len(named):
            raise ValueError("Lamb got the same parameter under two names (tied weights must appear once)")
        params = [p for _, p in named]
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"Lamb needs every parameter on one device, got {sorted(map(str, devices))}")
        dtypes = {p.dtype for p in params}
        if param_dtype is None:
            if len(dtypes) != 1:
                raise ValueError(f"parameters have mixed dtypes {sorted(map(str, dtypes))}; pass param_dtype")
            param_dtype = dtypes.pop()
        if param_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"Lamb keeps parameters in float32 or bfloat16, got {param_dtype}")
        if fused is None:
            fused = load_library()
        elif fused:
            load_library(required=True)

        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm, max_trust_ratio=max_trust_ratio)
        super().__init__(params, defaults)
        self.fused = bool(fused)
        self.seed = int(seed)
        self.loss_scale = 1.0
        self.grad_norm: float | None = None
        self.skipped = False
        self._step = 0
        self._names = names
        self._shapes = [tuple(p.shape) for p in params]
        device = params[0].device
        numels = [p.numel() for p in params]
        offsets = [0]
        for n in numels:
            offsets.append(offsets[-1] + n)
        total = offsets[-1]
        self.segments = torch.tensor(offsets, dtype=torch.int64, device=device)
        self._decay = torch.tensor([not no_weight_decay(n) for n in names], device=device)
        # Trust ratio on exactly the tensors that take weight decay (PopART LambNoBias).
        self._use_trust_ratio = self._decay.clone()

        self.flat_params = torch.empty(total, dtype=param_dtype, device=device)
        # autograd accumulates into .grad in place only when dtypes match, so bf16
        # parameters get bf16 gradient views plus an fp32 buffer for the update.
        self.flat_grads = torch.zeros(total, dtype=param_dtype, device=device)
        self._update = self.flat_grads if param_dtype == torch.float32 else torch.zeros(total, device=device)
        self.exp_avg = torch.zeros(total, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(total, dtype=torch.float32, device=device)
        with torch.no_grad():
            for p, begin, end in zip(params, offsets, offsets[1:]):
                view = self.flat_params[begin:end].view(p.shape)
                view.copy_(p)
                p.data = view
                grad = self.flat_grads[begin:end].view(p.shape)
                if p.grad is not None:
                    grad.copy_(p.grad)
                p.grad = grad

    # -------------------------------------------------------------- the step

    def reduce_norms(self, norms: torch.Tensor) -> torch.Tensor:
        """Sums per-segment squared norms over the shards of the flat buffers.

        The identity for one process holding whole buffers; replicated tensor
        sharding overrides it with `torch.distributed.all_reduce(norms, SUM)`.
        """
        return norms

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, loss_scale: float | None = None) -> Any:
        """One LAMB step; gradients are divided by `loss_scale` (default `self.loss_scale`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        loss_scale = float(self.loss_scale if loss_scale is None else loss_scale)
        if not loss_scale > 0:
            raise ValueError(f"loss_scale must be > 0, got {loss_scale}")
        sq_norms, stage1, stage2 = (
            (lamb_sq_norms, lamb_stage1, lamb_stage2)
            if self.fused
            else (lamb_sq_norms_fallback, lamb_stage1_fallback, lamb_stage2_fallback)
        )
        if self._update is not self.flat_grads:
            self._update.copy_(self.flat_grads)

        clip = 1.0
        max_grad_norm = group["max_grad_norm"]
        self.grad_norm, self.skipped = None, False
        if max_grad_norm is not None or loss_scale != 1.0:
            squares = self.reduce_norms(sq_norms(self._update, self.segments))
            self.grad_norm = math.sqrt(squares.double().sum().item()) / loss_scale
            if not math.isfinite(self.grad_norm):
                self.skipped = True
                return loss
            if max_grad_norm is not None and self.grad_norm > max_grad_norm:
                clip = max_grad_norm / self.grad_norm

        self._step += 1
        beta1, beta2 = group["betas"]
        weight_decay = self._decay * torch.tensor(group["weight_decay"], dtype=torch.float32)
        norms = stage1(self.flat_params, self._update, self.exp_avg, self.exp_avg_sq, self.segments,
                       weight_decay.to(torch.float32), beta1, beta2, group["eps"], self._step, clip / loss_scale)
        norms = self.reduce_norms(norms)
        stage2(self.flat_params, self._update, self.segments, norms, self._use_trust_ratio, group["lr"],
               group["max_trust_ratio"] or 0.0, self._rounding_seed())
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "flat_params"):
            raise ValueError("Lamb holds one flat buffer built at construction; create a new Lamb over all parameters")
        super().add_param_group(param_group)

    def _rounding_seed(self) -> int:
        """One stream of rounding bits per (seed, step): seed in the high word, step in the low."""
        return ((self.seed & 0x7FFFFFFF) << 32) | (self._step & 0xFFFFFFFF)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the flat gradient buffer. `set_to_none` is accepted for the Optimizer
        interface and ignored: `.grad` must stay a view of the buffer, or autograd
        would allocate a fresh gradient that the step never sees."""
        self.flat_grads.zero_()

    @property
    def step_count(self) -> int:
        return self._step

    @property
    def parameter_names(self) -> list[str]:
        return list(self._names)

    # --------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Step, moments (the flat fp32 buffers, not copies) and hyperparameters, by name."""
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return {
            "state": {"step": self._step, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq},
            "param_groups": [group],
            "names": list(self._names),
            "shapes": [list(s) for s in self._shapes],
            "seed": self.seed,
            "loss_scale": self.loss_scale,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a `state_dict()` of a Lamb over the same parameter names and shapes."""
        names, shapes = list(state_dict["names"]), [tuple(s) for s in state_dict["shapes"]]
        if names != self._names or shapes != self._shapes:
            saved, ours = list(zip(names, shapes)), list(zip(self._names, self._shapes))
            i = next((i for i, (a, b) in enumerate(zip(saved, ours)) if a != b), min(len(saved), len(ours)))
            saved_i = saved[i] if i < len(saved) else "nothing"
            ours_i = ours[i] if i < len(ours) else "nothing"
            raise ValueError(
                f"optimizer state holds {len(saved)} (name, shape) pairs, this Lamb {len(ours)}; first difference "
                f"at #{i}: saved {saved_i}, here {ours_i}. Load state saved for the same model."
            )
        state = state_dict["state"]
        for key, buf in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            saved = state[key]
            if saved.shape != buf.shape:
                raise ValueError(f"saved {key} has shape {tuple(saved.shape)}, expected {tuple(buf.shape)}")
            buf.copy_(saved)
        self._step = int(state["step"])
        group = state_dict["param_groups"][0]
        self.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
        self.param_groups[0]["betas"] = tuple(self.param_groups[0]["betas"])
        self.seed = int(state_dict.get("seed", self.seed))
        self.loss_scale = float(state_dict.get("loss_scale", self.loss_scale))


def _check_hyperparameters(lr, betas, eps, weight_decay, max_grad_norm, max_trust_ratio) -> None:
    if not lr >= 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0 or None (no clipping), got {max_grad_norm}")
    if max_trust_ratio is not None and not max_trust_ratio > 0:
        raise ValueError(f"max_trust_ratio must be > 0 or None (unbounded), got {max_trust_ratio}")
