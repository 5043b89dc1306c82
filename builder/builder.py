"""A generic ONNX graph builder in the manner of PopART's `popart.Builder`.

PopART counterpart → ours:
    addInputTensor / addInitializedInputTensor → `input` / `weight`
    aiOnnx.<op>(...), aiGraphcore / customOp   → `b.onnx.<Op>(...)`, `b.custom(domain).<Op>(...)`
    nameScope / virtualGraph / pipelineStage    → `name_scope` / `virtual_graph` / `pipeline_stage`
    recomputeOutputInBackwardPass              → `recompute`
    getModelProto                               → `model_proto`

Every node created inside a placement scope carries PopART's INT attributes
`__ipu_number`, `__pipeline_stage` and `__recompute_output_in_backward_pass`; the
`__` prefix keeps them legal for the ONNX checker and for onnxruntime.
"""
from __future__ import annotations

import contextlib
import enum
import hashlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

import numpy as np
import onnx
from onnx import helper, numpy_helper

from builder.shapes import RULES, Rule, ShapeError
from builder.tensor import FLOAT, Shape, Tensor, numpy_dtype, onnx_dtype

# The one ai.onnx opset every graph of the project uses (LayerNormalization needs 17,
# Gelu needs 20).
ONNX_OPSET = 20

IPU_NUMBER = "__ipu_number"
PIPELINE_STAGE = "__pipeline_stage"
RECOMPUTE = "__recompute_output_in_backward_pass"


class RecomputeType(enum.IntEnum):
    """PopART's RecomputeType values, as stored in `__recompute_output_in_backward_pass`."""

    UNDEFINED = 0
    CHECKPOINT = 1
    RECOMPUTE = 2


# An initializer maps (seed, shape) to an fp32 array.
Initializer = Callable[[int, Shape], np.ndarray]
Input = Union[Tensor, None, float, int, np.ndarray]


def normal(std: float) -> Initializer:
    """N(0, std²). Drawn with torch's generator: 3x faster than numpy's, which matters for
    the 515 M values of GroupBERT-large."""

    def init(seed: int, shape: Shape) -> np.ndarray:
        import torch

        generator = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=generator).mul_(std).numpy()

    return init


def zeros(seed: int, shape: Shape) -> np.ndarray:
    return np.zeros(shape, np.float32)


def ones(seed: int, shape: Shape) -> np.ndarray:
    return np.ones(shape, np.float32)


@dataclass(frozen=True)
class WeightSpec:
    name: str
    shape: tuple[int, ...]
    init: Initializer


class _Opset:
    """`b.onnx.MatMul(a, w)`: every attribute access is an op of one domain and version."""

    def __init__(self, builder: "Builder", domain: str, version: int, rules: dict[str, Rule]):
        self._builder, self.domain, self.version, self._rules = builder, domain, version, rules

    def __getattr__(self, op_type: str) -> Callable[..., Union[Tensor, tuple[Tensor, ...]]]:
        if op_type.startswith("_"):
            raise AttributeError(op_type)
        rule = self._rules.get(op_type)
        if rule is None:
            raise AttributeError(f"no shape rule for {self.domain or 'ai.onnx'}::{op_type}; add one to the opset's rules")

        def add(*inputs: Input, num_outputs: int = 1, **attrs):
            return self._builder._add_node(self, op_type, rule, inputs, attrs, num_outputs)

        return add


