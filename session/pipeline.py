"""Pipelining of the graph's stages, PopART's `enablePipelining` on torch.distributed.

The graph is cut at its `__pipeline_stage` annotations, and only there: stage s is the
set of nodes marked s, and it runs in the process of its virtual graph
(`__ipu_number`). As in PopART's BERT, a virtual graph may hold several stages: the
heads return to virtual graph 0 in a stage of their own after the last layers, so the
word embedding that the MLM head shares with the first stage stays one tensor in one
process, and its two gradients add up in place before the update.

    stages     0 (embeddings, layers 0-3)   1 (layers 4-7)   2 (heads: MLM, NSP, loss)
    process    virtual graph 0              virtual graph 1  virtual graph 0

A tensor made in one stage and read in a later one travels point to point when the
stages sit in different processes and is handed over in memory otherwise; its
gradient travels back the same way. Each stage is a `LoweredGraph` of its own
sub-model, so fusions, recompute marks and torch.compile work per stage as on the
whole graph.

Schedule: the micro-batches of one step (the gradient-accumulation count) flow
through the stages in a one-forward-one-backward order: stage k of K starts with
min(K-1-k, M) forwards, then alternates a forward and a backward, then drains its
backwards, so at most K-k micro-batches' activations are alive in a stage. The
order each process runs is found once by simulating all processes in unit-time ticks
(a process runs one action a tick; an action waits for those it needs, done at
earlier ticks). Example, 3 stages on 2 processes (2 layer groups, heads on virtual
graph 0), 4 micro-batches (Fs.m / Bs.m: forward / backward of stage s, micro-batch m):

    vg 0:  F0.0 F0.1 F2.0 B2.0 F2.1 B2.1 F0.2 B0.0 F2.2 B2.2 F0.3 B0.1 F2.3 B0.2 B2.3 B0.3
    vg 1:  F1.0 F1.1 B1.0 F1.2 B1.1 F1.3 B1.2 B1.3

Messages between processes: session/p2p.py.
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import onnx
import torch
import torch.distributed as dist
from onnx import helper

from builder import IPU_NUMBER, PIPELINE_STAGE, attribute
from session.lowering import TORCH_DTYPE, needed_nodes
from session.p2p import Links, Round, round_operations

if TYPE_CHECKING:
    from session.executor import GradientHooks

__all__ = ["Action", "PipelinePlan", "PipelineRunner", "Schedule", "one_forward_one_backward"]


@dataclass(frozen=True)
class Action:
    forward: bool
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{'F' if self.forward else 'B'}{self.stage}.{self.microbatch}"


@dataclass
class StageInfo:
    index: int
    virtual_graph: int
    nodes: list[str] = field(default_factory=list)
    graph_inputs: list[str] = field(default_factory=list)  # inputs of the whole graph it reads
    received: list[tuple[str, int]] = field(default_factory=list)  # (tensor, producing stage)
    sent: dict[str, list[int]] = field(default_factory=dict)  # tensor → stages that read it
    graph_outputs: list[str] = field(default_factory=list)  # requested outputs it computes
    weights: list[str] = field(default_factory=list)

    @property
    def outputs(self) -> list[str]:
        return list(dict.fromkeys([*self.sent, *self.graph_outputs]))


@dataclass(frozen=True)
class TensorSpec:
    """What travels on an edge: the graph's declared dims (ints and symbols) and element type."""

    dims: tuple[Any, ...]
    dtype: torch.dtype
    requires_grad: bool  # a gradient comes back for it

    def shape(self, sizes: dict[str, int]) -> tuple[int, ...]:
        return tuple(sizes[d] if isinstance(d, str) else d for d in self.dims)


def _declared_types(graph: onnx.GraphProto) -> dict[str, tuple[tuple[Any, ...], int]]:
    """(dims, element type) of every value the graph declares: inputs, outputs, value_info."""
    declared = {}
    for info in list(graph.input) + list(graph.output) + list(graph.value_info):
        t = info.type.tensor_type
        if t.HasField("shape"):
            dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim)
            declared[info.name] = (dims, t.elem_type)
    return declared


def _needs_gradient(graph: onnx.GraphProto, declared: dict) -> set[str]:
    """Floating-point values that depend on a weight through floating-point values: those
    autograd gives a gradient (integer and boolean results, and what only they feed, get none)."""
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
    graded = {t.name for t in graph.initializer if t.data_type in floats}
    for node in graph.node:
        if any(i in graded for i in node.input):
            graded.update(o for o in node.output if declared.get(o, (None, onnx.TensorProto.FLOAT))[1] in floats)
    return graded


