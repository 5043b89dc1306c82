"""Lowering of the builder's ONNX graphs to PyTorch: one small function per op type.

`LoweredGraph` is a `torch.nn.Module` holding the graph's initializers as parameters
(under their ONNX names) and its Constant nodes as buffers. Its forward runs the nodes
in order; inputs a node takes from a Constant (a Reshape target, Split sizes, axes) are
read once, when the graph is lowered, so the hot loop never syncs on a device value.

Dense layers and the attention core are fused while lowering (see "fusions" below).

Nodes of the custom domain go to `custom_ops` (the compiled `torch.ops.groupbert` ops
when built, their pure-torch versions otherwise). Where an op has several
implementations (the GEMM of dense layers, attention, grouped matmuls, the grouped
convolution), the graph's `KernelPolicy` (session/kernels.py) names the one to run:
this module never looks at the machine itself.

With `recompute=True`, each run of consecutive nodes marked Recompute
(`__recompute_output_in_backward_pass` = 2, PopART's RecomputeType) runs under
`torch.utils.checkpoint`: only the tensors entering the run are kept for backward.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper
from torch.utils.checkpoint import checkpoint

from builder import IPU_NUMBER, PIPELINE_STAGE, RECOMPUTE, RecomputeType
from custom_ops import DOMAIN, GROUPED_CONV1D
from session.kernels import KernelPolicy, choose_kernels

_TORCH_DTYPE = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.BOOL: torch.bool,
}


@dataclass
class _Context:
    """Run-time switches the op functions read."""

    training: bool = False


# An op factory gets the node's attributes (plus "_op_type" and "_policy", the graph's
# KernelPolicy) and the build-time values of its constant inputs (None where an input
# is computed) and returns fn(ctx, *inputs) -> output(s).
OpFn = Callable[..., Any]
Factory = Callable[[dict, list[Optional[np.ndarray]]], OpFn]
_OPS: dict[tuple[str, str], Factory] = {}


def _op(*op_types: str, domain: str = ""):
    def register(factory: Factory) -> Factory:
        for t in op_types:
            _OPS[(domain, t)] = factory
        return factory

    return register


def _simple(fn: Callable) -> Factory:
    return lambda attrs, consts: lambda ctx, *xs: fn(*xs)


for _name, _fn in {
    "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div, "Pow": torch.pow,
    "Max": torch.maximum, "Min": torch.minimum, "Equal": torch.eq, "Greater": torch.gt, "Less": torch.lt,
    "GreaterOrEqual": torch.ge, "LessOrEqual": torch.le, "And": torch.logical_and, "Not": torch.logical_not,
    "Relu": torch.relu, "Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Erf": torch.erf, "Sqrt": torch.sqrt,
    "Neg": torch.neg, "Exp": torch.exp, "Log": torch.log, "Abs": torch.abs, "Where": torch.where,
    "MatMul": torch.matmul, "Identity": lambda x: x,
}.items():
    _op(_name)(_simple(_fn))


@_op("Gelu")
def _gelu(attrs, consts):
    approximate = attrs.get("approximate", "none")
    return lambda ctx, x: F.gelu(x, approximate=approximate)


@_op("Softmax", "LogSoftmax")
def _softmax(attrs, consts):
    axis = attrs.get("axis", -1)
    fn = torch.softmax if attrs["_op_type"] == "Softmax" else torch.log_softmax
    return lambda ctx, x: fn(x, axis)


@_op("Cast")
def _cast(attrs, consts):
    dtype = _TORCH_DTYPE[attrs["to"]]
    return lambda ctx, x: x.to(dtype)


@_op("Dropout")
def _dropout(attrs, consts):
    ratio = float(consts[1]) if len(consts) > 1 and consts[1] is not None else 0.5
    return lambda ctx, x, *rest: F.dropout(x, ratio, training=ctx.training)


@_op("Transpose")
def _transpose(attrs, consts):
    perm = attrs["perm"]
    return lambda ctx, x: x.permute(perm)


@_op("Reshape")
def _reshape(attrs, consts):
    spec = [int(v) for v in consts[1]]

    def reshape(ctx, x, shape):
        return x.reshape([x.shape[i] if d == 0 else d for i, d in enumerate(spec)])

    return reshape


@_op("Unsqueeze")
def _unsqueeze(attrs, consts):
    axes = sorted(int(a) for a in consts[1])

    def unsqueeze(ctx, x, _axes):
        rank = x.dim() + len(axes)
        for a in sorted(a % rank for a in axes):
            x = x.unsqueeze(a)
        return x

    return unsqueeze


@_op("Squeeze")
def _squeeze(attrs, consts):
    axes = tuple(int(a) for a in consts[1])
    return lambda ctx, x, _axes: x.squeeze(axes)


@_op("Concat")
def _concat(attrs, consts):
    axis = attrs["axis"]
    return lambda ctx, *xs: torch.cat(xs, axis)


@_op("Split")
def _split(attrs, consts):
    sizes = [int(v) for v in consts[1]]
    axis = attrs.get("axis", 0)
    return lambda ctx, x, _sizes: torch.split(x, sizes, axis)


@_op("Gather")
def _gather(attrs, consts):
    axis = attrs.get("axis", 0)
    index = consts[1]
    if index is not None and index.ndim == 0:  # a fixed position, e.g. the [CLS] token
        i = int(index)
        return lambda ctx, data, _idx: data.select(axis, i)

    def gather(ctx, data, idx):
        if axis == 0 and data.dim() == 2:
            return F.embedding(idx, data)
        out = data.index_select(axis, idx.reshape(-1))
        return out.reshape(data.shape[:axis] + idx.shape + data.shape[axis + 1 :])

    return gather


@_op("GatherND")
def _gather_nd(attrs, consts):
    batch_dims = attrs.get("batch_dims", 0)

    def gather_nd(ctx, data, idx):
        # ONNX GatherND: data (*L, *D), idx (*L, *N, k) -> (*L, *N, *D[k:]); L the batch_dims leading axes.
        lead, k = tuple(data.shape[:batch_dims]), idx.shape[-1]
        rest = tuple(data.shape[batch_dims + k :])
        if k == 1 and idx.dim() == batch_dims + 2:  # one index per row (*L, N, 1): torch.gather
            i = (idx % data.shape[batch_dims]).reshape(*lead, idx.shape[-2], *[1] * len(rest))
            return torch.gather(data, batch_dims, i.expand(*lead, idx.shape[-2], *rest))
        sizes = data.shape[batch_dims : batch_dims + k]
        linear = torch.zeros(idx.shape[:-1], dtype=torch.int64, device=idx.device)
        for j, size in enumerate(sizes):  # row-major position within the k indexed axes
            linear = linear * size + idx[..., j] % size
        batch = 1
        for size in lead:
            batch *= size
        flat = data.reshape(batch, -1, *rest)  # (prod L, prod D[:k], *D[k:])
        rows = torch.arange(batch, device=idx.device).reshape(batch, *[1] * (linear.dim() - batch_dims))
        picked = flat[rows, linear.reshape(batch, *linear.shape[batch_dims:])]
        return picked.reshape(*lead, *idx.shape[batch_dims:-1], *rest)

    return gather_nd


@_op("LayerNormalization")
def _layer_norm(attrs, consts):
    axis, eps = attrs.get("axis", -1), attrs.get("epsilon", 1e-5)

    def layer_norm(ctx, x, scale, bias=None):
        return F.layer_norm(x, x.shape[axis:], scale, bias, eps)

    return layer_norm


@_op("ReduceMean", "ReduceSum")
def _reduce(attrs, consts):
    axes = tuple(int(a) for a in consts[1]) if len(consts) > 1 and consts[1] is not None else None
    keep = bool(attrs.get("keepdims", 1))
    fn = torch.mean if attrs["_op_type"] == "ReduceMean" else torch.sum
    return lambda ctx, x, *_: fn(x, axes, keepdim=keep) if axes is not None else fn(x)


def _grouped_matmul_equation(equation: str) -> bool:
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


@_op("Einsum")
def _einsum(attrs, consts):
    equation = attrs["equation"].replace(" ", "")
    if not (_grouped_matmul_equation(equation) and attrs["_policy"].grouped_matmul == "block_diagonal"):
        return lambda ctx, *xs: torch.einsum(equation, *xs)

    def block_diagonal(ctx, x, w):  # x (..., G, I), w (G, I, O) -> (..., G, O)
        # One dense matmul with the block-diagonal weight: G times the FLOPs of the
        # grouped product, the zero blocks adding exact zeros (session/kernels.py: why).
        *lead, g, i = x.shape
        y = torch.matmul(x.reshape(*lead, g * i), torch.block_diag(*w.unbind(0)))
        return y.reshape(*lead, g, w.shape[-1])

    return block_diagonal


@_op("ArgMax")
def _argmax(attrs, consts):
    axis, keep = attrs.get("axis", 0), bool(attrs.get("keepdims", 1))
    return lambda ctx, x: torch.argmax(x, axis, keepdim=keep)


@_op("SoftmaxCrossEntropyLoss")
def _softmax_cross_entropy(attrs, consts):
    reduction = attrs.get("reduction", "mean")
    ignore = attrs.get("ignore_index", -100)

    def loss(ctx, scores, labels, weights=None):
        # The loss is computed in fp32 whatever the precision of the logits.
        if (weights is None and reduction == "mean" and scores.dim() == 2 and scores.device.type == "cpu"
                and not torch.compiler.is_compiling()):
            return _SoftmaxCrossEntropy.apply(scores, labels, ignore)
        return F.cross_entropy(scores.float(), labels, weight=weights, ignore_index=ignore, reduction=reduction)

    return loss


# Ops of the portable export (session/export.py), so the session runs its files too.
@_op("Conv")
def _conv(attrs, consts):
    group, pads = attrs.get("group", 1), attrs.get("pads", [0, 0])
    if len(pads) != 2 or pads[0] != pads[1] or any(v != 1 for v in attrs.get("strides", [1]) + attrs.get("dilations", [1])):
        raise NotImplementedError("Conv is lowered for 1-D, stride 1, dilation 1, symmetric padding only")
    return lambda ctx, x, w, b=None: F.conv1d(x, w.to(x.dtype), b, padding=pads[0], groups=group)


@_op("Shape")
def _shape(attrs, consts):
    start, end = attrs.get("start", 0), attrs.get("end")
    # Kept on the CPU: a shape is read back as Python ints (by Slice), never computed on.
    return lambda ctx, x: torch.tensor(x.shape[start:end], dtype=torch.int64)


@_op("Slice")
def _slice(attrs, consts):
    def slice_(ctx, x, starts, ends, axes=None, steps=None):
        starts, ends = starts.tolist(), ends.tolist()
        axes = axes.tolist() if axes is not None else list(range(len(starts)))
        steps = steps.tolist() if steps is not None else [1] * len(starts)
        index = [slice(None)] * x.dim()
        for a, s, e, st in zip(axes, starts, ends, steps):
            index[a] = slice(s, e, st)
        return x[tuple(index)]

    return slice_


@_op(GROUPED_CONV1D, domain=DOMAIN)
def _grouped_conv1d(attrs, consts):
    from custom_ops.grouped_conv1d import grouped_conv1d

    policy = attrs["_policy"]

    def conv(ctx, x, weight, mask=None, sequence_ids=None):
        if torch.is_autocast_enabled(x.device.type):
            # Custom ops are not on autocast's lists: run in the autocast dtype here.
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
        if mask is not None:
            mask = mask.to(x.dtype)
        weight = weight.to(x.dtype)
        # torch's convolution cannot keep packed sequences apart: ids always take ours.
        compiled = sequence_ids is not None or not policy.conv_runs_torch(x.dtype, weight.shape[1], weight.shape[2])
        return grouped_conv1d(x, weight, mask, sequence_ids, compiled=compiled)

    return conv


# ------------------------------------------------------------- dense layers
# The fused linear layers (x @ Wᵀ + b) run forward and backward through `_Linear` on the
# CPU, its GEMMs from the kernel policy's `gemm`: oneDNN's inner product
# (torch.ops.mkldnn._linear_pointwise) or torch's matmul. Its backward differs from the
# one autograd derives for F.linear in two places, both measured (bench/linear.py):
#   db = dyᵀ · 1 as a GEMM: torch's column sum dy.sum(0) of a (4096, 1024) gradient takes
#        2x as long on one thread and up to 25x on two (Zen 4), fp32 and bf16 alike;
#   dW through oneDNN, whose inner product copies a transposed input to a contiguous one:
#        it copies the smaller of dyᵀ and xᵀ, computing dW = dyᵀ·x or (xᵀ·dy)ᵀ (0.6x the
#        time for the MLM decoder's (640, 30522)ᵀ · (640, 256)).
def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
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


def _column_sums(y: torch.Tensor) -> torch.Tensor:
    """y (T, N) summed over T, as a (1, T) · (T, N) GEMM."""
    return torch.mm(y.new_ones(1, y.shape[0]), y).view(-1)


class _Linear(torch.autograd.Function):
    """x @ wᵀ + b, forward and backward (dx = dy·w, dw = dyᵀ·x, db = dyᵀ·1) through oneDNN or torch."""

    @staticmethod
    def forward(ctx, x, w, b, onednn: bool):
        ctx.save_for_backward(x, w)
        ctx.has_bias, ctx.onednn = b is not None, onednn
        return _onednn_linear(x, w, b) if onednn else F.linear(x, w, b)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])  # (T, N), (T, K)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _onednn_linear(dy, w.t(), None) if ctx.onednn else torch.matmul(dy, w)
        if ctx.needs_input_grad[1]:
            if not ctx.onednn:
                dw = torch.mm(dy2.t(), x2)
            elif dy2.shape[1] > x2.shape[1]:  # N > K: copy xᵀ, the smaller
                dw = _onednn_linear(x2.t(), dy2.t(), None).t()
            else:
                dw = _onednn_linear(dy2.t(), x2.t(), None)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = _column_sums(dy2)
        return dx, dw, db, None


def linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None, *, onednn: bool = False) -> torch.Tensor:
    """F.linear, through `_Linear` on the CPU: oneDNN's GEMMs with `onednn` (fp32 only),
    torch's otherwise. Under autocast the operands are cast to its dtype first, as autocast
    casts F.linear's."""
    if x.device.type != "cpu":
        return F.linear(x, w, b)
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
        x, w, b = x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)
        with torch.autocast("cpu", enabled=False):
            return _Linear.apply(x, w, b, False)
    onednn = onednn and x.dtype == w.dtype == torch.float32 and (b is None or b.dtype == torch.float32)
    return _Linear.apply(x, w, b, onednn)