class Builder:
    """Builds one ONNX graph. Values are `Tensor`s whose shapes are checked as ops are added."""

    def __init__(self, seed: int = 0, opset: int = ONNX_OPSET):
        self.seed = seed
        self.onnx = _Opset(self, "", opset, RULES)
        self._custom: dict[str, _Opset] = {}
        self._nodes: list[onnx.NodeProto] = []
        self._inputs: list[Tensor] = []
        self._outputs: list[Tensor] = []
        self._weights: dict[str, WeightSpec] = {}
        self._weight_values: dict[str, np.ndarray] = {}
        self._tensors: dict[str, Tensor] = {}
        self._constants: dict[str, np.ndarray] = {}
        self._constant_cache: dict[tuple, Tensor] = {}
        self._scope: list[str] = []
        self._placement: dict[str, int] = {}
        self._counter = 0

    # ----------------------------------------------------------------- scopes
    @contextlib.contextmanager
    def name_scope(self, *parts: Union[str, int]) -> Iterator[None]:
        """Hierarchical names: weights join scopes with '.', nodes with '/' (as PopART)."""
        self._scope.extend(str(p) for p in parts)
        try:
            yield
        finally:
            del self._scope[len(self._scope) - len(parts) :]

    @contextlib.contextmanager
    def _attribute_scope(self, key: str, value: int) -> Iterator[None]:
        previous = self._placement.get(key)
        self._placement[key] = int(value)
        try:
            yield
        finally:
            if previous is None:
                del self._placement[key]
            else:
                self._placement[key] = previous

    def virtual_graph(self, index: int):
        return self._attribute_scope(IPU_NUMBER, index)

    def pipeline_stage(self, stage: int):
        return self._attribute_scope(PIPELINE_STAGE, stage)

    def recompute(self, mode: RecomputeType = RecomputeType.RECOMPUTE):
        return self._attribute_scope(RECOMPUTE, RecomputeType(mode))

    def scoped_name(self, name: str, sep: str = ".") -> str:
        return sep.join([*self._scope, name])

    # ------------------------------------------------------------ custom ops
    def custom(self, domain: str, version: int = 1, rules: Optional[dict[str, Rule]] = None) -> _Opset:
        """A handle for a custom domain; its rules give each op's output shapes."""
        if domain not in self._custom:
            if rules is None:
                raise ValueError(f"first use of custom domain {domain!r} must pass its shape rules")
            self._custom[domain] = _Opset(self, domain, version, rules)
        return self._custom[domain]

    # ---------------------------------------------------------- graph values
    def input(self, name: str, shape: Sequence[Union[int, str]], dtype: int = FLOAT) -> Tensor:
        """A graph input (PopART: addInputTensor). Symbolic dims are strings, e.g. "batch"."""
        t = self._new_tensor(name, tuple(shape), dtype)
        self._inputs.append(t)
        return t

    def weight(self, name: str, shape: Sequence[int], init: Initializer = zeros) -> Tensor:
        """A trainable initializer named by the enclosing name scopes (addInitializedInputTensor).

        Values are drawn lazily, from a generator seeded by (builder seed, full name), so
        a weight's initial value does not depend on what was built before it.
        """
        full = self.scoped_name(name)
        if full in self._weights:
            raise ValueError(f"weight {full!r} is defined twice")
        shape = tuple(int(d) for d in shape)
        self._weights[full] = WeightSpec(full, shape, init)
        return self._new_tensor(full, shape, FLOAT)

    def constant(self, value: Union[np.ndarray, float, int], dtype: Optional[int] = None) -> Tensor:
        """A Constant node (not trainable); identical constants are shared."""
        array = np.asarray(value, dtype=None if dtype is None else numpy_dtype(dtype))
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constant_cache:
            self._counter += 1
            name = f"const:{self._counter}"
            node = helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(array, name))
            self._nodes.append(node)
            self._constants[name] = array
            self._constant_cache[key] = self._new_tensor(name, array.shape, onnx_dtype(array.dtype))
        return self._constant_cache[key]

    def output(self, tensor: Tensor, name: Optional[str] = None) -> Tensor:
        """Mark a graph output, renamed through an Identity node when `name` is given."""
        if name is not None and name != tensor.name:
            self._counter += 1
            node = helper.make_node("Identity", [tensor.name], [name], name=f"{name}/Identity:{self._counter}")
            node.attribute.extend(helper.make_attribute(k, v) for k, v in self._placement.items())
            self._nodes.append(node)
            tensor = self._new_tensor(name, tensor.shape, tensor.dtype)
        self._outputs.append(tensor)
        return tensor

    def value_of(self, tensor: Tensor) -> np.ndarray:
        """The build-time value of a constant (e.g. a Reshape target)."""
        if tensor.name not in self._constants:
            raise ShapeError(f"{tensor.describe()} must be a constant known when the graph is built")
        return self._constants[tensor.name]

    # ------------------------------------------------------------ internals
    def _new_tensor(self, name: str, shape: Shape, dtype: int) -> Tensor:
        if name in self._tensors:
            raise ValueError(f"tensor name {name!r} is already used")
        t = Tensor(name, shape, dtype, self)
        self._tensors[name] = t
        return t

    def _as_tensor(self, value: Input, like: Optional[Tensor]) -> Optional[Tensor]:
        if value is None or isinstance(value, Tensor):
            return value
        if isinstance(value, np.ndarray):
            return self.constant(value)
        return self.constant(value, like.dtype if like is not None else FLOAT)

    def _add_node(self, opset: _Opset, op_type: str, rule: Rule, inputs: Sequence[Input], attrs: dict, num_outputs: int):
        like = next((t for t in inputs if isinstance(t, Tensor)), None)
        tensors = [self._as_tensor(v, like) for v in inputs]
        for t in tensors:
            if t is not None and t.builder is not self:
                raise ValueError(f"{t.describe()} belongs to another builder")
        self._counter += 1
        node_name = self.scoped_name(f"{op_type}:{self._counter}", sep="/")
        try:
            results = rule([t for t in tensors], attrs, self.value_of)
        except ShapeError as e:
            raise ShapeError(f"{node_name}: {e}") from None
        if op_type == "Split":
            num_outputs = len(results)
        names = [node_name if i == 0 else f"{node_name}.{i}" for i in range(num_outputs)]
        node = helper.make_node(
            op_type, ["" if t is None else t.name for t in tensors], names, name=node_name, domain=opset.domain, **attrs
        )
        node.attribute.extend(helper.make_attribute(k, v) for k, v in self._placement.items())
        self._nodes.append(node)
        outs = tuple(self._new_tensor(n, shape, dtype) for n, (shape, dtype) in zip(names, results))
        return outs[0] if num_outputs == 1 else outs

    # -------------------------------------------------------------- results
    @property
    def nodes(self) -> tuple[onnx.NodeProto, ...]:
        return tuple(self._nodes)

    def tensor(self, name: str) -> Tensor:
        return self._tensors[name]

    @property
    def weight_specs(self) -> dict[str, WeightSpec]:
        return dict(self._weights)

    def parameter_count(self) -> int:
        return sum(int(np.prod(s.shape)) for s in self._weights.values())

    def initial_value(self, name: str) -> np.ndarray:
        """The weight's initial value: the one set, or drawn from its seed (not kept: drawing
        again gives the same values, and a process that needs some weights never holds all)."""
        if name in self._weight_values:
            return self._weight_values[name]
        spec = self._weights[name]
        digest = hashlib.blake2b(f"{self.seed}:{name}".encode(), digest_size=7).digest()
        value = np.ascontiguousarray(spec.init(int.from_bytes(digest, "little"), spec.shape), dtype=np.float32)
        assert value.shape == spec.shape, (name, value.shape, spec.shape)
        return value

    def set_initial_values(self, values: dict[str, np.ndarray]) -> None:
        """Replace initial values by name (e.g. weights imported from a checkpoint)."""
        for name, value in values.items():
            spec = self._weights.get(name)
            if spec is None:
                raise ValueError(f"no weight named {name!r} in the graph")
            if tuple(value.shape) != spec.shape:
                raise ValueError(f"weight {name!r}: graph wants {spec.shape}, got {tuple(value.shape)}")
            self._weight_values[name] = np.ascontiguousarray(value, dtype=np.float32)

    def model_proto(self, with_weights: bool = True, declare_weights: bool = False) -> onnx.ModelProto:
        """The ONNX model (PopART: getModelProto). Weights as initializers; without them,
        `declare_weights` still lists each initializer's name, type and dims (no values),
        for a reader that draws `initial_value` only for the weights it needs."""
        def info(t: Tensor) -> onnx.ValueInfoProto:
            return helper.make_tensor_value_info(t.name, t.dtype, list(t.shape))

        io = {t.name for t in self._inputs} | {t.name for t in self._outputs}
        value_info = [info(t) for n, t in self._tensors.items() if n not in io and n not in self._weights]
        graph = helper.make_graph(
            self._nodes,
            "groupbert",
            [info(t) for t in self._inputs],
            [info(t) for t in self._outputs],
            value_info=value_info,
        )
        opsets = [helper.make_opsetid("", self.onnx.version)]
        opsets += [helper.make_opsetid(o.domain, o.version) for o in self._custom.values()]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="groupbert", ir_version=10)
        if declare_weights and not with_weights:
            for name, spec in self._weights.items():
                tensor = model.graph.initializer.add()
                tensor.name, tensor.data_type = name, FLOAT
                tensor.dims.extend(spec.shape)
        if with_weights:
            # Filled in place: make_graph/make_model would copy every initializer again,
            # which for GroupBERT-large is 2 GB per copy.
            for name in self._weights:
                value = self.initial_value(name)
                tensor = model.graph.initializer.add()
                tensor.name = name
                tensor.data_type = FLOAT
                tensor.dims.extend(value.shape)
                tensor.raw_data = value.tobytes()
        return model
