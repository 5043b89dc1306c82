"""Peephole fusions applied while lowering, as PopART's patterns are: the ONNX graph stays
standard, the torch program gets the fused kernel (session/dense.py, torch's own).

Each fusion is a matcher registered with `@fusion`, run in the order registered over the
whole graph (a later matcher sees the nodes earlier ones replaced):

    linear     Transpose(W, [1, 0]) → MatMul(x, ·) → Add(·, b)         ⇒ linear(x, W, b)
    siblings   linear layers reading the same x (attention's query, key and value)
               ⇒ one linear(x, [W1; W2; ...], [b1; b2; ...]), split: one wider GEMM per
               pass instead of several, and one dx instead of a sum of several
    grouped    Einsum('…gi,gio->…go', x, W) → Reshape(·, [0, …, 0, G·O]) → Add(·, b), where the
               kernel policy says grouped_matmul=einsum ⇒ grouped_linear(x, W, b)
    swish      Mul(x, Sigmoid(x))                                   ⇒ F.silu(x)
    glu        Split(z, [n, n]) → Mul(z₀, Sigmoid(z₁))                ⇒ F.glu(z)
               (one op each way instead of three to five, over a (B, S, H) tensor each)
    attention  MatMul(q, kᵀ) → Div(c) or Mul(1/c) → Add(mask) → Softmax → [Dropout] → MatMul(·, v)
               ⇒ F.scaled_dot_product_attention(q, k, v, mask, scale=1/c), or the composed
               form where the kernel policy says attention=composed
    add_norm   Add(a, b) → LayerNormalization(·, γ, β), where the kernel policy says norm=triton
               ⇒ one kernel each way (session/add_norm.py), the sum kept where others read it
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import onnx
import torch
import torch.nn.functional as F

from builder import IPU_NUMBER, PIPELINE_STAGE, RECOMPUTE, attribute
from session.add_norm import add_layer_norm
from session.dense import grouped_linear, grouped_matmul_equation, linear
from session.kernels import KernelPolicy

__all__ = ["Fused", "find_fusions", "fusion"]

OpFn = Callable[..., Any]


@dataclass(frozen=True)
class Fused:
    """A fused op: run after the node it is keyed by, in place of the nodes it replaces."""

    kind: str  # "linear", "siblings", "grouped", "swish", "glu", "attention", "add_norm"
    factory: Callable[[], OpFn]  # () -> fn(ctx, *inputs) -> output(s), as the lowering's op factories give
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    # The weights the op multiplies in the autocast dtype, in groups it concatenates along their
    # first axis, and the op taking (x, one tensor per group; default: `factory`'s, where each
    # group is one weight): where the kernel policy says weight_cast=shadow, the lowering feeds
    # it the groups' low-precision copy (session/shadow.py).
    weights: tuple[tuple[str, ...], ...] = ()
    shadowed: Optional[Callable[[], OpFn]] = None


class GraphView:
    """What a matcher reads of a graph: weights' shapes, constants, producers and consumers."""

    def __init__(self, graph: onnx.GraphProto, constants: dict[str, np.ndarray], needed: Optional[set[str]]):
        self.graph, self.constants, self.needed = graph, constants, needed
        self.weights = {t.name: tuple(t.dims) for t in graph.initializer}
        self.order = {n.name: i for i, n in enumerate(graph.node)}
        self._producer = {o: n for n in graph.node for o in n.output}
        self._consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in graph.node:
            for i in n.input:
                self._consumers.setdefault(i, []).append(n)
        self._outputs = {o.name for o in graph.output}

    def only_consumer(self, name: str, op_type: str) -> Optional[onnx.NodeProto]:
        """The node reading `name` when it alone does, is a standard `op_type` and `name` is not a graph output."""
        users = self._consumers.get(name, [])
        if len(users) == 1 and users[0].op_type == op_type and users[0].domain == "" and name not in self._outputs:
            return users[0]
        return None

    def made_by(self, name: str, op_type: str) -> Optional[onnx.NodeProto]:
        node = self._producer.get(name)
        return node if node is not None and node.op_type == op_type and node.domain == "" else None


Matcher = Callable[[GraphView, KernelPolicy, set[str]], dict[str, Fused]]
_MATCHERS: list[Matcher] = []


def fusion(matcher: Matcher) -> Matcher:
    """Register `matcher(view, policy, replaced)`: it returns its fused ops keyed by the node
    after which each runs, and adds the names of the nodes they replace to `replaced`."""
    _MATCHERS.append(matcher)
    return matcher


def find_fusions(graph: onnx.GraphProto, constants: dict[str, np.ndarray], policy: KernelPolicy,
                 needed: Optional[set[str]] = None) -> tuple[dict[str, Fused], set[str]]:
    """Fused ops keyed by the name of the node after which they run, and the names of all
    replaced nodes. `needed` (default: all) names the nodes the lowered graph runs."""
    view, fused, replaced = GraphView(graph, constants, needed), {}, set()
    for matcher in _MATCHERS:
        fused.update(matcher(view, policy, replaced))
    return fused, replaced


