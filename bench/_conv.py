"""GroupedConv1d benchmark: the compiled op against torch's grouped F.conv1d.

Correctness first (both against a float64 F.conv1d on the same data), then forward +
backward timings at GroupBERT base (B=32, S=128, H=768, C=16, K=7), fp32, bf16 and fp16,
variants alternating within every repeat, medians reported. Each CPU kernel level this
machine runs (bench/_levels.py: generic, avx2, avx512, avx512_bf16, then "native") is
timed in a child process with our kernels and torch's capped the same way; bf16 runs
on AVX512-BF16 dot products at avx512_bf16 (and natively on such a CPU), on AMX tiles
natively where the CPU has them, widened to fp32 below. `run(level)` returns the dict
that bench/ops.py merges into bench/results/ops.json; `python bench/_conv.py [--level L]
[--smoke]` prints the tables on their own (--smoke: B=2, S=37, H=48, 2 repeats).

The child's malloc keeps freed memory (see _MALLOC_ENV).

Peers, both timed forward + backward on the same values:
  torch (B,H,S) : F.conv1d on a contiguous channels-first copy made outside the timer.
                  The headline figure: torch in its own layout, no transposes counted.
  torch (B,S,H) : what a channels-last caller writes, x.transpose(1, 2) in and out.

Besides the headline (all threads, wall time), ours and torch (B,H,S) are timed on one
thread each in process CPU time, alternating, and the ratio of each pair reported
(median, min, max: conv_vs_torch_<dtype>_1thread_cpu). On a shared machine a thread of
an all-thread call that is descheduled holds the whole call up, on either side; the
CPU time of a one-thread call counts only its own work.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _levels  # noqa: E402

from custom_ops import library_status  # noqa: E402
from custom_ops.grouped_conv1d import compiled_available  # noqa: E402

FULL = dict(B=32, S=128, H=768, C=16, K=7)  # GroupBERT base, phase 1
SMOKE = dict(B=2, S=37, H=48, C=16, K=7)  # a partial tile, 3 groups: seconds at every level
REPEATS, SMOKE_REPEATS = 15, 2
# Each variant allocates ~25 MB of fresh outputs per call. With glibc's default
# trimming, which of them page-faults those pages (about 6000 faults, 10-30 ms of
# kernel time on this VM) depended on the order of the variants, not on the kernels;
# so the timings run in a process whose malloc never returns memory to the OS.
_MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}
CHECK_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _conv_channels_first(x_bhs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    hidden, per_group, width = w.shape
    return F.conv1d(x_bhs, w, padding=width // 2, groups=hidden // per_group)  # (B, H, S)


def _conv_channels_last_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _conv_channels_first(x.transpose(1, 2), w).transpose(1, 2)  # (B, S, H)


def _ours(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.groupbert.grouped_conv1d(x, w, None)


def _fwd_bwd(fn, x, w, grad_out):
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    out = fn(x, w)
    out.backward(grad_out)
    return out, x.grad, w.grad


def _rel_err(a: torch.Tensor, e: torch.Tensor) -> float:
    return ((a.double() - e).abs().max() / e.abs().max()).item()


def _check(dtype: torch.dtype, sizes: dict) -> dict[str, float]:
    """Relative errors of the compiled op against F.conv1d in float64 on the same values."""
    S, H, C, K = (sizes[k] for k in "SHCK")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(min(4, sizes["B"]), S, H, generator=gen).to(dtype)
    w = (torch.randn(H, C, K, generator=gen) / (C * K) ** 0.5).to(dtype)
    grad_out = torch.randn(*x.shape, generator=gen).to(dtype)
    ours = _fwd_bwd(_ours, x, w, grad_out)
    ref = _fwd_bwd(_conv_channels_last_torch, x.double(), w.double(), grad_out.double())
    errors = {name: _rel_err(a, e) for name, a, e in zip(["out", "grad_x", "grad_w"], ours, ref)}
    worst = max(errors.values())
    if worst > CHECK_RTOL[dtype]:
        raise AssertionError(f"grouped_conv1d {dtype} disagrees with F.conv1d: {errors}")
    return errors


def _time_variants(variants: dict, repeats: int = REPEATS) -> dict[str, float]:
    """Median wall seconds per call of each zero-argument callable, alternating them per
    repeat, and under "<name>:cpu" the median CPU seconds of the process (all threads):
    the cost of a call even when other work shares the cores. Fewer repeats (at least 3)
    when a round takes over a second: torch's bf16/fp16 conv capped at AVX2 takes seconds."""
    start = time.perf_counter()
    for fn in variants.values():
        fn()  # warm-up: allocations, oneDNN primitive caches
    round_s = time.perf_counter() - start
    repeats = repeats if round_s < 1.0 else min(repeats, max(3, int(repeats / round_s)))  # never more
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    medians = {name: statistics.median(ts) for name, ts in wall.items()}
    medians.update({f"{name}:cpu": statistics.median(ts) for name, ts in cpu.items()})
    return medians


