"""TrainingSession: forward, backward and the optimizer step over a lowered graph.

PopART counterpart: `popart.TrainingSession(fnModel, loss, optimizer, dataFlow, ...)`
whose `run(stepio)` consumes micro-batch × accumulation samples and makes one weight
update. Here `run(batch)` takes a batch of `micro_batch × gradient_accumulation` rows
(this replica's rows, when replicated), runs each micro-batch forward and backward (the
loss of each divided by the number of micro-batches: PopART's Mean reduction), then one
optimizer step at the scheduled learning rate. It returns the anchors (scalar outputs)
averaged over micro-batches and replicas.

Scale-out (docs/distributed.md): launched by torchrun, the session joins the process
group and runs as one replica (`replication_factor`), or one virtual graph of a
replica's pipeline (`pipelining`); gradients are mean-reduced over the replicas while
backward runs (session.replication), optionally with the optimizer state and
gradients sharded over them (`replicated_tensor_sharding`). Checkpoints always hold
the whole, unsharded state, so a run resumes with any number of processes.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence

import onnx
import torch
import torch.distributed as dist

from session import checkpoint
from session.distributed import Topology, init_topology, local_device, watchdog_for
from session.export import export_model
from session.inference import check_feeds, input_specs
from session.lowering import LoweredGraph
from session.model_io import ModelLike, load_model, save_model
from session.optimizers import Lamb, merge_states, select_state
from session.options import Precision, SessionOptions
from session.pipeline import PipelinePlan, PipelineRunner
from session.replication import GradientReducer, ShardedLamb
from session.schedules import Schedule, set_lr

MODEL_FILE = "model.onnx"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "session.json"


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer and its hyperparameters (PopART: popart.Adam in Lamb mode, ...).

    Biases and LayerNorm parameters take no weight decay and, for LAMB, no trust
    ratio (`session.optimizers.no_weight_decay`). Both kinds run the fused flat-buffer step.
    """

    kind: Literal["lamb", "adamw"] = "lamb"
    schedule: Schedule = Schedule(base_lr=1e-3, warmup_steps=0, total_steps=1, decay="constant")
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.01
    max_grad_norm: Optional[float] = None
    max_trust_ratio: Optional[float] = None


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


