"""TrainingSession: forward, backward and the optimizer step over a lowered graph.

PopART counterpart: `popart.TrainingSession(fnModel, loss, optimizer, dataFlow, ...)`
whose `run(stepio)` consumes micro-batch × accumulation samples and makes one weight
update. Here `run(batch)` takes a batch of `micro_batch × gradient_accumulation` rows
(this replica's rows, when replicated), runs each micro-batch forward and backward (the
loss of each divided by the number of micro-batches: PopART's Mean reduction), then one
optimizer step at the scheduled learning rate. It returns the anchors (scalar outputs)
averaged over micro-batches and replicas.

The session owns what is its own: the topology of the run, the optimizer and its
step, the loss scale, its randomness and the step count. How the micro-batches run
through the graph is its `Executor` (session.executor: the whole graph here, or this
process's pipeline stages), which it never asks about.

Scale-out (docs/distributed.md): in a process of a launched job (inside
`session.distributed.launch`), the session runs as one replica (`replication_factor`)
or one virtual graph of a replica's pipeline (`pipelining`), and materialises only the
weights and optimizer state of its own stages: the graph's weights are read one at a
time, from the proto, its external data or, for a graph that only declares them, the
`weights` callable (the builder's seeded initial values). Gradients are mean-reduced
over the replicas while backward runs (session.replication), optionally with the
optimizer state and gradients sharded over them (`replicated_tensor_sharding`).

Checkpoints (session.checkpoint owns their format) are written by every process for
what it holds (its stages' weights, its shard of the moments) and read back by name,
so a run resumes with any number of processes and no process ever holds the whole model.

A session changes nothing process-wide: its randomness (dropout, including what
recompute replays) comes from its own generator state, swapped in around its forward
and backward passes; process groups it makes are freed by `close()`.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import onnx
import torch
import torch.distributed as dist

from session import checkpoint, distributed
from session.distributed import Topology, local_device, make_topology
from session.executor import ExecutionContext, Executor, plan_execution
from session.export import export_model
from session.inference import InputSpec, check_feeds, input_specs
from session.kernel_tuning import conv_shape, graph_digest, measure_graph
from session.kernels import KernelPolicy, choose_kernels
from session.model_io import ModelLike, ModelSkeleton, WeightReader, load_without_data
from session.optimizers import OPTIMIZERS, FlatOptimizer, NoDecay, fewer_than_two_dims
from session.options import Precision, SessionOptions
from session.replication import GradientReducer, ShardedBuffers
from session.schedules import Schedule, set_lr
from session.state import LossScaler, SessionRandomness

__all__ = ["OptimizerSpec", "TrainingSession"]


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer (a name of `session.optimizers.OPTIMIZERS`) and its hyperparameters
    (PopART: popart.Adam in Lamb mode, ...): the learning rate's schedule, the weight decay and
    the gradient clipping, which every rule takes, and `hyperparameters`, the rule's own by the
    names its declaration gives (session/hyperparameters.py: LAMB's `betas`, `eps`,
    `max_trust_ratio`; Lion's `beta1`, `beta2`; ...); those not given take the rule's defaults.

    The tensors `no_decay(name, shape)` names (default: those of fewer than two
    dimensions) take no weight decay and, for LAMB, no trust ratio.
    """

    kind: str = "lamb"
    schedule: Schedule = Schedule(base_lr=1e-3, warmup_steps=0, total_steps=1, decay="constant")
    weight_decay: float = 0.01
    max_grad_norm: Optional[float] = None
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    no_decay: NoDecay = fewer_than_two_dims


