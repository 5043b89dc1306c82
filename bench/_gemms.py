"""The matrix products of a training step, read from a profile of the step, each timed alone.

`step_gemms(events)` lists every GEMM the step ran, at its shape, from the profiler's
events (recorded with shapes): `aten::mm`/`addmm`/`bmm`/`baddbmm`, oneDNN's
`mkldnn::_linear_pointwise`, and the products inside torch's fused CPU attention
(`_scaled_dot_product_flash_attention_for_cpu`: q·kᵀ and p·v forward; dP = dO·vᵀ,
dV = pᵀ·dO, dQ = dS·k, dK = dSᵀ·q backward; its forward recomputation inside the
backward is not counted: it is the kernel's cost, not the step's work).

`GemmTimer` times each of them alone, in its canonical layout (contiguous A (M, K),
B (K, N)), with the faster of torch's matmul and oneDNN's inner product (fp32/bf16,
unbatched) for that shape: the time the step's own products would take at the best
implementation this machine has. A training step cannot beat it; the share of the step
it covers is the GEMM fraction (bench/profile.py, bench/train_throughput.py).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import torch

_DTYPES = {"float": torch.float32, "c10::BFloat16": torch.bfloat16, "c10::Half": torch.float16,
           "double": torch.float64}


@dataclass(frozen=True, order=True)
class Gemm:
    """C (batch, M, N) = A (batch, M, K) · B (batch, K, N)."""

    batch: int
    m: int
    k: int
    n: int
    dtype: str  # "fp32", "bf16", "fp16"

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.k * self.n

    def __str__(self) -> str:
        lead = f"{self.batch} x " if self.batch > 1 else ""
        return f"{lead}({self.m} x {self.k}) · ({self.k} x {self.n}) {self.dtype}"


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}[dtype]


def _dtype(event, i: int) -> str:
    return _name(_DTYPES.get(event.input_dtypes[i], torch.float32))


def _prod(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def event_gemms(event) -> list[Gemm]:
    """The GEMMs one profiler event ran (none for an event that is no GEMM)."""
    name, shapes = event.name, event.input_shapes
    if name == "aten::mm":
        (m, k), (_, n) = shapes[0], shapes[1]
        return [Gemm(1, m, k, n, _dtype(event, 0))]
    if name == "aten::addmm":
        (m, k), (_, n) = shapes[1], shapes[2]
        return [Gemm(1, m, k, n, _dtype(event, 1))]
    if name == "aten::bmm":
        (b, m, k), (_, _, n) = shapes[0], shapes[1]
        return [Gemm(b, m, k, n, _dtype(event, 0))]
    if name == "aten::baddbmm":
        (b, m, k), (_, _, n) = shapes[1], shapes[2]
        return [Gemm(b, m, k, n, _dtype(event, 1))]
    if name == "mkldnn::_linear_pointwise":  # x (..., K) · w (N, K)ᵀ
        x, w = shapes[0], shapes[1]
        return [Gemm(1, _prod(x[:-1]), x[-1], w[0], _dtype(event, 0))]
    if name == "aten::_scaled_dot_product_flash_attention_for_cpu":  # q (B, A, S, D), k (B, A, L, D), v (B, A, L, E)
        (b, a, s, d), (_, _, l, _), (_, _, _, e) = shapes[:3]
        t = _dtype(event, 0)
        return [Gemm(b * a, s, d, l, t), Gemm(b * a, s, l, e, t)]
    if name == "aten::_scaled_dot_product_flash_attention_for_cpu_backward":  # dO, q, k, v, ...
        (b, a, s, e), (_, _, _, d), (_, _, l, _) = shapes[0], shapes[1], shapes[2]
        t = _dtype(event, 0)
        return [Gemm(b * a, s, e, l, t), Gemm(b * a, l, s, e, t), Gemm(b * a, s, l, d, t), Gemm(b * a, l, s, d, t)]
    return []


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def step_gemms(events) -> Counter[Gemm]:
    """Every GEMM of the profiled events, counted by shape (record_shapes=True). A matrix-vector
    product (M or N = 1: the column sums of bias gradients) is a reduction, not GEMM work."""
    found: Counter[Gemm] = Counter()
    for event in events:
        for gemm in event_gemms(event):
            if min(gemm.m, gemm.n) > 1:
                found[gemm] += 1
    return found


class GemmTimer:
    """Times a step's GEMMs alone: `pass_seconds()` runs each of them once (count times)."""

    def __init__(self, gemms: Counter[Gemm], trials: int = 3):
        torch.manual_seed(0)
        self.gemms = gemms
        self._runs: dict[Gemm, tuple[str, callable]] = {}
        for gemm in sorted(gemms):
            candidates = self._candidates(gemm)
            timings = {name: _best_seconds(run, trials) for name, run in candidates.items()}
            best = min(timings, key=timings.get)
            self._runs[gemm] = (best, candidates[best])

    @staticmethod
    def _candidates(gemm: Gemm) -> dict[str, callable]:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}[gemm.dtype]
        a = torch.randn(gemm.batch, gemm.m, gemm.k, dtype=dtype).squeeze(0)
        b = torch.randn(gemm.batch, gemm.k, gemm.n, dtype=dtype).squeeze(0)
        runs = {"torch": lambda: torch.matmul(a, b)}
        if gemm.batch == 1 and dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available():
            w = b.t().contiguous()  # (N, K): oneDNN's inner product computes a · wᵀ
            runs["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")
        return runs

    def implementations(self) -> dict[Gemm, str]:
        return {g: name for g, (name, _) in self._runs.items()}

    def pass_seconds(self) -> tuple[float, dict[Gemm, float]]:
        """Seconds of one pass over every GEMM of the step, in all and per shape (all its calls)."""
        per: dict[Gemm, float] = {}
        for gemm, (_, run) in self._runs.items():
            start = time.perf_counter()
            for _ in range(self.gemms[gemm]):
                run()
            per[gemm] = time.perf_counter() - start
        return sum(per.values()), per

    @property
    def flops(self) -> int:
        return sum(g.flops * c for g, c in self.gemms.items())


def _best_seconds(run, trials: int) -> float:
    run()
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best
