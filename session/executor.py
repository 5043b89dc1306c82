"""Executors: how a step's micro-batches run through this process's part of the graph.

A TrainingSession trains and evaluates through an `Executor` and never asks which one
it has (the shape of Megatron's `get_forward_backward_func`):

    LocalExecutor      the whole graph in this process: each micro-batch forward, then
                       backward, one after the other
    PipelinedExecutor  this process's pipeline stages, the micro-batches in the 1F1B
                       schedule, tensors between stages as messages (session.pipeline)

`plan_execution(model, outputs, pipelined)` is the one factory: it cuts the graph (or
not) and says how many virtual graphs, hence processes per replica, the execution
needs, before any process group exists; `plan.executor(context, microbatches)` then
lowers this process's part and returns the executor. Training and evaluation both
build theirs through it (evaluation: forward only, eval mode, sharing the training
weights).

An executor drives the micro-batches and tells the gradient hooks (the replicas'
`GradientReducer`) which micro-batch's backward runs and when one is complete; the
session owns everything else of the step (optimizer, loss scale, randomness, step).
"""
from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Iterator, Mapping, Optional, Protocol, Sequence

import onnx
import torch

from session.distributed import Topology
from session.kernels import KernelPolicy
from session.lowering import LoweredGraph
from session.pipeline import PipelinePlan, PipelineRunner

__all__ = ["ExecutionContext", "ExecutionPlan", "Executor", "GradientHooks", "plan_execution", "split_microbatches"]

Feeds = Mapping[str, torch.Tensor]


class GradientHooks(Protocol):
    """What an executor tells the gradient reduction (and, for weight sharding, the weights'
    gathering) as a training step runs: each forward of a stage's graph is framed by
    `forward_of` and `forward_done` (where FSDP/ZeRO-3 would gather a stage's weights and
    free them again), each backward announced by `backward_of`, each micro-batch closed by
    `end_microbatch`."""

    def forward_of(self, microbatch: int, stage: int) -> None:
        """The forward of pipeline stage `stage` (0 without pipelining) for `microbatch` is about to run."""

    def forward_done(self, microbatch: int, stage: int) -> None:
        """That forward has run; its outputs (and the autograd graph behind them) exist."""

    def backward_of(self, microbatch: int, roots: Sequence[torch.Tensor]) -> None:
        """The backward pass about to run, from `roots` (the tensors it differentiates), belongs to
        `microbatch`. The hooks may read the autograd graph behind `roots` (e.g. to take the
        gradients of a weight used twice as each use produces its part)."""

    def end_microbatch(self, microbatch: int) -> None:
        """Every backward pass of `microbatch` in this process has run."""


class _NoHooks:
    def forward_of(self, microbatch: int, stage: int) -> None:
        pass

    def forward_done(self, microbatch: int, stage: int) -> None:
        pass

    def backward_of(self, microbatch: int, roots: Sequence[torch.Tensor]) -> None:
        pass

    def end_microbatch(self, microbatch: int) -> None:
        pass


def split_microbatches(feeds: Feeds, count: int) -> list[dict[str, torch.Tensor]]:
    """`feeds` (rows first) as `count` equal micro-batches, views of the same memory."""
    if not feeds:
        return [{} for _ in range(count)]
    rows = next(iter(feeds.values())).shape[0]
    if rows % count:
        raise ValueError(f"batch of {rows} rows does not split into {count} micro-batches")
    size = rows // count
    return [{k: v[i * size : (i + 1) * size] for k, v in feeds.items()} for i in range(count)]


@dataclass(frozen=True)
class ExecutionContext:
    """What every executor takes from its session."""

    topology: Topology
    device: torch.device
    autocast: Callable[[], ContextManager]
    policy: KernelPolicy
    compile: bool = False
    progress: Callable[..., None] = lambda *_, **__: None


@contextlib.contextmanager
def step_weight_casts(device: torch.device, graphs: Iterable[LoweredGraph] = ()) -> Iterator[None]:
    """Around one training step's micro-batches: the copies autocast makes of the weights (in
    bf16 under bf16 precision) in the first micro-batch's forward serve every micro-batch of
    the step, instead of being made again for each; the weights change only at the
    optimizer's step, after them. Autocast keeps its copies of leaf tensors that need a
    gradient until its outermost context exits: this is that context, autocast off, around the
    per-micro-batch ones. Its cache is cleared on the way in and out, so no copy outlives the
    step or comes from a caller's own autocast. The arithmetic is unchanged: each micro-batch's
    gradient of a copy goes through the copy's cast, back to float32, into the weight's
    gradient, as before. Where the kernel policy says weight_cast=shadow, the dense layers of
    `graphs` read their own copy instead (session/shadow.py), made by the step's first forward."""
    torch.clear_autocast_cache()
    try:
        with torch.autocast(device.type, enabled=False), contextlib.ExitStack() as held:
            for graph in graphs:
                held.enter_context(graph.held_weights())
            yield
    finally:
        torch.clear_autocast_cache()


