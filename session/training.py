"""TrainingSession: forward, backward and the optimizer step over a lowered graph.

PopART counterpart: `popart.TrainingSession(fnModel, loss, optimizer, dataFlow, ...)`
whose `run(stepio)` consumes micro-batch × accumulation samples and makes one weight
update. Here `run(batch)` takes a batch of `micro_batch × gradient_accumulation` rows,
runs each micro-batch forward and backward (the loss of each divided by the number of
micro-batches: PopART's Mean reduction), then one optimizer step at the scheduled
learning rate. It returns the anchors (scalar outputs) averaged over micro-batches.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence

import onnx
import torch

from session.inference import to_feeds
from session.lowering import LoweredGraph
from session.model_io import ModelLike, load_model, save_model
from session.optimizers import Lamb, adamw
from session.options import Precision, SessionOptions
from session.schedules import Schedule, set_lr

MODEL_FILE = "model.onnx"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "session.json"


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer and its hyperparameters (PopART: popart.Adam in Lamb mode, ...).

    Biases and LayerNorm parameters take no weight decay and, for LAMB, no trust
    ratio (`session.optimizers.no_weight_decay`).
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
        if overflow:
            self.scale = max(self.scale / 2, 1.0)
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
        self.options = options or SessionOptions()
        if self.options.replication_factor != 1 or self.options.pipelining or self.options.replicated_tensor_sharding:
            raise ValueError("replication, RTS and pipelining are not available in TrainingSession yet; "
                             "set replication_factor=1, pipelining=False, replicated_tensor_sharding=False")
        self.device = torch.device(self.options.device)
        names = [o.name for o in proto.graph.output]
        if loss not in names:
            raise ValueError(f"loss {loss!r} is not a graph output; outputs are {names}")
        self.loss = loss
        scalar = [o.name for o in proto.graph.output if len(o.type.tensor_type.shape.dim) == 0]
        # Anchors: the outputs each run returns (default: every scalar output). Only they
        # and the loss are computed.
        self.anchors = tuple(anchors) if anchors is not None else tuple(scalar)
        computed = list(dict.fromkeys([loss, *self.anchors]))
        self.graph = LoweredGraph(proto, recompute=self.options.recompute, outputs=computed).to(self.device).train()
        # The graph structure, without its weights, to write checkpoints from.
        self._skeleton = self._copy_without_weights(proto)
        self.spec = optimizer
        self.optimizer = self._make_optimizer(optimizer, seed)
        self.scaler = _LossScaler(self.options.loss_scaling if self.options.precision is Precision.FP16 else None)
        self.step = 0
        self._forward = torch.compile(self.graph) if self.options.compile else self.graph
        torch.manual_seed(seed)

    @staticmethod
    def _copy_without_weights(proto: onnx.ModelProto) -> onnx.ModelProto:
        """The model with every field but the initializers (never copies the weights)."""
        skeleton = onnx.ModelProto()
        _copy_fields(proto, skeleton, skip="graph")
        _copy_fields(proto.graph, skeleton.graph, skip="initializer")
        return skeleton

    def _make_optimizer(self, spec: OptimizerSpec, seed: int) -> torch.optim.Optimizer:
        named = list(self.graph.named_weights())
        lr = spec.schedule(0)
        if spec.kind == "lamb":
            return Lamb(named, lr=lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay,
                        max_grad_norm=spec.max_grad_norm, max_trust_ratio=spec.max_trust_ratio, seed=seed)
        if spec.kind == "adamw":
            return adamw(named, lr=lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
        raise ValueError(f"unknown optimizer {spec.kind!r}; use 'lamb' or 'adamw'")

    # ------------------------------------------------------------------ run
    @property
    def learning_rate(self) -> float:
        return self.spec.schedule(self.step)

    def run(self, batch: Mapping[str, Any]) -> dict[str, float]:
        """One optimizer step over `batch` (micro_batch × gradient_accumulation rows)."""
        accumulation = self.options.gradient_accumulation
        feeds = to_feeds(batch, self.graph.input_names, self.device)
        rows = next(iter(feeds.values())).shape[0]
        if rows % accumulation:
            raise ValueError(f"batch of {rows} rows does not split into {accumulation} micro-batches")
        micro = rows // accumulation
        self._zero_grad()
        scale = self.scaler.scale
        totals = {name: 0.0 for name in self.anchors}
        for i in range(accumulation):
            part = {k: v[i * micro : (i + 1) * micro] for k, v in feeds.items()}
            with self.options.autocast():
                out = self._forward(part)
            loss = out[self.loss].float()
            (loss * (scale / accumulation)).backward()
            for name in self.anchors:
                totals[name] += out[name].detach().float().item() / accumulation
        totals["learning_rate"] = self.learning_rate
        overflow = self._optimizer_step(scale)
        self.scaler.update(overflow)
        if not overflow:
            self.step += 1
        totals["loss_scale"] = scale
        totals["skipped"] = float(overflow)
        return totals

    def _zero_grad(self) -> None:
        if isinstance(self.optimizer, Lamb):
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _optimizer_step(self, scale: float) -> bool:
        """Apply the update at this step's learning rate; True when skipped for overflow."""
        set_lr(self.optimizer, self.learning_rate)
        if isinstance(self.optimizer, Lamb):
            self.optimizer.step(loss_scale=scale)
            return self.optimizer.skipped
        params = [p for _, p in self.graph.named_weights() if p.grad is not None]
        if scale != 1.0:
            grads = [p.grad for p in params]
            if not all(torch.isfinite(g).all() for g in grads):
                return True
            torch._foreach_div_(grads, scale)
        if self.spec.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, self.spec.max_grad_norm)
        self.optimizer.step()
        return False

    @torch.no_grad()
    def evaluate(self, batch: Mapping[str, Any]) -> dict[str, float]:
        """The anchors on `batch` without updating anything (dropout off)."""
        self.graph.eval()
        try:
            with self.options.autocast():
                out = self.graph(to_feeds(batch, self.graph.input_names, self.device))
        finally:
            self.graph.train()
        return {name: out[name].float().item() for name in self.anchors}

    # ---------------------------------------------------------- checkpoints
    def model_proto(self) -> onnx.ModelProto:
        """The graph with the current weights as initializers."""
        model = onnx.ModelProto()
        model.CopyFrom(self._skeleton)
        for name, p in self.graph.named_weights():
            value = p.detach().float().cpu().contiguous().numpy()
            tensor = model.graph.initializer.add()
            tensor.name, tensor.data_type = name, onnx.TensorProto.FLOAT
            tensor.dims.extend(value.shape)
            tensor.raw_data = value.tobytes()
        return model

    def save(self, directory: str | os.PathLike, extra_state: Optional[dict] = None) -> Path:
        """Write model.onnx, the optimizer state and session.json atomically.

        Everything goes to a temporary sibling first, which is renamed into place: a crash
        leaves the previous checkpoint (or none), never a half-written one.
        """
        target = Path(directory)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        save_model(self.model_proto(), tmp / MODEL_FILE)
        torch.save({"optimizer": self.optimizer.state_dict()}, tmp / OPTIMIZER_FILE)
        state = {
            "step": self.step,
            "loss_scale": self.scaler.scale,
            "loss_scale_clean_steps": self.scaler.clean_steps,
            "torch_rng": torch.get_rng_state().tolist(),
            "extra": extra_state or {},
        }
        (tmp / STATE_FILE).write_text(json.dumps(state))
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        if target.exists():
            target.rename(old)
        tmp.rename(target)
        if old.exists():
            shutil.rmtree(old)
        return target

    def load(self, directory: str | os.PathLike) -> dict:
        """Restore weights, optimizer, step, loss scale and RNG; returns the extra state."""
        directory = Path(directory)
        for name in (MODEL_FILE, OPTIMIZER_FILE, STATE_FILE):
            if not (directory / name).exists():
                raise ValueError(f"{directory} is not a complete checkpoint: {name} is missing")
        self.load_weights(directory / MODEL_FILE)
        state = json.loads((directory / STATE_FILE).read_text())
        optimizer_state = torch.load(directory / OPTIMIZER_FILE, map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(optimizer_state["optimizer"])
        self.step = int(state["step"])
        self.scaler.scale = float(state["loss_scale"])
        self.scaler.clean_steps = int(state["loss_scale_clean_steps"])
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        return state["extra"]

    def load_weights(self, model: ModelLike, strict: bool = True) -> list[str]:
        """Copy weights by name from an ONNX model or checkpoint directory (e.g. phase 1 → phase 2)."""
        if not isinstance(model, onnx.ModelProto) and Path(model).is_dir():
            model = Path(model) / MODEL_FILE
        proto = load_model(model)
        state = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
        return self.graph.load_weights(state, strict=strict)


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
