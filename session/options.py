"""SessionOptions: how a graph is run (PopART's SessionOptions, the parts this project uses)."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Union

import torch


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
    replication_factor: int = 1
    replicated_tensor_sharding: bool = False
    pipelining: bool = False
    # Honour the graph's recompute marks (checkpoint every layer output, recompute the rest).
    recompute: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", Precision(self.precision))
        if self.gradient_accumulation < 1:
            raise ValueError(f"gradient_accumulation must be >= 1, got {self.gradient_accumulation}")
        if self.replication_factor < 1:
            raise ValueError(f"replication_factor must be >= 1, got {self.replication_factor}")
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
