"""Shape and dtype inference, one small rule per op type, run when each node is created.

A rule gets the input tensors, the node attributes and `value_of` (the build-time value
of a constant input, e.g. the target of a Reshape) and returns one (shape, dtype) per
output. A rule raises `ShapeError`; the builder re-raises it naming the node, so the
error points at the Python line that added the bad op.
"""
from __future__ import annotations

import math
import string
from typing import Callable, Optional, Sequence

import numpy as np

from builder.tensor import BOOL, FLOAT, INT64, Dim, Shape, Tensor

ValueOf = Callable[[Tensor], np.ndarray]
Rule = Callable[[Sequence[Optional[Tensor]], dict, ValueOf], list[tuple[Shape, int]]]


class ShapeError(ValueError):
    pass


def _shape_str(shape: Shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def broadcast(*shapes: Shape) -> Shape:
    """numpy broadcasting, with symbolic dims equal only to themselves (or 1)."""
    rank = max(len(s) for s in shapes)
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in shapes]
    out: list[Dim] = []
    for dims in zip(*padded):
        sizes = {d for d in dims if d != 1}
        if len(sizes) > 1:
            raise ShapeError("cannot broadcast " + " and ".join(_shape_str(s) for s in shapes))
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _same_dtype(inputs: Sequence[Tensor], op: str) -> int:
    dtypes = {t.dtype for t in inputs}
    if len(dtypes) != 1:
        raise ShapeError(f"{op} needs one element type, got " + ", ".join(t.describe() for t in inputs))
    return dtypes.pop()