def _paired_cpu_ratio(ours, peer, repeats: int) -> dict[str, float]:
    """ours and peer on one thread, alternating: median process CPU seconds of each, and
    the median, min and max over the repeats of peer / ours (each pair timed back to back)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # for the whole block: no idle worker of an earlier call spins meanwhile
    try:
        ours(), peer()  # warm-up at one thread
        start = time.process_time()
        ours(), peer()
        repeats = repeats if time.process_time() - start < 1.0 else min(repeats, 3)
        ours_s, peer_s = [], []
        for _ in range(repeats):
            for fn, times in ((ours, ours_s), (peer, peer_s)):
                start = time.process_time()
                fn()
                times.append(time.process_time() - start)
    finally:
        torch.set_num_threads(threads)
    ratios = [p / o for o, p in zip(ours_s, peer_s)]
    return {"ours_s": statistics.median(ours_s), "peer_s": statistics.median(peer_s),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "repeats": repeats}


def _peaks(smoke: bool) -> tuple[float, float]:
    """What this machine sustains now: an MKL sgemm (FLOP/s) and a large copy (bytes/s)."""
    n = 256 if smoke else 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    src = torch.empty((1 if smoke else 64) * 2**20 // 4)  # 64 MiB, well past L2
    dst = torch.empty_like(src)
    t = _time_variants({"gemm": lambda: a @ b, "copy": lambda: dst.copy_(src)}, repeats=2 if smoke else 5)
    return 2 * n**3 / t["gemm"], 2 * src.numel() * 4 / t["copy"]


def _time_dtype(dtype: torch.dtype, sizes: dict, repeats: int) -> dict[str, float]:
    B, S, H, C, K = (sizes[k] for k in "BSHCK")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, H, generator=gen).to(dtype)  # (B, S, H)
    x_bhs = x.transpose(1, 2).contiguous()  # (B, H, S), made outside the timer
    w = (torch.randn(H, C, K, generator=gen) / (C * K) ** 0.5).to(dtype)
    grad_out = torch.randn(B, S, H, generator=gen).to(dtype)
    grad_out_bhs = grad_out.transpose(1, 2).contiguous()
    threads = torch.get_num_threads()

    def ours_one_thread():
        torch.set_num_threads(1)
        try:
            _fwd_bwd(_ours, x, w, grad_out)
        finally:
            torch.set_num_threads(threads)

    variants = {
        "ours": lambda: _fwd_bwd(_ours, x, w, grad_out),
        "torch_bhs": lambda: _fwd_bwd(_conv_channels_first, x_bhs, w, grad_out_bhs),
        "torch_bsh": lambda: _fwd_bwd(_conv_channels_last_torch, x, w, grad_out),
        "ours_1thread": ours_one_thread,
        "ours_fwd": lambda: _ours(x, w),
        "torch_bhs_fwd": lambda: _conv_channels_first(x_bhs, w),
    }
    if dtype != torch.float32:
        # What a caller could run instead of a slow torch conv in this dtype: torch's
        # fp32 conv on the same (widened) values, the widening not timed.
        x32, w32, g32 = x_bhs.float(), w.float(), grad_out_bhs.float()
        variants["torch_bhs_fp32"] = lambda: _fwd_bwd(_conv_channels_first, x32, w32, g32)
    if dtype == torch.float16:
        del variants["torch_bsh"]
    t = _time_variants(variants, repeats)
    t["one_thread"] = _paired_cpu_ratio(variants["ours"], variants["torch_bhs"], repeats)
    return t


def run(level: str = _levels.NATIVE, smoke: bool = False) -> dict:
    """Checks, times and returns {"conv_vs_torch_fp32": x, ..., "conv": details} at one kernel level,
    in a child process with that level's caps and a malloc that keeps freed memory."""
    return _levels.run_child(Path(__file__), level, _MALLOC_ENV, ["--smoke"] if smoke else [])


