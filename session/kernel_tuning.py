"""Kernel choices measured on the device that runs them (issue 54: "our CUDA conv is 0.43× cuDNN
in bf16", and the policy still picked it).

Where two implementations of an op are both correct and which is faster depends on the chip,
the policy (session/kernels.py) asks this module: it times both on the run's device, at the
run's precision and at the model's own shapes, forward and backward, and keeps the faster.
A measurement is cached per device model, torch version, precision and shape in
`$GROUPBERT_KERNEL_CACHE` (default `~/.cache/groupbert/kernel_choices.json`), so the next run
on such a machine takes a few milliseconds to decide; the policy line names the winner and the
ratio that decided it. An explicit `training.kernels` choice is never measured over.

    conv   the grouped convolution (GroupedConv1d): the compiled kernels, torch's F.conv1d
           (cuDNN on a GPU) and, on a GPU with Triton, the Triton kernels
           (custom_ops/grouped_conv1d_triton.py), at (B, S, H) = (TOKENS // S, S, H), weight
           (H, C, K) of the graph's largest convolution; the default on CUDA, asked for
           anywhere with `kernels: {"conv": "measure"}`
    graph  the lowered program eager, through torch.compile, or on CUDA through torch.compile with
           its kernels replayed as CUDA graphs (mode reduce-overhead; session/lowering.py), timed by a
           TrainingSession on its first micro-batch, forward and backward (the gradients taken
           with torch.autograd.grad, so that no gradient hook or collective runs), asked for with
           `kernels: {"graph": "measure"}` (CUDA's default once it has run on a GPU). The two losses must
           agree within 10 % (their dropout draws differ): a compile that fails or computes
           something else is left out, named, never fatal. Cached per device, torch version,
           precision, model, micro-batch shape and the other kernel choices, with the seconds
           the compile took: a run whose remaining passes (its schedule's steps) would not pay a
           compile back stays eager, and one too short for any compile to pay back is not
           compiled to find out.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import onnx
import torch

__all__ = ["ConvShape", "Measurement", "cache_path", "conv_candidates", "conv_shape", "graph_digest", "measure_conv",
           "measure_graph"]

TOKENS = 8192  # B × S of the measured batch: a BERT-Large phase-1 micro batch (64 × 128)
WARMUP, REPEATS = 3, 10
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ConvShape:
    sequence: int  # S
    hidden: int  # H
    per_group: int  # C
    width: int  # K

    def text(self) -> str:
        return f"S{self.sequence} H{self.hidden} C{self.per_group} K{self.width}"


@dataclass(frozen=True)
class Measurement:
    """What decided an op's implementation: the winner and each candidate's time per forward +
    backward, and the candidates left out (failed or disagreed on this device)."""

    op: str
    winner: str
    times_ms: dict[str, float]
    where: str  # the device model and precision
    cached: bool
    refused: str = ""  # candidates left out, and why (session/kernel_tuning.py: _agreeing)
    why: str = ""  # a winner that is not the fastest (a compile the run would not pay back), and why
    first_s: float = 0.0  # the seconds of each candidate's first call (a compile's, for the graph)

    @property
    def runner_up(self) -> str:
        return min((name for name in self.times_ms if name != self.winner), key=self.times_ms.get)

    @property
    def ratio(self) -> float:
        """The runner-up's time over the winner's (≥ 1)."""
        return self.times_ms[self.runner_up] / self.times_ms[self.winner]

    def text(self) -> str:
        if self.why:
            return f"{self.op}={self.winner}: {self.why}"
        if len(self.times_ms) < 2:
            return f"{self.op}={self.winner}, the only one that ran on {self.where}: {self.refused}"
        others = sorted((name for name in self.times_ms if name not in (self.winner, self.runner_up)),
                        key=self.times_ms.get)
        rest = "".join(f", {self.times_ms[name] / self.times_ms[self.winner]:.2f}× than {name}" for name in others)
        return (f"{self.op}={self.winner} measured {self.ratio:.2f}× faster than {self.runner_up}{rest} on "
                f"{self.where}" + (" (cached)" if self.cached else "") + (f"; {self.refused}" if self.refused else ""))


def cache_path() -> Path:
    return Path(os.environ.get("GROUPBERT_KERNEL_CACHE", "~/.cache/groupbert/kernel_choices.json")).expanduser()


def conv_shape(proto: onnx.ModelProto) -> Optional[ConvShape]:
    """The graph's largest GroupedConv1d (by H × C × K) with its sequence length (the fixed second
    dimension of the graph's first input that has one: (batch, S) rows); None without one."""
    weights = {t.name: tuple(t.dims) for t in proto.graph.initializer}
    sequence = next((d.dim_value for i in proto.graph.input for d in i.type.tensor_type.shape.dim[1:2]
                     if d.dim_value), 0)
    shapes = [weights[n.input[1]] for n in proto.graph.node if n.op_type == "GroupedConv1d" and n.input[1] in weights]
    if not shapes or not sequence:
        return None
    hidden, per_group, width = max(shapes, key=lambda s: s[0] * s[1] * s[2])
    return ConvShape(sequence, hidden, per_group, width)


