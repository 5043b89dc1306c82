"""Flat-buffer optimizers: every parameter in one buffer, the step a few passes over it.

`FlatOptimizer` moves every parameter into one flat buffer (each `param.data` becomes a
view of it). `FlatLayout` says where each tensor starts; its `segments` (N + 1 offsets)
is the table the fused ops take, and consecutive tensors form buckets, the units in
which gradients are communicated between replicas (session.replication).

What is common to every rule lives here: the flat parameters, the global gradient norm
(every step, in every precision: non-finite gradients skip the step, leaving
parameters, state and the step count untouched), clipping, the loss-scale undo, the
step count, bf16 parameters rounded stochastically, and the state by name. A rule
(session/optimizers.py: LAMB, AdamW, Lion) names its per-parameter state buffers in
`state_kinds` ("exp_avg", "exp_avg_sq", ...; fp32 whatever the parameter dtype), its own
hyperparameters in `hyperparameters` (a declaration of session/hyperparameters.py: it gets
them by those names, checked, in its parameter group, beside `lr` and `weight_decay`), and
implements `_apply`, the update of the buffers it is given.

Where the gradients and the state live is the optimizer's `holding`, not its rule:
`WholeBuffers` (here) holds every tensor's in this process, with `.grad` of each
parameter a view of one flat gradient buffer that autograd accumulates into;
`session.replication.ShardedBuffers` holds a replica's shard of them (replicated tensor
sharding, ZeRO stage 2), and any rule runs on it unchanged. The per-segment squared
norms a rule computes on a shard are partial sums: `holding.reduce_norms` is the one
place where they meet (the identity here, an all-reduce over the replicas when
sharded), so everything after it sees the norms of whole tensors, as PopART's RTS LAMB
does. With pipelining each process holds only its stages' tensors: `stage_group` sums
the global gradient norm over the stages.

The state by name (`state_dict`, and session/checkpoint.py's files) is the same for every
layout and holding: each kind's values of each tensor, unpadded, in the layout's order.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist
from pydantic import ValidationError

from custom_ops._library import load_library
from custom_ops.lamb import lamb_sq_norms, lamb_sq_norms_fallback, lamb_stage2, lamb_stage2_fallback
from session.hyperparameters import Hyperparameters

__all__ = ["FlatLayout", "FlatOptimizer", "NoDecay", "WholeBuffers", "fewer_than_two_dims", "select_state"]

NamedParameters = Iterable[tuple[str, torch.nn.Parameter]]
# Which tensors take no weight decay (and no trust ratio): (name, shape) -> bool.
NoDecay = Callable[[str, tuple[int, ...]], bool]
# A held piece of a tensor's state: (tensor index, first element, end element, offset in the held buffers).
Piece = tuple[int, int, int, int]


def fewer_than_two_dims(name: str, shape: tuple[int, ...]) -> bool:
    """The default no-decay rule: vectors and scalars (biases, normalisation scales)."""
    return len(shape) < 2


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


class WholeBuffers:
    """Every tensor's gradients and state in this process: the holding of one process or of
    replicas that all-reduce whole gradients.

    `.grad` of each parameter is a view of `flat_grads`, which autograd accumulates into;
    bf16 parameters get bf16 gradient views (autograd accumulates in place only when the
    dtypes match) and the step an fp32 copy to work on.
    """

    sharded = False
    replicas = 1

    def attach(self, optimizer: "FlatOptimizer", params: Sequence[torch.nn.Parameter]) -> None:
        """Allocate the gradient buffer over `optimizer.layout` and make each `.grad` a view of it."""
        self.layout, self.flat_params, self.segments = optimizer.layout, optimizer.flat_params, optimizer.segments
        total, device, dtype = self.layout.total, self.flat_params.device, self.flat_params.dtype
        self.flat_grads = torch.zeros(total, dtype=dtype, device=device)
        self._update = self.flat_grads if dtype == torch.float32 else torch.zeros(total, device=device)
        with torch.no_grad():
            for p, start in zip(params, self.layout.starts):
                grad = self.flat_grads[start : start + p.numel()].view(p.shape)
                if p.grad is not None:
                    grad.copy_(p.grad)
                p.grad = grad

    def new_state(self) -> torch.Tensor:
        """A zeroed fp32 state buffer over what this holding holds."""
        return torch.zeros(self.layout.total, dtype=torch.float32, device=self.flat_params.device)

    def step_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(parameters, gradients-then-update in fp32, segment table) the step works on."""
        if self._update is not self.flat_grads:
            self._update.copy_(self.flat_grads)
        return self.flat_params, self._update, self.segments

    def reduce_norms(self, norms: torch.Tensor) -> torch.Tensor:
        """Per-segment squared norms summed over the holders of the buffers: all here."""
        return norms

    def after_update(self) -> None:
        """The parameters the step worked on were updated (a shard gathers them)."""

    def zero_grad(self) -> None:
        self.flat_grads.zero_()

    def pieces(self) -> list[Piece]:
        """The state held here: every tensor whole."""
        return [(i, 0, n, s) for i, (s, n) in enumerate(zip(self.layout.starts, self.layout.numels))]

    def gather(self, buffer: torch.Tensor) -> Optional[torch.Tensor]:
        """A held state buffer as every tensor's values, unpadded (the buffer itself when unpadded)."""
        return self.layout.unpad(buffer)

    def scatter(self, buffer: torch.Tensor, values: torch.Tensor) -> None:
        """The inverse of `gather`: every tensor's values, unpadded, into the held buffer."""
        buffer.copy_(self.layout.pad(values) if self.layout.padded else values)

    def gradient_bytes(self) -> int:
        return self.flat_grads.nbytes


