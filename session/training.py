"""TrainingSession: forward, backward and the optimizer step over a lowered graph.

PopART counterpart: `popart.TrainingSession(fnModel, loss, optimizer, dataFlow, ...)`
whose `run(stepio)` consumes micro-batch × accumulation samples and makes one weight
update. Here `run(batch)` takes a batch of `micro_batch × gradient_accumulation` rows
(this replica's rows, when replicated), runs each micro-batch forward and backward (the
loss of each divided by the number of micro-batches: PopART's Mean reduction), then one
optimizer step at the scheduled learning rate. It returns the anchors (scalar outputs)
averaged over micro-batches and replicas.

Scale-out (docs/distributed.md): in a process of a launched job (inside
`session.distributed.launch`), the session runs as one replica (`replication_factor`)
or one virtual graph of a replica's pipeline (`pipelining`), and materialises only the
weights and optimizer state of its own stages: the graph's weights are read one at a
time, from the proto, its external data or, for a graph that only declares them, the
`weights` callable (the builder's seeded initial values). Gradients are mean-reduced
over the replicas while backward runs (session.replication), optionally with the
optimizer state and gradients sharded over them (`replicated_tensor_sharding`).

Checkpoints are written by every process for what it holds (its stages' weights, its
shard of the moments), in files indexed by name, and read back by name, so a run
resumes with any number of processes and no process ever holds the whole model.

A session changes nothing process-wide: its randomness (dropout, including what
recompute replays) comes from its own generator state, swapped in around its forward
and backward passes; process groups it makes are freed by `close()`.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping, Optional, Sequence

import numpy as np
import onnx
import torch
import torch.distributed as dist

from session import checkpoint, distributed
from session.checkpoint import TensorFile
from session.distributed import Topology, local_device, make_topology
from session.export import export_model
from session.inference import check_feeds, input_specs
from session.kernels import KernelPolicy, choose_kernels
from session.lowering import LoweredGraph, needed_nodes
from session.model_io import ModelLike, WeightReader, load_without_data
from session.optimizers import Lamb, NoDecay, fewer_than_two_dims, select_state
from session.options import Precision, SessionOptions
from session.pipeline import PipelinePlan, PipelineRunner
from session.replication import GradientReducer, ShardedLamb
from session.schedules import Schedule, set_lr

MODEL_FILE = "model.onnx"
STATE_FILE = "session.json"
LEGACY_OPTIMIZER_FILE = "optimizer.pt"  # checkpoints written before per-process files


def weights_file(virtual_graph: int) -> str:
    return f"weights.vg{virtual_graph}.data"


def optimizer_file(virtual_graph: int) -> str:
    return f"optimizer.vg{virtual_graph}.safetensors"


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer and its hyperparameters (PopART: popart.Adam in Lamb mode, ...).

    The tensors `no_decay(name, shape)` names (default: those of fewer than two
    dimensions) take no weight decay and, for LAMB, no trust ratio. Both kinds run the
    fused flat-buffer step.
    """

    kind: Literal["lamb", "adamw"] = "lamb"
    schedule: Schedule = Schedule(base_lr=1e-3, warmup_steps=0, total_steps=1, decay="constant")
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.01
    max_grad_norm: Optional[float] = None
    max_trust_ratio: Optional[float] = None
    no_decay: NoDecay = fewer_than_two_dims


class _LossScaler:
    """Static or dynamic loss scaling for fp16 (Micikevicius et al. 2018).

    Dynamic: start at 2^15, halve on a non-finite gradient (the step is skipped), double
    after `growth_interval` clean steps.
    """

    def __init__(self, setting: float | str | None, growth_interval: int = 1000):
        self.dynamic = setting == "dynamic"
        self.scale = 2.0**15 if self.dynamic else float(setting or 1.0)
        self.growth_interval = growth_interval
        self.clean_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:  # the run stops when it falls below training.min_loss_scale (bert/train.py)
            self.scale /= 2
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps % self.growth_interval == 0:
                self.scale *= 2


