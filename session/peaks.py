"""The peak a device's FLOPs are measured against: the MFU of a training log line.

MFU (model FLOPs utilisation, PaLM's and nanoGPT's figure) is the model FLOPs a step does
(bert/run/budget.py: 3 × the graph's forward FLOPs, counted by `bert.py summary`) per second,
over what the devices that run it can do:

- a GPU: its datasheet's dense peak for the precision (tensor cores for bf16/fp16, the
  CUDA cores for fp32), looked up by the name torch reports; a GPU not in the table has no
  MFU figure (its TFLOP/s are still logged);
- a CPU: no datasheet figure holds (clocks follow load and the instruction set), so the
  peak is that of a square GEMM in the run's precision measured when the run starts, with
  the run's threads: the roofline the step's own matmuls run on, MFU relative to it.

The figure is per device: a run on N processes (replicas × pipeline stages) is measured
against N peaks.
"""
from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["DATASHEET_FLOPS", "Peak", "datasheet_peak", "device_peak", "flops_text", "measured_gemm_peak"]

# Dense peaks (no sparsity) from NVIDIA's datasheets, FLOP/s, by the name torch reports;
# the first pattern found in the name wins. bf16 and fp16 run on the tensor cores at the
# same rate; fp32 on the CUDA cores (TF32 would be a tensor-core rate: the product's fp32
# runs are measured against the stricter CUDA-core figure only where TF32 is off).
DATASHEET_FLOPS = (
    ("H200", {"bf16": 989.4e12, "fp32": 66.9e12}),
    ("H100 PCIe", {"bf16": 756.0e12, "fp32": 51.2e12}),
    ("H100 NVL", {"bf16": 835.0e12}),
    ("H100", {"bf16": 989.4e12, "fp32": 66.9e12}),
    ("A100", {"bf16": 312.0e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362.1e12, "fp32": 91.6e12}),
)
GEMM_SIZE = 1024  # the CPU's measured GEMM: n³ multiply-adds, a few hundredths of a second on two cores


@dataclass(frozen=True)
class Peak:
    """FLOP/s one device can do, and where the figure comes from (for the log line)."""

    flops: float
    source: str


def datasheet_peak(name: str, precision: str) -> Optional[Peak]:
    """The datasheet peak of the GPU called `name` in `precision` (fp16 counts as bf16), or None."""
    key = "bf16" if precision in ("bf16", "fp16") else precision
    for pattern, peaks in DATASHEET_FLOPS:
        if pattern in name:
            return Peak(peaks[key], f"{pattern} datasheet {key}") if key in peaks else None
    return None


@functools.lru_cache(maxsize=None)
def measured_gemm_peak(precision: str, n: int = GEMM_SIZE, repeats: int = 3) -> Peak:
    """FLOP/s of an n³ matmul on this CPU in `precision` with torch's threads, the median of
    `repeats` after two untimed ones (random data: zeros run faster); once per process."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=generator).to(dtype) for _ in range(2))
    times = []
    for i in range(repeats + 2):
        began = time.perf_counter()
        torch.mm(a, b)
        if i >= 2:
            times.append(time.perf_counter() - began)
    return Peak(2 * n**3 / statistics.median(times), f"{n}³ {precision} GEMM measured at start")


def device_peak(device: str | torch.device, precision: str) -> Optional[Peak]:
    """The peak of one device of a run (see the module docstring); None where none is known."""
    device = torch.device(device)
    if device.type == "cuda":
        return datasheet_peak(torch.cuda.get_device_name(device), precision)
    if device.type == "cpu":
        return measured_gemm_peak(precision)
    return None


def flops_text(flops: float) -> str:
    """FLOP/s for a line: '412 TFLOP/s', '38.5 GFLOP/s'."""
    return f"{flops / 1e12:.3g} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.3g} GFLOP/s"