class FlatOptimizer(torch.optim.Optimizer):
    """The common part of every flat-buffer optimizer (see the module docstring).

    Args:
        named_parameters: (name, parameter) pairs, e.g. `model.named_parameters()`;
            parameters that do not require grad are left out. All must share a device.
        lr: the learning rate (the session sets it before every step).
        weight_decay: decoupled weight decay of the tensors for which `no_decay(name, shape)`
            is False.
        max_grad_norm: clip the global gradient norm to this before the step (None: off).
        param_dtype: torch.bfloat16 stores the parameters in bf16 and rounds each update
            stochastically (unbiased); None keeps the parameters' own dtype (fp32 or bf16).
        fused: True requires the compiled ops, False uses the pure-torch versions, None
            (default) uses the compiled ops when `make` has built them.
        seed: seeds the stochastic rounding of bf16 parameters (one stream per step).
        bucket_numel: elements per bucket of the layout (None: one bucket).
        stage_group: with pipelining, the process group of this replica's stages, over
            which the global gradient norm is summed.
        no_decay: which tensors take no weight decay (default `fewer_than_two_dims`).
        holding: where the gradients and the state live (default `WholeBuffers()`;
            `session.replication.ShardedBuffers(group)` for replicated tensor sharding).
        **hyperparameters: the rule's own, by the names its declaration gives
            (`hyperparameters`, session/hyperparameters.py); absent ones take its defaults.

    `lr`, `weight_decay`, `max_grad_norm` and the rule's own hyperparameters are the one
    parameter group's entries, by those names.

    After `step()` the gradient buffer holds the update, not the gradient (it is reused
    to save memory and bandwidth): call `zero_grad()` before the next backward.
    `zero_grad()` zeroes the buffer and never sets `.grad` to None, so the views stay.
    `skipped` and `grad_norm` report the last step.
    """

    name: ClassVar[str] = ""  # what checkpoints and configs call it
    state_kinds: ClassVar[tuple[str, ...]] = ()  # its per-parameter state buffers, by name
    hyperparameters: ClassVar[type[Hyperparameters]] = Hyperparameters  # its own, declared (none here)

    def __init__(self, named_parameters: NamedParameters, lr: float = 1e-3, weight_decay: float = 0.0, *,
                 max_grad_norm: float | None = None, param_dtype: torch.dtype | None = None,
                 fused: bool | None = None, seed: int = 0, bucket_numel: int | None = None, stage_group: Any = None,
                 no_decay: NoDecay = fewer_than_two_dims, holding: Any = None, **hyperparameters: Any) -> None:
        kind = type(self).__name__
        own = self.own_hyperparameters(hyperparameters)
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None (no clipping), got {max_grad_norm}")
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        if not named:
            raise ValueError(f"{kind} got no parameters that require grad")
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            raise ValueError(f"{kind} got repeated parameter names: {sorted({n for n in names if names.count(n) > 1})}")
        if len({id(p) for _, p in named}) != len(named):
            raise ValueError(f"{kind} got the same parameter under two names (tied weights must appear once)")
        params = [p for _, p in named]
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"{kind} needs every parameter on one device, got {sorted(map(str, devices))}")
        dtypes = {p.dtype for p in params}
        if param_dtype is None:
            if len(dtypes) != 1:
                raise ValueError(f"parameters have mixed dtypes {sorted(map(str, dtypes))}; pass param_dtype")
            param_dtype = dtypes.pop()
        if param_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{kind} keeps parameters in float32 or bfloat16, got {param_dtype}")
        if bucket_numel is not None and bucket_numel < 1:
            raise ValueError(f"bucket_numel must be >= 1 or None, got {bucket_numel}")
        if fused is None:
            fused = load_library()
        elif fused:
            load_library(required=True)

        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, **own, "max_grad_norm": max_grad_norm})
        self.fused = bool(fused)
        self.seed = int(seed)
        self.loss_scale = 1.0
        self.grad_norm: float | None = None
        self.skipped = False
        self.stage_group = stage_group
        self._step = 0
        self.holding = holding if holding is not None else WholeBuffers()
        self.layout = FlatLayout.build(names, [p.shape for p in params], bucket_numel, self.holding.replicas)
        device = params[0].device
        self.segments = torch.tensor(self.layout.segments, dtype=torch.int64, device=device)
        self.decay = torch.tensor([not no_decay(n, tuple(p.shape)) for n, p in named], device=device)
        self.flat_params = torch.zeros(self.layout.total, dtype=param_dtype, device=device)
        with torch.no_grad():
            for p, start, shape in zip(params, self.layout.starts, self.layout.shapes):
                view = self.flat_params[start : start + p.numel()].view(shape)
                view.copy_(p)
                p.data = view
        self.holding.attach(self, params)
        self.flat_state = {kind: self.holding.new_state() for kind in self.state_kinds}

    @property
    def kind(self) -> str:
        """What checkpoints and configs call this optimizer."""
        return self.name

    @classmethod
    def own_hyperparameters(cls, given: Mapping[str, Any], source: str = "") -> dict[str, Any]:
        """`given` checked against the rule's declaration, its defaults filled in: the rule's own
        hyperparameters by name, or a ValueError naming each that is wrong and the ones it takes."""
        declared = cls.hyperparameters.model_fields
        where = f"{source}: " if source else ""
        unknown = [name for name in given if name not in declared]
        if unknown:
            raise ValueError(f"{where}{cls.__name__} takes no {unknown[0]!r}; its own hyperparameters are "
                             f"{', '.join(declared) or 'none'}, besides lr and weight_decay "
                             f"({cls.hyperparameters.__name__}, session/hyperparameters.py)")
        try:
            checked = cls.hyperparameters(**given)
        except ValidationError as e:
            raise ValueError(where + f"{cls.__name__}: " + "; ".join(
                f"{'.'.join(map(str, err['loc']))} = {err['input']!r}: {err['msg']}" for err in e.errors())) from None
        return {name: getattr(checked, name) for name in declared}

    @property
    def sharded(self) -> bool:
        """Whether this process holds a shard of the gradients and state or all of them."""
        return self.holding.sharded

    @property
    def flat_grads(self) -> torch.Tensor:
        """The whole gradient buffer (whole holdings only)."""
        return self.holding.flat_grads

    # -------------------------------------------------------------- the step
    def _apply(self, params: torch.Tensor, update: torch.Tensor, segments: torch.Tensor, grad_scale: float) -> None:
        """The rule: update `params` from the gradients in `update` (fp32, to be multiplied by
        `grad_scale`, which undoes the loss scale and clips) and the state in `flat_state`.
        Called with `self.step_count` already counting this step."""
        raise NotImplementedError

    def _global_sq_norm(self, sq_norms: torch.Tensor) -> float:
        """Σ of the squared norms of every tensor of the model, over pipeline stages too."""
        total = sq_norms.double().sum()
        if self.stage_group is not None:
            dist.all_reduce(total, group=self.stage_group)
        return total.item()

    def _write(self, params: torch.Tensor, update: torch.Tensor, segments: torch.Tensor, lr: float) -> None:
        """p ← p − lr·u, bf16 parameters rounded stochastically: LAMB's fused stage 2 with the trust
        ratio off on every tensor, for rules that compute their whole update themselves."""
        n = segments.numel() - 1
        norms = torch.zeros(n, 2, device=params.device)
        no_trust = torch.zeros(n, dtype=torch.bool, device=params.device)
        (lamb_stage2 if self.fused else lamb_stage2_fallback)(params, update, segments, norms, no_trust, lr, 0.0,
                                                              self._rounding_seed())

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, loss_scale: float | None = None) -> Any:
        """One step; gradients are divided by `loss_scale` (default `self.loss_scale`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        loss_scale = float(self.loss_scale if loss_scale is None else loss_scale)
        if not loss_scale > 0:
            raise ValueError(f"loss_scale must be > 0, got {loss_scale}")
        params, update, segments = self.holding.step_buffers()
        squares = self.holding.reduce_norms((lamb_sq_norms if self.fused else lamb_sq_norms_fallback)(update, segments))
        self.grad_norm = math.sqrt(self._global_sq_norm(squares)) / loss_scale
        self.skipped = not math.isfinite(self.grad_norm)
        if self.skipped:
            return loss
        clip, max_grad_norm = 1.0, self.param_groups[0]["max_grad_norm"]
        if max_grad_norm is not None and self.grad_norm > max_grad_norm:
            clip = max_grad_norm / self.grad_norm
        self._step += 1
        self._apply(params, update, segments, clip / loss_scale)
        self.holding.after_update()
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "flat_params"):
            raise ValueError(f"{type(self).__name__} holds one flat buffer built at construction; create a new one "
                             "over all parameters")
        super().add_param_group(param_group)

    def _rounding_seed(self) -> int:
        """One stream of rounding bits per (seed, step): seed in the high word, step in the low."""
        return ((self.seed & 0x7FFFFFFF) << 32) | (self._step & 0xFFFFFFFF)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the gradient buffer. `set_to_none` is accepted for the Optimizer interface
        and ignored: `.grad` must stay a view of the buffer, or autograd would allocate a
        fresh gradient that the step never sees."""
        self.holding.zero_grad()

    @property
    def step_count(self) -> int:
        return self._step

    @property
    def parameter_names(self) -> list[str]:
        return list(self.layout.names)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this process holds."""
        return sum(buffer.nbytes for buffer in self.flat_state.values())

    # --------------------------------------------------------------- state
    def scalar_state(self) -> dict[str, Any]:
        """Everything of the state but the per-parameter buffers: which optimizer and its
        state kinds, step, hyperparameters, names and shapes."""
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return {"optimizer": self.kind, "state_kinds": list(self.state_kinds), "step": self._step,
                "param_groups": [group], "names": list(self.layout.names),
                "shapes": [list(s) for s in self.layout.shapes], "seed": self.seed, "loss_scale": self.loss_scale}

    def load_scalar_state(self, state: dict[str, Any], source: str = "the checkpoint") -> None:
        """Restore a `scalar_state()` saved by an optimizer of this kind over these tensors (or
        more of them: a checkpoint holds every pipeline stage's)."""
        saved = {n: tuple(sh) for n, sh in zip(state["names"], state["shapes"])}
        for name, shape in zip(self.layout.names, self.layout.shapes):
            if saved.get(name) != tuple(shape):
                got = "nothing" if name not in saved else saved[name]
                raise ValueError(f"{source} holds optimizer state {got} for {name!r}, this optimizer {tuple(shape)}: "
                                 "load state saved for the same model")
        if saved_kind(state) != self.kind:
            raise ValueError(f"{source}: optimizer state was saved by {saved_kind(state)}, this optimizer is "
                             f"{self.kind}; resume with optimizer {saved_kind(state)!r} or start a new run")
        # The saved hyperparameters hold (a resume continues the run that saved them); any the
        # state does not record keep this optimizer's.
        group, ours = state["param_groups"][0], self.param_groups[0]
        saved = {name: group.get(name, ours[name]) for name in self.hyperparameters.model_fields}
        own = self.own_hyperparameters(saved, source)
        self._step = int(state["step"])
        ours.update({k: group[k] for k in ("lr", "weight_decay", "max_grad_norm") if k in group}, **own)
        self.seed = int(state.get("seed", self.seed))
        self.loss_scale = float(state.get("loss_scale", self.loss_scale))

    def state_dict(self) -> Optional[dict[str, Any]]:
        """Scalar state and each state kind's values (unpadded, in the layout's order), by name:
        the same for every layout and holding. Collective when sharded: the whole state on
        the group's first process, None on the others."""
        values = {kind: self.holding.gather(buffer) for kind, buffer in self.flat_state.items()}
        if any(v is None for v in values.values()):
            return None
        scalar = self.scalar_state()
        return {**scalar, "state": {"step": scalar.pop("step"), **values}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a `state_dict()` of an optimizer of this kind over the same names and shapes."""
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
        for kind in self.state_kinds:  # checked before anything is loaded: a refused state changes nothing
            if kind not in state or tuple(state[kind].shape) != (expected,):
                got = tuple(state[kind].shape) if kind in state else "nothing"
                raise ValueError(f"saved {kind} has shape {got}, expected ({expected},)")
        self.load_scalar_state({**state_dict, "step": state["step"]}, "the optimizer state")
        for kind, buffer in self.flat_state.items():
            self.holding.scatter(buffer, state[kind])


def saved_kind(state: dict[str, Any]) -> str:
    """Which optimizer saved a scalar state: recorded since checkpoint format 4; before, LAMB
    or AdamW by the trust ratio."""
    return state.get("optimizer") or ("lamb" if state.get("trust_ratio", True) else "adamw")


def _state_kinds(state: dict[str, Any]) -> list[str]:
    return [k for k in state["state"] if k != "step"]


def select_state(state: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The part of a `FlatOptimizer.state_dict()` that covers `names` (in that order)."""
    offsets, offset = {}, 0
    for name, shape in zip(state["names"], state["shapes"]):
        offsets[name] = (offset, math.prod(shape), list(shape))
        offset += math.prod(shape)
    missing = [n for n in names if n not in offsets]
    if missing:
        raise ValueError(f"optimizer state has no entry for {len(missing)} tensors, e.g. {missing[:3]}; "
                         "load state saved for the same model")
    pieces = [offsets[n] for n in names]
    values = {kind: torch.cat([state["state"][kind][a : a + n] for a, n, _ in pieces]) if pieces else
              state["state"][kind][:0] for kind in _state_kinds(state)}
    return {**state, "names": list(names), "shapes": [s for _, _, s in pieces],
            "state": {**state["state"], **values}}