class _Processes(checkpoint.Collective):
    """Collectives over every process of the run (the identity in one process)."""

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
        self.loss, self.anchors = loss, _anchors(proto, loss, anchors)
        self._fetch = list(dict.fromkeys([loss, *self.anchors]))  # only these are computed
        plan = plan_execution(proto, self._fetch, options.pipelining)
        self.device = local_device(torch.device(options.device))
        self._launch = distributed.current()
        self._watchdog = self._launch.watchdog if self._launch is not None else None
        self.topology: Topology = make_topology(options.replication_factor, plan.virtual_graphs)
        self.policy: KernelPolicy = choose_kernels(self.device, options.precision, compile=options.compile,
                                                   overrides=options.kernels, conv=conv_shape(proto))
        if self.policy.measured:  # every process timed it: rank 0's choice holds for all, one program everywhere
            conv, measured = _Processes(self.topology).broadcast((self.policy.conv, self.policy.measured))
            self.policy = dataclasses.replace(self.policy, conv=conv, measured=measured)
        self.resume_notes: list[str] = []  # set by `load`: what differs from the run that wrote the checkpoint
        self._context = ExecutionContext(self.topology, self.device, options.autocast, self.policy, options.compile,
                                         self._progress)
        self.executor: Executor = plan.executor(self._context, options.gradient_accumulation, loss=loss,
                                                recompute=options.recompute, weights=reader)
        self._model = ModelSkeleton(proto, plan.weight_placement())
        named = {n: p for g in self.executor.graphs.values() for n, p in g.named_weights()}
        self._named = sorted(named.items(), key=lambda item: self._model.order[item[0]])
        self.spec = optimizer
        self.optimizer = self._make_optimizer(optimizer, seed)
        # How many of this process's graphs give each weight a gradient per micro-batch.
        uses = [sum(name in g.parameter_names for g in self.executor.graphs.values()) for name, _ in self._named]
        self.reducer = (GradientReducer(self.optimizer, self.topology.replica_group, options.gradient_accumulation,
                                        uses) if self.topology.replicas > 1 else None)
        self._sync_replicas()
        self.scaler = LossScaler(options.loss_scaling if options.precision is Precision.FP16 else None)
        self.step = 0
        self._stop_requested = False
        self.stop_agreed = False
        # Each rank's seconds of work in the last step (its forward and backward passes, not
        # the wait for the others' gradients): where ranks differ, the slow one shows.
        self.rank_seconds: list[float] = []
        self._seed = seed
        self._rng = SessionRandomness(seed + self.topology.rank, self.device)
        self._collective = _Processes(self.topology)
        self._graph_inputs = input_specs(proto)  # what each graph input accepts (dtype, dims, id ranges)
        self._evaluators: dict[tuple, Executor] = {}
        self._digest = graph_digest(proto)
        self.notes: list[str] = []  # lines for the run's log: kernel choices made on the first step
        self._closed = False

    def _make_optimizer(self, spec: OptimizerSpec, seed: int) -> FlatOptimizer:
        rule = OPTIMIZERS.get(spec.kind)
        if rule is None:
            raise ValueError(f"unknown optimizer {spec.kind!r}; use one of {sorted(OPTIMIZERS)}")
        topo, options = self.topology, self.options
        sharded = topo.replicas > 1 and options.replicated_tensor_sharding
        own = rule.own_hyperparameters(spec.hyperparameters, f"optimizer {spec.kind!r}")
        return rule(self._named, lr=spec.schedule(0), weight_decay=spec.weight_decay, **own,
                    max_grad_norm=spec.max_grad_norm, seed=seed, stage_group=topo.stage_group,
                    bucket_numel=max(1, int(options.gradient_bucket_mb * 2**20 / 4)) if topo.replicas > 1 else None,
                    no_decay=spec.no_decay, fused=self.policy.lamb == "compiled",
                    holding=ShardedBuffers(topo.replica_group) if sharded else None)

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
    def weight_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every weight of the model (all processes' together) with its shape, in the graph's order."""
        return list(self._model.weights)

    @property
    def input_names(self) -> tuple[str, ...]:
        """The graph inputs this process reads (none for a pipeline's middle stages)."""
        return self.executor.input_names

    @property
    def input_specs(self) -> dict[str, InputSpec]:
        """What each graph input accepts: dtype, dims (a symbol such as "batch" for the rows) and value range."""
        return dict(self._graph_inputs)

    @property
    def needs_data(self) -> bool:
        return bool(self.input_names)

    def _feeds(self, batch: Optional[Mapping[str, Any]], names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The inputs `names` of `batch`, checked as InferenceSession checks them (keys the
        graph does not read are ignored)."""
        if not names:
            return {}
        if batch is None:
            raise ValueError(f"this process reads the inputs {list(names)}: pass a batch")
        specs = {n: self._graph_inputs[n] for n in names}
        return check_feeds({k: v for k, v in batch.items() if k in specs}, specs, self.device)

    # ------------------------------------------------------------------ run
    @property
    def learning_rate(self) -> float:
        return self.spec.schedule(self.step)

    def request_stop(self) -> None:
        """Ask every process to stop after the current step (a signal arrived here)."""
        self._stop_requested = True

    def run(self, batch: Optional[Mapping[str, Any]], learning_rate: Optional[float] = None) -> dict[str, float]:
        """One optimizer step over `batch` (micro_batch × gradient_accumulation rows of this
        replica; None on pipeline processes that read no input) at `learning_rate` (default:
        the schedule's at this step; a run keyed to its time spent passes its own)."""
        feeds = self._feeds(batch, self.input_names)
        if self._watchdog is not None:
            self._watchdog.at(self.step + 1, "starting the step")
        if self.policy.graph == "measure":
            self._decide_graph(feeds)
        self.optimizer.zero_grad()
        scale = self.scaler.scale
        began = time.perf_counter()
        with self._rng.active():
            totals = self.executor.train_step(feeds, scale, self.reducer)
        busy = time.perf_counter() - began
        if self.reducer is not None:
            self._progress("reducing gradients")
            self.reducer.finish()
        return self._finish_step(totals, scale, self.learning_rate if learning_rate is None else learning_rate, busy)

    def _decide_graph(self, feeds: dict[str, torch.Tensor]) -> None:
        """graph=measure: eager, compiled or (CUDA) CUDA graphs, whichever runs this first
        micro-batch fastest here (session/kernel_tuning.py); rank 0's choice holds for every process. The measurement's
        dropout draws come from a forked generator: the run's randomness is as without it."""
        runners = self.executor.graph_runners(feeds)
        if runners is None:
            winner, text = "eager", "graph=eager: not measured with pipelining"
        else:
            self._progress(f"timing the program: {', '.join(runners)}")
            rows = {k: (v.shape[0] // self.executor.microbatches, *v.shape[1:]) for k, v in sorted(feeds.items())}
            others = " ".join(f"{op}={impl}" for op, impl in self.policy.choices().items() if op != "graph")
            signature = f"{self._digest} | micro-batch {rows} | {others}"
            passes = max(1, self.spec.schedule.total_steps - self.step) * self.executor.microbatches
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                measured = measure_graph(self.device, self.policy.precision, signature, runners, passes)
            winner, text = measured.winner, measured.text()
        winner, text = self._collective.broadcast((winner, text))
        self.executor.compile_graphs(winner)
        self.policy = dataclasses.replace(self.policy, graph=winner,
                                          measured="; ".join(t for t in (self.policy.measured, text) if t))
        self._context = dataclasses.replace(self._context, policy=self.policy)  # evaluators follow it
        self.notes.append(f"kernels: {text}")

    def _finish_step(self, totals: torch.Tensor, scale: float, learning_rate: float,
                     busy: float = 0.0) -> dict[str, float]:
        topo = self.topology
        n = len(totals)
        # One all-reduce carries the anchors, the stop flag and, each in its own slot, every
        # rank's busy seconds.
        values = torch.zeros(n + 1 + topo.world_size, dtype=totals.dtype, device=totals.device)
        values[:n] = totals
        values[n] = float(self._stop_requested)
        values[n + 1 + topo.rank] = busy
        if topo.distributed:
            # The anchors live where the heads are: one process per replica adds them.
            self._progress("averaging the anchors")
            dist.all_reduce(values)
            values[:n] /= topo.replicas
        values = values.tolist()
        self.stop_agreed = values[n] > 0
        self.rank_seconds = values[n + 1 :]
        metrics = dict(zip(self._fetch, values[:n]))
        metrics = {name: metrics[name] for name in self.anchors} | {self.loss: metrics[self.loss]}
        metrics["learning_rate"] = learning_rate
        overflow = not math.isfinite(metrics[self.loss])
        if not overflow:
            self._progress("optimizer step")
            set_lr(self.optimizer, learning_rate)
            self.optimizer.step(loss_scale=scale * topo.replicas)
            overflow = self.optimizer.skipped
        self.scaler.update(overflow)
        if not overflow:
            self.step += 1
        metrics["grad_norm"] = self.optimizer.grad_norm if not overflow else float("nan")
        metrics["loss_scale"] = scale
        metrics["skipped"] = float(overflow)
        if self._watchdog is not None:
            self._watchdog.after(self.step)
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
        executor = self._evaluator(tuple(outputs), microbatches or self.options.gradient_accumulation)
        feeds = self._feeds(batch, executor.input_names)
        self._progress("evaluating")
        found = executor.forward(feeds, outputs)
        self._progress("between steps")
        return found

    def _evaluator(self, outputs: tuple[str, ...], microbatches: int) -> Executor:
        """The executor computing `outputs` with this process's weights (made once per outputs and count)."""
        key = (outputs, microbatches)
        if key not in self._evaluators:
            def missing(tensor: onnx.TensorProto) -> np.ndarray:
                raise ValueError(f"evaluating {list(outputs)} needs weight {tensor.name!r}, which this process does "
                                 "not train (the outputs must come from the trained graph)")

            plan = plan_execution(self._model.declared_for(outputs), outputs, self.options.pipelining)
            self._evaluators[key] = plan.executor(self._context, microbatches, weights=missing,
                                                  parameters=dict(self._named))
        return self._evaluators[key]

    # ---------------------------------------------------------- collectives
    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` (any picklable object) on every process (collective when distributed)."""
        return self._collective.broadcast(value)

    def gather(self, value: Any) -> Optional[list[Any]]:
        """Every process's `value` on rank 0, in rank order; None elsewhere (collective when distributed)."""
        return self._collective.gather(value)

    def reduce_sum(self, values: Sequence[float]) -> list[float]:
        """Each value summed over every process of the run, in float64 (collective when distributed)."""
        total = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        if self.topology.distributed:
            dist.all_reduce(total)
        return total.tolist()

    def weights_are_finite(self) -> bool:
        """Whether every weight of the model is finite (collective when distributed)."""
        finite = torch.isfinite(self.optimizer.flat_params).all().float().reshape(1)
        if self.topology.distributed:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return bool(finite.item())

    # ---------------------------------------------------------- checkpoints
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
        return self._model.with_weights({name: weights[name].numpy() for name, _ in self._model.weights})

    def save(self, directory: str | os.PathLike, extra_state: Optional[dict] = None) -> Optional[Path]:
        """Write the checkpoint atomically (collective when distributed: every process calls
        it and writes what it holds; rank 0 writes the graph and session.json and returns
        the path). Checksums of every file are verified by `load` (session.checkpoint)."""
        self._progress("saving a checkpoint")
        topo = self.topology
        per_rank = self._collective.gather({"rng": self._rng.state(), "extra": extra_state or {}})
        state = checkpoint.SessionState(
            step=self.step, loss_scale=self.scaler.scale, loss_scale_clean_steps=self.scaler.clean_steps,
            topology={"replicas": topo.replicas, "virtual_graphs": topo.virtual_graphs}, per_rank=per_rank or [],
            kernels=self.policy.as_dict(),
            optimizer={**self.optimizer.scalar_state(), "names": [n for n, _ in self._model.weights],
                       "shapes": [list(s) for _, s in self._model.weights]})
        holdings = checkpoint.Holdings(
            self._model.skeleton, self._model.weights, self._model.placement, dict(self._named), self.optimizer,
            topo.virtual_graph, first_replica=topo.replica == 0, lead=topo.rank == 0)
        path = checkpoint.save(Path(directory), holdings, state, self._collective,
                               published=self._launch.note_checkpoint if self._launch is not None else None)
        if self._launch is not None:  # every process knows it now (rank 0 published it at once)
            self._launch.note_checkpoint(directory)
        self._progress("between steps")
        return path

    def load(self, directory: str | os.PathLike) -> dict:
        """Restore weights, optimizer, step, loss scale and randomness; returns the extra state.

        Every process reads what it holds from the checkpoint (a shared file system across
        nodes), after checking each file it reads against its checksum. A checkpoint of
        another topology (N replicas resumed by M, with or without sharding or pipelining)
        loads too. The extra state returned is this rank's when the topology is the same,
        else rank 0's with `resharded_from` naming the saved topology, and the randomness
        then starts afresh from (seed, step, rank). `resume_notes` says what differs from
        the run that wrote it (an older format, other kernels).
        """
        directory = Path(directory)
        state = checkpoint.read_state(directory)
        self.load_weights(directory, strict=True)
        checkpoint.read_optimizer(directory, state, self.optimizer)
        self.step = state.step
        self.scaler.scale, self.scaler.clean_steps = state.loss_scale, state.loss_scale_clean_steps
        changes = self.policy.changes_from(state.kernels)
        self.resume_notes = ([f"{directory} is in checkpoint {state.old}: it loads, and new checkpoints are written in "
                              f"format {checkpoint.FORMAT}"] if state.old else []) + \
            ([f"this host runs other kernels than the run it resumes ({'; '.join(changes)}): it continues, but not "
              "bit for bit"] if changes else [])
        if self._launch is not None:
            self._launch.note_checkpoint(directory)
        if self._watchdog is not None:
            self._watchdog.after(self.step)
        topo = self.topology
        if state.topology == {"replicas": topo.replicas, "virtual_graphs": topo.virtual_graphs}:
            mine = state.per_rank[topo.rank]
            self._rng.load(mine["rng"])
            return mine["extra"]
        self._rng.reseed(self._seed * 1_000_003 + self.step * 1009 + topo.rank)
        return {**state.per_rank[0]["extra"], "resharded_from": state.topology}

    def load_weights(self, model: ModelLike, strict: bool = True) -> list[str]:
        """Copy this process's weights by name from an ONNX model, a model file or a checkpoint
        directory (e.g. phase 1 → phase 2), reading only the tensors it holds; returns the
        names not found (an error when `strict`)."""
        weights = checkpoint.model_weights(model, [name for name, _ in self._named])
        missing = []
        for graph in self.executor.graphs.values():
            missing += graph.load_weights(weights, strict=strict)
        return list(dict.fromkeys(missing))

    def export(self, path: str | os.PathLike, portable: bool = True, **kwargs) -> Optional[Path]:
        """Write the current model for serving (session.export.export_model: standard ONNX when
        portable). Collective when distributed: rank 0 writes and returns the path."""
        model = self.model_proto()
        return None if model is None else export_model(model, path, portable=portable, **kwargs)


def _anchors(proto: onnx.ModelProto, loss: str, anchors: Optional[Sequence[str]]) -> tuple[str, ...]:
    """The outputs each run returns (default: every scalar output), after checking the loss is one."""
    names = [o.name for o in proto.graph.output]
    if loss not in names:
        raise ValueError(f"loss {loss!r} is not a graph output; outputs are {names}")
    if anchors is not None:
        return tuple(anchors)
    return tuple(o.name for o in proto.graph.output if len(o.type.tensor_type.shape.dim) == 0)