class _GroupedLinear(torch.autograd.Function):
    """y (..., G·O) = x (..., G, I) · w (G, I, O) per group, + b (G·O,): one batched GEMM over
    the groups on strided views of x and y, where einsum permutes x to (G, T, I) and the
    result back (two copies each way); db as a GEMM, as in `_Linear`."""

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
    """F.cross_entropy(scores.float(), labels, ignore_index=i), mean over the labels kept, for
    scores (N, C). Its backward writes softmax − one-hot, scaled, over the saved
    log-probabilities in place: two passes over (N, C), where F.cross_entropy's backward
    zero-fills an (N, C) gradient for the one-hot, then runs log_softmax's backward over it.
    (N, C) is (masked positions, vocabulary) for the MLM loss, the largest activation of a
    BERT step: 0.5x the time of F.cross_entropy's forward + backward at (640, 30522) on
    one thread (Zen 4). A second backward through the same graph is refused."""

    @staticmethod
    def forward(ctx, scores, labels, ignore_index: int):
        logp = torch.log_softmax(scores.float(), dim=-1)  # (N, C)
        kept = labels != ignore_index  # (N,)
        target = labels.masked_fill(~kept, 0)
        count = kept.sum()
        ctx.save_for_backward(logp, target, kept, count)
        ctx.dtype, ctx.used = scores.dtype, False
        # 0/0 = nan when every label is ignored, as F.cross_entropy gives (its gradient: zeros)
        return -(logp.gather(1, target[:, None]).squeeze(1) * kept).sum() / count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dloss):
        if ctx.used:
            raise RuntimeError("the fused softmax cross-entropy's backward ran twice: its saved "
                               "log-probabilities are overwritten by the first (retain_graph is not supported)")
        ctx.used = True
        logp, target, kept, count = ctx.saved_tensors
        scale = (kept * (dloss / count.clamp(min=1)))[:, None]  # (N, 1): 0 on ignored rows
        dscores = logp.exp_().mul_(scale)  # softmax · scale
        dscores.scatter_add_(1, target[:, None], -scale)  # − one-hot · scale
        return dscores.to(ctx.dtype), None, None


