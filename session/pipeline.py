"""Pipelining of the graph's stages, PopART's `enablePipelining` on torch.distributed.

The graph is cut at its `__pipeline_stage` annotations, and only there: stage s is the
set of nodes marked s, and it runs in the process of its virtual graph
(`__ipu_number`). As in PopART's BERT, a virtual graph may hold several stages: the
heads return to virtual graph 0 in a stage of their own after the last layers, so the
word embedding that the MLM head shares with the first stage stays one tensor in one
process, and its two gradients add up in place before the update.

    stages     0 (embeddings, layers 0-3)   1 (layers 4-7)   2 (heads: MLM, NSP, loss)
    process    virtual graph 0              virtual graph 1  virtual graph 0

A tensor made in one stage and read in a later one travels point to point
(isend/recv of torch.distributed) when the stages sit in different processes and is
handed over in memory otherwise; its gradient travels back the same way. Each stage
is a `LoweredGraph` of its own sub-model, so fusions, recompute marks and
torch.compile work per stage as on the whole graph.

Schedule: the micro-batches of one step (the gradient-accumulation count) flow
through the stages in a one-forward-one-backward order: stage k of K starts with
min(K-1-k, M) forwards, then alternates a forward and a backward, then drains its
backwards, so at most K-k micro-batches' activations are alive in a stage. The
order each process runs is found once by simulating all processes with unit-time
actions (a process runs one action at a time, an action waits for the ones it needs);
it is free of deadlocks by construction, as every receive comes after its send in
that simulated timeline. Example, 3 stages on 2 processes (2 layer groups, heads on
virtual graph 0), 4 micro-batches (Fs.m / Bs.m: forward / backward of stage s, micro-batch m):

    vg 0:  F0.0 F0.1 F2.0 B2.0 F2.1 B2.1 F0.2 B0.0 F2.2 B2.2 F0.3 B0.1 F2.3 B0.2 B2.3 B0.3
    vg 1:  F1.0 F1.1 B1.0 F1.2 B1.1 F1.3 B1.2 B1.3
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import onnx
import torch
import torch.distributed as dist
from onnx import helper

from builder import IPU_NUMBER, PIPELINE_STAGE
from session.lowering import needed_nodes

__all__ = ["Action", "PipelinePlan", "PipelineRunner", "one_forward_one_backward"]


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


def _int_attribute(node: onnx.NodeProto, name: str) -> Optional[int]:
    for a in node.attribute:
        if a.name == name:
            return int(helper.get_attribute_value(a))
    return None


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
            stage, vgraph = _int_attribute(node, PIPELINE_STAGE), _int_attribute(node, IPU_NUMBER)
            if stage is None or vgraph is None:
                raise ValueError(
                    f"node {node.name} ({node.op_type}) has no {PIPELINE_STAGE}/{IPU_NUMBER} attribute: pipelining "
                    "needs every node placed (bert/placement.py does this for model.layers_per_stage)")
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
            raise ValueError(f"virtual graphs {vgraphs} are not numbered 0..{len(vgraphs) - 1}")
        self.virtual_graphs = len(vgraphs)
        # Every (tensor, consumer stage) edge gets a number: its messages' tag.
        self.edges = {(name, c): k for k, (name, c) in enumerate(
            (name, c) for info in self.stages.values() for name, consumers in info.sent.items() for c in consumers)}

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


def one_forward_one_backward(stages: dict[int, StageInfo], microbatches: int) -> dict[int, list[Action]]:
    """Each virtual graph's actions for one step (see the module docstring)."""
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
        queues[s] = seq
    done: dict[Action, int] = {}
    plans: dict[int, list[Action]] = defaultdict(list)
    heads = {s: 0 for s in order}
    vgraphs = sorted({stages[s].virtual_graph for s in order})
    t = 0
    while len(done) < 2 * count * microbatches:
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
    return dict(plans)


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool]
_HEADER = 10  # dtype code, requires_grad, rank, up to 7 dims


