#!/usr/bin/env python3
"""The GPU check's benchmarks, one part per child process of bench/gpu_check.py.

    python bench/_gpu_bench.py PART[,PART...] --json-out FILE [--dry-run] [--compile-backend B]

Parts (each checks correctness first, then times, then sets the figure against a peer
measured in the same process and against a roofline measured in the same process):

  peaks      bf16 GEMM (n³, random data) and fp32 GEMM without TF32 (CUDA cores), a large
             device-to-device copy (bytes read + written), beside the datasheet bf16 peak
  bert       BERT-Large phase 1 (seq 128, 20 masks) training in bf16: our TrainingSession
             (fused LAMB) against HuggingFace BertForPreTraining (SDPA attention, autocast
             bf16, fused AdamW) on the same batch, HF's MLM head over every position as its
             users run it, and over the masked positions only; model FLOPs per step / step
             time against the datasheet peak (MFU) and the GEMM peak measured here
  groupbert  GroupBERT-Large the same, against HF BERT-Large (same width and depth; HF has
             no GroupBERT), its loss checked against an independent eager GroupBERT
             (both: our session also with weight_cast=shadow, the weights' bf16 copy made once
             per step, session/shadow.py, its loss equal to the default's, timed beside it)
  conv       GroupedConv1d forward + backward at GroupBERT-Large shapes, the compiled kernels and
             the Triton ones (where Triton runs), against cuDNN's F.conv1d(groups=G), each checked
             against float64 F.conv1d first
  lamb       one fused LAMB step over GroupBERT-Large's parameters against torch's fused
             AdamW and the HBM floor (bytes per parameter / measured copy bandwidth)
  compile    our BERT-Large training step with SessionOptions(compile=True) against eager, and
             HF BertForPreTraining (masked-only MLM head) with torch.compile against it eager:
             the compiled peer a careful user would build

`--dry-run` runs every part on the CPU at tiny sizes (the same code, seconds), so the
suite keeps it working where no GPU is; `--compile-backend eager` then stands in for
inductor, whose code generation takes minutes on a 2-core CPU (dynamo's capture of the
session's graph still runs). The JSON a part writes is what gpu_check.py records.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _hf_peer  # noqa: E402
from bert import ModelConfig, build_model  # noqa: E402
from bert.data import synthetic_batch  # noqa: E402
from bert.model import no_weight_decay  # noqa: E402
from bert.summary import forward_flops  # noqa: E402
from custom_ops import library_status, load_library  # noqa: E402
from custom_ops.grouped_conv1d import grouped_conv1d  # noqa: E402
from custom_ops.triton_support import triton_available, triton_status  # noqa: E402
from session import SessionOptions, peaks  # noqa: E402
from session.optimizers import Lamb  # noqa: E402
from session.schedules import Schedule  # noqa: E402
from session.training import OptimizerSpec, TrainingSession  # noqa: E402

PARTS = ("peaks", "bert", "groupbert", "conv", "lamb", "norm", "profile", "compile", "batch")


@dataclass(frozen=True)
class Sizes:
    """What each part runs on: the real shapes on the GPU, tiny ones in the dry run."""

    hidden: int
    layers: int
    heads: int
    vocab: int
    seq: int
    masks: int
    batch: int  # sequences per training step
    steps: int  # training steps per timed sample
    repeats: int  # timed samples per runner (alternating runners): median, min and max reported
    warmup: int  # untimed samples per runner first (on the GPU: 2 × 4 steps before 5 × 4 timed ones)
    gemm_n: int  # the bf16 GEMM of the peak; the fp32 one is half as wide
    copy_mib: int  # each way
    conv: tuple[int, int, int, int, int]  # B, S, H, C, K
    max_positions: int = 512


GPU = Sizes(hidden=1024, layers=24, heads=16, vocab=30522, seq=128, masks=20, batch=64, steps=4, repeats=5, warmup=2,
            gemm_n=8192, copy_mib=1024, conv=(64, 128, 1024, 16, 7))
DRY = Sizes(hidden=48, layers=2, heads=3, vocab=101, seq=32, masks=5, batch=4, steps=1, repeats=2, warmup=1,
            gemm_n=128, copy_mib=4, conv=(2, 37, 96, 16, 7), max_positions=64)


def model_config(arch: str, s: Sizes) -> ModelConfig:
    return ModelConfig(architecture=arch, hidden_size=s.hidden, num_layers=s.layers, num_heads=s.heads,
                       vocab_size=s.vocab, sequence_length=s.seq, max_predictions=s.masks,
                       max_positions=s.max_positions)


# --------------------------------------------------------------------- timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, inner: int = 1) -> float:
    """Seconds per call of `fn`, `inner` calls back to back: CUDA events on the GPU
    (the host's clock would count launch gaps after the last kernel), the host's clock on the CPU."""
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / inner
    begin = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - begin) / inner


@dataclass(frozen=True)
class Timing:
    """Seconds per call over the repeats of one runner: the median, and the fastest and slowest
    repeat (the spread a ratio from these figures must exceed to mean something)."""

    median: float
    low: float
    high: float

    def per(self, n: int) -> "Timing":
        return Timing(self.median / n, self.low / n, self.high / n)

    def ms(self, name: str) -> dict[str, float]:
        """`name` (the median), `name_min`, `name_max`, in milliseconds."""
        return {name: self.median * 1e3, f"{name}_min": self.low * 1e3, f"{name}_max": self.high * 1e3}


def time_repeats(runners: dict[str, Callable[[], object]], device: torch.device, repeats: int, warmup: int,
                 inner: int = 1) -> dict[str, Timing]:
    """Seconds per call of each runner over `repeats` samples, the runners alternating within
    every repeat (so drifting clocks and other load hit them alike), after `warmup` untimed
    calls each (the allocator's pools and cuDNN/cuBLAS's choices settled)."""
    for fn in runners.values():
        for _ in range(warmup):
            fn()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, fn in runners.items():
            times[name].append(time_call(fn, device, inner))
    return {name: Timing(statistics.median(t), min(t), max(t)) for name, t in times.items()}


def time_alternating(runners: dict[str, Callable[[], object]], device: torch.device, repeats: int, warmup: int,
                     inner: int = 1) -> dict[str, float]:
    """The median seconds per call of each runner (`time_repeats`)."""
    return {name: t.median for name, t in time_repeats(runners, device, repeats, warmup, inner).items()}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| in float64; inf when `actual` holds a NaN or inf (an unwritten or
    overflowed element must never pass)."""
    a, e = actual.detach().double(), expected.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------- peaks


def datasheet_peak(device: torch.device) -> tuple[str, float | None]:
    """The GPU's name and its datasheet's dense bf16 FLOP/s (session/peaks.py, as the training
    log's MFU); None on the CPU or a GPU not in the table."""
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    peak = peaks.datasheet_peak(name, "bf16")
    return name, peak.flops if peak is not None else None


def gemm_flops(device: torch.device, n: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of an n³ matmul on random data (zeros run faster on some GPUs), median of `repeats`."""
    gen = torch.Generator(device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, generator=gen).to(dtype)
    seconds = time_alternating({"gemm": lambda: a @ b}, device, repeats, warmup=2, inner=5)["gemm"]
    return 2 * n**3 / seconds


def copy_bandwidth(device: torch.device, mib: int, repeats: int = 5) -> float:
    """Bytes/s of a large copy, counting the bytes read and the bytes written."""
    src = torch.randn(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    seconds = time_alternating({"copy": lambda: dst.copy_(src)}, device, repeats, warmup=2, inner=5)["copy"]
    return 2 * src.nbytes / seconds


@contextlib.contextmanager
def no_tf32():
    """fp32 matmuls on the CUDA cores: the roofline of our fp32 FMA kernels."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def part_peaks(s: Sizes, device: torch.device, args) -> dict:
    name, datasheet = datasheet_peak(device)
    bf16 = gemm_flops(device, s.gemm_n, torch.bfloat16)
    with no_tf32():
        fp32 = gemm_flops(device, s.gemm_n // 2, torch.float32)
    copy = copy_bandwidth(device, s.copy_mib)
    out = {"device": name, "gemm_n_bf16": s.gemm_n, "gemm_n_fp32": s.gemm_n // 2, "copy_mib": s.copy_mib,
           "gemm_tflops_bf16": bf16 / 1e12, "gemm_tflops_fp32_no_tf32": fp32 / 1e12, "copy_gbps": copy / 1e9,
           "datasheet_tflops_bf16": datasheet / 1e12 if datasheet else None}
    print(f"{name}: bf16 GEMM {s.gemm_n}³ {bf16 / 1e12:.1f} TFLOP/s"
          + (f" ({bf16 / datasheet:.0%} of the datasheet's {datasheet / 1e12:.1f})" if datasheet else "")
          + f"; fp32 GEMM (no TF32) {fp32 / 1e12:.2f} TFLOP/s; copy {copy / 1e9:.0f} GB/s (read + write)")
    return out


# ------------------------------------------------------------------- training


class Ours:
    """Our TrainingSession on the device, in bf16, the fused LAMB, anchors = the loss only."""

    def __init__(self, cfg: ModelConfig, device: torch.device, compile: bool, weights: Callable, kernels: dict):
        builder = build_model(cfg, seed=0).builder
        spec = OptimizerSpec(kind="lamb", schedule=Schedule(1e-4, 0, 10**9, decay="constant"))
        # Eager or compiled as asked: on CUDA the policy would otherwise time both at the first
        # step (graph=measure) and could run the "eager" runner compiled.
        kernels = {"graph": "compiled" if compile else "eager", **kernels}
        options = SessionOptions(device=str(device), precision="bf16", compile=compile, kernels=kernels)
        self.session = TrainingSession(builder.model_proto(with_weights=False, declare_weights=True), optimizer=spec,
                                       options=options, anchors=("loss",), weights=weights)

    def step(self, batch) -> float:
        return self.session.run(batch)["loss"]


class HuggingFace:
    """BertForPreTraining as its users train it (SDPA attention, autocast bf16, fused AdamW).

    `loss(batch, masked_only=False)`: the model's own loss, its MLM head over every
    position; `masked_only=True`: the same modules with the sequence output gathered at the
    masked positions before the MLM head, as NVIDIA's BERT does (the strongest eager peer).
    """

    def __init__(self, cfg: ModelConfig, device: torch.device, weights: dict[str, torch.Tensor] | None):
        import transformers

        hf_cfg = _hf_peer.bert_config(cfg, attn_implementation="sdpa")
        with torch.device(device):
            self.model = transformers.BertForPreTraining(hf_cfg).train()
        if weights is not None:
            # Our names are HuggingFace's; the decoder's weight and bias are tied to the word
            # embedding and cls.predictions.bias, the position ids are HF's own.
            missing, unexpected = self.model.load_state_dict(weights, strict=False)
            if unexpected:
                raise RuntimeError(f"our weights have names HF BertForPreTraining lacks: {unexpected[:5]}")
            untied = [m for m in missing if not m.startswith("cls.predictions.decoder.") and "position_ids" not in m]
            if untied:
                raise RuntimeError(f"HF weights not set from ours: {untied[:5]}")
        self.attention = self.model.config._attn_implementation
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
        self.device = device
        self._masked: Callable | None = None  # the masked-only loss under torch.compile (`compile_masked`)

    def compile_masked(self) -> None:
        """The masked-only loss (model.bert, the gather, model.cls, the losses) under torch.compile:
        compiling the module alone would leave the submodules this path calls eager."""
        self._masked = torch.compile(functools.partial(_hf_peer.pretraining_loss, self.model, masked_only=True))

    def loss(self, batch, masked_only: bool) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            if masked_only and self._masked is not None:
                return self._masked(batch)
            return _hf_peer.pretraining_loss(self.model, batch, masked_only)

    def step(self, batch, masked_only: bool = False) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.loss(batch, masked_only).backward()
        self.optimizer.step()


def training_flops(cfg: ModelConfig, batch: int) -> dict[str, float]:
    """FLOPs of one training step (3 x forward: matmuls, einsums, the grouped conv) of the work
    each runner does: ours and HF masked-only project the masked positions through the MLM
    head, HF as its users run it projects every position (+ 3·(2H² + 2HV) per extra position)."""
    useful = 3 * forward_flops(build_model(cfg), batch)
    s, p, h, v = cfg.sequence_length, cfg.max_predictions, cfg.hidden_size, cfg.vocab_size
    return {"useful": useful, "hf_all_positions": useful + 3 * (2 * h * h + 2 * h * v) * (s - p) * batch}


def device_batch(cfg: ModelConfig, size: int, device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in synthetic_batch(cfg, size, torch.Generator().manual_seed(0)).items()}


def compiled_kernels(device: torch.device) -> dict:
    """Kernel overrides for our sessions: none where the compiled ops run on this device; the
    torch implementations where the library is missing or was built without CUDA kernels
    (recorded, so a figure never hides which kernels produced it)."""
    if not load_library():
        return {}  # the policy already picks torch's implementations
    if device.type == "cuda" and not torch._C._dispatch_has_kernel_for_dispatch_key("groupbert::grouped_conv1d",
                                                                                     "CUDA"):
        return {"conv": "torch", "lamb": "torch"}
    return {}


def cached_weights(cfg: ModelConfig) -> Callable:
    """The builder's seeded initial values, each drawn once however many sessions read it."""
    return functools.cache(build_model(cfg, seed=0).builder.initial_value)


def mfu_figures(prefix: str, flops: float, seconds: float, gemm: float, datasheet: float | None) -> dict:
    out = {f"{prefix}_tflops": flops / seconds / 1e12, f"{prefix}_of_gemm_peak": flops / seconds / gemm}
    if datasheet:
        out[f"{prefix}_mfu"] = flops / seconds / datasheet
    return out


def part_train(arch: str, s: Sizes, device: torch.device, args) -> dict:
    """Our session against HF on one batch: losses checked, then steps timed alternately."""
    cfg = model_config(arch, s)
    batch = device_batch(cfg, s.batch, device)
    kernels = compiled_kernels(device)
    t0 = time.perf_counter()
    ours = Ours(cfg, device, compile=False, weights=cached_weights(cfg), kernels=kernels)
    setup_s = time.perf_counter() - t0
    print(f"{arch}: our session built in {setup_s:.1f} s; {ours.session.policy.describe()}")
    weights = {n: p.detach() for n, p in ours.session.named_weights()} if arch == "bert" else None
    hf = HuggingFace(model_config("bert", s), device, weights)

    # Correctness first, on the same batch and (for BERT) the same weights, before any step.
    tol = 2e-2  # bf16 autocast on both sides
    with torch.no_grad():
        hf_loss = hf.loss(batch, masked_only=False).item()
        hf_masked_loss = hf.loss(batch, masked_only=True).item()
        if arch == "groupbert":
            from tests.reference_groupbert import groupbert_pretraining

            state = {n: p.detach().float() for n, p in ours.session.named_weights()}
            reference = groupbert_pretraining(state, cfg, batch)["loss"].item()  # fp32, eager
            del state
    ours_loss = ours.step(batch)
    # The weights' bf16 copy made once per step: the same arithmetic as the default's casts.
    shadow = Ours(cfg, device, compile=False, weights=cached_weights(cfg), kernels={**kernels, "weight_cast": "shadow"})
    shadow_loss = shadow.step(batch)
    checks = ({"ours vs HF": (ours_loss, hf_loss), "HF masked-only vs HF": (hf_masked_loss, hf_loss)}
              if arch == "bert" else
              {"ours vs the eager fp32 reference": (ours_loss, reference),
               "HF masked-only vs HF (its own weights)": (hf_masked_loss, hf_loss)})
    checks["ours, weight_cast=shadow vs ours"] = (shadow_loss, ours_loss)
    errors = {name: abs(a - e) / abs(e) for name, (a, e) in checks.items()}
    print(f"{arch} check: " + ", ".join(f"{name}: {a:.6f} vs {e:.6f}" for name, (a, e) in checks.items()))
    bad = {name: err for name, err in errors.items() if not err <= tol}
    if bad:
        raise AssertionError(f"{arch}: losses disagree beyond {tol}: {bad}")

    runners = {"ours": lambda: [ours.step(batch) for _ in range(s.steps)],
               "ours_shadow": lambda: [shadow.step(batch) for _ in range(s.steps)],
               "hf": lambda: [hf.step(batch) for _ in range(s.steps)],
               "hf_masked": lambda: [hf.step(batch, masked_only=True) for _ in range(s.steps)]}
    timings = {k: t.per(s.steps) for k, t in time_repeats(runners, device, s.repeats, s.warmup).items()}
    seconds = {k: t.median for k, t in timings.items()}
    gemm = gemm_flops(device, s.gemm_n, torch.bfloat16)
    _, datasheet = datasheet_peak(device)
    flops = training_flops(cfg, s.batch)
    hf_flops = training_flops(model_config("bert", s), s.batch)
    out = {"arch": arch, "config": asdict(s), "batch": s.batch, "precision": "bf16", "recompute": False,
           "policy": ours.session.policy.as_dict(), "kernel_overrides": kernels, "hf_attention": hf.attention,
           "session_setup_s": setup_s, "check_losses": {k: list(v) for k, v in checks.items()},
           "check_rel_err": errors, "gemm_tflops_bf16": gemm / 1e12,
           "datasheet_tflops_bf16": datasheet / 1e12 if datasheet else None,
           "flops_per_step": flops["useful"], "hf_flops_per_step_all_positions": hf_flops["hf_all_positions"]}
    for name, t in timings.items():
        out.update(t.ms(f"{name}_step_ms"))
        out[f"{name}_seq_per_s"] = s.batch / t.median
    out.update(mfu_figures("ours", flops["useful"], seconds["ours"], gemm, datasheet))
    out.update(mfu_figures("hf_masked", hf_flops["useful"], seconds["hf_masked"], gemm, datasheet))
    out.update(mfu_figures("hf", hf_flops["hf_all_positions"], seconds["hf"], gemm, datasheet))
    out["ours_vs_hf"] = seconds["hf"] / seconds["ours"]
    out["ours_vs_hf_masked"] = seconds["hf_masked"] / seconds["ours"]
    out["shadow_vs_autocast"] = seconds["ours"] / seconds["ours_shadow"]
    out["shadow_loss_equal"] = shadow_loss == ours_loss
    print(f"{arch} bf16, batch {s.batch} x seq {s.seq}: ours {out['ours_seq_per_s']:.1f} seq/s "
          f"({out['ours_tflops']:.1f} TFLOP/s = {flops['useful'] / 1e12:.3f} TFLOP / {seconds['ours'] * 1e3:.1f} ms, "
          f"{out['ours_of_gemm_peak']:.0%} of the {gemm / 1e12:.0f} TFLOP/s GEMM"
          + (f", MFU {out['ours_mfu']:.1%} of {datasheet / 1e12:.0f}" if datasheet else "") + ")")
    print(f"  HF BERT {out['hf_seq_per_s']:.1f} seq/s, HF masked-only {out['hf_masked_seq_per_s']:.1f} seq/s; "
          f"ours / HF {out['ours_vs_hf']:.2f}x, ours / HF masked-only {out['ours_vs_hf_masked']:.2f}x")
    print(f"  ours with weight_cast=shadow {out['ours_shadow_seq_per_s']:.1f} seq/s: "
          f"{out['shadow_vs_autocast']:.3f}x the default's casts (loss {'equal' if out['shadow_loss_equal'] else 'not equal'})")
    return out


# Phase 2's rows (NVIDIA's BERT recipe: seq 512, 80 masks); the dry run's at its tiny width.
PHASE_2 = {"seq": 512, "masks": 80}
DRY_PHASE_2 = {"seq": 64, "masks": 10}
# The global batch the fit splits: its divisors are the micro batches it can choose (every
# power of two up to it).
FIT_GLOBAL = {"gpu": 4096, "dry": 64}


def part_batch(s: Sizes, device: torch.device, args) -> dict:
    """batch.micro_batch_size auto (bert/run/fit.py) for BERT-Large at phase 1 and phase 2 and
    GroupBERT-Large at phase 1: the micro batch it chooses, its predicted peak memory against
    the allocator's over the timed steps, and one step at batch 64 (today's) and at the
    chosen size timed alternately: sequences per second and MFU of each."""
    from bert import config_from_dict
    from bert.run.fit import DEVICE_SHARE, GIB, device_memory, largest_fitting, measure_memory
    from bert.tasks.pretraining import make_session

    dry = device.type != "cuda"
    gemm = gemm_flops(device, s.gemm_n, torch.bfloat16)
    _, datasheet = datasheet_peak(device)
    kernels = {**compiled_kernels(device), "graph": "eager"}
    out: dict = {"global_batch": FIT_GLOBAL["dry" if dry else "gpu"], "runs": {}}
    for arch, phase in (("bert", 1), ("bert", 2), ("groupbert", 1)):
        sizes = s if phase == 1 else replace(s, **(DRY_PHASE_2 if dry else PHASE_2))
        cfg = model_config(arch, sizes)
        config = config_from_dict({
            "name": "fit", "model": cfg.model_dump(mode="json"), "data": {"source": "synthetic"},
            "training": {"device": str(device), "steps": 10, "kernels": kernels},
            "precision": {"dtype": "bf16"},
            "batch": {"micro_batch_size": "auto", "global_batch_size": out["global_batch"]}})  # as a user writes it
        # What fit_micro_batch does, its figures kept: the step's memory measured at micro
        # batches 1 and 2, the largest divisor of the global batch within 90 % of the device.
        fit = measure_memory(config, device, make_session)
        limit = DEVICE_SHARE * device_memory(device) if not dry else fit.peak(s.batch * 2) * 1.01  # the dry run: 2 × 4 rows
        chosen = largest_fitting(fit, out["global_batch"], limit)
        print(f"{arch} phase {phase}: micro batch {chosen} fits {limit / GIB:.3g} GiB (predicted peak "
              f"{fit.peak(chosen) / GIB:.3g} GiB; {fit.how})")
        today = min(s.batch, chosen)
        ours = Ours(cfg, device, compile=False, weights=cached_weights(cfg), kernels=kernels)
        batches = {size: device_batch(cfg, size, device) for size in (today, chosen)}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        runners = {f"b{size}": (lambda b=batches[size], o=ours: o.step(b)) for size in (today, chosen)}
        timings = time_repeats(runners, device, s.repeats, s.warmup)
        run = {"micro_batch": chosen, "today": today, "seq": sizes.seq, "masks": sizes.masks,
               "limit_gib": limit / GIB, "predicted_peak_gib": fit.peak(chosen) / GIB, "per_row_mib": fit.per_row / 2**20}
        if device.type == "cuda":
            run["measured_peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        for size in (today, chosen):
            t = timings[f"b{size}"]
            flops = training_flops(cfg, size)["useful"]
            run[f"b{size}"] = {**t.ms("step_ms"), "seq_per_s": size / t.median,
                               **mfu_figures("ours", flops, t.median, gemm, datasheet)}
        run["chosen_vs_b64"] = run[f"b{chosen}"]["seq_per_s"] / run[f"b{today}"]["seq_per_s"]
        out["runs"][f"{arch}_phase{phase}"] = run
        print(f"  batch {today}: {run[f'b{today}']['seq_per_s']:.1f} seq/s; batch {chosen}: "
              f"{run[f'b{chosen}']['seq_per_s']:.1f} seq/s ({run['chosen_vs_b64']:.2f}x)"
              + (f"; peak {run['measured_peak_gib']:.1f} GiB measured" if "measured_peak_gib" in run else ""))
        del ours, batches, runners
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def _profile_steps(step: Callable[[], object], device: torch.device, s: Sizes, steps: int = 2) -> dict:
    """Where `steps` warm steps spend their time: the device's busy time (the union of its
    kernels, from torch.profiler) against the step's wall clock timed without the profiler as
    the other parts time it (a device idle between kernels waits on the host), and the kernels
    and the ops (with the kernels they launch) that take the most."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_device = device.type == "cuda"
    timing = time_repeats({"step": lambda: [step() for _ in range(s.steps)]}, device, s.repeats, s.warmup)["step"]
    wall = timing.per(s.steps).median
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    kind = DeviceType.CUDA if on_device else DeviceType.CPU
    # Kernels on the device; on the CPU (the dry run) the ops that call no other op.
    leaves = [e for e in prof.events() if e.device_type == kind and not e.is_user_annotation
              and (on_device or not e.cpu_children)]
    busy = _busy_seconds([(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in leaves]) / steps

    def table(events, key: str) -> list[dict]:
        top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:20]
        return [{"name": e.key[:120], "ms_per_step": getattr(e, key) / 1e3 / steps, "calls_per_step": e.count / steps}
                for e in top]

    averages = [e for e in prof.key_averages() if not e.is_user_annotation]
    kernels = [e for e in averages if e.device_type == kind] if on_device else []
    ops = [e for e in averages if e.device_type == DeviceType.CPU]
    return {**timing.per(s.steps).ms("wall_ms"), "busy_ms": busy * 1e3, "busy_fraction": busy / wall,
            "kernels": table(kernels, "self_device_time_total"),
            "ops": table(ops, "device_time_total" if on_device else "cpu_time_total")}


def part_profile(s: Sizes, device: torch.device, args) -> dict:
    """Where a training step's time goes, for our BERT-Large and GroupBERT-Large and HF BERT."""
    out = {}
    for arch in ("bert", "groupbert"):
        cfg = model_config(arch, s)
        batch = device_batch(cfg, s.batch, device)
        ours = Ours(cfg, device, compile=False, weights=cached_weights(cfg), kernels=compiled_kernels(device))
        out[f"ours_{arch}"] = _profile_steps(functools.partial(ours.step, batch), device, s)
        del ours
    hf = HuggingFace(model_config("bert", s), device, None)
    batch = device_batch(model_config("bert", s), s.batch, device)
    out["hf_bert_masked_only"] = _profile_steps(lambda: hf.step(batch, masked_only=True), device, s)
    for name, prof in out.items():
        print(f"{name}: {prof['wall_ms']:.1f} ms per step, kernels busy {prof['busy_ms']:.1f} ms "
              f"({prof['busy_fraction']:.0%})")
        for title in ("kernels", "ops"):
            for row in prof[title][:12]:
                print(f"  {title[:-1]:6} {row['ms_per_step']:8.2f} ms {row['calls_per_step']:6.0f}x  {row['name'][:90]}")
    return out


def part_compile(s: Sizes, device: torch.device, args) -> dict:
    """Our BERT-Large step with torch.compile against the same step eager, and the peer a careful
    user would build: HF BertForPreTraining (MLM head at the masked positions) compiled, against
    it eager; one process, the four runners alternating."""
    cfg = model_config("bert", s)
    batch = device_batch(cfg, s.batch, device)
    weights, kernels = cached_weights(cfg), compiled_kernels(device)
    eager = Ours(cfg, device, compile=False, weights=weights, kernels=kernels)
    ours_weights = {n: p.detach() for n, p in eager.session.named_weights()}  # both HF runners start from them
    hf_eager = HuggingFace(model_config("bert", s), device, ours_weights)
    backend = args.compile_backend
    with compile_backend(backend):
        compiled = Ours(cfg, device, compile=True, weights=weights, kernels=kernels)
        hf_compiled = HuggingFace(model_config("bert", s), device, ours_weights)
        hf_compiled.compile_masked()
        t0 = time.perf_counter()
        first = {"compiled": compiled.step(batch), "eager": eager.step(batch)}
        first_step_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.no_grad():
            hf_first = {"compiled": hf_compiled.loss(batch, masked_only=True).item()}
        hf_first_step_s = time.perf_counter() - t0
        with torch.no_grad():
            hf_first["eager"] = hf_eager.loss(batch, masked_only=True).item()
        err = abs(first["compiled"] - first["eager"]) / abs(first["eager"])
        hf_err = abs(hf_first["compiled"] - hf_first["eager"]) / abs(hf_first["eager"])
        print(f"compile ({backend}): first step (compiling) {first_step_s:.1f} s; loss {first['compiled']:.6f} "
              f"compiled vs {first['eager']:.6f} eager; HF first forward (compiling) {hf_first_step_s:.1f} s, "
              f"loss {hf_first['compiled']:.6f} vs {hf_first['eager']:.6f}")
        if not err <= 2e-2 or not hf_err <= 2e-2:
            raise AssertionError(f"compiled loss {first['compiled']} vs eager {first['eager']}; HF {hf_first}")
        runners = {"eager": lambda: [eager.step(batch) for _ in range(s.steps)],
                   "compiled": lambda: [compiled.step(batch) for _ in range(s.steps)],
                   "hf_masked_eager": lambda: [hf_eager.step(batch, masked_only=True) for _ in range(s.steps)],
                   "hf_masked_compiled": lambda: [hf_compiled.step(batch, masked_only=True) for _ in range(s.steps)]}
        timings = {k: t.per(s.steps) for k, t in time_repeats(runners, device, s.repeats, s.warmup).items()}
    out = {"arch": "bert", "backend": backend, "batch": s.batch, "first_step_s": first_step_s, "check_rel_err": err,
           "hf_first_forward_s": hf_first_step_s, "hf_check_rel_err": hf_err,
           **{k: v for name, t in timings.items() for k, v in t.ms(f"{name}_step_ms").items()},
           "compiled_vs_eager": timings["eager"].median / timings["compiled"].median,
           "hf_compiled_vs_eager": timings["hf_masked_eager"].median / timings["hf_masked_compiled"].median,
           "ours_compiled_vs_hf_compiled": timings["hf_masked_compiled"].median / timings["compiled"].median}
    print(f"compile: eager {out['eager_step_ms']:.1f} ms, compiled {out['compiled_step_ms']:.1f} ms per step: "
          f"{out['compiled_vs_eager']:.2f}x; HF masked-only eager {out['hf_masked_eager_step_ms']:.1f} ms, compiled "
          f"{out['hf_masked_compiled_step_ms']:.1f} ms; ours compiled / HF compiled "
          f"{out['ours_compiled_vs_hf_compiled']:.2f}x")
    return out


@contextlib.contextmanager
def compile_backend(backend: str):
    """torch.compile with `backend` for the sessions made inside (SessionOptions has no backend:
    "inductor", torch's default, is what training.compile runs)."""
    if backend == "inductor":
        yield
        return
    original = torch.compile
    torch.compile = functools.partial(original, backend=backend)
    try:
        yield
    finally:
        torch.compile = original


# ----------------------------------------------------------------------- conv


def part_conv(s: Sizes, device: torch.device, args) -> dict:
    """Ours (channels-last, fwd + bwd) against cuDNN's grouped F.conv1d on (B, H, S)."""
    if not load_library():
        raise RuntimeError(f"compiled ops unavailable: {library_status()}")
    if device.type == "cuda" and not torch._C._dispatch_has_kernel_for_dispatch_key("groupbert::grouped_conv1d",
                                                                                     "CUDA"):
        raise RuntimeError("libgroupbert_ops.so was built without CUDA kernels")
    b, seq, h, c, k = s.conv
    groups, pad = h // c, k // 2
    flops = 3 * 2 * b * seq * h * c * k  # forward, grad-input, grad-weight: one multiply-add per tap
    copy = copy_bandwidth(device, s.copy_mib)
    with no_tf32():
        fp32_peak = gemm_flops(device, s.gemm_n // 2, torch.float32)
    ids = torch.zeros(b, seq, dtype=torch.int64)
    for row in range(b):  # packed rows: sequences of 5 to 100 tokens, a padding tail
        start, q = 0, 1
        while start < seq - 9:
            length = 5 + (17 * q + 31 * row) % 96
            ids[row, start : start + length] = q
            start, q = start + length, q + 1
    ids = ids.to(device)
    # cuDNN at its best for these shapes (benchmark mode: it times its algorithms on the first
    # call, a warm-up), in IEEE fp32 as ours computes (no TF32: torch enables it for cuDNN by default).
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = False
    out: dict = {"shape": dict(B=b, S=seq, H=h, C=c, K=k), "flops": flops, "copy_gbps": copy / 1e9,
                 "gemm_tflops_fp32_no_tf32": fp32_peak / 1e12, "cudnn_benchmark": True, "cudnn_tf32": False}

    def fwd_bwd(fn, x, w, grad):
        x = x.detach().requires_grad_()
        w = w.detach().requires_grad_()
        fn(x, w).backward(grad)
        return x.grad, w.grad

    ours = lambda x, w: grouped_conv1d(x, w)  # (B, S, H)
    packed = lambda x, w: grouped_conv1d(x, w, None, ids)
    # The Triton kernels (issue 54, item 3) where they run: on the GPU, or under TRITON_INTERPRET=1 on the CPU.
    triton = triton_available(device)
    ours_triton = lambda x, w: grouped_conv1d(x, w, implementation="triton")  # (B, S, H)
    packed_triton = lambda x, w: grouped_conv1d(x, w, None, ids, implementation="triton")
    out["triton"] = triton or triton_status(device)
    cudnn = lambda x, w: F.conv1d(x, w, padding=pad, groups=groups)  # (B, H, S)
    cudnn_bsh = lambda x, w: F.conv1d(x.transpose(1, 2), w, padding=pad, groups=groups).transpose(1, 2)
    for name, dtype, tol in (("fp32", torch.float32, 1e-5), ("bf16", torch.bfloat16, 1e-2)):
        gen = torch.Generator(device).manual_seed(1)
        x = torch.randn(b, seq, h, device=device, generator=gen).to(dtype)
        w = (torch.randn(h, c, k, device=device, generator=gen) / (c * k) ** 0.5).to(dtype)
        grad = torch.randn(b, seq, h, device=device, generator=gen).to(dtype)
        x_bhs, grad_bhs = x.transpose(1, 2).contiguous(), grad.transpose(1, 2).contiguous()  # outside the timer
        # Check first: out, grad_x, grad_w against float64 F.conv1d on the same (rounded) values.
        xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
        ref = cudnn_bsh(xd, wd)
        ref.backward(grad.double())
        errors = {}
        for runner, fn in (("ours", ours), ("triton", ours_triton))[: 2 if triton else 1]:
            xo, wo = x.detach().requires_grad_(), w.detach().requires_grad_()
            got = fn(xo, wo)
            got.backward(grad)
            errors[runner] = {"out": rel_err(got, ref), "grad_x": rel_err(xo.grad, xd.grad),
                              "grad_w": rel_err(wo.grad, wd.grad)}
            if not max(errors[runner].values()) <= tol:
                raise AssertionError(f"grouped_conv1d ({runner}) {name} on {device} disagrees with float64 F.conv1d: "
                                     f"{errors[runner]}")
        del xd, wd, ref, xo, wo, got
        runners = {"ours": lambda: fwd_bwd(ours, x, w, grad),
                   "ours_packed": lambda: fwd_bwd(packed, x, w, grad),
                   "cudnn": lambda: fwd_bwd(cudnn, x_bhs, w, grad_bhs),
                   "cudnn_from_bsh": lambda: fwd_bwd(cudnn_bsh, x, w, grad)}
        if triton:
            runners.update(triton=lambda: fwd_bwd(ours_triton, x, w, grad),
                           triton_packed=lambda: fwd_bwd(packed_triton, x, w, grad))
        t = time_alternating(runners, device, s.repeats * 2, s.warmup + 1, inner=3 if device.type == "cuda" else 1)
        moved = 5 * b * seq * h * x.element_size()  # fwd reads x, writes out; bwd reads grad, x, writes grad_x
        r = {"max_rel_err": errors["ours"], **{f"{v}_ms": t[v] * 1e3 for v in t},
             "ours_vs_cudnn": t["cudnn"] / t["ours"], "ours_vs_cudnn_from_bsh": t["cudnn_from_bsh"] / t["ours"],
             "ours_tflops": flops / t["ours"] / 1e12, "ours_of_fp32_gemm": flops / t["ours"] / fp32_peak,
             "memory_floor_ms": moved / copy * 1e3}
        if triton:
            r.update(triton_max_rel_err=errors["triton"], triton_vs_cudnn=t["cudnn"] / t["triton"],
                     triton_vs_ours=t["ours"] / t["triton"], triton_tflops=flops / t["triton"] / 1e12)
            out[f"conv_triton_vs_cudnn_{name}"] = r["triton_vs_cudnn"]
        out[name] = r
        out[f"conv_vs_cudnn_{name}"] = r["ours_vs_cudnn"]
        print(f"conv {name} (B={b} S={seq} H={h} C={c} K={k}) errors " + "; ".join(
            f"{runner} " + ", ".join(f"{k_} {v:.1e}" for k_, v in e.items()) for runner, e in errors.items()))
        peer = "cuDNN" if device.type == "cuda" else "torch"
        print(f"  fwd+bwd ours {r['ours_ms']:.3f} ms ({r['ours_tflops']:.2f} TFLOP/s, {r['ours_of_fp32_gemm']:.0%} of "
              f"the fp32 GEMM without TF32), packed {r['ours_packed_ms']:.3f} ms; {peer} {r['cudnn_ms']:.3f} ms "
              f"(from (B,S,H) {r['cudnn_from_bsh_ms']:.3f}): ours {r['ours_vs_cudnn']:.2f}x {peer}; "
              f"memory floor {r['memory_floor_ms']:.3f} ms")
        if triton:
            print(f"  Triton (B, S, H) {r['triton_ms']:.3f} ms ({r['triton_tflops']:.2f} TFLOP/s), packed "
                  f"{r['triton_packed_ms']:.3f} ms: {r['triton_vs_cudnn']:.2f}x {peer}, {r['triton_vs_ours']:.2f}x ours")
    return out


# ----------------------------------------------------------------------- lamb


# Bytes per fp32 parameter. LAMB: the gradient norm (read g), stage 1 (read g m v p, write m v u),
# stage 2 (read p u, write p).
LAMB_BYTES = 44
ADAMW_BYTES = 28  # read g m v p, write m v p


def _parameters(shapes: list[tuple[str, tuple[int, ...]]], device: torch.device, seed: int):
    gen = torch.Generator(device).manual_seed(seed)
    named = []
    for name, shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, device=device, generator=gen) * 0.02)
        p.grad = torch.randn(shape, device=device, generator=gen) * 1e-3
        named.append((name, p))
    return named


def _lamb_check(device: torch.device) -> float:
    """Our Lamb on `device` against the same Lamb on the CPU kernels (in the dry run, the compiled
    CPU kernels against the pure-torch step), 3 steps on a small model, gradient clipping on."""
    shapes = _shapes(ModelConfig(architecture="groupbert", hidden_size=48, num_layers=2, num_heads=3, vocab_size=101,
                                 max_positions=40, sequence_length=19, max_predictions=5))
    here, cpu = _parameters(shapes, device, 0), _parameters(shapes, torch.device("cpu"), 0)
    with torch.no_grad():
        for (_, a), (_, b) in zip(here, cpu):
            b.copy_(a)
            b.grad.copy_(a.grad)
    opt_here = Lamb(here, lr=6e-3, no_decay=no_weight_decay, fused=True, max_grad_norm=1.0)
    opt_cpu = Lamb(cpu, lr=6e-3, no_decay=no_weight_decay, fused=device.type != "cpu", max_grad_norm=1.0)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        grads = torch.randn(opt_cpu.flat_grads.numel(), generator=gen) * 1e-3
        opt_here.flat_grads.copy_(grads)
        opt_cpu.flat_grads.copy_(grads)
        opt_here.step()
        opt_cpu.step()
    return rel_err(opt_here.flat_params.cpu(), opt_cpu.flat_params)


def _shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    proto = build_model(cfg).builder.model_proto(with_weights=False, declare_weights=True)
    return [(t.name, tuple(t.dims)) for t in proto.graph.initializer]


def part_lamb(s: Sizes, device: torch.device, args) -> dict:
    if not load_library():
        raise RuntimeError(f"compiled ops unavailable: {library_status()}")
    if device.type == "cuda" and not torch._C._dispatch_has_kernel_for_dispatch_key("groupbert::lamb_stage1",
                                                                                     "CUDA"):
        raise RuntimeError("libgroupbert_ops.so was built without CUDA kernels")
    err = _lamb_check(device)
    print(f"lamb check: {device} vs the CPU kernels after 3 steps, max relative error {err:.1e}")
    if not err <= 1e-5:
        raise AssertionError(f"fused LAMB on {device} disagrees with the CPU kernel: {err}")
    shapes = _shapes(model_config("groupbert", s))
    n = sum(torch.Size(shape).numel() for _, shape in shapes)
    ours = Lamb(_parameters(shapes, device, 0), lr=1e-4, no_decay=no_weight_decay, fused=True)
    adamw_params = [p for _, p in _parameters(shapes, device, 1)]
    adamw = torch.optim.AdamW(adamw_params, lr=1e-4, weight_decay=0.01, fused=True)
    t = time_alternating({"ours": ours.step, "adamw_fused": adamw.step}, device, s.repeats * 2, s.warmup + 1)
    copy = copy_bandwidth(device, s.copy_mib)
    out = {"params": n, "tensors": len(shapes), "check_rel_err": err, "copy_gbps": copy / 1e9,
           "ours_ms": t["ours"] * 1e3, "adamw_fused_ms": t["adamw_fused"] * 1e3,
           "ours_floor_ms": LAMB_BYTES * n / copy * 1e3, "adamw_floor_ms": ADAMW_BYTES * n / copy * 1e3,
           "bytes_per_param": {"lamb": LAMB_BYTES, "adamw": ADAMW_BYTES}}
    out["lamb_vs_adamw_fused"] = t["adamw_fused"] / t["ours"]
    out["lamb_vs_floor"] = t["ours"] / (LAMB_BYTES * n / copy)
    out["adamw_vs_floor"] = t["adamw_fused"] / (ADAMW_BYTES * n / copy)
    print(f"lamb step over {n / 1e6:.1f} M parameters ({len(shapes)} tensors): ours {out['ours_ms']:.2f} ms "
          f"({out['lamb_vs_floor']:.2f}x its floor {LAMB_BYTES} B x {n / 1e6:.1f} M / {copy / 1e9:.0f} GB/s = "
          f"{out['ours_floor_ms']:.2f} ms); torch fused AdamW {out['adamw_fused_ms']:.2f} ms "
          f"({out['adamw_vs_floor']:.2f}x its {ADAMW_BYTES} B floor)")
    return out


# ----------------------------------------------------------------------- norm


def part_norm(s: Sizes, device: torch.device, args) -> dict:
    """The fused residual add and layer norm (session/add_norm.py, kernels norm=triton) against
    torch's add and F.layer_norm, forward + backward, at the model's (B·S, H) in bf16 under
    autocast, the sum read on (pre-norm), after a check against them; the memory floor beside."""
    from session.add_norm import add_layer_norm

    if not triton_available(device):
        return {"timed": False, "why": triton_status(device)}  # the CPU without the interpreter
    rows, hidden = s.batch * s.seq, s.hidden
    gen = torch.Generator(device).manual_seed(2)
    a = torch.randn(rows, hidden, device=device, generator=gen).bfloat16()
    b = torch.randn(rows, hidden, device=device, generator=gen).bfloat16()
    gamma = 1 + 0.1 * torch.randn(hidden, device=device, generator=gen)
    beta = 0.1 * torch.randn(hidden, device=device, generator=gen)

    def step(triton: bool):
        leaves = [t.detach().requires_grad_() for t in (a, b, gamma, beta)]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y, summed = add_layer_norm(*leaves, 1e-12, keep_sum=True, triton=triton)
        torch.autograd.backward([y, summed], [torch.ones_like(y), torch.ones_like(summed)])
        return y, summed, leaves

    fused, plain = step(True), step(False)
    errors = {"out": rel_err(fused[0], plain[0]), "sum": rel_err(fused[1], plain[1]),
              **{f"grad_{n}": rel_err(f.grad, p.grad) for n, f, p in zip(("a", "b", "gamma", "beta"), fused[2],
                                                                           plain[2])}}
    if not max(errors.values()) <= 2e-2:
        raise AssertionError(f"add_norm on {device} disagrees with the unfused ops: {errors}")
    t = time_alternating({"fused": lambda: step(True), "unfused": lambda: step(False)}, device, s.repeats * 2,
                         s.warmup + 1, inner=3 if device.type == "cuda" else 1)
    copy = copy_bandwidth(device, s.copy_mib)
    # Forward reads a, b (bf16), writes the sum (bf16) and y (float32 under CUDA's autocast); the
    # backward reads dy, the sum and its other gradient, writes one gradient (the add's two are one).
    moved = rows * hidden * (2 + 2 + 2 + 4 + 4 + 2 + 2 + 2)
    out = {"shape": {"rows": rows, "hidden": hidden}, "max_rel_err": errors, "fused_ms": t["fused"] * 1e3,
           "unfused_ms": t["unfused"] * 1e3, "fused_vs_unfused": t["unfused"] / t["fused"],
           "floor_ms": moved / copy * 1e3, "fused_vs_floor": t["fused"] / (moved / copy), "timed": True}
    print(f"add + layer norm ({rows} x {hidden}, bf16 autocast, fwd + bwd): fused {out['fused_ms']:.3f} ms, "
          f"unfused {out['unfused_ms']:.3f} ms ({out['fused_vs_unfused']:.2f}x); memory floor {out['floor_ms']:.3f} ms "
          f"({out['fused_vs_floor']:.2f}x it)")
    return out


# ----------------------------------------------------------------------- main


def run_part(part: str, dry_run: bool, args) -> dict:
    sizes = DRY if dry_run else GPU
    if dry_run:
        # One thread: the dry run shares a small CPU with other work, where every barrier of a
        # multi-threaded op waits for descheduled threads (its figures are not the point).
        device = torch.device("cpu")
        torch.set_num_threads(1)
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        raise RuntimeError("no CUDA device: run the dry run (--dry-run) on the CPU")
    torch.manual_seed(0)
    load_library()  # each part runs in a process of its own on the GPU: none may rely on another's load
    parts = {"peaks": part_peaks, "conv": part_conv, "lamb": part_lamb, "norm": part_norm, "profile": part_profile,
             "compile": part_compile, "batch": part_batch,
             "bert": functools.partial(part_train, "bert"), "groupbert": functools.partial(part_train, "groupbert")}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result = parts[part](sizes, device, args)
    result["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if device.type == "cuda":
        result["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--json-out", required=True,
                        help="JSON file, rewritten after each part: {part: {status, seconds, results | error}}")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend of the compile part (default inductor, what training.compile runs)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; the parts are {', '.join(PARTS)}")
    # One part's failure is recorded and the next part runs (gpu_check.py runs each part in
    # a process of its own on the GPU, so a crash or a hang costs only that part).
    record: dict = {}
    for part in parts:
        print(f"--- {part}", flush=True)
        start = time.perf_counter()
        try:
            record[part] = {"status": "ok", "results": run_part(part, args.dry_run, args)}
        except Exception as e:  # recorded with its traceback's last line, never fatal to the rest
            traceback.print_exc()
            record[part] = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        record[part]["seconds"] = time.perf_counter() - start
        Path(args.json_out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