# ------------------------------------------------------------------ fusions
# Peephole rewrites applied while lowering, as PopART's patterns are: the ONNX graph
# stays standard, the torch program gets the fused kernel.
#   linear:    Transpose(W, [1, 0]) → MatMul(x, ·) → Add(·, b)        ⇒ linear(x, W, b) (_Linear above)
#   siblings:  linear layers reading the same x (attention's query, key and value)
#              ⇒ one linear(x, [W1; W2; ...], [b1; b2; ...]), split: one wider GEMM per
#              pass instead of several, and one dx instead of a sum of several
#   grouped:   Einsum('…gi,gio->…go', x, W) → Reshape(·, [0, …, 0, G·O]) → Add(·, b), where the
#              kernel policy says grouped_matmul=einsum ⇒ grouped_linear(x, W, b) (_GroupedLinear)
#   swish:     Mul(x, Sigmoid(x))                                  ⇒ F.silu(x)
#   glu:       Split(z, [n, n]) → Mul(z₀, Sigmoid(z₁))               ⇒ F.glu(z)
#              (one op each way instead of three to five, over a (B, S, H) tensor each)
#   attention: MatMul(q, kᵀ) → Mul(c) → Add(mask) → Softmax → [Dropout] → MatMul(·, v)
#              ⇒ F.scaled_dot_product_attention(q, k, v, mask, scale=c)
@dataclass(frozen=True)
class _Fused:
    kind: str  # "linear", "siblings", "grouped", "swish", "glu", "attention"
    factory: Callable[[], OpFn]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