_PLACEMENT = (IPU_NUMBER, PIPELINE_STAGE, RECOMPUTE)


def _placement(node: onnx.NodeProto) -> tuple:
    return tuple(attribute(node, a) for a in _PLACEMENT)


def _siblings(ctx, x, *weights_and_biases, onednn: bool):
    ws, bs = weights_and_biases[0::2], weights_and_biases[1::2]  # W_i (N_i, K), b_i (N_i,)
    return _concatenated(ctx, x, torch.cat(ws), torch.cat(bs), [w.shape[0] for w in ws], onednn)


def _concatenated(ctx, x, w, b, rows: list[int], onednn: bool):
    """The siblings' layer on their weights and biases concatenated: w = [W_1; W_2; ...]."""
    return linear(x, w, b, onednn=onednn).split(rows, -1)  # (..., Σ N_i) split


@fusion
def _linear_layers(view: GraphView, policy: KernelPolicy, replaced: set[str]) -> dict[str, Fused]:
    """linear and siblings: the layers grouped by input (and placement: a group runs as one step)."""
    fused, weights, onednn = {}, view.weights, policy.gemm == "onednn"
    linears: dict[tuple, list[tuple[onnx.NodeProto, ...]]] = {}
    for t in view.graph.node:
        if t.op_type != "Transpose" or t.input[0] not in weights or len(weights[t.input[0]]) != 2:
            continue
        if attribute(t, "perm") != [1, 0]:
            continue
        mm = view.only_consumer(t.output[0], "MatMul")
        if mm is None or mm.input[1] != t.output[0]:
            continue
        add = view.only_consumer(mm.output[0], "Add")
        bias = add and next((i for i in add.input if i != mm.output[0]), None)
        if add is None or weights.get(bias) != (weights[t.input[0]][0],):
            continue
        if view.needed is not None and add.name not in view.needed:
            continue
        linears.setdefault((mm.input[0], _placement(add)), []).append((t, mm, add, bias))
    for (x, _), group in linears.items():
        group.sort(key=lambda members: view.order[members[2].name])
        for t, mm, add, bias in group:
            replaced |= {t.name, mm.name, add.name}
        if len(group) == 1:
            (t, mm, add, bias), = group
            fused[add.name] = Fused("linear", lambda: lambda ctx, x, w, b: linear(x, w, b, onednn=onednn),
                                    (x, t.input[0], bias), (add.output[0],), ((t.input[0],), (bias,)))
            continue
        inputs = [x]
        for t, _, _, bias in group:
            inputs += [t.input[0], bias]
        rows = [weights[t.input[0]][0] for t, _, _, _ in group]
        # The group runs where its first member ran: its input exists there and every
        # member's output is read only later.
        fused[group[0][2].name] = Fused("siblings", lambda: functools.partial(_siblings, onednn=onednn),
                                        tuple(inputs), tuple(add.output[0] for _, _, add, _ in group),
                                        (tuple(inputs[1::2]), tuple(inputs[2::2])),
                                        lambda rows=rows: functools.partial(_concatenated, rows=rows, onednn=onednn))
    return fused


@fusion
def _grouped_linear_layers(view: GraphView, policy: KernelPolicy, replaced: set[str]) -> dict[str, Fused]:
    fused, weights = {}, view.weights
    if policy.grouped_matmul != "einsum":
        return fused
    for e in view.graph.node:
        if e.op_type != "Einsum" or e.domain or e.input[1] not in weights:
            continue
        equation = attribute(e, "equation").replace(" ", "")
        if not grouped_matmul_equation(equation):
            continue
        g, _, o = weights[e.input[1]]
        reshape = view.only_consumer(e.output[0], "Reshape")
        target = view.constants.get(reshape.input[1]) if reshape is not None else None
        rank = len(equation.split(",")[0])  # x (..., G, I)
        if target is None or [int(v) for v in target] != [0] * (rank - 2) + [g * o]:
            continue
        add = view.only_consumer(reshape.output[0], "Add")
        bias = add and next((i for i in add.input if i != reshape.output[0]), None)
        if add is None or weights.get(bias) != (g * o,):
            continue
        fused[add.name] = Fused("grouped", lambda: lambda ctx, x, w, b: grouped_linear(x, w, b),
                                (e.input[0], e.input[1], bias), (add.output[0],), ((e.input[1],), (bias,)))
        replaced |= {e.name, reshape.name, add.name}
    return fused


