"""Optimizers of the training session: LAMB and AdamW on flat buffers (fused op or pure torch).

LAMB follows You et al., "Large Batch Optimization for Deep Learning: Training BERT
in 76 minutes" (ICLR 2020, Algorithm 2) as PopART's `LambNoBias` runs it: Adam
moments with bias correction, decoupled weight decay, a per-tensor trust ratio
‖p‖/‖u‖; the tensors `no_decay` names (by default every tensor of fewer than two
dimensions: biases and normalisation scales; a model may pass its own rule, as
bert/model.py does with HuggingFace's names) take neither weight decay nor the trust
ratio (a plain Adam step). Moments stay in fp32 whatever the parameter dtype.
AdamW (Loshchilov & Hutter 2019) is the same step with the trust ratio off on every
tensor: p ← p − lr·(m̂/(√v̂ + ε) + wd·p), which is PopART's Adam with decoupled
weight decay, so both share one fused kernel, one state layout and one checkpoint format.

Flat buffers. `Lamb` moves every parameter into one flat buffer (each `param.data`
becomes a view of it) and every gradient into a second (`param.grad` views, which
autograd accumulates into in place), so one call of each fused op covers the whole
model. `FlatLayout` says where each tensor starts; its `segments` (N + 1 offsets) is
the table the fused ops take. Consecutive tensors form buckets, the units in which
gradients are communicated between replicas (session.replication).

Replicated tensor sharding. The step is written for the buffers `_step_buffers`
returns: the whole flat buffers here, a replica's shard of them in
`session.replication.ShardedLamb`, whose layout pads each bucket to a multiple of the
replica count so that replica r holds chunk r of every bucket. The per-segment squared
norms the fused ops return are then partial sums: `Lamb.reduce_norms` is the one place
where they meet (the identity here, an all-reduce over the replicas in the sharded
subclass), so everything after it (global grad norm, trust ratios) sees the norms of
whole tensors, as PopART's RTS LAMB does (sum per shard, all-reduce, sqrt). With
pipelining each process holds only its stages' tensors: `stage_group` sums the global
gradient norm over the stages.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from custom_ops._library import load_library
from custom_ops.lamb import (
    lamb_sq_norms,
    lamb_sq_norms_fallback,
    lamb_stage1,
    lamb_stage1_fallback,
    lamb_stage2,
    lamb_stage2_fallback,
)

__all__ = ["FlatLayout", "Lamb", "NoDecay", "adamw", "fewer_than_two_dims", "select_state", "merge_states"]

NamedParameters = Iterable[tuple[str, torch.nn.Parameter]]
# Which tensors take no weight decay (and no trust ratio): (name, shape) -> bool.
NoDecay = Callable[[str, tuple[int, ...]], bool]


def fewer_than_two_dims(name: str, shape: tuple[int, ...]) -> bool:
    """The default no-decay rule: vectors and scalars (biases, normalisation scales)."""
    return len(shape) < 2


def adamw(named_parameters: NamedParameters, lr: float, betas: tuple[float, float] = (0.9, 0.999),
          eps: float = 1e-6, weight_decay: float = 0.01, **kwargs: Any) -> "Lamb":
    """AdamW with decoupled weight decay, none on the `no_decay` tensors: `Lamb` without trust ratio."""
    return Lamb(named_parameters, lr, betas, eps, weight_decay, trust_ratio=False, **kwargs)


@dataclass(frozen=True)
class FlatLayout:
    """Where each named tensor lives in the flat buffers.

    Tensors lie back to back in their order. Consecutive tensors form buckets of at
    most `bucket_numel` elements (None: one bucket); a tensor that does not fit in one
    starts a new bucket, and one larger than a bucket spans several of its own, cut at
    multiples of `replicas`, so no bucket is much larger than `bucket_numel` (the word
    embedding would otherwise be one). With `replicas` > 1 every bucket that ends at a tensor's
    end is padded with zeros to a multiple of `replicas`, so each bucket splits into
    equal chunks: replica r's shard is chunk r of every bucket. The padding after a
    bucket's last tensor belongs to that tensor's segment; it stays zero (zero
    parameter, zero gradient, zero update) and adds nothing to a norm.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...]
    buckets: tuple[tuple[int, int], ...]
    replicas: int = 1

    @classmethod
    def build(cls, names: Sequence[str], shapes: Sequence[Sequence[int]], bucket_numel: Optional[int] = None,
              replicas: int = 1) -> "FlatLayout":
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        shapes = [tuple(int(d) for d in s) for s in shapes]
        starts, buckets = [], []
        offset, bucket_start, in_bucket = 0, 0, 0
        cut = None if bucket_numel is None else max(1, bucket_numel // replicas) * replicas
        for shape in shapes:
            numel = math.prod(shape)
            if in_bucket and cut is not None and in_bucket + numel > bucket_numel:
                offset = bucket_start + -(-in_bucket // replicas) * replicas
                buckets.append((bucket_start, offset))
                bucket_start, in_bucket = offset, 0
            starts.append(offset)
            offset += numel
            in_bucket += numel
            while cut is not None and in_bucket > max(bucket_numel, cut):  # a tensor larger than a bucket
                buckets.append((bucket_start, bucket_start + cut))
                bucket_start, in_bucket = bucket_start + cut, in_bucket - cut
            if cut is not None and numel > bucket_numel and in_bucket:
                # Its last piece is a bucket of its own too: every bucket of a large tensor
                # lies inside it (reduced straight from its gradient, session/replication.py).
                offset = bucket_start + -(-in_bucket // replicas) * replicas
                buckets.append((bucket_start, offset))
                bucket_start, in_bucket = offset, 0
        if shapes and (in_bucket or not buckets):
            buckets.append((bucket_start, bucket_start + -(-in_bucket // replicas) * replicas))
        return cls(tuple(names), tuple(shapes), tuple(starts), tuple(buckets), replicas)

    @property
    def total(self) -> int:
        """Elements in the flat buffers, padding included."""
        return self.buckets[-1][1] if self.buckets else 0

    @property
    def numels(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    @property
    def segments(self) -> list[int]:
        """The fused ops' segment table: segment i runs from starts[i] to the next start."""
        return [*self.starts, self.total]

    @property
    def padded(self) -> bool:
        return self.total != sum(self.numels)

    def chunks(self, replica: int) -> list[tuple[int, int]]:
        """Replica `replica`'s [start, end) of every bucket: together, its shard."""
        n = self.replicas
        return [(a + replica * (b - a) // n, a + (replica + 1) * (b - a) // n) for a, b in self.buckets]

    @property
    def shard_numel(self) -> int:
        return self.total // self.replicas

    def unpad(self, flat: torch.Tensor) -> torch.Tensor:
        """The tensors' elements back to back (the checkpoint layout); `flat` itself when unpadded."""
        if not self.padded:
            return flat
        return torch.cat([flat[s : s + n] for s, n in zip(self.starts, self.numels)])

    def pad(self, unpadded: torch.Tensor) -> torch.Tensor:
        """The inverse of `unpad`: a new buffer of `total` elements, zero in the padding."""
        out = unpadded.new_zeros(self.total)
        offset = 0
        for s, n in zip(self.starts, self.numels):
            out[s : s + n] = unpadded[offset : offset + n]
            offset += n
        return out


class Lamb(torch.optim.Optimizer):
    """LAMB (or AdamW) over one flat parameter buffer; `fused` picks the compiled ops or pure torch.

    Args:
        named_parameters: (name, parameter) pairs, e.g. `model.named_parameters()`;
            parameters that do not require grad are left out. All must share a device.
        lr, betas, eps, weight_decay: as in the paper; `weight_decay` applies to every
            tensor for which `no_decay(name, shape)` is False.
        no_decay: which tensors take neither weight decay nor the trust ratio
            (default `fewer_than_two_dims`).
        max_grad_norm: clip the global gradient norm to this before the step (None: off).
        max_trust_ratio: upper bound of the trust ratio (None: unbounded).
        trust_ratio: False turns the trust ratio off on every tensor: AdamW.
        param_dtype: torch.bfloat16 stores the parameters in bf16 and rounds each update
            stochastically (unbiased); None keeps the parameters' own dtype (fp32 or bf16).
        fused: True requires the compiled ops, False uses the pure-torch versions, None
            (default) uses the compiled ops when `make` has built them.
        seed: seeds the stochastic rounding of bf16 parameters (one stream per step).
        bucket_numel: elements per bucket of the layout (None: one bucket).
        stage_group: with pipelining, the process group of this replica's stages, over
            which the global gradient norm is summed.

    After `step()` the gradient buffer holds the update, not the gradient (it is
    reused to save memory and bandwidth): call `zero_grad()` before the next backward.
    `zero_grad()` zeroes the buffer and never sets `.grad` to None, so the views stay.

    The global gradient norm is computed every step, in every precision: non-finite
    gradients (a diverging run, an fp16 loss-scale overflow) skip the step, leaving
    parameters, moments and the step count untouched. `skipped` and `grad_norm`
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
        trust_ratio: bool = True,
        param_dtype: torch.dtype | None = None,
        fused: bool | None = None,
        seed: int = 0,
        bucket_numel: int | None = None,
        stage_group: Any = None,
        no_decay: NoDecay = fewer_than_two_dims,
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
        if bucket_numel is not None and bucket_numel < 1:
            raise ValueError(f"bucket_numel must be >= 1 or None, got {bucket_numel}")
        if fused is None:
            fused = load_library()
        elif fused:
            load_library(required=True)

        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        max_grad_norm=max_grad_norm, max_trust_ratio=max_trust_ratio)
        super().__init__(params, defaults)
        self.fused = bool(fused)
        self.trust_ratio = bool(trust_ratio)
        self.seed = int(seed)
        self.loss_scale = 1.0
        self.grad_norm: float | None = None
        self.skipped = False
        self.stage_group = stage_group
        self._step = 0
        self.layout = FlatLayout.build(names, [p.shape for p in params], bucket_numel, self._replicas())
        device = params[0].device
        self.segments = torch.tensor(self.layout.segments, dtype=torch.int64, device=device)
        self._decay = torch.tensor([not no_decay(n, tuple(p.shape)) for n, p in named], device=device)
        # Trust ratio on exactly the tensors that take weight decay (PopART LambNoBias).
        self._use_trust_ratio = self._decay.clone() if self.trust_ratio else torch.zeros_like(self._decay)

        self.flat_params = torch.zeros(self.layout.total, dtype=param_dtype, device=device)
        with torch.no_grad():
            for p, start, shape in zip(params, self.layout.starts, self.layout.shapes):
                view = self.flat_params[start : start + p.numel()].view(shape)
                view.copy_(p)
                p.data = view
        self._allocate_state(params)

    # Whether this process holds a shard of the moments (replicated tensor sharding) or all of them.
    sharded = False

    def _replicas(self) -> int:
        """Replicas the layout pads buckets for (1: whole buffers in this process)."""
        return 1

    def _allocate_state(self, params: list[torch.nn.Parameter]) -> None:
        """Gradient and moment buffers over the whole layout; `.grad` of each parameter a view."""
        total, device, dtype = self.layout.total, self.flat_params.device, self.flat_params.dtype
        # autograd accumulates into .grad in place only when dtypes match, so bf16
        # parameters get bf16 gradient views plus an fp32 buffer for the update.
        self.flat_grads = torch.zeros(total, dtype=dtype, device=device)
        self._update = self.flat_grads if dtype == torch.float32 else torch.zeros(total, device=device)
        self.exp_avg = torch.zeros(total, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(total, dtype=torch.float32, device=device)
        with torch.no_grad():
            for p, start in zip(params, self.layout.starts):
                grad = self.flat_grads[start : start + p.numel()].view(p.shape)
                if p.grad is not None:
                    grad.copy_(p.grad)
                p.grad = grad

    # -------------------------------------------------------------- the step

    def _step_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(parameters, gradients-then-update, segment table) the step works on."""
        if self._update is not self.flat_grads:
            self._update.copy_(self.flat_grads)
        return self.flat_params, self._update, self.segments

    def reduce_norms(self, norms: torch.Tensor) -> torch.Tensor:
        """Sums per-segment squared norms over the shards of the flat buffers.

        The identity for one process holding whole buffers; replicated tensor
        sharding overrides it with `torch.distributed.all_reduce(norms, SUM)`.
        """
        return norms

    def _global_sq_norm(self, sq_norms: torch.Tensor) -> float:
        """Σ of the squared norms of every tensor of the model, over pipeline stages too."""
        total = sq_norms.double().sum()
        if self.stage_group is not None:
            dist.all_reduce(total, group=self.stage_group)
        return total.item()

    def _after_update(self) -> None:
        """Called after the parameters the step works on were updated (sharding gathers them)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, loss_scale: float | None = None) -> Any:
        """One step; gradients are divided by `loss_scale` (default `self.loss_scale`)."""
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
        params, update, segments = self._step_buffers()

        clip = 1.0
        max_grad_norm = group["max_grad_norm"]
        squares = self.reduce_norms(sq_norms(update, segments))
        self.grad_norm = math.sqrt(self._global_sq_norm(squares)) / loss_scale
        self.skipped = not math.isfinite(self.grad_norm)
        if self.skipped:
            return loss
        if max_grad_norm is not None and self.grad_norm > max_grad_norm:
            clip = max_grad_norm / self.grad_norm

        self._step += 1
        beta1, beta2 = group["betas"]
        weight_decay = self._decay * torch.tensor(group["weight_decay"], dtype=torch.float32)
        norms = stage1(params, update, self.exp_avg, self.exp_avg_sq, segments,
                       weight_decay.to(torch.float32), beta1, beta2, group["eps"], self._step, clip / loss_scale)
        if self.trust_ratio:  # AdamW needs no norms: skip the collective
            norms = self.reduce_norms(norms)
        stage2(params, update, segments, norms, self._use_trust_ratio, group["lr"],
               group["max_trust_ratio"] or 0.0, self._rounding_seed())
        self._after_update()
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
        return list(self.layout.names)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this process holds (the two moment buffers)."""
        return self.exp_avg.nbytes + self.exp_avg_sq.nbytes

    # --------------------------------------------------------------- state

    def held_pieces(self) -> list[tuple[int, int, int, int]]:
        """The moments this process holds, as (tensor index, first element, end element,
        offset in `exp_avg`/`exp_avg_sq`): every tensor whole here (a shard's chunks with RTS)."""
        return [(i, 0, n, s) for i, (s, n) in enumerate(zip(self.layout.starts, self.layout.numels))]

    def scalar_state(self) -> dict[str, Any]:
        """Everything of the state but the moments: step, hyperparameters, names and shapes."""
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return {"step": self._step, "param_groups": [group], "names": list(self.layout.names),
                "shapes": [list(s) for s in self.layout.shapes], "seed": self.seed, "loss_scale": self.loss_scale,
                "trust_ratio": self.trust_ratio}

    def load_scalar_state(self, state: dict[str, Any], source: str = "the checkpoint") -> None:
        """Restore a `scalar_state()` saved by an optimizer over these tensors (or more of them:
        a checkpoint holds every pipeline stage's)."""
        saved = {n: tuple(sh) for n, sh in zip(state["names"], state["shapes"])}
        for name, shape in zip(self.layout.names, self.layout.shapes):
            if saved.get(name) != tuple(shape):
                got = "nothing" if name not in saved else saved[name]
                raise ValueError(f"{source} holds optimizer state {got} for {name!r}, this optimizer {tuple(shape)}: "
                                 "load state saved for the same model")
        if bool(state.get("trust_ratio", True)) != self.trust_ratio:
            kinds = {True: "LAMB", False: "AdamW"}
            raise ValueError(f"{source}: optimizer state was saved by {kinds[bool(state.get('trust_ratio', True))]}, "
                             f"this optimizer is {kinds[self.trust_ratio]}; resume with the same training.optimizer")
        self._step = int(state["step"])
        group = state["param_groups"][0]
        self.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
        self.param_groups[0]["betas"] = tuple(self.param_groups[0]["betas"])
        self.seed = int(state.get("seed", self.seed))
        self.loss_scale = float(state.get("loss_scale", self.loss_scale))

    def _full_moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The moments of every tensor, unpadded, in the layout's order."""
        return self.layout.unpad(self.exp_avg), self.layout.unpad(self.exp_avg_sq)

    def _load_moments(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        for buf, saved in ((self.exp_avg, exp_avg), (self.exp_avg_sq, exp_avg_sq)):
            buf.copy_(self.layout.pad(saved) if self.layout.padded else saved)

    def state_dict(self) -> dict[str, Any]:
        """Step, moments (unpadded, in name order; the buffers themselves when unpadded) and
        hyperparameters, by name: the same for every layout and sharding."""
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        exp_avg, exp_avg_sq = self._full_moments()
        return {
            "state": {"step": self._step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq},
            "param_groups": [group],
            "names": list(self.layout.names),
            "shapes": [list(s) for s in self.layout.shapes],
            "seed": self.seed,
            "loss_scale": self.loss_scale,
            "trust_ratio": self.trust_ratio,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a `state_dict()` of an optimizer over the same parameter names and shapes."""
        names, shapes = list(state_dict["names"]), [tuple(s) for s in state_dict["shapes"]]
        ours = list(zip(self.layout.names, self.layout.shapes))
        if list(zip(names, shapes)) != ours:
            saved = list(zip(names, shapes))
            i = next((i for i, (a, b) in enumerate(zip(saved, ours)) if a != b), min(len(saved), len(ours)))
            saved_i = saved[i] if i < len(saved) else "nothing"
            ours_i = ours[i] if i < len(ours) else "nothing"
            raise ValueError(
                f"optimizer state holds {len(saved)} (name, shape) pairs, this optimizer {len(ours)}; first "
                f"difference at #{i}: saved {saved_i}, here {ours_i}. Load state saved for the same model."
            )
        state = state_dict["state"]
        expected = sum(math.prod(s) for s in shapes)
        for key in ("exp_avg", "exp_avg_sq"):
            if tuple(state[key].shape) != (expected,):
                raise ValueError(f"saved {key} has shape {tuple(state[key].shape)}, expected ({expected},)")
        self.load_scalar_state({**state_dict, "step": state["step"]}, "the optimizer state")
        self._load_moments(state["exp_avg"], state["exp_avg_sq"])


def select_state(state: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The part of a `Lamb.state_dict()` that covers `names` (in that order)."""
    offsets, offset = {}, 0
    for name, shape in zip(state["names"], state["shapes"]):
        offsets[name] = (offset, math.prod(shape), list(shape))
        offset += math.prod(shape)
    missing = [n for n in names if n not in offsets]
    if missing:
        raise ValueError(f"optimizer state has no entry for {len(missing)} tensors, e.g. {missing[:3]}; "
                         "load state saved for the same model")
    pieces = [offsets[n] for n in names]
    moments = {key: torch.cat([state["state"][key][a : a + n] for a, n, _ in pieces]) if pieces else
               state["state"][key][:0] for key in ("exp_avg", "exp_avg_sq")}
    return {**state, "names": list(names), "shapes": [s for _, _, s in pieces],
            "state": {**state["state"], **moments}}


def merge_states(states: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """One state over `names` from states over disjoint parts of them (pipeline stages)."""
    if len(states) == 1 and list(states[0]["names"]) == list(names):
        return states[0]
    by_name: dict[str, tuple[dict, int, int, list]] = {}
    for state in states:
        offset = 0
        for name, shape in zip(state["names"], state["shapes"]):
            by_name[name] = (state, offset, math.prod(shape), list(shape))
            offset += math.prod(shape)
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ValueError(f"no stage holds optimizer state for {missing[:3]}")
    steps = {int(s["state"]["step"]) for s in states}
    if len(steps) != 1:
        raise ValueError(f"stages are at different optimizer steps {sorted(steps)}")
    pieces = [by_name[n] for n in names]
    moments = {key: torch.cat([state["state"][key][a : a + k] for state, a, k, _ in pieces])
               for key in ("exp_avg", "exp_avg_sq")}
    first = states[0]
    return {**first, "names": list(names), "shapes": [shape for *_, shape in pieces],
            "state": {**first["state"], **moments}}


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