class PipelinePlan:
    """The stages of `model` needed for `outputs`, their processes and the tensors between them."""

    def __init__(self, model: onnx.ModelProto, outputs: Sequence[str]):
        graph = model.graph
        weights = {t.name for t in graph.initializer}
        graph_inputs = {i.name for i in graph.input}
        constants = {n.output[0] for n in graph.node if n.op_type == "Constant" and n.domain == ""}
        seen = needed_nodes(graph, outputs)
        needed = [n for n in graph.node if n.name in seen and n.output[0] not in constants]

        stage_of_tensor: dict[str, int] = {}
        self.stages: dict[int, StageInfo] = {}
        for node in needed:
            stage, vgraph = attribute(node, PIPELINE_STAGE), attribute(node, IPU_NUMBER)
            if stage is None or vgraph is None:
                raise ValueError(
                    f"node {node.name} ({node.op_type}) has no {PIPELINE_STAGE}/{IPU_NUMBER} attribute: pipelining "
                    "needs every node placed (the model's placement scopes do this)")
            info = self.stages.setdefault(stage, StageInfo(stage, vgraph))
            if info.virtual_graph != vgraph:
                raise ValueError(f"pipeline stage {stage} has nodes on virtual graphs {info.virtual_graph} and "
                                 f"{vgraph} (node {node.name}); a stage runs in one process")
            info.nodes.append(node.name)
            for name in node.input:
                if not name or name in constants:
                    continue
                if name in weights:
                    if name not in info.weights:
                        info.weights.append(name)
                elif name in graph_inputs:
                    if name not in info.graph_inputs:
                        info.graph_inputs.append(name)
                else:
                    source = stage_of_tensor[name]
                    if source > stage:
                        raise ValueError(f"node {node.name} in pipeline stage {stage} reads {name!r} from the later "
                                         f"stage {source}; stages must follow the data flow")
                    if source != stage and (name, source) not in info.received:
                        info.received.append((name, source))
                        self.stages[source].sent.setdefault(name, []).append(stage)
            for name in node.output:
                stage_of_tensor[name] = stage
        for name in outputs:
            if name in stage_of_tensor:
                self.stages[stage_of_tensor[name]].graph_outputs.append(name)
        self.stages = dict(sorted(self.stages.items()))
        owner: dict[str, int] = {}
        for info in self.stages.values():
            for w in info.weights:
                if owner.setdefault(w, info.virtual_graph) != info.virtual_graph:
                    raise ValueError(
                        f"weight {w!r} is used on virtual graphs {owner[w]} and {info.virtual_graph}; a weight shared "
                        "by stages must stay in one process (place its users on one virtual graph, as PopART's BERT "
                        "puts the tied MLM projection back on IPU 0)")
        vgraphs = sorted({s.virtual_graph for s in self.stages.values()})
        if vgraphs != list(range(len(vgraphs))):
            missing = sorted(set(range(max(vgraphs) + 1)) - set(vgraphs))
            raise ValueError(f"virtual graphs {missing} hold no node of the pipeline (a stage with no layers?); "
                             f"every virtual graph 0..{max(vgraphs)} needs one")
        self.virtual_graphs = len(vgraphs)
        # Every (tensor, consumer stage) edge gets a number: its place in a round's order.
        self.edges = {(name, c): k for k, (name, c) in enumerate(
            (name, c) for info in self.stages.values() for name, consumers in info.sent.items() for c in consumers)}
        self.specs = self._tensor_specs(graph)
        # Where each symbolic dimension of the edges is read from: (graph input, axis).
        self.symbols: dict[str, tuple[str, int]] = {}
        for i in graph.input:
            dims = _declared_types(graph).get(i.name, ((), 0))[0]
            for axis, d in enumerate(dims):
                if isinstance(d, str):
                    self.symbols.setdefault(d, (i.name, axis))
        unknown = sorted({d for s in self.specs.values() for d in s.dims if isinstance(d, str)} - set(self.symbols))
        if unknown:
            raise ValueError(f"pipeline edges have dimensions {unknown} that no graph input has: their size cannot "
                             "be known before the tensors are computed")

    def _tensor_specs(self, graph: onnx.GraphProto) -> dict[str, TensorSpec]:
        declared = _declared_types(graph)
        graded = _needs_gradient(graph, declared)
        specs = {}
        for name, _ in self.edges:
            if name not in declared or any(d is None for d in declared[name][0]):
                raise ValueError(f"pipelining needs the shape of {name!r}, which crosses stages, but the graph does "
                                 "not declare it (value_info)")
            dims, elem = declared[name]
            if elem not in TORCH_DTYPE:
                raise ValueError(f"{name!r} crosses stages with ONNX element type {elem}, which cannot be sent")
            specs[name] = TensorSpec(dims, TORCH_DTYPE[elem], name in graded)
        return specs

    def local_stages(self, virtual_graph: int) -> list[StageInfo]:
        return [s for s in self.stages.values() if s.virtual_graph == virtual_graph]

    def stage_model(self, model: onnx.ModelProto, index: int) -> onnx.ModelProto:
        """Stage `index` of `model` (the one planned) as a model of its own: its nodes (and the
        Constants they read), its weights, the graph inputs and received tensors as inputs,
        what it sends and computes as outputs."""
        info = self.stages[index]
        graph = model.graph
        names = set(info.nodes)
        nodes = [n for n in graph.node if n.name in names]
        read = {i for n in nodes for i in n.input}
        constants = [n for n in graph.node if n.op_type == "Constant" and n.domain == "" and n.output[0] in read]
        value = lambda name: helper.make_empty_tensor_value_info(name)  # noqa: E731 (names are all lowering reads)
        sub = onnx.ModelProto(ir_version=model.ir_version)
        sub.opset_import.extend(model.opset_import)
        sub.graph.name = f"{graph.name}.stage{index}"
        sub.graph.node.extend(constants + nodes)
        sub.graph.input.extend([value(n) for n in info.graph_inputs + [t for t, _ in info.received]])
        sub.graph.output.extend([value(n) for n in info.outputs])
        keep = set(info.weights)
        sub.graph.initializer.extend(t for t in graph.initializer if t.name in keep)
        return sub