class PipelineRunner:
    """Runs this process's stages of one step: forwards and backwards, messages between them.

    `graphs` maps this process's stage indices to their lowered graphs; `rank_of_stage`
    gives the global rank holding each stage of this replica.
    """

    def __init__(self, plan: PipelinePlan, graphs: dict[int, Callable], rank_of_stage: dict[int, int], rank: int,
                 microbatches: int, device: torch.device, autocast: Callable, loss: str,
                 progress: Callable[..., None] = lambda *_, **__: None):
        self.plan, self.graphs = plan, graphs
        self.rank_of_stage, self.rank = rank_of_stage, rank
        self.microbatches, self.device, self.autocast, self.loss = microbatches, device, autocast, loss
        self.progress = progress
        virtual_graph = next(iter(plan.stages[s].virtual_graph for s in graphs))
        self.actions = one_forward_one_backward(plan.stages, microbatches)[virtual_graph]
        # The last backward of each micro-batch in this process: its gradients are then complete.
        self.last_backward = {a.microbatch: i for i, a in enumerate(self.actions) if not a.forward}
        self.input_names = list(dict.fromkeys(n for s in graphs for n in plan.stages[s].graph_inputs))

    @property
    def needs_data(self) -> bool:
        return bool(self.input_names)

    def run(self, feeds: dict[str, torch.Tensor], loss_scale: float, fetch: Sequence[str],
            reducer: Any = None) -> torch.Tensor:
        """One step; returns Σ over micro-batches of the fetched outputs computed here, / M."""
        m_count = self.microbatches
        micro = {}
        if feeds:
            rows = next(iter(feeds.values())).shape[0]
            if rows % m_count:
                raise ValueError(f"batch of {rows} rows does not split into {m_count} micro-batches")
            size = rows // m_count
            micro = {k: [v[i * size : (i + 1) * size] for i in range(m_count)] for k, v in feeds.items()}
        totals = torch.zeros(len(fetch), device=self.device)
        local: dict[tuple[int, int, bool], torch.Tensor] = {}  # (edge, microbatch, backward) → tensor
        stash: dict[tuple[int, int], tuple[dict, dict]] = {}
        sends: list[Any] = []
        fetch_of = {s: [i for i, n in enumerate(fetch) if n in self.plan.stages[s].graph_outputs] for s in self.graphs}
        for position, action in enumerate(self.actions):
            s, m = action.stage, action.microbatch
            info = self.plan.stages[s]
            if action.forward:
                self.progress(f"forward of stage {s}, micro-batch {m}")
                inputs = {name: micro[name][m] for name in info.graph_inputs}
                received = {name: self._receive(self.plan.edges[(name, s)], m, source, local, backward=False)
                            for name, source in info.received}
                with self.autocast():
                    out = self.graphs[s]({**inputs, **received})
                for name, consumers in info.sent.items():
                    for c in consumers:
                        self._send(out[name], self.plan.edges[(name, c)], m, c, local, sends, backward=False)
                if fetch_of[s]:
                    totals[fetch_of[s]] += torch.stack([out[fetch[i]].detach().float() for i in fetch_of[s]]) / m_count
                stash[(s, m)] = (received, out)
            else:
                self.progress(f"backward of stage {s}, micro-batch {m}")
                received, out = stash.pop((s, m))
                tensors, grads = [], []
                if self.loss in info.graph_outputs:
                    tensors.append(out[self.loss].float())
                    grads.append(torch.tensor(loss_scale / m_count, device=self.device))
                for name, consumers in info.sent.items():
                    if not out[name].requires_grad:
                        continue
                    total = None
                    for c in consumers:
                        g = self._receive(self.plan.edges[(name, c)], m, c, local, backward=True, like=out[name])
                        total = g if total is None else total + g
                    tensors.append(out[name])
                    grads.append(total)
                if reducer is not None:
                    reducer.backward_of(m)
                if tensors:
                    torch.autograd.backward(tensors, grads)
                for name, source in info.received:
                    x = received[name]
                    if x.requires_grad:
                        g = x.grad if x.grad is not None else torch.zeros_like(x)
                        self._send(g, self.plan.edges[(name, s)], m, source, local, sends, backward=True)
                if reducer is not None and self.last_backward[m] == position:
                    reducer.end_microbatch(m)
            sends = [(work, buffer) for work, buffer in sends if not work.is_completed()]  # release sent buffers
        self.progress("waiting for the last pipeline messages", waiting=True)
        for work, _ in sends:
            work.wait()
        return totals

    # ----------------------------------------------------------- messages
    def _tag(self, edge: int, microbatch: int, backward: bool, part: int) -> int:
        return ((microbatch * len(self.plan.edges) + edge) * 2 + int(backward)) * 2 + part

    def _send(self, tensor: torch.Tensor, edge: int, microbatch: int, stage: int, local: dict, sends: list,
              backward: bool) -> None:
        dst = self.rank_of_stage[stage]
        if dst == self.rank:
            # Same process: hand over a leaf, so each stage's backward stays its own.
            local[(edge, microbatch, backward)] = tensor.detach().requires_grad_(tensor.requires_grad and not backward)
            return
        requires_grad = tensor.requires_grad
        tensor = tensor.detach().contiguous()
        if not backward:  # the receiver learns shape, dtype and whether a gradient comes back from a header
            header = torch.zeros(_HEADER, dtype=torch.int64)
            header[0], header[1], header[2] = _DTYPES.index(tensor.dtype), int(requires_grad), tensor.dim()
            header[3 : 3 + tensor.dim()] = torch.tensor(tensor.shape)
            header = header.to(self.device)
            sends.append((dist.isend(header, dst, tag=self._tag(edge, microbatch, backward, 0)), header))
        # The buffers stay referenced until their sends complete.
        sends.append((dist.isend(tensor, dst, tag=self._tag(edge, microbatch, backward, 1)), tensor))

    def _receive(self, edge: int, microbatch: int, stage: int, local: dict, backward: bool,
                 like: Optional[torch.Tensor] = None) -> torch.Tensor:
        src = self.rank_of_stage[stage]
        if src == self.rank:
            return local.pop((edge, microbatch, backward))
        self.progress(f"waiting for {'a gradient' if backward else 'an activation'} from rank {src}", waiting=True)
        if backward:
            out = torch.empty_like(like, memory_format=torch.contiguous_format)
            dist.recv(out, src, tag=self._tag(edge, microbatch, backward, 1))
            return out
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, src, tag=self._tag(edge, microbatch, backward, 0))
        code, requires_grad, rank, *dims = header.tolist()
        out = torch.empty(dims[:rank], dtype=_DTYPES[code], device=self.device)
        dist.recv(out, src, tag=self._tag(edge, microbatch, backward, 1))
        return out.requires_grad_(bool(requires_grad))