@fusion
def _gates(view: GraphView, policy: KernelPolicy, replaced: set[str]) -> dict[str, Fused]:
    """swish and glu: a Sigmoid whose only reader multiplies it by its input, or by the other
    half of the Split it came from."""
    fused = {}
    for sigmoid in view.graph.node:
        if sigmoid.op_type != "Sigmoid" or sigmoid.domain:
            continue
        mul = view.only_consumer(sigmoid.output[0], "Mul")
        if mul is None:
            continue
        other = mul.input[1] if mul.input[0] == sigmoid.output[0] else mul.input[0]
        if other == sigmoid.input[0]:
            fused[mul.name] = Fused("swish", lambda: lambda ctx, x: F.silu(x), (other,), (mul.output[0],))
            replaced |= {sigmoid.name, mul.name}
            continue
        split = view.made_by(sigmoid.input[0], "Split")
        if split is None or len(split.output) != 2 or list(split.output) != [other, sigmoid.input[0]]:
            continue
        sizes = view.constants.get(split.input[1]) if len(split.input) > 1 else None
        if sizes is None or len(sizes) != 2 or sizes[0] != sizes[1] or view.only_consumer(other, "Mul") is not mul:
            continue
        axis = attribute(split, "axis", 0)
        fused[mul.name] = Fused("glu", lambda axis=axis: lambda ctx, z: F.glu(z, axis), (split.input[0],),
                                (mul.output[0],))
        replaced |= {split.name, sigmoid.name, mul.name}
    return fused


@fusion
def _attention(view: GraphView, policy: KernelPolicy, replaced: set[str]) -> dict[str, Fused]:
    fused, constants = {}, view.constants
    for out in view.graph.node:
        if out.op_type != "MatMul" or out.name in replaced:
            continue
        probs = out.input[0]
        dropout = view.made_by(probs, "Dropout")
        ratio = 0.0
        if dropout is not None:
            ratio = float(constants.get(dropout.input[1], 0.5)) if len(dropout.input) > 1 else 0.5
            probs = dropout.input[0]
        softmax = view.made_by(probs, "Softmax")
        add = softmax and view.made_by(softmax.input[0], "Add")
        mul = add and (view.made_by(add.input[0], "Div") or view.made_by(add.input[0], "Mul"))
        scores = mul and view.made_by(mul.input[0], "MatMul")
        chain = [n for n in (scores, mul, add, softmax, dropout) if n is not None]
        if scores is None or mul.input[1] not in constants or constants[mul.input[1]].ndim != 0:
            continue
        if attribute(softmax, "axis", -1) != -1:
            continue
        if any(view.only_consumer(n.output[0], c.op_type) is not c for n, c in zip(chain, chain[1:] + [out])):
            continue
        scale = float(constants[mul.input[1]])
        scale = 1.0 / scale if mul.op_type == "Div" else scale
        fused[out.name] = Fused("attention", functools.partial(_attention_fn, scale, ratio,
                                                               policy.attention == "composed"),
                                (scores.input[0], scores.input[1], add.input[1], out.input[1]), (out.output[0],))
        replaced |= {n.name for n in chain} | {out.name}
    return fused


def _attention_fn(scale: float, ratio: float, composed: bool) -> OpFn:
    def run(ctx, q, k_t, mask, v):  # q, v (B, A, S, D); k_t (B, A, D, S); mask (B, 1, 1, S) or packed (B, 1, S, S)
        p = ratio if ctx.training else 0.0
        if composed:
            probs = torch.softmax(torch.matmul(q, k_t) * scale + mask, dim=-1)
            return torch.matmul(F.dropout(probs, p, training=ctx.training), v)
        return F.scaled_dot_product_attention(q, k_t.transpose(-1, -2), v, attn_mask=mask.to(q.dtype), dropout_p=p,
                                              scale=scale)

    return run


@fusion
def _add_norms(view: GraphView, policy: KernelPolicy, replaced: set[str]) -> dict[str, Fused]:
    """add_norm: a LayerNormalization over the last axis, with a bias and no statistics
    outputs, of an Add nothing else replaced, in the same placement; run where the Add ran."""
    fused = {}
    if policy.norm != "triton":
        return fused
    for norm in view.graph.node:
        if norm.op_type != "LayerNormalization" or norm.domain or attribute(norm, "axis", -1) != -1:
            continue
        if len(norm.input) < 3 or not norm.input[2] or any(norm.output[1:]):
            continue
        add = view.made_by(norm.input[0], "Add")
        if add is None or add.name in replaced or _placement(add) != _placement(norm):
            continue
        if view.needed is not None and not {add.name, norm.name} <= view.needed:
            continue
        keep = view.only_consumer(add.output[0], "LayerNormalization") is not norm
        eps = float(attribute(norm, "epsilon", 1e-5))
        fused[add.name] = Fused("add_norm", functools.partial(_add_norm_fn, eps, keep),
                                (add.input[0], add.input[1], norm.input[1], norm.input[2]),
                                (norm.output[0], add.output[0]) if keep else (norm.output[0],))
        replaced |= {add.name, norm.name}
    return fused


def _add_norm_fn(eps: float, keep: bool) -> OpFn:
    return lambda ctx, a, b, gamma, beta: add_layer_norm(a, b, gamma, beta, eps, keep_sum=keep)
