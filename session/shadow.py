"""The weights' low-precision copy, made once per training step (issue 54, item 4: "no per-step
casts of weights that a bf16 copy kept by the optimizer step makes unneeded").

Under bf16 (or fp16) precision every dense layer multiplies in bf16, so each forward cast its
float32 weight and bias to bf16 where it used them: on an H200, 321 copy kernels and 2.0 ms of a
BERT-Large micro-batch, and on the CPU a cast per weight and micro-batch in session/dense.py,
plus a concatenation of the query, key and value weights (the siblings fusion) before it.
Where the kernel policy says weight_cast=shadow, the lowered graph instead keeps one bf16 copy
of those weights (`WeightShadow`), refreshed once per training step by one multi-tensor copy
(`torch._foreach_copy_`) after the optimizer's step has written the weights, and the layers
read it:

- A group of weights one layer concatenates (siblings: [W_q; W_k; W_v]) is one copy, laid out
  concatenated, so the layer reads it as it is and concatenates nothing.
- The arithmetic is a cast's: the copy holds each weight rounded to nearest even, as the cast
  made it; in backward, the copy's gradient (bf16) is cast to each weight's dtype and split
  into the weights' rows, as the cast's and the concatenation's backward did (`_ShadowCast`),
  and reaches each weight's gradient (and the replicas' hooks) as before. Losses and weights
  equal those of a cast at each use to the bit (tests/test_weight_shadow.py).
- When it is refreshed: on entry to a training step (session/executor.py `step_weight_casts`,
  before any micro-batch), and on every forward outside one (evaluation, inference, a
  measurement), since anything may have written the weights between (a loaded checkpoint, a
  user). Within a step nothing writes them: the optimizer steps after its micro-batches.
- A forward not under autocast to the copy's dtype (an fp32 evaluation of the same graph)
  reads the float32 weights, as if there were no copy.

Its cost: 2 bytes per weight it holds, kept between steps (autocast's copies lived for a step),
and host time. Each group passes through `_ShadowCast`, a Python autograd function: 19 µs of
host time per group and forward on this repository's Zen 4 (2026-11-30), where a cast's
dispatch takes 3.4 µs (its kernel launch comes on top on a GPU). So the copy saves device time
(a few large copies instead of many small ones) and may cost host time: on a GPU whose host
launches kernels more slowly than the device runs them (GroupBERT-Large kept an H200 busy only
0.72 of its step, before the convolution's host syncs were removed), only `make gpu-check`'s
timing says which wins, and until it has, the default stays weight_cast=autocast.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch

__all__ = ["SHADOW_DTYPES", "ShadowPlan", "WeightShadow", "full_precision", "is_single_shadow"]

SHADOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class _ShadowCast(torch.autograd.Function):
    """(weights..., their copy) → the copy, which forward returns as it is (no kernel); backward
    casts the copy's gradient to the weights' dtype and splits it into their rows. The weights
    come first, so that a single weight's node leads to its accumulator as a cast's does."""

    @staticmethod
    def forward(ctx, *weights_and_copy: torch.Tensor) -> torch.Tensor:
        *weights, copy = weights_and_copy
        ctx.rows = [w.shape[0] for w in weights]
        ctx.dtype = weights[0].dtype
        ctx.set_materialize_grads(False)
        return copy.view_as(copy)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Optional[torch.Tensor]):
        if grad is None:  # the replicas' hook took this use's gradient (session/replication.py)
            return (None,) * (len(ctx.rows) + 1)
        grad = grad.to(ctx.dtype)
        parts = grad.split(ctx.rows) if len(ctx.rows) > 1 else (grad,)
        return (*(p if ctx.needs_input_grad[i] else None for i, p in enumerate(parts)), None)


def is_single_shadow(node) -> bool:
    """Whether an autograd node is the shadow's copy of one weight: then, like autocast's cast
    (ToCopyBackward0), the gradient it receives is that weight's, in the copy's dtype
    (session/replication.py `gradient_edges`)."""
    return node.name() == "_ShadowCastBackward" and len(node.next_functions) == 2


class WeightShadow(torch.nn.Module):
    """The copy of `groups` of a graph's weights (each group: indices into its parameter list,
    concatenated along the first axis) in `dtype`: one flat buffer, a view of it per group."""

    def __init__(self, groups: Sequence[tuple[int, ...]], shapes: Sequence[torch.Size], dtype: torch.dtype):
        super().__init__()
        self.groups, self.dtype = [tuple(g) for g in groups], dtype
        self._sources = [i for g in self.groups for i in g]  # the weight of each part, in order
        self._rows = [[shapes[i][0] for i in g] for g in self.groups]
        self._shapes = [torch.Size((sum(rows), *shapes[g[0]][1:])) for g, rows in zip(self.groups, self._rows)]
        self.register_buffer("flat", torch.empty(sum(s.numel() for s in self._shapes), dtype=dtype),
                             persistent=False)
        self._views: tuple = ()  # (the flat buffer's address, the groups' views, the parts' views)
        self.live = self._held = self._fresh = False

    def _layout(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each group's view of the flat buffer and each weight's rows in it, made again after
        the module moved the buffer (`.to(device)`)."""
        if not self._views or self._views[0] != self.flat.data_ptr():
            groups, parts, start = [], [], 0
            for shape, rows in zip(self._shapes, self._rows):
                view = self.flat[start:start + shape.numel()].view(shape)
                groups.append(view)
                parts += view.split(rows)
                start += shape.numel()
            self._views = (self.flat.data_ptr(), groups, parts)
        return self._views[1], self._views[2]

    @torch.no_grad()
    def refresh(self, params: Sequence[torch.Tensor]) -> None:
        """The copy made again from the weights: one multi-tensor copy, each weight cast to `dtype`."""
        _, parts = self._layout()
        torch._foreach_copy_(parts, [params[i] for i in self._sources])

    def values(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each group as its layer reads it: the copy, its gradient routed to the weights."""
        groups, _ = self._layout()
        return [_ShadowCast.apply(*(params[i] for i in group), view) for view, group in zip(groups, self.groups)]

    def prepare(self, params: Sequence[torch.Tensor]) -> None:
        """Before a forward: whether it reads the copy (under autocast to the copy's dtype), and
        the copy made again unless this step's first forward made it."""
        device = self.flat.device.type
        self.live = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == self.dtype
        if self.live and not (self._held and self._fresh):
            self.refresh(params)
            self._fresh = self._held

    def inputs(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What the layers read in this forward: the copy, or the float32 weights."""
        return self.values(params) if self.live else full_precision(params, self.groups)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Nothing writes the weights inside: the first forward makes the copy, the rest read it."""
        self._held, self._fresh = True, False
        try:
            yield
        finally:
            self._held = False


def full_precision(params: Sequence[torch.Tensor], groups: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Each group without the copy: the weight itself, or the group's weights concatenated."""
    return [params[g[0]] if len(g) == 1 else torch.cat([params[i] for i in g]) for g in groups]


class ShadowPlan:
    """Which fused layers read the copy, decided while a graph is lowered (session/lowering.py):
    those whose weights (session/fusions.py `Fused.weights`) are all the graph's initializers,
    where the kernel policy says weight_cast=shadow and the precision is bf16 or fp16."""

    def __init__(self, policy, parameter_names: Sequence[str]):
        shadowing = policy.weight_cast == "shadow"
        self.dtype = SHADOW_DTYPES.get(policy.precision) if shadowing else None
        self._index = {name: i for i, name in enumerate(parameter_names)}
        self.slots: dict[tuple[str, ...], str] = {}  # a group of weights → the name its copy is read by

    def route(self, fused) -> tuple:
        """(the op's factory, its inputs): the copy's where it reads one, the weights' otherwise."""
        if self.dtype is None or not fused.weights or not all(n in self._index for g in fused.weights for n in g):
            return fused.factory, fused.inputs
        names = tuple(self.slots.setdefault(g, f"\0shadow {len(self.slots)}") for g in fused.weights)
        return fused.shadowed or fused.factory, fused.inputs[:1] + names

    def shadow(self, params: Sequence[torch.Tensor]) -> Optional[WeightShadow]:
        if not self.slots:
            return None
        groups = [tuple(self._index[n] for n in g) for g in self.slots]
        return WeightShadow(groups, [p.shape for p in params], self.dtype)
