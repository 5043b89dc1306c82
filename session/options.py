"""SessionOptions: how a graph is run (PopART's SessionOptions, the parts this project uses)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

import torch

from session.kernel_choices import check_overrides


class Precision(str, enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"  # autocast: matmuls in bf16, norms, softmax and losses in fp32
    FP16 = "fp16"  # autocast in fp16 with loss scaling


@dataclass(frozen=True)
class SessionOptions:
    device: str = "cpu"
    precision: Precision = Precision.FP32
    # fp16 only: a fixed loss scale, or "dynamic" (grows after clean steps, halves on overflow).
    loss_scaling: Union[float, str, None] = None
    gradient_accumulation: int = 1
    # Data-parallel replicas (PopART's replicatedGraphCount); None: every process the
    # launcher started that the pipeline does not use (torchrun's world size / stages).
    replication_factor: Optional[int] = None
    # Shard gradients and optimizer state over the replicas (PopART's RTS; ZeRO-2).
    replicated_tensor_sharding: bool = False
    # Run the graph's __pipeline_stage's as a pipeline, one process per virtual graph.
    pipelining: bool = False
    # Gradients travel between replicas in buckets of about this size (DDP's bucket_cap_mb).
    gradient_bucket_mb: float = 25.0
    # Honour the graph's recompute marks (checkpoint every layer output, recompute the rest).
    recompute: bool = False
    compile: bool = False
    # Implementations to force, by op ({"gemm": "torch"}; session/kernels.py lists them).
    kernels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", Precision(self.precision))
        if self.gradient_accumulation < 1:
            raise ValueError(f"gradient_accumulation must be >= 1, got {self.gradient_accumulation}")
        if self.replication_factor is not None and self.replication_factor < 1:
            raise ValueError(f"replication_factor must be >= 1 or None (every process), got {self.replication_factor}")
        if not self.gradient_bucket_mb > 0:
            raise ValueError(f"gradient_bucket_mb must be > 0, got {self.gradient_bucket_mb}")
        check_overrides(self.kernels)
        if isinstance(self.loss_scaling, str) and self.loss_scaling != "dynamic":
            raise ValueError(f"loss_scaling must be a number, 'dynamic' or None, got {self.loss_scaling!r}")

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        return {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(self.precision)

    def autocast(self):
        """The autocast context for the forward pass (disabled in fp32)."""
        device_type = torch.device(self.device).type
        dtype = self.autocast_dtype
        return torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)