# ------------------------------------------------------------------ schedule
@dataclass(frozen=True)
class Schedule:
    """Each virtual graph's actions in order, and the tick at which each runs."""

    actions: dict[int, list[Action]]
    ticks: dict[Action, int]

    @property
    def length(self) -> int:
        return 1 + max(self.ticks.values())


def one_forward_one_backward(stages: dict[int, StageInfo], microbatches: int, forward_only: bool = False) -> Schedule:
    """The 1F1B schedule of every virtual graph (see the module docstring); with
    `forward_only`, each stage's forwards alone, in order (evaluation)."""
    order = list(stages)
    count = len(order)
    producers = {s: {p for _, p in stages[s].received} for s in order}
    consumers = {s: {c for cs in stages[s].sent.values() for c in cs} for s in order}
    queues: dict[int, list[Action]] = {}
    for k, s in enumerate(order):
        warmup = min(count - 1 - k, microbatches)
        seq = [Action(True, s, m) for m in range(warmup)]
        for m in range(microbatches - warmup):
            seq += [Action(True, s, warmup + m), Action(False, s, m)]
        seq += [Action(False, s, m) for m in range(microbatches - warmup, microbatches)]
        queues[s] = [a for a in seq if a.forward] if forward_only else seq
    done: dict[Action, int] = {}
    plans: dict[int, list[Action]] = defaultdict(list)
    heads = {s: 0 for s in order}
    vgraphs = sorted({stages[s].virtual_graph for s in order})
    t = 0
    while len(done) < sum(len(q) for q in queues.values()):
        progressed = False
        for v in vgraphs:
            ready = []
            for s in order:
                if stages[s].virtual_graph != v or heads[s] >= len(queues[s]):
                    continue
                a = queues[s][heads[s]]
                needs = ([Action(True, p, a.microbatch) for p in producers[s]] if a.forward else
                         [Action(True, s, a.microbatch)] + [Action(False, c, a.microbatch) for c in consumers[s]])
                if all(done.get(n, t) < t for n in needs):
                    ready.append(a)
            if ready:  # backwards first (they free memory), then the oldest micro-batch
                a = min(ready, key=lambda x: (x.forward, x.microbatch, -x.stage if not x.forward else x.stage))
                done[a] = t
                heads[a.stage] += 1
                plans[v].append(a)
                progressed = True
        if not progressed:  # nothing new completes from here on: a bug, not a user error
            pending = [str(queues[s][heads[s]]) for s in order if heads[s] < len(queues[s])]
            raise RuntimeError(f"pipeline schedule deadlocks at {pending}")
        t += 1
    return Schedule(dict(plans), done)