def _bf16_kernel() -> str:
    """Which of our kernels runs bf16 (at GroupBERT's 16 channels per group) at the level in force."""
    level = torch.ops.groupbert.cpu_capability()
    amx = torch.ops.groupbert.amx_state()
    if not amx.startswith("off"):
        return f"amx tiles ({amx})"
    if level == "avx512_bf16":
        return "avx512_bf16 dot products (vdpbf16ps)"
    return f"{level}, widened to fp32"


def _run_here(level: str, smoke: bool = False) -> dict:
    if not compiled_available():
        raise RuntimeError(f"compiled grouped_conv1d unavailable: {library_status()}")
    _levels.check_child_level(level)
    sizes, repeats = (SMOKE, SMOKE_REPEATS) if smoke else (FULL, REPEATS)
    B, S, H, C, K = (sizes[k] for k in "BSHCK")
    flops_pass = 2 * B * S * H * C * K  # one multiply-add per (output element, c, k)
    flops = 3 * flops_pass  # forward, grad-input, grad-weight
    gemm_flops, copy_bytes = _peaks(smoke)
    caps = " ".join(f"{k}={v}" for k, v in _levels.LEVEL_ENV[level].items()) or "nothing capped"
    print(f"\n=== grouped_conv1d at level {level}{' (smoke: tiny sizes)' if smoke else ''} ({caps}; ours runs "
          f"{torch.ops.groupbert.cpu_capability()}, bf16 on {_bf16_kernel()}; torch's ATen "
          f"{torch.backends.cpu.get_cpu_capability()})")
    print(f"B={B} S={S} H={H} C={C} K={K} (G={H // C}), {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"FLOPs per pass 2*B*S*H*C*K = {flops_pass / 1e6:.1f} M; forward+backward x3 = {flops / 1e9:.3f} G")
    print("malloc keeps freed memory (" + " ".join(f"{k}={v}" for k, v in _MALLOC_ENV.items()) + "): no page faults "
          "after warm-up, for either side")
    print(f"roofline now: MKL sgemm {gemm_flops / 1e9:.0f} GFLOP/s, copy {copy_bytes / 1e9:.1f} GB/s")
    result: dict = {"conv": {"level": level, "ours_level": torch.ops.groupbert.cpu_capability(),
                             "amx": torch.ops.groupbert.amx_state(), "bf16_kernel": _bf16_kernel(),
                             "smoke": smoke,
                             "aten_capability": torch.backends.cpu.get_cpu_capability(),
                             "load_average": os.getloadavg()[0],
                             "shape": dict(sizes), "threads": torch.get_num_threads(),
                             "repeats": repeats, "gemm_gflops": gemm_flops / 1e9, "copy_gbps": copy_bytes / 1e9,
                             "headline_peer": "torch F.conv1d on contiguous (B, H, S), transposes not timed"}}
    for name, dtype in DTYPES.items():
        errors = _check(dtype, sizes)
        t = _time_dtype(dtype, sizes, repeats)
        elt = torch.empty((), dtype=dtype).element_size()
        # Least traffic: forward reads x, writes out; backward reads grad_out and x,
        # writes grad_x (grad-input and grad-weight fused would read each once).
        moved = 5 * B * S * H * elt + 2 * H * C * K * elt
        speedup = t["torch_bhs"] / t["ours"]
        result[f"conv_vs_torch_{name}"] = speedup
        result[f"conv_vs_torch_{name}_1thread_cpu"] = t["one_thread"]["ratio"]
        # The model's activations are (B, S, H): a torch caller transposes in and out.
        if "torch_bsh" in t:
            result[f"conv_vs_torch_channels_last_{name}"] = t["torch_bsh"] / t["ours"]
        result["conv"][name] = {
            "max_rel_err": errors,
            "ours_ms": t["ours"] * 1e3, "ours_1thread_ms": t["ours_1thread"] * 1e3,
            "torch_bhs_ms": t["torch_bhs"] * 1e3, "torch_bsh_ms": t.get("torch_bsh", float("nan")) * 1e3,
            "ours_fwd_ms": t["ours_fwd"] * 1e3, "torch_bhs_fwd_ms": t["torch_bhs_fwd"] * 1e3,
            "ours_cpu_ms": t["ours:cpu"] * 1e3, "torch_bhs_cpu_ms": t["torch_bhs:cpu"] * 1e3,
            "cpu_time_ratio_vs_torch_bhs": t["torch_bhs:cpu"] / t["ours:cpu"],
            "speedup_vs_torch_bhs": speedup, "speedup_vs_torch_bsh": t.get("torch_bsh", float("nan")) / t["ours"],
            "thread_speedup": t["ours_1thread"] / t["ours"],
            "one_thread_cpu": {"ours_ms": t["one_thread"]["ours_s"] * 1e3,
                               "torch_bhs_ms": t["one_thread"]["peer_s"] * 1e3,
                               "ratio_median": t["one_thread"]["ratio"], "ratio_min": t["one_thread"]["ratio_min"],
                               "ratio_max": t["one_thread"]["ratio_max"], "repeats": t["one_thread"]["repeats"]},
            "ours_gflops": flops / t["ours"] / 1e9, "bytes_moved_min": moved,
            "arithmetic_intensity": flops / moved,
        }
        r = result["conv"][name]
        print(f"\n{name}: max relative error vs float64 F.conv1d: "
              + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
        print(f"  fwd+bwd  ours {r['ours_ms']:7.2f} ms  ({r['ours_gflops']:.0f} GFLOP/s = {flops / 1e9:.3f} G / "
              f"{t['ours'] * 1e3:.2f} ms, {100 * r['ours_gflops'] * 1e9 / gemm_flops:.0f}% of sgemm)")
        print(f"           ours, 1 thread {r['ours_1thread_ms']:7.2f} ms  (x{r['thread_speedup']:.2f} from threads)")
        print(f"           torch (B,H,S) {r['torch_bhs_ms']:7.2f} ms  -> speed-up x{speedup:.2f}  [headline]")
        if "torch_bsh" in t:
            print(f"           torch (B,S,H) {r['torch_bsh_ms']:7.2f} ms  -> speed-up x{r['speedup_vs_torch_bsh']:.2f}")
        if "torch_bhs_fp32" in t:
            r["torch_bhs_fp32_ms"] = t["torch_bhs_fp32"] * 1e3
            r["speedup_vs_torch_fp32_same_values"] = t["torch_bhs_fp32"] / t["ours"]
            result[f"conv_vs_torch_fp32_peer_{name}"] = r["speedup_vs_torch_fp32_same_values"]
            print(f"           torch (B,H,S) in fp32 on the same values {r['torch_bhs_fp32_ms']:7.2f} ms  -> speed-up "
                  f"x{r['speedup_vs_torch_fp32_same_values']:.2f}")
        print(f"  CPU time ours {r['ours_cpu_ms']:7.2f} ms, torch (B,H,S) {r['torch_bhs_cpu_ms']:7.2f} ms "
              f"-> x{r['cpu_time_ratio_vs_torch_bhs']:.2f} (process CPU time, all threads)")
        one = r["one_thread_cpu"]
        print(f"  one thread each, CPU time: ours {one['ours_ms']:7.2f} ms, torch (B,H,S) "
              f"{one['torch_bhs_ms']:7.2f} ms -> x{one['ratio_median']:.2f} (pairs: min x{one['ratio_min']:.2f}, max x{one['ratio_max']:.2f}, "
              f"{one['repeats']} repeats)")
        print(f"  forward  ours {r['ours_fwd_ms']:7.2f} ms, torch (B,H,S) {r['torch_bhs_fwd_ms']:7.2f} ms")
        print(f"  bytes moved >= 5*B*S*H*{elt} + weights = {moved / 1e6:.1f} MB -> "
              f"{moved / copy_bytes * 1e3:.2f} ms at copy speed; {flops / moved:.0f} FLOP/byte, so compute-bound "
              f"(ridge {gemm_flops / copy_bytes:.0f} FLOP/byte); FLOP floor {flops / gemm_flops * 1e3:.2f} ms")
    return result


if __name__ == "__main__":
    _levels.main(__doc__, _run_here, run, "conv")