class _SessionRandomness:
    """The session's own random-number state (CPU, and its CUDA device when there is one).

    `active()` swaps it in for the global generators around the session's forward and
    backward passes and swaps the caller's back after, so dropout masks, and the ones
    torch.utils.checkpoint replays when it recomputes, come from the session's stream
    alone: two sessions in one process, or the code around them, never shift each
    other's randomness.
    """

    def __init__(self, seed: int, device: torch.device):
        self.device = device if device.type == "cuda" else None
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        self.cpu = torch.Generator().manual_seed(seed).get_state()
        self.cuda = torch.Generator(self.device).manual_seed(seed).get_state() if self.device else None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        saved_cpu = torch.get_rng_state()
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            saved_cuda = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(self.cuda, self.device)
        try:
            yield
        finally:
            self.cpu = torch.get_rng_state()
            torch.set_rng_state(saved_cpu)
            if self.device is not None:
                self.cuda = torch.cuda.get_rng_state(self.device)
                torch.cuda.set_rng_state(saved_cuda, self.device)

    def state(self) -> dict[str, list[int]]:
        out = {"cpu": self.cpu.tolist()}
        if self.cuda is not None:
            out["cuda"] = self.cuda.tolist()
        return out

    def load(self, state: dict[str, list[int]]) -> None:
        self.cpu = torch.tensor(state["cpu"], dtype=torch.uint8)
        if self.device is not None and "cuda" in state:
            self.cuda = torch.tensor(state["cuda"], dtype=torch.uint8)


class _Processes(checkpoint.Collective):
    """The checkpoint protocol's collectives over every process of the run."""

    def __init__(self, topology: Topology):
        self.rank, self.world = topology.rank, topology.world_size

    def gather(self, value: Any) -> Optional[list[Any]]:
        if self.world == 1:
            return [value]
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(value, out, dst=0)
        return out

    def broadcast(self, value: Any) -> Any:
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


class _LazyWeights(Mapping):
    """Weights by name, each read when asked for (a checkpoint's or a model file's)."""

    def __init__(self, tensors: dict[str, onnx.TensorProto], reader: WeightReader):
        self.tensors, self.reader = tensors, reader

    def __getitem__(self, name: str) -> np.ndarray:
        return self.reader(self.tensors[name])

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