_PLACEMENT = (IPU_NUMBER, PIPELINE_STAGE, RECOMPUTE)


def _placement(node: onnx.NodeProto) -> tuple:
    attrs = node_attributes(node)
    return tuple(attrs.get(a) for a in _PLACEMENT)


def _siblings(ctx, x, *weights_and_biases, onednn: bool):
    ws, bs = weights_and_biases[0::2], weights_and_biases[1::2]  # W_i (N_i, K), b_i (N_i,)
    y = linear(x, torch.cat(ws), torch.cat(bs), onednn=onednn)  # (..., Σ N_i)
    return y.split([w.shape[0] for w in ws], -1)


def _find_fusions(graph: onnx.GraphProto, constants: dict[str, np.ndarray], policy: KernelPolicy,
                  needed: Optional[set[str]] = None) -> tuple[dict[str, _Fused], set[str]]:
    """Fused ops keyed by the name of the node after which they run, and the names of all
    replaced nodes. `needed` (default: all) names the nodes the lowered graph runs."""
    weights = {t.name: tuple(t.dims) for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    order = {n.name: i for i, n in enumerate(graph.node)}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    outputs = {o.name for o in graph.output}

    def only_consumer(name: str, op_type: str) -> Optional[onnx.NodeProto]:
        users = consumers.get(name, [])
        if len(users) == 1 and users[0].op_type == op_type and users[0].domain == "" and name not in outputs:
            return users[0]
        return None

    def made_by(name: str, op_type: str) -> Optional[onnx.NodeProto]:
        node = producer.get(name)
        return node if node is not None and node.op_type == op_type and node.domain == "" else None

    fused: dict[str, _Fused] = {}
    replaced: set[str] = set()
    onednn = policy.gemm == "onednn"
    # Linear layers, grouped by input (and placement: a group runs as one step).
    linears: dict[tuple, list[tuple[onnx.NodeProto, ...]]] = {}
    for t in graph.node:
        if t.op_type != "Transpose" or t.input[0] not in weights or len(weights[t.input[0]]) != 2:
            continue
        if node_attributes(t).get("perm") != [1, 0]:
            continue
        mm = only_consumer(t.output[0], "MatMul")
        if mm is None or mm.input[1] != t.output[0]:
            continue
        add = only_consumer(mm.output[0], "Add")
        bias = add and next((i for i in add.input if i != mm.output[0]), None)
        if add is None or weights.get(bias) != (weights[t.input[0]][0],):
            continue
        if needed is not None and add.name not in needed:
            continue
        linears.setdefault((mm.input[0], _placement(add)), []).append((t, mm, add, bias))
    for (x, _), group in linears.items():
        group.sort(key=lambda members: order[members[2].name])
        for t, mm, add, bias in group:
            replaced |= {t.name, mm.name, add.name}
        if len(group) == 1:
            (t, mm, add, bias), = group
            fused[add.name] = _Fused("linear", lambda: lambda ctx, x, w, b: linear(x, w, b, onednn=onednn),
                                     (x, t.input[0], bias), (add.output[0],))
            continue
        inputs = [x]
        for t, _, _, bias in group:
            inputs += [t.input[0], bias]
        # The group runs where its first member ran: its input exists there and every
        # member's output is read only later.
        fused[group[0][2].name] = _Fused("siblings", lambda: functools.partial(_siblings, onednn=onednn),
                                         tuple(inputs), tuple(add.output[0] for _, _, add, _ in group))

    for e in graph.node:
        if e.op_type != "Einsum" or e.domain or e.input[1] not in weights or policy.grouped_matmul != "einsum":
            continue
        equation = _decode(node_attributes(e)["equation"]).replace(" ", "")
        if not _grouped_matmul_equation(equation):
            continue
        g, _, o = weights[e.input[1]]
        reshape = only_consumer(e.output[0], "Reshape")
        target = constants.get(reshape.input[1]) if reshape is not None else None
        rank = len(equation.split(",")[0])  # x (..., G, I)
        if target is None or [int(v) for v in target] != [0] * (rank - 2) + [g * o]:
            continue
        add = only_consumer(reshape.output[0], "Add")
        bias = add and next((i for i in add.input if i != reshape.output[0]), None)
        if add is None or weights.get(bias) != (g * o,):
            continue
        fused[add.name] = _Fused("grouped", lambda: lambda ctx, x, w, b: grouped_linear(x, w, b),
                                 (e.input[0], e.input[1], bias), (add.output[0],))
        replaced |= {e.name, reshape.name, add.name}

    for sigmoid in graph.node:
        if sigmoid.op_type != "Sigmoid" or sigmoid.domain:
            continue
        mul = only_consumer(sigmoid.output[0], "Mul")
        if mul is None:
            continue
        other = mul.input[1] if mul.input[0] == sigmoid.output[0] else mul.input[0]
        if other == sigmoid.input[0]:
            fused[mul.name] = _Fused("swish", lambda: lambda ctx, x: F.silu(x), (other,), (mul.output[0],))
            replaced |= {sigmoid.name, mul.name}
            continue
        split = made_by(sigmoid.input[0], "Split")
        if split is None or len(split.output) != 2 or list(split.output) != [other, sigmoid.input[0]]:
            continue
        sizes = constants.get(split.input[1]) if len(split.input) > 1 else None
        if sizes is None or len(sizes) != 2 or sizes[0] != sizes[1] or only_consumer(other, "Mul") is not mul:
            continue
        axis = node_attributes(split).get("axis", 0)
        fused[mul.name] = _Fused("glu", lambda axis=axis: lambda ctx, z: F.glu(z, axis), (split.input[0],),
                                 (mul.output[0],))
        replaced |= {split.name, sigmoid.name, mul.name}

    for out in graph.node:
        if out.op_type != "MatMul" or out.name in replaced:
            continue
        probs = out.input[0]
        dropout = made_by(probs, "Dropout")
        ratio = 0.0
        if dropout is not None:
            ratio = float(constants.get(dropout.input[1], 0.5)) if len(dropout.input) > 1 else 0.5
            probs = dropout.input[0]
        softmax = made_by(probs, "Softmax")
        add = softmax and made_by(softmax.input[0], "Add")
        mul = add and made_by(add.input[0], "Mul")
        scores = mul and made_by(mul.input[0], "MatMul")
        chain = [n for n in (scores, mul, add, softmax, dropout) if n is not None]
        if scores is None or mul.input[1] not in constants or constants[mul.input[1]].ndim != 0:
            continue
        if node_attributes(softmax).get("axis", -1) != -1:
            continue
        if any(only_consumer(n.output[0], c.op_type) is not c for n, c in zip(chain, chain[1:] + [out])):
            continue
        scale = float(constants[mul.input[1]])

        def attention(scale=scale, ratio=ratio, composed=policy.attention == "composed"):
            def run(ctx, q, k_t, mask, v):  # q, v (B, A, S, D); k_t (B, A, D, S); mask (B, 1, 1, S) or packed (B, 1, S, S)
                p = ratio if ctx.training else 0.0
                if composed:
                    probs = torch.softmax(torch.matmul(q, k_t) * scale + mask, dim=-1)
                    return torch.matmul(F.dropout(probs, p, training=ctx.training), v)
                return F.scaled_dot_product_attention(
                    q, k_t.transpose(-1, -2), v, attn_mask=mask.to(q.dtype), dropout_p=p, scale=scale
                )

            return run

        fused[out.name] = _Fused("attention", attention, (scores.input[0], scores.input[1], add.input[1], out.input[1]),
                                 (out.output[0],))
        replaced |= {n.name for n in chain} | {out.name}
    return fused, replaced


# --------------------------------------------------------------------- graph
@dataclass(frozen=True)
class _Step:
    fn: OpFn
    inputs: tuple[int, ...]  # environment slots (-1: absent optional input)
    outputs: tuple[int, ...]
    recompute: bool
    name: str
    release: tuple[int, ...] = ()  # slots no later step or output reads: dropped after this one


def _writable(array: np.ndarray) -> np.ndarray:
    return array if array.flags.writeable else array.copy()


def node_attributes(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _decode(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


class LoweredGraph(torch.nn.Module):
    """An ONNX graph as a torch module: forward(feeds) -> {output name: tensor}."""

    def __init__(
        self, model: onnx.ModelProto, *, recompute: bool = False, fuse: bool = True, outputs: Optional[Sequence[str]] = None,
        parameters: Optional[dict[str, torch.nn.Parameter]] = None, policy: Optional[KernelPolicy] = None,
        weights: Optional[Callable[[onnx.TensorProto], np.ndarray]] = None,
    ):
        """`outputs` (default: all) names the graph outputs to compute; nodes that none of
        them needs are not run (PopART computes only a run's anchors). `parameters` gives
        existing parameters to use for initializers of the same name (a weight that two
        pipeline stages of one process share stays one tensor). `policy` picks the kernels
        (default: `choose_kernels()` for fp32 on the CPU). `weights` reads an initializer's
        values (default: from the proto itself; `session.model_io.WeightReader` reads
        external data and declared weights lazily, one tensor at a time)."""
        super().__init__()
        graph = model.graph
        self.recompute = recompute
        self.policy = policy or choose_kernels()
        self.input_names = tuple(i.name for i in graph.input)
        all_outputs = tuple(o.name for o in graph.output)
        unknown = set(outputs or ()) - set(all_outputs)
        if unknown:
            raise ValueError(f"{sorted(unknown)} are not graph outputs; the graph has {list(all_outputs)}")
        self.output_names = tuple(outputs) if outputs is not None else all_outputs
        needed = needed_nodes(graph, self.output_names)
        self.parameter_names: tuple[str, ...] = tuple(t.name for t in graph.initializer)
        # ONNX names hold dots, which nn.Module attribute names may not.
        shared = parameters or {}
        read = weights or (lambda t: numpy_helper.to_array(t).copy())
        self._params = torch.nn.ParameterList(
            [shared[t.name] if t.name in shared else torch.nn.Parameter(torch.from_numpy(_writable(read(t))))
             for t in graph.initializer]
        )
        slots: dict[str, int] = {}

        def slot(name: str) -> int:
            return slots.setdefault(name, len(slots))

        for name in self.input_names + self.parameter_names:
            slot(name)
        constants: dict[str, np.ndarray] = {
            n.output[0]: numpy_helper.to_array(node_attributes(n)["value"])
            for n in graph.node
            if n.op_type == "Constant" and n.domain == ""
        }
        fused, replaced = _find_fusions(graph, constants, self.policy, needed) if fuse else ({}, set())
        const_tensors: list[torch.Tensor] = []
        const_slots: list[int] = []
        steps: list[_Step] = []
        for node in graph.node:
            attrs = {k: _decode(v) for k, v in node_attributes(node).items()}
            recomputed = attrs.get(RECOMPUTE, 0) == RecomputeType.RECOMPUTE
            if node.op_type == "Constant" and node.domain == "":
                const_tensors.append(torch.from_numpy(constants[node.output[0]].copy()))
                const_slots.append(slot(node.output[0]))
                continue
            if node.name not in needed:
                continue
            if node.name in replaced:
                if node.name in fused:
                    f = fused[node.name]
                    steps.append(_Step(f.factory(), tuple(slot(i) for i in f.inputs), tuple(slot(o) for o in f.outputs),
                                       recomputed, node.name))
                continue
            factory = _OPS.get((node.domain, node.op_type))
            if factory is None:
                raise NotImplementedError(f"no lowering for {node.domain or 'ai.onnx'}::{node.op_type} (node {node.name})")
            attrs["_op_type"], attrs["_policy"] = node.op_type, self.policy
            fn = factory(attrs, [constants.get(i) for i in node.input])
            steps.append(
                _Step(
                    fn,
                    tuple(slot(i) if i else -1 for i in node.input),
                    tuple(slot(o) for o in node.output),
                    recomputed,
                    node.name,
                )
            )
        for i, t in enumerate(const_tensors):
            self.register_buffer(f"_const{i}", t, persistent=False)
        self._const_slots = const_slots
        self._steps = _with_releases(steps, [slots[n] for n in self.output_names])
        self._num_slots = len(slots)
        self._output_slots = [slots[n] for n in self.output_names]
        self._input_slots = [slots[n] for n in self.input_names]
        self._ctx = _Context()
        self._segments = _segments(self._steps, self._output_slots)
        # The kernel policy's graph=compiled: this module's program through torch.compile
        # (its custom ops and oneDNN's GEMM stay whole: extern kernels to inductor).
        self._compiled = torch.compile(self._forward) if self.policy.graph == "compiled" else None

    # ---------------------------------------------------------------- weights
    def named_weights(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Parameters under their ONNX (HuggingFace-style) names."""
        return zip(self.parameter_names, self._params)

    def weights_state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.named_weights()}

    @torch.no_grad()
    def load_weights(self, state: dict[str, Any], strict: bool = True) -> list[str]:
        """Copy weights by name (e.g. a HuggingFace state dict); returns the names not found."""
        missing = []
        for name, p in self.named_weights():
            if name not in state:
                missing.append(name)
                continue
            value = state[name] if torch.is_tensor(state[name]) else torch.from_numpy(np.array(state[name]))
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"weight {name!r}: graph wants {tuple(p.shape)}, got {tuple(value.shape)}")
            p.copy_(value)
        if strict and missing:
            raise ValueError(f"{len(missing)} weights missing from the state dict, e.g. {missing[:3]}")
        return missing

    # ---------------------------------------------------------------- running
    def train(self, mode: bool = True) -> "LoweredGraph":
        self._ctx.training = mode
        return super().train(mode)

    def forward(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._compiled is not None and not torch.compiler.is_compiling():
            return self._compiled(feeds)
        return self._forward(feeds)

    def _forward(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        env: list[Any] = [None] * self._num_slots
        for name, s in zip(self.input_names, self._input_slots):
            if name not in feeds:
                raise ValueError(f"missing input {name!r}; the graph takes {list(self.input_names)}")
            env[s] = feeds[name]
        for i, p in enumerate(self._params):
            env[len(self.input_names) + i] = p
        for s, (_, t) in zip(self._const_slots, self.named_buffers()):
            env[s] = t
        if self.recompute and torch.is_grad_enabled():
            self._run_with_recompute(env)
        else:
            self._run(self._steps, env)
        return {n: env[s] for n, s in zip(self.output_names, self._output_slots)}

    def _run(self, steps: Sequence[_Step], env: list[Any]) -> None:
        ctx = self._ctx
        for step in steps:
            out = step.fn(ctx, *[env[i] if i >= 0 else None for i in step.inputs])
            if len(step.outputs) == 1:
                env[step.outputs[0]] = out
            else:
                for s, o in zip(step.outputs, out):
                    env[s] = o
            for s in step.release:
                env[s] = None

    def _run_with_recompute(self, env: list[Any]) -> None:
        for steps, needed, keep in self._segments:
            if needed is None:
                self._run(steps, env)
                continue

            def segment(*values, steps=steps, needed=needed, keep=keep):
                local: list[Any] = [None] * self._num_slots
                for s, v in zip(needed, values):
                    local[s] = v
                self._run(steps, local)
                return tuple(local[s] for s in keep)

            outs = checkpoint(segment, *[env[s] for s in needed], use_reentrant=False)
            for s, v in zip(keep, outs):
                env[s] = v


def _with_releases(steps: Sequence[_Step], output_slots: Sequence[int]) -> list[_Step]:
    """The steps, each naming the intermediate values it reads or writes for the last time.

    Dropping them from the environment as the graph runs keeps only live values (and
    what autograd saved for backward) in memory, as eager code does; the graph's outputs
    are kept.
    """
    last: dict[int, int] = {}
    for k, step in enumerate(steps):
        for s in step.outputs:
            last.setdefault(s, k)  # an output nothing reads dies where it is made
        for s in step.inputs:
            last[s] = k
    produced = {s for step in steps for s in step.outputs}
    release: list[list[int]] = [[] for _ in steps]
    for s, k in last.items():
        if s in produced and s not in output_slots:
            release[k].append(s)
    return [dataclasses.replace(step, release=tuple(r)) for step, r in zip(steps, release)]


def needed_nodes(graph: onnx.GraphProto, outputs: Sequence[str]) -> set[str]:
    """Names of the nodes the given outputs depend on."""
    producer = {o: n for n in graph.node for o in n.output}
    needed: set[str] = set()
    stack = list(outputs)
    while stack:
        node = producer.get(stack.pop())
        if node is not None and node.name not in needed:
            needed.add(node.name)
            stack.extend(i for i in node.input if i)
    return needed


def _segments(steps: Sequence[_Step], output_slots: Sequence[int]) -> list[tuple[list[_Step], Optional[list[int]], list[int]]]:
    """Split the nodes into maximal runs of equal recompute marking.

    A recomputed run gets the slots it reads from outside (kept for backward) and the
    slots it produces that later nodes or the outputs read; other runs get (steps, None, []).
    """
    runs: list[list[_Step]] = []
    for step in steps:
        if runs and step.recompute == runs[-1][-1].recompute:
            runs[-1].append(step)
        else:
            runs.append([step])
    segments = []
    read_after: set[int] = set(output_slots)
    for run in reversed(runs):
        produced = {s for step in run for s in step.outputs}
        if run[0].recompute:
            needed = sorted({i for step in run for i in step.inputs if i >= 0 and i not in produced})
            keep = sorted(produced & read_after)
            segments.append((run, needed, keep))
        else:
            segments.append((run, None, []))
        read_after |= {i for step in run for i in step.inputs if i >= 0}
    return segments[::-1]