# -------------------------------------------------------------------- runner
class _Step:
    """What one step's actions hand each other: same-process tensors, posted receives,
    tensors to send in this tick's round, and each forward's inputs and outputs kept for
    its backward."""

    def __init__(self, micro: dict[str, list[torch.Tensor]]):
        self.micro = micro
        self.local: dict[tuple[int, bool, int], torch.Tensor] = {}
        self.arriving: dict[tuple[int, bool, int], tuple[Round, torch.Tensor, Any]] = {}
        self.outgoing: dict[tuple[int, bool, int], torch.Tensor] = {}
        self.stash: dict[tuple[int, int], tuple[dict, dict]] = {}


class PipelineRunner:
    """Runs this process's stages of one step: forwards and backwards, messages between them.

    `graphs` maps this process's stage indices to their lowered graphs; `rank_of_stage`
    gives the global rank holding each stage of this replica; `stage_group` is the
    process group of this replica's stages and `source_rank` the one of them that reads
    the data and broadcasts the sizes of the step's symbolic dimensions. With
    `forward_only` the schedule holds forwards alone (evaluation: `run_forward`).
    """

    def __init__(self, plan: PipelinePlan, graphs: dict[int, Callable], rank_of_stage: dict[int, int], rank: int,
                 microbatches: int, device: torch.device, autocast: Callable, loss: Optional[str],
                 progress: Callable[..., None] = lambda *_, **__: None, stage_group: Any = None,
                 source_rank: int = 0, strict: Optional[bool] = None, forward_only: bool = False):
        self.plan, self.graphs = plan, graphs
        self.rank_of_stage, self.rank = rank_of_stage, rank
        self.microbatches, self.device, self.autocast, self.loss = microbatches, device, autocast, loss
        self.progress = progress
        self.stage_group, self.source_rank = stage_group, source_rank
        strict = os.environ.get("GROUPBERT_STRICT_P2P", "0") == "1" if strict is None else strict
        self.forward_only = forward_only
        self.virtual_graph = next(iter(plan.stages[s].virtual_graph for s in graphs))
        self.schedule = one_forward_one_backward(plan.stages, microbatches, forward_only=forward_only)
        self.actions = self.schedule.actions[self.virtual_graph]
        self.rounds = round_operations(plan, self.schedule, self.virtual_graph)
        # The last backward of each micro-batch in this process: its gradients are then complete.
        self.last_backward = {a.microbatch: i for i, a in enumerate(self.actions) if not a.forward}
        self.input_names = list(dict.fromkeys(n for s in graphs for n in plan.stages[s].graph_inputs))
        self.links = Links(plan.specs, {k: name for (name, _), k in plan.edges.items()}, rank_of_stage, device, strict,
                           progress)
        self._vg = {k: i.virtual_graph for k, i in plan.stages.items()}
        self.symbol_names = sorted(plan.symbols)

    @property
    def needs_data(self) -> bool:
        return bool(self.input_names)

    # ------------------------------------------------------------- a step
    def run(self, micro: list[dict[str, torch.Tensor]], loss_scale: float, fetch: Sequence[str],
            hooks: GradientHooks) -> torch.Tensor:
        """One training step over the micro-batches (this process's inputs of each; [] where it
        reads none); returns Σ over micro-batches of the fetched outputs computed here, / M."""
        totals = torch.zeros(len(fetch), device=self.device)
        fetch_of = {s: [i for i, n in enumerate(fetch) if n in self.plan.stages[s].graph_outputs] for s in self.graphs}

        def act(position: int, action: Action, step: _Step) -> None:
            s, m = action.stage, action.microbatch
            if action.forward:
                hooks.forward_of(m, s)
                received, out = self._forward(s, m, step)
                hooks.forward_done(m, s)
                if fetch_of[s]:
                    values = torch.stack([out[fetch[i]].detach().float() for i in fetch_of[s]])
                    totals[fetch_of[s]] += values / self.microbatches
                step.stash[(s, m)] = (received, out)
            else:
                self._backward(s, m, step, loss_scale, hooks)
                if self.last_backward[m] == position:
                    hooks.end_microbatch(m)

        self._drive(micro, act)
        return totals

    def run_forward(self, micro: list[dict[str, torch.Tensor]], outputs: Sequence[str]
                    ) -> dict[str, list[torch.Tensor]]:
        """Forwards alone (evaluation): each requested output computed here, one value per micro-batch."""
        assert self.forward_only, "a runner made with forward_only=True"
        found: dict[str, list[Optional[torch.Tensor]]] = {}

        def act(position: int, action: Action, step: _Step) -> None:
            _, out = self._forward(action.stage, action.microbatch, step)
            for name in outputs:
                if name in self.plan.stages[action.stage].graph_outputs:
                    found.setdefault(name, [None] * self.microbatches)[action.microbatch] = out[name].detach()

        self._drive(micro, act)
        return found

    def _drive(self, micro: list[dict[str, torch.Tensor]], act: Callable[[int, Action, _Step], None]) -> None:
        """Run this process's actions tick by tick, each tick's messages as one group."""
        by_name = {k: [part[k] for part in micro] for k in (micro[0] if micro else {})}
        self.progress("sharing the step's sizes", waiting=True)
        sizes = self._sizes(by_name)
        step = _Step(by_name)
        in_flight: list[Round] = []  # rounds not known complete, and the buffers they read
        action_at = {self.schedule.ticks[a]: (i, a) for i, a in enumerate(self.actions)}
        for tick, ops in enumerate(self.rounds):
            if tick in action_at:
                act(*action_at[tick], step)
            if ops:
                in_flight.append(self.links.exchange(ops, sizes, step.outgoing, step.arriving))
            in_flight = [group for group in in_flight if not group.completed()]  # sent buffers released
        self.progress("waiting for the last pipeline messages", waiting=True)
        for group in in_flight:
            group.wait()
        assert not step.arriving and not step.outgoing and not step.local, "every message was consumed"

    def _sizes(self, micro: dict[str, list[torch.Tensor]]) -> dict[str, int]:
        """The step's symbolic dimension sizes, the same in every process of the replica."""
        values = torch.zeros(len(self.symbol_names), dtype=torch.int64, device=self.device)
        if micro:
            for k, symbol in enumerate(self.symbol_names):
                name, axis = self.plan.symbols[symbol]
                if name in micro:
                    values[k] = micro[name][0].shape[axis]
        if self.stage_group is not None and self.symbol_names:
            dist.broadcast(values, src=self.source_rank, group=self.stage_group)
        return dict(zip(self.symbol_names, values.tolist()))

    def _forward(self, s: int, m: int, step: _Step) -> tuple[dict, dict]:
        info = self.plan.stages[s]
        self.progress(f"forward of stage {s}, micro-batch {m}")
        inputs = {name: step.micro[name][m] for name in info.graph_inputs}
        received = {}
        for name, source in info.received:
            key = (self.plan.edges[(name, s)], False, m)
            x = step.local.pop(key) if self._vg[source] == self.virtual_graph else self.links.arrived(key, step.arriving, source)
            received[name] = x.requires_grad_(self.plan.specs[name].requires_grad and not self.forward_only)
        with self.autocast():
            out = self.graphs[s]({**inputs, **received})
        for name, consumers in info.sent.items():
            spec = self.plan.specs[name]
            if not self.forward_only and out[name].requires_grad != spec.requires_grad:
                raise RuntimeError(f"{name!r} requires_grad={out[name].requires_grad} at run time, but the plan "
                                   f"expected {spec.requires_grad}: the gradient messages would not match")
            for c in consumers:
                key = (self.plan.edges[(name, c)], False, m)
                if self._vg[c] == self.virtual_graph:  # a leaf of its own: each stage's backward stays its own
                    step.local[key] = out[name].detach()
                else:
                    step.outgoing[key] = out[name].detach().to(spec.dtype)
        return received, out

    def _backward(self, s: int, m: int, step: _Step, loss_scale: float, hooks: GradientHooks) -> None:
        info = self.plan.stages[s]
        self.progress(f"backward of stage {s}, micro-batch {m}")
        received, out = step.stash.pop((s, m))
        tensors, grads = [], []
        if self.loss in info.graph_outputs:
            tensors.append(out[self.loss].float())
            grads.append(torch.tensor(loss_scale / self.microbatches, device=self.device))
        for name, consumers in info.sent.items():
            if not self.plan.specs[name].requires_grad:
                continue
            total = None
            for c in consumers:
                key = (self.plan.edges[(name, c)], True, m)
                g = step.local.pop(key) if self._vg[c] == self.virtual_graph else self.links.arrived(key, step.arriving, c)
                total = g if total is None else total + g
            tensors.append(out[name])
            grads.append(total.to(out[name].dtype))
        hooks.backward_of(m, tensors)
        if tensors:
            torch.autograd.backward(tensors, grads)
        for name, source in info.received:
            x = received[name]
            if not self.plan.specs[name].requires_grad:
                continue
            g = x.grad if x.grad is not None else torch.zeros_like(x)
            key = (self.plan.edges[(name, s)], True, m)
            if self._vg[source] == self.virtual_graph:
                step.local[key] = g
            else:
                step.outgoing[key] = g.to(self.plan.specs[name].dtype)