class TrainingSession:
    """Trains an ONNX graph (see the module docstring).

    `model` is an ONNX model or the path of one; its initializers are the trainable
    weights. `weights(name)` gives the values of initializers the model only declares
    (name, type and dims). Use as a context manager, or call `close()`, to free the
    process groups it made.
    """

    def __init__(
        self,
        model: ModelLike,
        loss: str = "loss",
        optimizer: OptimizerSpec = OptimizerSpec(),
        options: Optional[SessionOptions] = None,
        anchors: Optional[Sequence[str]] = None,
        seed: int = 0,
        weights: Optional[Callable[[str], np.ndarray]] = None,
    ):
        if isinstance(model, onnx.ModelProto):
            proto, reader = model, WeightReader(None, weights, "the model")
        else:
            proto, reader = load_without_data(model), WeightReader(Path(model).parent, weights, str(model))
        self.options = options = options or SessionOptions()
        names = [o.name for o in proto.graph.output]
        if loss not in names:
            raise ValueError(f"loss {loss!r} is not a graph output; outputs are {names}")
        self.loss = loss
        scalar = [o.name for o in proto.graph.output if len(o.type.tensor_type.shape.dim) == 0]
        # Anchors: the outputs each run returns (default: every scalar output). Only they
        # and the loss are computed.
        self.anchors = tuple(anchors) if anchors is not None else tuple(scalar)
        self._fetch = list(dict.fromkeys([loss, *self.anchors]))
        plan = PipelinePlan(proto, self._fetch) if options.pipelining else None
        if plan is not None and plan.virtual_graphs < 2:
            raise ValueError("pipelining needs the graph's stages on two or more virtual graphs; this graph places "
                             "everything on virtual graph 0")
        self.device = local_device(torch.device(options.device))
        self._launch = distributed.current()
        self.topology: Topology = make_topology(options.replication_factor, plan.virtual_graphs if plan else 1)
        topo = self.topology
        if options.pipelining and topo.world_size == 1:
            raise ValueError("pipelining needs one process per virtual graph: launch with "
                             f"`torchrun --nproc-per-node {plan.virtual_graphs} bert.py ...`")
        self._watchdog = self._launch.watchdog if self._launch is not None else None
        self.policy: KernelPolicy = choose_kernels(self.device, options.precision, compile=options.compile,
                                                   overrides=options.kernels)
        self.kernel_changes: list[str] = []  # set by `load`: what this host runs differently

        # The graph, or this process's stages of it (a weight two of them use is one tensor).
        self.graphs: dict[int, LoweredGraph] = {}
        lower = dict(recompute=options.recompute, policy=self.policy, weights=reader)
        if plan is None:
            self.graphs[0] = LoweredGraph(proto, outputs=self._fetch, **lower)
        else:
            shared: dict[str, torch.nn.Parameter] = {}
            for info in plan.local_stages(topo.virtual_graph):
                graph = LoweredGraph(plan.stage_model(proto, info.index), outputs=info.outputs, parameters=shared,
                                     **lower)
                shared.update(graph.named_weights())
                self.graphs[info.index] = graph
        for graph in self.graphs.values():
            graph.to(self.device).train()
        self.graph = self.graphs[0] if plan is None else None
        order = {t.name: i for i, t in enumerate(proto.graph.initializer)}
        self._all_weights = [(t.name, tuple(t.dims)) for t in proto.graph.initializer]
        # Which virtual graph holds each weight (its checkpoint file).
        self._weight_vg = ({w: info.virtual_graph for info in plan.stages.values() for w in info.weights}
                           if plan is not None else {name: 0 for name, _ in self._all_weights})
        named = {n: p for g in self.graphs.values() for n, p in g.named_weights()}
        self._named = sorted(named.items(), key=lambda item: order[item[0]])
        # The graph structure, without its weights, to write checkpoints from; and with
        # them declared (names, dims), to plan the graphs of evaluations.
        self._skeleton = self._copy_without_weights(proto)
        self._declared = self._copy_without_weights(proto)
        for name, shape in self._all_weights:
            tensor = self._declared.graph.initializer.add()
            tensor.name, tensor.data_type = name, onnx.TensorProto.FLOAT
            tensor.dims.extend(shape)
        self._evaluators: dict[tuple, Any] = {}
        self.spec = optimizer
        self.optimizer = self._make_optimizer(optimizer, seed)
        # How many of this process's stages give each weight a gradient per micro-batch.
        uses = [sum(name in g.parameter_names for g in self.graphs.values()) for name, _ in self._named]
        self.reducer = (GradientReducer(self.optimizer, topo.replica_group, options.gradient_accumulation, uses)
                        if topo.replicas > 1 else None)
        self._sync_replicas()
        self.scaler = _LossScaler(options.loss_scaling if options.precision is Precision.FP16 else None)
        self.step = 0
        self._stop_requested = False
        self.stop_agreed = False
        self._forward = {s: torch.compile(g) if options.compile else g for s, g in self.graphs.items()}
        self.runner = None
        if plan is not None:
            rank_of_stage = {s: topo.rank_of(topo.replica, info.virtual_graph) for s, info in plan.stages.items()}
            readers = [info.virtual_graph for info in plan.stages.values() if info.graph_inputs]
            self.runner = PipelineRunner(plan, self._forward, rank_of_stage, topo.rank, options.gradient_accumulation,
                                         self.device, options.autocast, loss, self._progress,
                                         stage_group=topo.stage_group,
                                         source_rank=topo.rank_of(topo.replica, min(readers, default=0)))
        self._seed = seed
        self._rng = _SessionRandomness(seed + topo.rank, self.device)
        self._collective = _Processes(topo)
        # What each graph input accepts (dtype, dims, id ranges); the ones this process reads.
        self._graph_inputs = input_specs(proto)
        self._input_specs = {n: spec for n, spec in self._graph_inputs.items() if n in self.input_names}
        self._closed = False

    @staticmethod
    def _copy_without_weights(proto: onnx.ModelProto) -> onnx.ModelProto:
        """The model with every field but the initializers (never copies the weights)."""
        skeleton = onnx.ModelProto()
        _copy_fields(proto, skeleton, skip="graph")
        _copy_fields(proto.graph, skeleton.graph, skip="initializer")
        return skeleton

    def _make_optimizer(self, spec: OptimizerSpec, seed: int) -> Lamb:
        if spec.kind not in ("lamb", "adamw"):
            raise ValueError(f"unknown optimizer {spec.kind!r}; use 'lamb' or 'adamw'")
        topo, options = self.topology, self.options
        kwargs = dict(lr=spec.schedule(0), betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay,
                      max_grad_norm=spec.max_grad_norm, max_trust_ratio=spec.max_trust_ratio,
                      trust_ratio=spec.kind == "lamb", seed=seed, stage_group=topo.stage_group,
                      bucket_numel=max(1, int(options.gradient_bucket_mb * 2**20 / 4)) if topo.replicas > 1 else None,
                      no_decay=spec.no_decay, fused=self.policy.lamb == "compiled")
        if topo.replicas > 1 and options.replicated_tensor_sharding:
            return ShardedLamb(self._named, group=topo.replica_group, **kwargs)
        return Lamb(self._named, **kwargs)

    @torch.no_grad()
    def _sync_replicas(self) -> None:
        """Every replica starts from replica 0's weights."""
        topo = self.topology
        if topo.replicas > 1:
            src = topo.rank_of(0, topo.virtual_graph)
            dist.broadcast(self.optimizer.flat_params, src=src, group=topo.replica_group)

    def close(self) -> None:
        """Free the process groups this session made (collective, as their making was)."""
        if not self._closed:
            self._closed = True
            self.topology.close()

    def __enter__(self) -> "TrainingSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --------------------------------------------------------------- graph
    def named_weights(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This process's weights under their ONNX names, in the graph's order."""
        return list(self._named)

    @property
    def input_names(self) -> tuple[str, ...]:
        """The graph inputs this process reads (none for a pipeline's middle stages)."""
        if self.runner is not None:
            return tuple(self.runner.input_names)
        return self.graph.input_names

    @property
    def needs_data(self) -> bool:
        return bool(self.input_names)

    # ------------------------------------------------------------------ run
    @property
    def learning_rate(self) -> float:
        return self.spec.schedule(self.step)

    def request_stop(self) -> None:
        """Ask every process to stop after the current step (a signal arrived here)."""
        self._stop_requested = True

    def run(self, batch: Optional[Mapping[str, Any]]) -> dict[str, float]:
        """One optimizer step over `batch` (micro_batch × gradient_accumulation rows of this
        replica; None on pipeline processes that read no input)."""
        feeds = {}
        if self.needs_data:
            if batch is None:
                raise ValueError(f"this process reads the inputs {list(self.input_names)}: pass a batch")
            # Checked as InferenceSession checks them; keys the graph does not read are ignored.
            feeds = check_feeds({k: v for k, v in batch.items() if k in self._input_specs}, self._input_specs,
                                self.device)
        if self._watchdog is not None:
            self._watchdog.at(self.step + 1, "starting the step")
        self.optimizer.zero_grad()
        scale = self.scaler.scale
        with self._rng.active():
            if self.runner is not None:
                totals = self.runner.run(feeds, scale, self._fetch, self.reducer)
            else:
                totals = self._run_microbatches(feeds, scale)
        if self.reducer is not None:
            self._progress("reducing gradients")
            self.reducer.finish()
        return self._finish_step(totals, scale)

    def _run_microbatches(self, feeds: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
        accumulation = self.options.gradient_accumulation
        rows = next(iter(feeds.values())).shape[0]
        if rows % accumulation:
            raise ValueError(f"batch of {rows} rows does not split into {accumulation} micro-batches")
        micro = rows // accumulation
        totals = torch.zeros(len(self._fetch), device=self.device)
        forward = self._forward[0]
        for i in range(accumulation):
            self._progress(f"micro-batch {i}")
            part = {k: v[i * micro : (i + 1) * micro] for k, v in feeds.items()}
            with self.options.autocast():
                out = forward(part)
            if self.reducer is not None:
                self.reducer.backward_of(i)
            (out[self.loss].float() * (scale / accumulation)).backward()
            if self.reducer is not None:
                self.reducer.end_microbatch(i)
            # Summed on the device: one host sync per step, not per micro-batch.
            totals += torch.stack([out[n].detach().float() for n in self._fetch]) / accumulation
        return totals

    def _finish_step(self, totals: torch.Tensor, scale: float) -> dict[str, float]:
        topo = self.topology
        values = torch.cat([totals, torch.tensor([float(self._stop_requested)], device=totals.device)])
        if topo.distributed:
            # The anchors live where the heads are: one process per replica adds them.
            self._progress("averaging the anchors")
            dist.all_reduce(values)
            values[:-1] /= topo.replicas
        values = values.tolist()
        self.stop_agreed = values[-1] > 0
        metrics = dict(zip(self._fetch, values))
        metrics = {name: metrics[name] for name in self.anchors} | {self.loss: metrics[self.loss]}
        metrics["learning_rate"] = self.learning_rate
        overflow = not math.isfinite(metrics[self.loss])
        if not overflow:
            self._progress("optimizer step")
            set_lr(self.optimizer, self.learning_rate)
            self.optimizer.step(loss_scale=scale * topo.replicas)
            overflow = self.optimizer.skipped
        self.scaler.update(overflow)
        if not overflow:
            self.step += 1
        metrics["grad_norm"] = self.optimizer.grad_norm if not overflow else float("nan")
        metrics["loss_scale"] = scale
        metrics["skipped"] = float(overflow)
        self._progress("between steps")
        return metrics

    def _progress(self, phase: str, **_: Any) -> None:
        if self._watchdog is not None:
            self._watchdog.progress(phase)

    # ----------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, batch: Optional[Mapping[str, Any]], outputs: Sequence[str],
                 microbatches: Optional[int] = None) -> dict[str, list[torch.Tensor]]:
        """Forward only, in eval mode (no dropout), with the current weights: `batch` (this
        replica's rows; None on pipeline processes that read no input) in `microbatches`
        micro-batches (default: the gradient accumulation), and for each requested output
        this process computes, its value for each micro-batch. A pipeline runs its stages'
        forwards as a step does (collective over the replica's processes); processes that
        compute none of the outputs get {}. Evaluation graphs share the training weights."""
        m = microbatches or self.options.gradient_accumulation
        evaluator = self._evaluator(tuple(outputs), m)
        feeds = {}
        if evaluator.input_names:
            if batch is None:
                raise ValueError(f"this process reads the inputs {list(evaluator.input_names)}: pass a batch")
            specs = {n: self._graph_inputs[n] for n in evaluator.input_names}
            feeds = check_feeds({k: v for k, v in batch.items() if k in specs}, specs, self.device)
        self._progress("evaluating")
        if self.runner is not None:
            found = evaluator.run_forward(feeds, outputs)
        else:
            rows = next(iter(feeds.values())).shape[0]
            if rows % m:
                raise ValueError(f"batch of {rows} rows does not split into {m} micro-batches")
            size = rows // m
            found = {name: [] for name in outputs}
            for i in range(m):
                with self.options.autocast():
                    out = evaluator({k: v[i * size : (i + 1) * size] for k, v in feeds.items()})
                for name in outputs:
                    found[name].append(out[name])
        self._progress("between steps")
        return found

    def reduce_sum(self, values: Sequence[float]) -> list[float]:
        """Each value summed over every process of the run, in float64 (collective when distributed)."""
        total = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        if self.topology.distributed:
            dist.all_reduce(total)
        return total.tolist()

    def _evaluator(self, outputs: tuple[str, ...], microbatches: int):
        """The graph (or this process's pipeline stages) computing `outputs`, sharing the weights."""
        key = (outputs, microbatches)
        if key in self._evaluators:
            return self._evaluators[key]
        shared = {n: p for n, p in self._named}

        def missing(tensor: onnx.TensorProto) -> np.ndarray:
            raise ValueError(f"evaluating {list(outputs)} needs weight {tensor.name!r}, which this process does not "
                             "train (the outputs must come from the trained graph)")

        lower = dict(recompute=False, policy=self.policy, weights=missing, parameters=shared)
        if self.runner is None:
            model = onnx.ModelProto()
            model.CopyFrom(self._declared)
            needed = needed_nodes(model.graph, outputs)
            read = {i for n in model.graph.node if n.name in needed for i in n.input}
            for i in reversed(range(len(model.graph.input))):  # only the inputs the outputs need
                if model.graph.input[i].name not in read:
                    del model.graph.input[i]
            evaluator = LoweredGraph(model, outputs=outputs, **lower).to(self.device).eval()
        else:
            topo = self.topology
            plan = PipelinePlan(self._declared, outputs)
            graphs = {info.index: LoweredGraph(plan.stage_model(self._declared, info.index), outputs=info.outputs,
                                               **lower).to(self.device).eval()
                      for info in plan.local_stages(topo.virtual_graph)}
            rank_of_stage = {s: topo.rank_of(topo.replica, info.virtual_graph) for s, info in plan.stages.items()}
            readers = [info.virtual_graph for info in plan.stages.values() if info.graph_inputs]
            evaluator = PipelineRunner(plan, graphs, rank_of_stage, topo.rank, microbatches, self.device,
                                       self.options.autocast, self.loss, self._progress, stage_group=topo.stage_group,
                                       source_rank=topo.rank_of(topo.replica, min(readers, default=0)),
                                       forward_only=True)
        self._evaluators[key] = evaluator
        return evaluator

    # ---------------------------------------------------------- checkpoints
    def weights_are_finite(self) -> bool:
        """Whether every weight of the model is finite (collective when distributed)."""
        finite = torch.isfinite(self.optimizer.flat_params).all().float().reshape(1)
        if self.topology.distributed:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return bool(finite.item())

    def model_proto(self) -> Optional[onnx.ModelProto]:
        """The graph with the current weights as initializers (collective when distributed:
        the whole model on rank 0, None on the others). For exports and tests of models
        that fit one process; checkpoints never gather the model."""
        mine = ({n: p.detach().float().cpu().contiguous() for n, p in self._named}
                if self.topology.replica == 0 else None)
        parts = self._collective.gather(mine)
        if parts is None:
            return None
        weights = {n: t for part in parts if part is not None for n, t in part.items()}
        model = onnx.ModelProto()
        model.CopyFrom(self._skeleton)
        for name, _ in self._all_weights:
            value = weights[name].numpy()
            tensor = model.graph.initializer.add()
            tensor.name, tensor.data_type = name, onnx.TensorProto.FLOAT
            tensor.dims.extend(value.shape)
            tensor.raw_data = value.tobytes()
        return model

    def _files(self) -> dict[str, dict[str, list[str]]]:
        """Which checkpoint file holds which weights (and their moments): one pair per virtual graph."""
        by_vg: dict[int, list[str]] = {}
        for name, _ in self._all_weights:
            by_vg.setdefault(self._weight_vg[name], []).append(name)
        return {"weights": {weights_file(v): names for v, names in sorted(by_vg.items())},
                "optimizer": {optimizer_file(v): names for v, names in sorted(by_vg.items())}}

    def save(self, directory: str | os.PathLike, extra_state: Optional[dict] = None) -> Optional[Path]:
        """Write the checkpoint atomically (collective when distributed: every process calls
        it and writes what it holds; rank 0 writes the graph and session.json and returns
        the path). Checksums of every file are verified by `load` (session.checkpoint)."""
        self._progress("saving a checkpoint")
        topo = self.topology
        per_rank = self._collective.gather({"rng": self._rng.state(), "extra": extra_state or {}})
        files = self._files()
        shapes = dict(self._all_weights)
        mine = [name for name, _ in self._named]
        vg, writers, owned = topo.virtual_graph, {}, set()
        sharded = isinstance(self.optimizer, ShardedLamb)
        moments = self._moment_file(files["optimizer"][optimizer_file(vg)], shapes)
        if topo.replica == 0:
            writers[weights_file(vg)] = lambda path: self._write_weights(path, files["weights"][weights_file(vg)])
            owned |= {weights_file(vg), optimizer_file(vg)}
        if topo.replica == 0 or sharded:
            writers[optimizer_file(vg)] = lambda path: self._write_moments(path, moments, header=topo.replica == 0)
        if topo.rank == 0:
            state = {
                "step": self.step,
                "loss_scale": self.scaler.scale,
                "loss_scale_clean_steps": self.scaler.clean_steps,
                "topology": {"replicas": topo.replicas, "virtual_graphs": topo.virtual_graphs},
                "per_rank": per_rank,
                "kernels": self.policy.as_dict(),
                "files": files,
                "optimizer": {**self.optimizer.scalar_state(), "names": [n for n, _ in self._all_weights],
                              "shapes": [list(s) for _, s in self._all_weights]},
            }
            writers[MODEL_FILE] = lambda path: onnx.save_model(self._skeleton_with_references(files), str(path))
            writers[STATE_FILE] = lambda path: path.write_text(json.dumps(state))
            owned |= {MODEL_FILE, STATE_FILE}
        assert all(self._weight_vg[n] == vg for n in mine), "a process holds one virtual graph's weights"
        path = checkpoint.write(Path(directory), writers, owned, self._collective,
                                published=self._launch.note_checkpoint if self._launch is not None else None)
        self._progress("between steps")
        return path

    @staticmethod
    def _moment_file(names: list[str], shapes: dict[str, tuple[int, ...]]) -> TensorFile:
        keys = [f"{kind}/{n}" for kind in ("exp_avg", "exp_avg_sq") for n in names]
        sizes = [math.prod(shapes[n]) for _ in range(2) for n in names]
        return TensorFile(keys, sizes)

    def _write_weights(self, path: Path, names: list[str]) -> None:
        params = dict(self._named)
        with open(path, "wb") as f:
            for name in names:  # one tensor at a time
                f.write(params[name].detach().float().cpu().numpy().astype("<f4").tobytes())

    def _write_moments(self, path: Path, moments: TensorFile, header: bool) -> None:
        if header:
            moments.create(path)
        names = self.optimizer.layout.names
        for kind, buffer in (("exp_avg", self.optimizer.exp_avg), ("exp_avg_sq", self.optimizer.exp_avg_sq)):
            for i, first, end, offset in self.optimizer.held_pieces():
                moments.write(path, f"{kind}/{names[i]}", first, buffer[offset : offset + end - first].cpu().numpy())

    def _skeleton_with_references(self, files: dict[str, dict[str, list[str]]]) -> onnx.ModelProto:
        """The graph with every weight as external data in its virtual graph's file."""
        where = {}
        for file, names in files["weights"].items():
            offset = 0
            for name in names:
                where[name] = (file, offset)
                offset += 4 * math.prod(dict(self._all_weights)[name])
        model = onnx.ModelProto()
        model.CopyFrom(self._skeleton)
        for name, shape in self._all_weights:
            file, offset = where[name]
            tensor = model.graph.initializer.add()
            tensor.name, tensor.data_type = name, onnx.TensorProto.FLOAT
            tensor.dims.extend(shape)
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", file), ("offset", str(offset)), ("length", str(4 * math.prod(shape)))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
        return model

    def load(self, directory: str | os.PathLike) -> dict:
        """Restore weights, optimizer, step, loss scale and randomness; returns the extra state.

        Every process reads what it holds from the checkpoint (a shared file system across
        nodes), after checking each file it reads against its checksum. A checkpoint of
        another topology (N replicas resumed by M, with or without sharding or pipelining)
        loads too. The extra state returned is this rank's when the topology is the same,
        else rank 0's with `resharded_from` naming the saved topology, and the randomness
        then starts afresh from (seed, step, rank).
        """
        directory = Path(directory)
        checkpoint.verify(directory, (MODEL_FILE, STATE_FILE), only=(MODEL_FILE, STATE_FILE))
        state = _read_json(directory / STATE_FILE)
        if "files" not in state:
            self._load_legacy(directory)
        else:
            mine = {name for name, _ in self._named}
            optimizer_files = [f for f, names in state["files"]["optimizer"].items() if mine & set(names)]
            self.load_weights(directory, strict=True, verified=(MODEL_FILE,))
            checkpoint.verify(directory, (), only=optimizer_files)
            self.optimizer.load_scalar_state(state["optimizer"], f"checkpoint {directory}")
            self._read_moments(directory, state["files"]["optimizer"])
        self.step = int(state["step"])
        self.scaler.scale = float(state["loss_scale"])
        self.scaler.clean_steps = int(state["loss_scale_clean_steps"])
        self.kernel_changes = self.policy.changes_from(state.get("kernels", {}))
        if self._launch is not None:
            self._launch.note_checkpoint(directory)
        topo = self.topology
        saved = state.get("topology", {"replicas": 1, "virtual_graphs": 1})
        per_rank = state.get("per_rank", [{"rng": {"cpu": state.get("torch_rng")}, "extra": state.get("extra", {})}])
        if saved == {"replicas": topo.replicas, "virtual_graphs": topo.virtual_graphs}:
            mine_state = per_rank[topo.rank]
            self._rng.load(mine_state.get("rng") or {"cpu": mine_state["torch_rng"]})
            return mine_state["extra"]
        self._rng.reseed(self._seed * 1_000_003 + self.step * 1009 + topo.rank)
        return {**per_rank[0]["extra"], "resharded_from": saved}

    def _read_moments(self, directory: Path, files: dict[str, list[str]]) -> None:
        from safetensors import safe_open

        file_of = {name: file for file, names in files.items() for name in names}
        names = self.optimizer.layout.names
        opened: dict[str, Any] = {}
        with contextlib.ExitStack() as stack:
            for kind, buffer in (("exp_avg", self.optimizer.exp_avg), ("exp_avg_sq", self.optimizer.exp_avg_sq)):
                for i, first, end, offset in self.optimizer.held_pieces():
                    file = file_of[names[i]]
                    if file not in opened:
                        opened[file] = stack.enter_context(safe_open(str(directory / file), framework="pt"))
                    buffer[offset : offset + end - first] = opened[file].get_slice(f"{kind}/{names[i]}")[first:end]

    def _load_legacy(self, directory: Path) -> None:
        """A checkpoint written before per-process files: the model inline, one optimizer.pt."""
        checkpoint.verify(directory, (MODEL_FILE, STATE_FILE, LEGACY_OPTIMIZER_FILE))
        self.load_weights(directory / MODEL_FILE)
        try:
            saved = torch.load(directory / LEGACY_OPTIMIZER_FILE, map_location="cpu", weights_only=True)["optimizer"]
        except Exception as e:
            raise ValueError(f"checkpoint {directory}: {LEGACY_OPTIMIZER_FILE} is unreadable ({e})") from None
        self.optimizer.load_state_dict(select_state(saved, self.optimizer.parameter_names))

    def export(self, path: str | os.PathLike, portable: bool = True, **kwargs) -> Optional[Path]:
        """Write the current model for serving (session.export.export_model: standard ONNX when
        portable). Collective when distributed: rank 0 writes and returns the path."""
        model = self.model_proto()
        return None if model is None else export_model(model, path, portable=portable, **kwargs)

    def load_weights(self, model: ModelLike, strict: bool = True, verified: Sequence[str] = ()) -> list[str]:
        """Copy this process's weights by name from an ONNX model, a model file or a checkpoint
        directory (e.g. phase 1 → phase 2), reading only the tensors it holds; returns the
        names not found (an error when `strict`)."""
        if isinstance(model, onnx.ModelProto):
            proto, reader = model, WeightReader(None, None, "the model")
        else:
            path = Path(model)
            if path.is_dir():
                if (path / checkpoint.CHECKSUMS_FILE).exists():
                    checkpoint.verify(path, (MODEL_FILE,), only=[f for f in (MODEL_FILE,) if f not in verified])
                path = path / MODEL_FILE
            proto, reader = load_without_data(path), WeightReader(path.parent, None, str(path))
            if (path.parent / checkpoint.CHECKSUMS_FILE).exists():
                mine = {name for name, _ in self._named}
                external = {e.value for t in proto.graph.initializer if t.name in mine
                            for e in t.external_data if e.key == "location"}
                checkpoint.verify(path.parent, (), only=sorted(external))
        state = _LazyWeights({t.name: t for t in proto.graph.initializer}, reader)
        missing = []
        for graph in self.graphs.values():
            missing += graph.load_weights(state, strict=strict)
        return list(dict.fromkeys(missing))


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def _copy_fields(source, target, skip: str) -> None:
    """Copy the set fields of one protobuf message into another, all but `skip`."""
    for field, value in source.ListFields():
        if field.name == skip:
            continue
        if hasattr(value, "extend"):  # a repeated field
            getattr(target, field.name).extend(value)
        elif field.message_type is not None:
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)


__all__ = ["OptimizerSpec", "TrainingSession"]