class TrainingSession:
    def __init__(
        self,
        model: ModelLike,
        loss: str = "loss",
        optimizer: OptimizerSpec = OptimizerSpec(),
        options: Optional[SessionOptions] = None,
        anchors: Optional[Sequence[str]] = None,
        seed: int = 0,
    ):
        proto = load_model(model)
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
        self.device = local_device(torch.device(options.device))
        self.topology: Topology = init_topology(
            options.replication_factor, plan.virtual_graphs if plan else 1, self.device)
        topo = self.topology
        if options.pipelining and topo.world_size == 1:
            raise ValueError("pipelining needs one process per virtual graph: launch with "
                             f"`torchrun --nproc-per-node {plan.virtual_graphs} bert.py ...`")
        self.watchdog = watchdog_for(topo, options.fault_timeout) if topo.distributed else None
        progress = self.watchdog.progress if self.watchdog else (lambda *_, **__: None)

        # The graph, or this process's stages of it (a weight two of them use is one tensor).
        self.graphs: dict[int, LoweredGraph] = {}
        if plan is None:
            self.graphs[0] = LoweredGraph(proto, recompute=options.recompute, outputs=self._fetch)
        else:
            shared: dict[str, torch.nn.Parameter] = {}
            for info in plan.local_stages(topo.virtual_graph):
                graph = LoweredGraph(plan.stage_model(proto, info.index), recompute=options.recompute,
                                     outputs=info.outputs, parameters=shared)
                shared.update(graph.named_weights())
                self.graphs[info.index] = graph
        for graph in self.graphs.values():
            graph.to(self.device).train()
        self.graph = self.graphs[0] if plan is None else None
        order = {t.name: i for i, t in enumerate(proto.graph.initializer)}
        self._all_weight_names = [t.name for t in proto.graph.initializer]
        named = {n: p for g in self.graphs.values() for n, p in g.named_weights()}
        self._named = sorted(named.items(), key=lambda item: order[item[0]])
        # The graph structure, without its weights, to write checkpoints from.
        self._skeleton = self._copy_without_weights(proto)
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
            self.runner = PipelineRunner(plan, self._forward, rank_of_stage, topo.rank, options.gradient_accumulation,
                                         self.device, options.autocast, loss, progress)
        self._seed = seed
        torch.manual_seed(seed + topo.rank)
        # What each graph input this process reads accepts (dtype, dims, id ranges).
        self._input_specs = {n: spec for n, spec in input_specs(proto).items() if n in self.input_names}

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
                      bucket_numel=max(1, int(options.gradient_bucket_mb * 2**20 / 4)) if topo.replicas > 1 else None)
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
        self.optimizer.zero_grad()
        scale = self.scaler.scale
        if self.runner is not None:
            totals = self.runner.run(feeds, scale, self._fetch, self.reducer)
        else:
            totals = self._run_microbatches(feeds, scale)
        if self.reducer is not None:
            self._progress("reducing gradients", waiting=True)
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
            self._progress("averaging the anchors", waiting=True)
            dist.all_reduce(values)
            values[:-1] /= topo.replicas
        values = values.tolist()
        self.stop_agreed = values[-1] > 0
        metrics = dict(zip(self._fetch, values))
        metrics = {name: metrics[name] for name in self.anchors} | {self.loss: metrics[self.loss]}
        metrics["learning_rate"] = self.learning_rate
        overflow = not math.isfinite(metrics[self.loss])
        if not overflow:
            self._progress("optimizer step", waiting=self.topology.distributed)  # mostly collectives
            set_lr(self.optimizer, self.learning_rate)
            self.optimizer.step(loss_scale=scale * topo.replicas)
            overflow = self.optimizer.skipped
        self.scaler.update(overflow)
        if not overflow:
            self.step += 1
        metrics["grad_norm"] = self.optimizer.grad_norm if not overflow else float("nan")
        metrics["loss_scale"] = scale
        metrics["skipped"] = float(overflow)
        if self.watchdog is not None:
            self.watchdog.step_done(self.step)
        return metrics

    def _progress(self, phase: str, waiting: bool = False) -> None:
        if self.watchdog is not None:
            self.watchdog.progress(phase, waiting=waiting)

    # ---------------------------------------------------------- checkpoints
    def weights_are_finite(self) -> bool:
        """Whether every weight of the model is finite (collective when distributed)."""
        finite = torch.isfinite(self.optimizer.flat_params).all().float().reshape(1)
        if self.topology.distributed:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        return bool(finite.item())

    def _gather(self, local: Any) -> Optional[list[Any]]:
        """Collective: every process's `local` object on rank 0 (None elsewhere)."""
        if not self.topology.distributed:
            return [local]
        out = [None] * self.topology.world_size if self.topology.rank == 0 else None
        dist.gather_object(local, out, dst=0)
        return out

    def _gathered_state(self, optimizer: bool = True) -> Optional[tuple[dict[str, torch.Tensor], Optional[dict]]]:
        """Collective: all weights and (optionally) the whole optimizer state, on rank 0."""
        weights = {n: p.detach().float().cpu().contiguous() for n, p in self._named}
        state = self.optimizer.state_dict() if optimizer else None  # collective when sharded; None off replica 0
        parts = self._gather((weights, _to_cpu(state)) if self.topology.replica == 0 else None)
        if parts is None:
            return None
        parts = [p for p in parts if p is not None]
        all_weights = {n: t for w, _ in parts for n, t in w.items()}
        if optimizer:
            state = merge_states([o for _, o in parts], [n for n in self._all_weight_names if n in all_weights])
        return all_weights, state

    def model_proto(self) -> Optional[onnx.ModelProto]:
        """The graph with the current weights as initializers (collective when distributed:
        the whole model on rank 0, None on the others)."""
        gathered = self._gathered_state(optimizer=False)
        return None if gathered is None else self._proto_with(gathered[0])

    def _proto_with(self, weights: dict[str, torch.Tensor]) -> onnx.ModelProto:
        model = onnx.ModelProto()
        model.CopyFrom(self._skeleton)
        for name in self._all_weight_names:
            if name not in weights:
                continue
            value = weights[name].numpy()
            tensor = model.graph.initializer.add()
            tensor.name, tensor.data_type = name, onnx.TensorProto.FLOAT
            tensor.dims.extend(value.shape)
            tensor.raw_data = value.tobytes()
        return model

    def save(self, directory: str | os.PathLike, extra_state: Optional[dict] = None) -> Optional[Path]:
        """Write model.onnx, the optimizer state and session.json atomically (collective when
        distributed: every process calls it; rank 0 writes; returns the path there).

        Everything goes to a temporary sibling first, which is renamed into place: a crash
        leaves the previous checkpoint (or none), never a half-written one; the files'
        checksums are verified by `load` (session.checkpoint).
        """
        context = self.watchdog.long_operation("saving a checkpoint") if self.watchdog else contextlib.nullcontext()
        with context:
            gathered = self._gathered_state()
            per_rank = self._gather({"torch_rng": torch.get_rng_state().tolist(), "extra": extra_state or {}})
            if gathered is None:
                return None
            weights, optimizer_state = gathered
            topo = self.topology
            state = {
                "step": self.step,
                "loss_scale": self.scaler.scale,
                "loss_scale_clean_steps": self.scaler.clean_steps,
                "torch_rng": per_rank[0]["torch_rng"],
                "extra": per_rank[0]["extra"],
                "topology": {"replicas": topo.replicas, "virtual_graphs": topo.virtual_graphs},
                "per_rank": per_rank,
            }
            return checkpoint.write(Path(directory), {
                MODEL_FILE: lambda path: save_model(self._proto_with(weights), path),
                OPTIMIZER_FILE: lambda path: torch.save({"optimizer": optimizer_state}, path),
                STATE_FILE: lambda path: path.write_text(json.dumps(state)),
            })

    def load(self, directory: str | os.PathLike) -> dict:
        """Restore weights, optimizer, step, loss scale and RNG; returns the extra state.

        Every process reads the checkpoint (a shared file system across nodes). A
        checkpoint of another topology (N replicas resumed by M, with or without sharding
        or pipelining) loads too: the state is whole. The extra state returned is this
        rank's when the topology is the same, else rank 0's with `resharded_from`
        naming the saved topology, and the RNG then starts afresh from (seed, step, rank).
        """
        directory = Path(directory)
        checkpoint.verify(directory, (MODEL_FILE, OPTIMIZER_FILE, STATE_FILE))
        self.load_weights(directory / MODEL_FILE)
        state = json.loads((directory / STATE_FILE).read_text())
        optimizer_state = torch.load(directory / OPTIMIZER_FILE, map_location="cpu", weights_only=True)["optimizer"]
        self.optimizer.load_state_dict(select_state(optimizer_state, self.optimizer.parameter_names))
        self.step = int(state["step"])
        self.scaler.scale = float(state["loss_scale"])
        self.scaler.clean_steps = int(state["loss_scale_clean_steps"])
        topo = self.topology
        saved = state.get("topology", {"replicas": 1, "virtual_graphs": 1})
        per_rank = state.get("per_rank", [{"torch_rng": state["torch_rng"], "extra": state["extra"]}])
        if saved == {"replicas": topo.replicas, "virtual_graphs": topo.virtual_graphs}:
            mine = per_rank[topo.rank]
            torch.set_rng_state(torch.tensor(mine["torch_rng"], dtype=torch.uint8))
            return mine["extra"]
        torch.manual_seed(self._seed * 1_000_003 + self.step * 1009 + topo.rank)
        return {**per_rank[0]["extra"], "resharded_from": saved}

    def export(self, path: str | os.PathLike, portable: bool = True, **kwargs) -> Optional[Path]:
        """Write the current model for serving (session.export.export_model: standard ONNX when
        portable). Collective when distributed: rank 0 writes and returns the path."""
        model = self.model_proto()
        return None if model is None else export_model(model, path, portable=portable, **kwargs)

    def load_weights(self, model: ModelLike, strict: bool = True) -> list[str]:
        """Copy weights by name from an ONNX model or checkpoint directory (e.g. phase 1 → phase 2)."""
        if not isinstance(model, onnx.ModelProto) and Path(model).is_dir():
            if (Path(model) / checkpoint.CHECKSUMS_FILE).exists():
                checkpoint.verify(Path(model), (MODEL_FILE,))
            model = Path(model) / MODEL_FILE
        proto = load_model(model)
        state = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
        missing = []
        for graph in self.graphs.values():
            missing += graph.load_weights(state, strict=strict)
        return list(dict.fromkeys(missing))


def _to_cpu(state: Any) -> Any:
    if torch.is_tensor(state):
        return state.cpu()
    if isinstance(state, dict):
        return {k: _to_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_to_cpu(v) for v in state]
    return state


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