def _axis(axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise ShapeError(f"axis {axis} out of range for rank {rank}")
    return axis % rank


def _elementwise(op: str, out_dtype: Optional[int] = None) -> Rule:
    def rule(inputs, attrs, value_of):
        dtype = _same_dtype(inputs, op)
        return [(broadcast(*(t.shape for t in inputs)), dtype if out_dtype is None else out_dtype)]

    return rule


def _unary(inputs, attrs, value_of):
    return [(inputs[0].shape, inputs[0].dtype)]


def _where(inputs, attrs, value_of):
    cond, a, b = inputs
    if cond.dtype != BOOL:
        raise ShapeError(f"Where condition must be bool, got {cond.describe()}")
    return [(broadcast(cond.shape, a.shape, b.shape), _same_dtype([a, b], "Where"))]


def _cast(inputs, attrs, value_of):
    return [(inputs[0].shape, attrs["to"])]


def _dropout(inputs, attrs, value_of):
    return [(inputs[0].shape, inputs[0].dtype), (inputs[0].shape, BOOL)]


def _matmul(inputs, attrs, value_of):
    a, b = inputs
    dtype = _same_dtype(inputs, "MatMul")
    if a.rank < 2 or b.rank < 2:
        raise ShapeError(f"MatMul needs rank >= 2, got {a.describe()} and {b.describe()}")
    if a.shape[-1] != b.shape[-2]:
        raise ShapeError(
            f"MatMul inner dimensions differ: {a.describe()} @ {b.describe()} "
            f"({a.shape[-1]} != {b.shape[-2]})"
        )
    try:
        batch = broadcast(a.shape[:-2], b.shape[:-2])
    except ShapeError as e:
        raise ShapeError(f"MatMul batch dimensions of {a.describe()} and {b.describe()}: {e}") from None
    return [(batch + (a.shape[-2], b.shape[-1]), dtype)]


def _transpose(inputs, attrs, value_of):
    x = inputs[0]
    perm = attrs.get("perm", list(reversed(range(x.rank))))
    if sorted(perm) != list(range(x.rank)):
        raise ShapeError(f"Transpose perm {perm} is not a permutation of the {x.rank} axes of {x.describe()}")
    return [(tuple(x.shape[p] for p in perm), x.dtype)]


def _reshape(inputs, attrs, value_of):
    x, target = inputs
    spec = [int(v) for v in value_of(target)]
    out: list[Dim] = [x.shape[i] if d == 0 else d for i, d in enumerate(spec)]
    if out.count(-1) > 1:
        raise ShapeError(f"Reshape target {spec} has more than one -1")
    known_in = math.prod(d for d in x.shape if isinstance(d, int))
    known_out = math.prod(d for d in out if isinstance(d, int) and d != -1)
    sym_in = sorted(d for d in x.shape if isinstance(d, str))
    sym_out = sorted(d for d in out if isinstance(d, str))
    leftover = list(sym_in)
    for d in sym_out:
        if d not in leftover:
            raise ShapeError(f"Reshape of {x.describe()} to {spec}: symbolic dim {d!r} is not in the input")
        leftover.remove(d)
    if leftover and -1 not in out:
        raise ShapeError(f"Reshape of {x.describe()} to {spec} drops the symbolic dims {leftover}")
    if -1 in out:
        if known_in % known_out:
            raise ShapeError(f"cannot reshape {x.describe()} to {spec}")
        size = known_in // known_out
        # A -1 that absorbs symbolic dims becomes their product, e.g. "batch*20".
        out[out.index(-1)] = "*".join(leftover + ([str(size)] if size != 1 else [])) if leftover else size
    elif known_in != known_out:
        raise ShapeError(f"cannot reshape {x.describe()} ({known_in} elements) to {spec} ({known_out})")
    return [(tuple(out), x.dtype)]


def _unsqueeze(inputs, attrs, value_of):
    x, axes_t = inputs
    rank = x.rank + len(value_of(axes_t))
    axes = sorted(_axis(int(a), rank) for a in value_of(axes_t))
    dims = iter(x.shape)
    return [(tuple(1 if i in axes else next(dims) for i in range(rank)), x.dtype)]


def _squeeze(inputs, attrs, value_of):
    x, axes_t = inputs
    axes = {_axis(int(a), x.rank) for a in value_of(axes_t)}
    for a in axes:
        if x.shape[a] != 1:
            raise ShapeError(f"Squeeze axis {a} of {x.describe()} is not 1")
    return [(tuple(d for i, d in enumerate(x.shape) if i not in axes), x.dtype)]


def _concat(inputs, attrs, value_of):
    dtype = _same_dtype(inputs, "Concat")
    axis = _axis(attrs["axis"], inputs[0].rank)
    for t in inputs[1:]:
        if t.rank != inputs[0].rank or any(
            a != b for i, (a, b) in enumerate(zip(t.shape, inputs[0].shape)) if i != axis
        ):
            raise ShapeError("Concat shapes differ off the axis: " + ", ".join(x.describe() for x in inputs))
    sizes = [t.shape[axis] for t in inputs]
    size = sum(sizes) if all(isinstance(s, int) for s in sizes) else "?"
    shape = list(inputs[0].shape)
    shape[axis] = size
    return [(tuple(shape), dtype)]


def _split(inputs, attrs, value_of):
    x = inputs[0]
    axis = _axis(attrs.get("axis", 0), x.rank)
    sizes = [int(s) for s in value_of(inputs[1])]
    if sum(sizes) != x.shape[axis]:
        raise ShapeError(f"Split sizes {sizes} do not add up to axis {axis} of {x.describe()}")
    return [(x.shape[:axis] + (s,) + x.shape[axis + 1 :], x.dtype) for s in sizes]


def _gather(inputs, attrs, value_of):
    data, idx = inputs
    if idx.dtype not in (INT64, 6):
        raise ShapeError(f"Gather indices must be int32/int64, got {idx.describe()}")
    axis = _axis(attrs.get("axis", 0), data.rank)
    return [(data.shape[:axis] + idx.shape + data.shape[axis + 1 :], data.dtype)]


def _gather_nd(inputs, attrs, value_of):
    data, idx = inputs
    b = attrs.get("batch_dims", 0)
    if data.shape[:b] != idx.shape[:b]:
        raise ShapeError(f"GatherND batch dims of {data.describe()} and {idx.describe()} differ")
    return [(idx.shape[:-1] + data.shape[b + idx.shape[-1] :], data.dtype)]


def _layer_norm(inputs, attrs, value_of):
    x, scale = inputs[0], inputs[1]
    axis = _axis(attrs.get("axis", -1), x.rank)
    if scale.shape != x.shape[axis:]:
        raise ShapeError(f"LayerNormalization scale {scale.describe()} does not match {x.describe()} from axis {axis}")
    return [(x.shape, x.dtype)]


def _reduce(inputs, attrs, value_of):
    x = inputs[0]
    axes = (
        {_axis(int(a), x.rank) for a in value_of(inputs[1])}
        if len(inputs) > 1 and inputs[1] is not None
        else set(range(x.rank))
    )
    keep = attrs.get("keepdims", 1)
    shape = tuple((1 if i in axes else d) for i, d in enumerate(x.shape) if keep or i not in axes)
    return [(shape, x.dtype)]


def _einsum(inputs, attrs, value_of):
    eq = attrs["equation"].replace(" ", "")
    lhs, rhs = eq.split("->")
    terms = lhs.split(",")
    if len(terms) != len(inputs):
        raise ShapeError(f"Einsum {eq!r} names {len(terms)} operands, got {len(inputs)}")
    sizes: dict[str, Dim] = {}
    for term, t in zip(terms, inputs):
        if len(term) != t.rank or any(c not in string.ascii_letters for c in term):
            raise ShapeError(f"Einsum term {term!r} does not fit {t.describe()}")
        for c, d in zip(term, t.shape):
            if sizes.setdefault(c, d) != d:
                raise ShapeError(f"Einsum {eq!r}: index {c!r} is {sizes[c]} and {d} in " + ", ".join(x.describe() for x in inputs))
    return [(tuple(sizes[c] for c in rhs), _same_dtype(inputs, "Einsum"))]


def _softmax_cross_entropy(inputs, attrs, value_of):
    scores, labels = inputs[0], inputs[1]
    if scores.shape[:1] + scores.shape[2:] != labels.shape:
        raise ShapeError(f"SoftmaxCrossEntropyLoss scores {scores.describe()} do not fit labels {labels.describe()}")
    if attrs.get("reduction", "mean") == "none":
        return [(labels.shape, scores.dtype), (scores.shape, scores.dtype)]
    return [((), scores.dtype), (scores.shape, scores.dtype)]


def _constant(inputs, attrs, value_of):
    value = attrs["value"]
    from onnx import numpy_helper

    array = numpy_helper.to_array(value)
    return [(tuple(array.shape), value.data_type)]


def _argmax(inputs, attrs, value_of):
    x = inputs[0]
    axis = _axis(attrs.get("axis", 0), x.rank)
    keep = attrs.get("keepdims", 1)
    shape = tuple((1 if i == axis else d) for i, d in enumerate(x.shape) if keep or i != axis)
    return [(shape, INT64)]


RULES: dict[str, Rule] = {
    **{op: _elementwise(op) for op in ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min")},
    **{op: _elementwise(op, BOOL) for op in ("Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual")},
    "And": _elementwise("And", BOOL),
    **{
        op: _unary
        for op in ("Relu", "Sigmoid", "Tanh", "Gelu", "Erf", "Sqrt", "Neg", "Exp", "Log", "Softmax", "LogSoftmax", "Identity", "Not", "Abs")
    },
    "Where": _where,
    "Cast": _cast,
    "Dropout": _dropout,
    "MatMul": _matmul,
    "Transpose": _transpose,
    "Reshape": _reshape,
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Concat": _concat,
    "Split": _split,
    "Gather": _gather,
    "GatherND": _gather_nd,
    "LayerNormalization": _layer_norm,
    "ReduceMean": _reduce,
    "ReduceSum": _reduce,
    "Einsum": _einsum,
    "SoftmaxCrossEntropyLoss": _softmax_cross_entropy,
    "Constant": _constant,
    "ArgMax": _argmax,
}

__all__ = ["RULES", "Rule", "ShapeError", "broadcast", "FLOAT"]
