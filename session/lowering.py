"""Lowering of the builder's ONNX graphs to PyTorch: one small function per op type.

`LoweredGraph` is a `torch.nn.Module` holding the graph's initializers as parameters
(under their ONNX names) and its Constant nodes as buffers. Its forward runs the nodes
in order; inputs a node takes from a Constant (a Reshape target, Split sizes, axes) are
read once, when the graph is lowered, so the hot loop never syncs on a device value.

Dense layers and the attention core are fused while lowering (session/fusions.py), the
CPU's dense layers running the kernels of session/dense.py.

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

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch.utils.checkpoint import checkpoint

from builder import RECOMPUTE, RecomputeType, attribute, attributes
from custom_ops import DOMAIN
from custom_ops.schema import CUSTOM_OPS
from custom_ops.spec import CustomOp
from session.dense import COMPILED_CROSS_ENTROPY_MIN_COLUMNS, grouped_matmul_equation, softmax_cross_entropy
from session.fusions import find_fusions
from session.kernels import KernelPolicy, choose_kernels
from session.program import Step, recompute_runs, with_releases
from session.shadow import ShadowPlan

class WeightsMismatch(ValueError):
    """Weights that do not fit the graph (a shape, a missing name): the caller names their source."""


# The torch dtype of each ONNX element type the lowering runs (casts, graph inputs).
TORCH_DTYPE = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.BOOL: torch.bool,
}


# The compiled programs of the kernel policy's graph choice: torch.compile's mode for each.
_COMPILE_MODES = {"compiled": "default", "cudagraphs": "reduce-overhead"}


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
    dtype = TORCH_DTYPE[attrs["to"]]
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


@_op("Einsum")
def _einsum(attrs, consts):
    equation = attrs["equation"].replace(" ", "")
    if not (grouped_matmul_equation(equation) and attrs["_policy"].grouped_matmul == "block_diagonal"):
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
    compiled = attrs["_policy"].cross_entropy == "compiled"

    def loss(ctx, scores, labels, weights=None):
        # The loss is computed in fp32 whatever the precision of the logits.
        if (compiled and weights is None and reduction == "mean" and scores.dim() == 2
                and scores.shape[1] >= COMPILED_CROSS_ENTROPY_MIN_COLUMNS
                and scores.dtype in (torch.float32, torch.bfloat16) and not torch.compiler.is_compiling()):
            return softmax_cross_entropy(scores, labels, ignore)
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


def _cast_of_input(graph: onnx.GraphProto, node: onnx.NodeProto, i: int) -> bool:
    """Whether input `i` of `node` is a Cast of a graph input: a mask input made so is one the
    sessions check holds only 0 and 1 when it is fed (session/inference.py `input_specs`, the
    same rule), so its op need not check it again on the device, where reading the answer back
    stops the host (the GroupBERT convolution's mask, twice per layer and micro-batch)."""
    if len(node.input) <= i or not node.input[i]:
        return False
    inputs = {v.name for v in graph.input}
    return any(n.op_type == "Cast" and n.domain == "" and n.output[0] == node.input[i] and n.input[0] in inputs
               for n in graph.node)


def _custom(op: CustomOp) -> Factory:
    """A custom node's lowering (its spec, custom_ops/), with the kernel policy's choice for it."""
    def factory(attrs, consts):
        fn = op.lower(attrs, attrs["_policy"].choices()[op.kernel])
        return lambda ctx, *xs: fn(*xs)

    return factory


for _op_spec in CUSTOM_OPS.values():
    _op(_op_spec.op_type, domain=DOMAIN)(_custom(_op_spec))


# --------------------------------------------------------------------- graph
def _writable(array: np.ndarray) -> np.ndarray:
    return array if array.flags.writeable else array.copy()


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
            n.output[0]: numpy_helper.to_array(attribute(n, "value"))
            for n in graph.node
            if n.op_type == "Constant" and n.domain == ""
        }
        fused, replaced = find_fusions(graph, constants, self.policy, needed) if fuse else ({}, set())
        shadows = ShadowPlan(self.policy, self.parameter_names)  # weight_cast=shadow: session/shadow.py
        const_tensors: list[torch.Tensor] = []
        const_slots: list[int] = []
        steps: list[Step] = []
        for node in graph.node:
            attrs = attributes(node)
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
                    factory, inputs = shadows.route(f)
                    steps.append(Step(factory(), tuple(slot(i) for i in inputs), tuple(slot(o) for o in f.outputs),
                                       recomputed, node.name))
                continue
            factory = _OPS.get((node.domain, node.op_type))
            if factory is None:
                raise NotImplementedError(f"no lowering for {node.domain or 'ai.onnx'}::{node.op_type} (node {node.name})")
            attrs["_op_type"], attrs["_policy"] = node.op_type, self.policy
            spec = CUSTOM_OPS.get(node.op_type) if node.domain == DOMAIN else None
            if spec is not None and spec.mask_inputs:
                attrs["_fed_masks"] = tuple(i for i in spec.mask_inputs if _cast_of_input(graph, node, i))
            fn = factory(attrs, [constants.get(i) for i in node.input])
            steps.append(
                Step(
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
        self._steps = with_releases(steps, [slots[n] for n in self.output_names])
        self._num_slots = len(slots)
        self._output_slots = [slots[n] for n in self.output_names]
        self._input_slots = [slots[n] for n in self.input_names]
        self._ctx = _Context()
        self._shadow = shadows.shadow(list(self._params))  # a submodule: moves with the graph
        self._shadow_slots = [slots[name] for name in shadows.slots.values()]
        self._segments = recompute_runs(self._steps, self._output_slots)
        # The kernel policy's graph=compiled: this module's program through torch.compile
        # (its custom ops and oneDNN's GEMM stay whole: extern kernels to inductor);
        # graph=cudagraphs: the same, its kernels replayed as CUDA graphs (mode reduce-overhead).
        self._programs: dict[str, Callable] = {}
        self._mode = "eager"
        self.compile_program(self.policy.graph if self.policy.graph in _COMPILE_MODES else "eager")

    def compile_program(self, mode: str) -> None:
        """From now on run the program eagerly, through torch.compile ("compiled") or as CUDA
        graphs ("cudagraphs"): graph=measure times them (TrainingSession); each is made once."""
        if mode != "eager" and mode not in self._programs:
            self._programs[mode] = torch.compile(self._forward, mode=_COMPILE_MODES[mode])
        self._mode = mode

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
                raise WeightsMismatch(f"weight {name!r}: graph wants {tuple(p.shape)}, got {tuple(value.shape)}")
            p.copy_(value)
        if strict and missing:
            raise WeightsMismatch(f"{len(missing)} weights missing from the state dict, e.g. {missing[:3]}")
        return missing

    # ---------------------------------------------------------------- running
    def train(self, mode: bool = True) -> "LoweredGraph":
        self._ctx.training = mode
        return super().train(mode)

    def held_weights(self) -> ContextManager:
        """Around a training step's micro-batches, in which nothing writes the weights: the
        low-precision copy (weight_cast=shadow) is made by the first forward, read by the rest."""
        return self._shadow.held() if self._shadow is not None else contextlib.nullcontext()

    def forward(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._shadow is not None:
            self._shadow.prepare(self._params)
        if self._mode == "eager" or torch.compiler.is_compiling():
            return self._forward(feeds)
        if self._mode != "cudagraphs":
            return self._programs[self._mode](feeds)
        # A replay writes its outputs over the last one's: each call is a step of its own, and
        # what it returns is copied out (the losses and anchors, small; autograd sees the copy).
        torch.compiler.cudagraph_mark_step_begin()
        return {name: value.clone() for name, value in self._programs["cudagraphs"](feeds).items()}

    def _forward(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        env: list[Any] = [None] * self._num_slots
        for name, s in zip(self.input_names, self._input_slots):
            if name not in feeds:
                raise ValueError(f"missing input {name!r}; the graph takes {list(self.input_names)}")
            env[s] = feeds[name]
        for i, p in enumerate(self._params):
            env[len(self.input_names) + i] = p
        if self._shadow is not None:
            for s, v in zip(self._shadow_slots, self._shadow.inputs(list(self._params))):
                env[s] = v
        for s, (_, t) in zip(self._const_slots, self.named_buffers()):
            env[s] = t
        if self.recompute and torch.is_grad_enabled():
            self._run_with_recompute(env)
        else:
            self._run(self._steps, env)
        return {n: env[s] for n, s in zip(self.output_names, self._output_slots)}

    def _run(self, steps: Sequence[Step], env: list[Any]) -> None:
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
