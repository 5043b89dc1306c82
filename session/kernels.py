"""Which implementation runs each op: decided once per session, here and nowhere else.

The lowering (session/lowering.py) and the optimizer ask a `KernelPolicy` which
implementation to run; they never look at the CPU, the vendor or the environment
themselves. A policy is chosen from the device, the precision and what this machine
offers, can be overridden op by op with one setting (`SessionOptions.kernels`, the
config's `training.kernels`, e.g. `{"gemm": "torch"}`), is printed once when a run
starts (`describe`, with the threads the ops run on and where that count came from:
session/process.py) and is stored in every checkpoint, so a resume on a host that would
choose differently says so (`changes_from`).

    op              implementations         chosen by default
    gemm            onednn | torch          onednn for fp32 on an AMD CPU whose torch and oneDNN
                                            run AVX-512: torch's fp32 GEMM goes through MKL there,
                                            which runs its AVX2 code on AMD (a 2048³ matmul reads
                                            207 GFLOP/s against oneDNN's 458 on a Zen 5; on a Zen 4,
                                            whose AVX-512 runs at the AVX2 rate, a BERT step still
                                            spends 9 % less CPU time); torch elsewhere and under
                                            autocast (torch's bf16 matmul is oneDNN's already); at
                                            the AVX2 level the two tie (1.01x, Zen 4)
    attention       sdpa | composed         composed (matmul-softmax-matmul) on CPU in bf16/fp16,
                                            where torch's flash attention is 2.7x slower forward +
                                            backward at S = 128; sdpa elsewhere (fp32 CPU: composed
                                            takes 1.4x as long)
    grouped_matmul  einsum | block_diagonal block_diagonal on CPU in bf16/fp16 (one dense matmul with
                                            the block-diagonal weight, 4x the FLOPs on AMX/AVX512-BF16,
                                            3x faster than einsum's permute-bmm-permute); einsum
                                            elsewhere: batched per-group GEMMs (the lowering's
                                            grouped-linear fusion runs them on strided views)
    conv            compiled | torch |      compiled when `make` built the ops (bf16 runs on AMX tiles
                    triton                  or AVX512-BF16 dot products where the CPU has them, as
                                            oneDNN's does; docs/custom_ops.md); torch when not built.
                                            On CUDA (or with conv=measure) the fastest of those that
                                            run there, Triton's (B, S, H) kernels among them, timed
                                            on the device at the graph's shape and cached
                                            (session/kernel_tuning.py: our compiled bf16 kernel was
                                            0.43× cuDNN on an H200)
    lamb            compiled | torch        compiled when built
    cross_entropy   compiled | torch        compiled on the CPU when built: a SoftmaxCrossEntropyLoss
                                            over a vocabulary (mean, no weights, 8192 columns or
                                            more: the MLM loss; session/lowering.py) in two compiled
                                            ops (custom_ops/softmax_xent.py) that never hold an
                                            (N, C) fp32 array, 1.9x F.cross_entropy's forward +
                                            backward at 640 × 30522 in bf16 (bench/cross_entropy.py);
                                            torch elsewhere and for narrower heads (F.cross_entropy
                                            of the scores cast to fp32; torch.compile fuses it)
    norm            torch | triton          torch (an Add, then F.layer_norm) until the fused Triton
                                            kernel of a residual add and its layer norm
                                            (session/add_norm.py) has been timed on a GPU; triton
                                            where asked for (CUDA, or the CPU under
                                            TRITON_INTERPRET=1)
    weight_cast     shadow | autocast       autocast (each dense layer casts its weights to bf16/fp16
                                            in each forward, as autocast casts them); shadow where
                                            asked for: the layers read a low-precision copy made once
                                            per step by one multi-tensor copy (session/shadow.py),
                                            the same arithmetic to the bit. On this CPU the copy saved
                                            nothing measurable (the casts are under 1 % of a bf16 BERT
                                            step, Zen 4, 2026-11-30); on an H200 they are 321 small
                                            kernels of a BERT-Large micro-batch, and it becomes
                                            CUDA's default once gpu-check has timed it there
    graph           eager | compiled |      compiled (torch.compile of the lowered program) when the
                    cudagraphs              session's `compile` option asks for it; cudagraphs (CUDA
                                            only): compiled, its kernels replayed as CUDA graphs
                                            (torch.compile's reduce-overhead mode: one launch where
                                            the host launched each kernel). With
                                            graph=measure a training session times them on its first
                                            micro-batch, forward and backward, and keeps the fastest
                                            where the run's remaining steps pay the compile back
                                            (session/kernel_tuning.py; cached like conv's: a GPU's
                                            compiled BERT step was 1.28× eager on an H200). It becomes
                                            CUDA's default once it has run on a GPU (gpu-check's
                                            tests, issue 54). Eager otherwise: compiling takes
                                            30 s to 4 min per process, which only long runs pay back.
                                            Measured (Zen 4, 2 threads, CPU time per step, compiled /
                                            eager): BERT fp32 0.99, bf16 0.94; GroupBERT fp32 0.97,
                                            bf16 0.97 (bench/train_throughput.py records
                                            `*_compiled_vs_eager_*`). oneDNN's GEMM and the compiled
                                            ops stay whole under it (extern kernels)

The compiled ops pick their instruction set at run time (`custom_ops.cpu_capability`,
capped by GROUPBERT_CPU_CAPABILITY for tests and benchmarks); the policy records it.
oneDNN's fp32 linear is reached through `torch.ops.mkldnn._linear_pointwise`, a private
op: tests/test_kernels.py pins its behaviour against F.linear, and a probe when the policy
is chosen (session/dense.py) falls back to gemm=torch, saying so in `describe`, where this
torch lacks it or it computes something else.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from session.dense import onednn_linear_available
from session.kernel_choices import CHOICES, check_overrides
from session.kernel_tuning import ConvShape, conv_candidates, measure_conv
from session.process import threads_source

__all__ = ["CHOICES", "KernelPolicy", "choose_kernels"]

@dataclass(frozen=True)
class KernelPolicy:
    """One implementation per op (see the module docstring), and the facts it was chosen from."""

    gemm: str = "torch"
    attention: str = "sdpa"
    grouped_matmul: str = "einsum"
    conv: str = "torch"
    lamb: str = "torch"
    cross_entropy: str = "torch"
    norm: str = "torch"
    weight_cast: str = "autocast"
    graph: str = "eager"  # "measure" until a training session's first micro-batch decides it
    # Facts (what the choices were made from; recorded, compared on resume).
    device: str = "cpu"
    precision: str = "fp32"
    cpu: str = ""  # vendor and the ISA torch's CPU kernels run
    compiled_level: Optional[str] = None  # the compiled ops' instruction set, None when not built
    amx_tiles: Optional[str] = None  # "hardware" or "emulated" where bf16 convolutions run on AMX tiles
    threads: Optional[int] = None  # torch's intra-op threads (the compiled ops' too)
    threads_from: str = ""  # where that count came from (session/process.py)
    note: str = ""  # a default this machine could not take, and why
    measured: str = ""  # the choices timed on the device, and their ratios (session/kernel_tuning.py)

    def choices(self) -> dict[str, str]:
        return {op: getattr(self, op) for op in CHOICES}

    def describe(self) -> str:
        """One line for the start of a run."""
        level = f", compiled ops {self.compiled_level}" if self.compiled_level else ", compiled ops not built"
        if self.amx_tiles and self.conv == "compiled" and self.precision == "bf16" and self.device == "cpu":
            level += f" + {self.amx_tiles} AMX tiles"
        if self.threads is not None:
            level += f"; {self.threads} thread{'' if self.threads == 1 else 's'}: {self.threads_from}"
        ops = " ".join(f"{op}={impl}" for op, impl in self.choices().items())
        note = "; ".join(part for part in (self.measured, self.note) if part)
        note = f" ({note})" if note else ""
        return f"kernels ({self.device} {self.precision}, {self.cpu or 'no CPU facts'}{level}): {ops}{note}"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def changes_from(self, saved: Mapping[str, Any]) -> list[str]:
        """`op saved → now` for every implementation that differs from a recorded policy."""
        changes = []
        for op in CHOICES:
            before = saved.get(op)
            if before is not None and before != getattr(self, op) and getattr(self, op) != "measure":
                changes.append(f"{op} {before} → {getattr(self, op)}")
        if saved.get("compiled_level") not in (None, self.compiled_level) and self.compiled_level is not None:
            changes.append(f"compiled ops {saved['compiled_level']} → {self.compiled_level}")
        return changes


_ONEDNN_OP = "torch.ops.mkldnn._linear_pointwise"


def choose_kernels(device: str | torch.device = "cpu", precision: str = "fp32", *, compile: bool = False,
                   overrides: Optional[Mapping[str, str]] = None, conv: Optional[ConvShape] = None) -> KernelPolicy:
    """The policy for this machine, device and precision, with `overrides` ({op: implementation})
    applied; `conv`: the graph's convolution, whose implementation is timed on a GPU (or where
    `conv=measure` asks) when both are available (session/kernel_tuning.py)."""
    from custom_ops import cpu_capability, load_library

    device_type = torch.device(device).type
    precision = str(getattr(precision, "value", precision))
    reduced = precision in ("bf16", "fp16")
    built = load_library()
    level = cpu_capability() if built else None
    amx = torch.ops.groupbert.amx_state() if built else "off"
    vendor = _cpu_vendor() if device_type == "cpu" else ""
    torch_isa = torch.backends.cpu.get_cpu_capability()
    onednn_isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    onednn_fast = (device_type == "cpu" and precision == "fp32" and vendor == "AuthenticAMD"
                   and torch_isa.startswith("AVX512") and onednn_isa.startswith(("ALL", "AVX512", "AVX10"))
                   and torch.backends.mkldnn.is_available())
    note = ""
    if onednn_fast and not onednn_linear_available():
        onednn_fast, note = False, f"gemm=torch: this torch has no working {_ONEDNN_OP}"
    cpu_reduced = device_type == "cpu" and reduced
    policy = KernelPolicy(
        graph="compiled" if compile else "eager",
        gemm="onednn" if onednn_fast else "torch",
        attention="composed" if cpu_reduced else "sdpa",
        grouped_matmul="block_diagonal" if cpu_reduced else "einsum",
        conv="compiled" if built else "torch",
        lamb="compiled" if built else "torch",
        cross_entropy="compiled" if built and device_type == "cpu" else "torch",
        device=device_type, precision=precision,
        cpu=f"{vendor or 'unknown vendor'} {torch_isa}" if device_type == "cpu" else "",
        compiled_level=level, amx_tiles=None if amx.startswith("off") else amx.split()[0], note=note,
        threads=torch.get_num_threads(), threads_from=threads_source(torch.get_num_threads()),
    )
    overrides = dict(check_overrides(overrides or {}))
    if overrides.get("conv") == "measure" or ("conv" not in overrides and device_type == "cuda"):
        overrides.pop("conv", None)
        candidates = conv_candidates(torch.device(device), precision)
        if len(candidates) > 1 and conv is not None:
            measured = measure_conv(torch.device(device), precision, conv, candidates)
            policy = dataclasses.replace(policy, conv=measured.winner, measured=measured.text())
    return _apply(policy, overrides, built)


def _apply(policy: KernelPolicy, overrides: Mapping[str, str], built: bool) -> KernelPolicy:
    for op, impl in check_overrides(overrides).items():
        if impl == "triton":
            from custom_ops.triton_support import triton_status

            why = triton_status(policy.device)
            if why is not None:
                raise ValueError(f"kernels: {op}=triton, but {why}; use {op}=compiled or {op}=torch")
        if op == "graph" and impl == "cudagraphs" and policy.device != "cuda":
            raise ValueError("kernels: graph=cudagraphs replays the program's kernels as CUDA graphs (torch.compile's "
                             f"reduce-overhead mode) and needs a CUDA device, not {policy.device}: use graph=compiled "
                             "or graph=eager")
        if op == "cross_entropy" and impl == "compiled" and policy.device != "cpu":
            raise ValueError(f"kernels: cross_entropy=compiled runs on the CPU, not {policy.device}: use "
                             "cross_entropy=torch")
        if impl == "compiled" and not built:
            raise ValueError(f"kernels: {op}=compiled, but the compiled ops are not built; run `make`")
        if impl == "onednn" and not (torch.backends.mkldnn.is_available() and onednn_linear_available()):
            raise ValueError(f"kernels: gemm=onednn, but this torch has no working oneDNN linear ({_ONEDNN_OP}); "
                             "use gemm=torch")
    return dataclasses.replace(policy, **dict(overrides))


def _cpu_vendor() -> str:
    """The CPU vendor id (GenuineIntel, AuthenticAMD, ...), or '' where /proc/cpuinfo says none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