class Executor(abc.ABC):
    """Runs one step's micro-batches through this process's graphs (see the module docstring)."""

    graphs: dict[int, LoweredGraph]  # this process's lowered graphs, by pipeline stage
    input_names: tuple[str, ...]  # the graph inputs this process reads (none on middle stages)
    microbatches: int

    @abc.abstractmethod
    def train_step(self, feeds: Feeds, loss_scale: float, hooks: Optional[GradientHooks] = None) -> torch.Tensor:
        """Forward and backward of every micro-batch (the loss of each scaled by `loss_scale` / M);
        returns Σ over micro-batches / M of each fetched output computed here (0 elsewhere)."""

    @abc.abstractmethod
    def forward(self, feeds: Feeds, outputs: Sequence[str]) -> dict[str, list[torch.Tensor]]:
        """Forward only: each requested output computed here, one value per micro-batch."""

    def graph_runners(self, feeds: Feeds) -> Optional[dict[str, Callable[[], tuple]]]:
        """graph=measure (session/kernel_tuning.py): "eager", "compiled" and on CUDA "cudagraphs",
        each one forward and backward of the first micro-batch of `feeds` returning its loss;
        None where the program cannot be timed alone (pipeline stages wait on each other: they
        stay eager)."""
        return None

    def compile_graphs(self, mode: str) -> None:
        """From now on run this process's programs eagerly, compiled or as CUDA graphs."""
        for graph in self.graphs.values():
            graph.compile_program(mode)


class ExecutionPlan(abc.ABC):
    """How a model's graph is cut into processes, known before any process group exists."""

    virtual_graphs: int

    @abc.abstractmethod
    def weight_placement(self) -> dict[str, int]:
        """The virtual graph (process of a replica, checkpoint file) of every weight."""

    @abc.abstractmethod
    def executor(self, context: ExecutionContext, microbatches: int, *, loss: Optional[str] = None,
                 recompute: bool = False, weights: Optional[Callable[[onnx.TensorProto], Any]] = None,
                 parameters: Optional[dict[str, torch.nn.Parameter]] = None) -> Executor:
        """This process's executor: its part of the graph lowered (`weights` reads initial
        values; `parameters` are existing weights to share). With a `loss` (one of the
        outputs) it trains; without, it evaluates (forward only, eval mode)."""


def plan_execution(model: onnx.ModelProto, outputs: Sequence[str], pipelined: bool) -> ExecutionPlan:
    """The plan computing `outputs` of `model`: the whole graph here, or its pipeline stages
    (`pipelined`: cut at `__pipeline_stage`, one process per virtual graph)."""
    return _PipelinedPlan(model, outputs) if pipelined else _LocalPlan(model, outputs)


def _lowered(model: onnx.ModelProto, outputs: Sequence[str], context: ExecutionContext, training: bool,
             **lower: Any) -> LoweredGraph:
    graph = LoweredGraph(model, outputs=outputs, policy=context.policy, **lower).to(context.device)
    return graph.train(training)


# ------------------------------------------------------------------ local
class _LocalPlan(ExecutionPlan):
    virtual_graphs = 1

    def __init__(self, model: onnx.ModelProto, outputs: Sequence[str]):
        self.model, self.outputs = model, list(outputs)

    def weight_placement(self) -> dict[str, int]:
        return {t.name: 0 for t in self.model.graph.initializer}

    def executor(self, context: ExecutionContext, microbatches: int, *, loss: Optional[str] = None,
                 recompute: bool = False, weights=None, parameters=None) -> Executor:
        graph = _lowered(self.model, self.outputs, context, loss is not None, recompute=recompute, weights=weights,
                         parameters=parameters)
        return LocalExecutor(graph, context, microbatches, loss)