def graph_digest(proto: onnx.ModelProto) -> str:
    """The model as its timing knows it: a digest of its ops and weight shapes (not their values)."""
    digest = hashlib.sha256()
    for node in proto.graph.node:
        digest.update(f"{node.domain}:{node.op_type};".encode())
    for tensor in proto.graph.initializer:
        digest.update(f"{list(tensor.dims)};".encode())
    return digest.hexdigest()[:16]


def _device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name (/proc/cpuinfo): what a cached choice holds for."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "cpu")
    except OSError:
        return platform.processor() or "cpu"


def _time(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call: CUDA events on a GPU, the host clock on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    began = time.perf_counter()
    fn()
    return (time.perf_counter() - began) * 1e3


def _timed(runners: dict[str, Callable[[], object]], device: torch.device) -> dict[str, float]:
    """The median milliseconds of each runner, alternating, after WARMUP untimed calls each."""
    for fn in runners.values():
        for _ in range(WARMUP):
            fn()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(REPEATS):
        for name, fn in runners.items():
            times[name].append(_time(fn, device))
    return {name: statistics.median(t) for name, t in times.items()}


def conv_candidates(device: torch.device, precision: str) -> tuple[str, ...]:
    """The convolutions that can run on `device` at `precision`: the compiled kernels where built,
    torch's, and the Triton kernels on a GPU where Triton is installed (float32, bf16, fp16)."""
    from custom_ops.grouped_conv1d import compiled_available
    from custom_ops.triton_support import triton_available

    candidates = ("compiled",) if compiled_available() else ()
    candidates += ("torch",)
    if device.type == "cuda" and precision in ("fp32", "bf16", "fp16") and triton_available(device):
        candidates += ("triton",)
    return candidates


def measure_conv(device: torch.device, precision: str, shape: ConvShape,
                 candidates: Optional[tuple[str, ...]] = None) -> Measurement:
    """The fastest of `candidates` (default `conv_candidates`) for `shape` on `device`, from the
    cache or measured now (forward + backward, both gradients)."""
    from custom_ops.grouped_conv1d import grouped_conv1d

    candidates = candidates or conv_candidates(device, precision)
    where = f"{_device_name(device)}, {precision}"
    key = f"{where} | torch {torch.__version__} | conv {shape.text()} | {' '.join(candidates)}"
    cached = _cached("conv", where, key)
    if cached is not None:
        return cached
    dtype, batch = _DTYPES[precision], max(1, TOKENS // shape.sequence)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, shape.sequence, shape.hidden, generator=generator).to(device, dtype).requires_grad_()
    w = (torch.randn(shape.hidden, shape.per_group, shape.width, generator=generator) * 0.1).to(device, dtype)
    w.requires_grad_()
    mask = torch.ones(batch, shape.sequence, device=device, dtype=dtype)
    grad = torch.randn(batch, shape.sequence, shape.hidden, generator=generator).to(device, dtype)

    def step(implementation: str) -> Callable[[], object]:
        def run():
            x.grad = w.grad = None
            out = grouped_conv1d(x, w, mask, implementation=implementation)
            out.backward(grad)
            return out, x.grad, w.grad
        return run

    return _race("conv", where, key, {name: step(name) for name in candidates}, _TOLERANCE[precision], device)


def measure_graph(device: torch.device, precision: str, signature: str,
                  runners: dict[str, Callable[[], tuple]], passes: int) -> Measurement:
    """Eager, compiled or CUDA graphs, from the cache or timed now: `runners` maps "eager" and the
    compiled candidates to one forward and backward of the program each (returning its loss);
    `signature` names the model, the micro-batch and the other kernel choices, what the time
    depends on; `passes`,
    the forward and backward passes the run has left. A run too short to pay back a compile
    stays eager without compiling (at best a compile halves a pass, and takes 10 s or more);
    one that a cached measurement says would not pay back its compile stays eager too."""
    where = f"{_device_name(device)}, {precision}"
    key = f"{where} | torch {torch.__version__} | graph {signature}"
    measured = _cached("graph", where, key)
    if measured is not None:
        eager_ms, winner_ms = measured.times_ms["eager"], measured.times_ms[measured.winner]
        saved_s = (eager_ms - winner_ms) * passes / 1e3
        if measured.winner != "eager" and saved_s < measured.first_s:
            return dataclasses.replace(measured, winner="eager", why=(
                f"{measured.winner} measured {eager_ms / winner_ms:.2f}× faster than eager on {where} (cached), "
                f"but {passes} passes save {saved_s:.1f} s against its {measured.first_s:.0f} s of compiling"))
        return measured
    eager = runners["eager"]
    eager()
    once_ms = _time(eager, device)
    if once_ms * passes * _MOST_SAVED < _LEAST_COMPILE_S * 1e3:
        return Measurement("graph", "eager", {"eager": once_ms}, where, False, why=(
            f"{passes} passes of {once_ms:.0f} ms cannot pay back a compile (at best half a pass saved, "
            f"against {_LEAST_COMPILE_S:.0f} s or more of compiling)"))
    return _race("graph", where, key, runners, _GRAPH_TOLERANCE, device)  # the compiled one's first call compiles


def _cached(op: str, where: str, key: str) -> Optional[Measurement]:
    found = _read_cache().get(key)
    if found is None:
        return None
    return Measurement(op, found["winner"], found["times_ms"], where, True, first_s=float(found.get("first_s", 0.0)))


def _race(op: str, where: str, key: str, runners: dict[str, Callable[[], tuple]], tolerance: float,
          device: torch.device) -> Measurement:
    """The fastest of the `runners` that agree (`_agreeing`), cached under `key` unless one was
    refused: a candidate that failed here is tried again next time (another driver, a fix)."""
    began = time.perf_counter()
    kept, refused = _agreeing(runners, tolerance)
    first_s = time.perf_counter() - began
    times = _timed(kept, device)
    winner = min(times, key=times.get)
    if not refused:
        cache = _read_cache()
        cache[key] = {"winner": winner, "times_ms": times, "first_s": round(first_s, 1)}
        _write_cache(cache)
    return Measurement(op, winner, times, where, False, refused, first_s=first_s)


# Relative to the largest value: what two correct implementations may differ by at a precision.
_TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 1e-2}
# Eager and compiled draw their dropout masks differently: their losses agree only roughly. This
# catches a compile that computes something else (exact equality is the tests' business).
_GRAPH_TOLERANCE = 0.1
_MOST_SAVED, _LEAST_COMPILE_S = 0.5, 10.0


def _agreeing(runners: dict[str, Callable[[], tuple]], tolerance: float
              ) -> tuple[dict[str, Callable[[], tuple]], str]:
    """The runners whose outputs and gradients agree with the first's, and a line naming the
    others and why (one that raised, or gave other values): a candidate not yet run on this
    device never decides a run's kernels by failing, or by being fast and wrong."""
    first, *rest = runners
    reference = [t.detach().float().clone() for t in runners[first]()]
    kept, refused = {first: runners[first]}, []
    for name in rest:
        try:
            got = runners[name]()
        except Exception as e:  # the kernel's own failure on this device: named, never fatal
            refused.append(f"{name} failed here ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            continue
        errors = [(g.float() - r).abs().max().item() / max(r.abs().max().item(), 1e-30) for g, r in zip(got, reference)]
        if max(errors) > tolerance:
            refused.append(f"{name} disagreed with {first} here (relative error {max(errors):.1e})")
            continue
        kept[name] = runners[name]
    return kept, "; ".join(refused)


def _read_cache() -> dict:
    path = cache_path()
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: measured again and rewritten
    return found if isinstance(found, dict) else {}


def _write_cache(cache: dict) -> None:
    from fileio import write_atomically

    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(cache, indent=1, sort_keys=True) + "\n")
    except OSError:
        pass  # a read-only home: the choice holds for this run, and is measured again next time