class LocalExecutor(Executor):
    """The whole graph in this process: micro-batches forward and backward in turn."""

    def __init__(self, graph: LoweredGraph, context: ExecutionContext, microbatches: int, loss: Optional[str]):
        self.graphs = {0: graph}
        self.input_names = graph.input_names
        self.microbatches = microbatches
        self.context, self.loss = context, loss
        self._run = torch.compile(graph) if context.compile else graph

    def train_step(self, feeds: Feeds, loss_scale: float, hooks: Optional[GradientHooks] = None) -> torch.Tensor:
        hooks = hooks or _NoHooks()
        fetch, loss, m = self.graphs[0].output_names, self.loss, self.microbatches
        totals = torch.zeros(len(fetch), device=self.context.device)
        with step_weight_casts(self.context.device, self.graphs.values()):
            for i, part in enumerate(split_microbatches(feeds, m)):
                self.context.progress(f"micro-batch {i}")
                hooks.forward_of(i, 0)
                with self.context.autocast():
                    out = self._run(part)
                hooks.forward_done(i, 0)
                scaled = out[loss].float() * (loss_scale / m)
                hooks.backward_of(i, (scaled,))
                scaled.backward()
                hooks.end_microbatch(i)
                # Summed on the device: one host sync per step, not per micro-batch.
                totals += torch.stack([out[n].detach().float() for n in fetch]) / m
        return totals

    def graph_runners(self, feeds: Feeds) -> Optional[dict[str, Callable[[], tuple]]]:
        # The gradients by autograd.grad: no gradient hook, no collective, nothing accumulated.
        graph, part = self.graphs[0], split_microbatches(feeds, self.microbatches)[0]
        params = [p for _, p in graph.named_weights() if p.requires_grad]

        def runner(mode: str) -> Callable[[], tuple]:
            def run() -> tuple:
                graph.compile_program(mode)
                with self.context.autocast():
                    loss = graph(part)[self.loss].float()
                torch.autograd.grad(loss, params, allow_unused=True)
                return (loss.detach(),)
            return run
        modes = ("eager", "compiled") + (("cudagraphs",) if self.context.device.type == "cuda" else ())
        return {mode: runner(mode) for mode in modes}

    def forward(self, feeds: Feeds, outputs: Sequence[str]) -> dict[str, list[torch.Tensor]]:
        found: dict[str, list[torch.Tensor]] = {name: [] for name in outputs}
        for part in split_microbatches(feeds, self.microbatches):
            with self.context.autocast():
                out = self._run(part)
            for name in outputs:
                found[name].append(out[name])
        return found


# -------------------------------------------------------------- pipelined
class _PipelinedPlan(ExecutionPlan):
    def __init__(self, model: onnx.ModelProto, outputs: Sequence[str]):
        self.model, self.outputs = model, list(outputs)
        self.plan = PipelinePlan(model, outputs)
        if self.plan.virtual_graphs < 2:
            raise ValueError("pipelining needs the graph's stages on two or more virtual graphs; this graph places "
                             "everything on virtual graph 0")
        self.virtual_graphs = self.plan.virtual_graphs

    def weight_placement(self) -> dict[str, int]:
        return {w: info.virtual_graph for info in self.plan.stages.values() for w in info.weights}

    def executor(self, context: ExecutionContext, microbatches: int, *, loss: Optional[str] = None,
                 recompute: bool = False, weights=None, parameters=None) -> Executor:
        topo = context.topology
        if topo.world_size == 1:
            raise ValueError("pipelining needs one process per virtual graph: launch with "
                             f"`torchrun --nproc-per-node {self.virtual_graphs} bert.py ...`")
        shared = dict(parameters or {})  # a weight two of this process's stages use is one tensor
        graphs = {}
        for info in self.plan.local_stages(topo.virtual_graph):
            graph = _lowered(self.plan.stage_model(self.model, info.index), info.outputs, context, loss is not None,
                             recompute=recompute, weights=weights, parameters=shared)
            shared.update(graph.named_weights())
            graphs[info.index] = graph
        return PipelinedExecutor(self.plan, graphs, context, microbatches, self.outputs, loss)


class PipelinedExecutor(Executor):
    """This process's pipeline stages in the 1F1B schedule (session.pipeline)."""

    def __init__(self, plan: PipelinePlan, graphs: dict[int, LoweredGraph], context: ExecutionContext,
                 microbatches: int, fetch: Sequence[str], loss: Optional[str]):
        topo = context.topology
        self.graphs, self.microbatches, self.context = graphs, microbatches, context
        self.fetch = list(fetch)
        run = {s: torch.compile(g) if context.compile else g for s, g in graphs.items()}
        rank_of_stage = {s: topo.rank_of(topo.replica, info.virtual_graph) for s, info in plan.stages.items()}
        readers = [info.virtual_graph for info in plan.stages.values() if info.graph_inputs]
        self.runner = PipelineRunner(plan, run, rank_of_stage, topo.rank, microbatches, context.device,
                                     context.autocast, loss, context.progress, stage_group=topo.stage_group,
                                     source_rank=topo.rank_of(topo.replica, min(readers, default=0)),
                                     forward_only=loss is None)
        self.input_names = tuple(self.runner.input_names)

    def train_step(self, feeds: Feeds, loss_scale: float, hooks: Optional[GradientHooks] = None) -> torch.Tensor:
        micro = split_microbatches(feeds, self.microbatches) if feeds else []
        with step_weight_casts(self.context.device, self.graphs.values()):
            return self.runner.run(micro, loss_scale, self.fetch, hooks or _NoHooks())

    def forward(self, feeds: Feeds, outputs: Sequence[str]) -> dict[str, list[torch.Tensor]]:
        micro = split_microbatches(feeds, self.microbatches) if feeds else []
        return self.runner.run_forward(micro, outputs)
