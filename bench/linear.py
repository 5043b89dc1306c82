#!/usr/bin/env python3
"""The fused linear layer's two fp32 CPU paths: torch's F.linear (MKL) and oneDNN.

    python bench/linear.py
    ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 python bench/linear.py

Forward + backward (dx, dw, db) of the dense layers of BERT-base and of the benchmark
model of bench/train_throughput.py, batch 32 × seq 128 tokens, each path timed in turn
(best of 5). Correctness first: every gradient of the oneDNN path equals F.linear's to
1e-5 relative. session/lowering.py picks oneDNN on AMD CPUs with AVX-512 (where MKL
keeps to its AVX2 code); the second command shows why not below AVX-512. Prints only
(no results file). `--smoke`: one small shape, one timed run (tests/test_bench_smoke.py).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from session.lowering import _OneDnnLinear  # noqa: E402

SHAPES = [(768, 3072), (3072, 768), (768, 768), (256, 1024), (1024, 256), (256, 256)]  # (in, out)
TOKENS = (32, 128)


def fwd_bwd_seconds(fn, x, w, b, dy, repeats: int = 5) -> tuple[float, list[torch.Tensor]]:
    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms up
        for t in (x, w, b):
            t.grad = None
        start = time.perf_counter()
        fn(x, w, b).backward(dy)
        best = min(best, time.perf_counter() - start)
    return best, [t.grad.clone() for t in (x, w, b)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="seconds: one small shape, one timed run")
    args = parser.parse_args()
    shapes, tokens, repeats = ([(48, 80)], (4, 16), 1) if args.smoke else (SHAPES, TOKENS, 5)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ATen {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'in':>5} {'out':>5} {'F.linear ms':>12} {'oneDNN ms':>10} {'speed-up':>9} {'GFLOP/s':>8}")
    for n_in, n_out in shapes:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(*tokens, n_in, generator=g, requires_grad=True)
        w = torch.randn(n_out, n_in, generator=g, requires_grad=True)
        b = torch.randn(n_out, generator=g, requires_grad=True)
        dy = torch.randn(*tokens, n_out, generator=g)
        base, want = fwd_bwd_seconds(torch.nn.functional.linear, x, w, b, dy, repeats)
        ours, got = fwd_bwd_seconds(_OneDnnLinear.apply, x, w, b, dy, repeats)
        for name, a, e in zip(("dx", "dw", "db"), got, want):
            error = float((a - e).abs().max() / e.abs().max())
            assert error <= 1e-5, f"{n_in}x{n_out} {name}: oneDNN differs from F.linear by {error:.1e}"
        flops = 3 * 2 * tokens[0] * tokens[1] * n_in * n_out
        print(f"{n_in:>5} {n_out:>5} {base * 1e3:>12.1f} {ours * 1e3:>10.1f} {base / ours:>8.2f}× {flops / ours / 1e9:>8.0f}")
    if args.smoke:
        print("smoke: oneDNN's gradients equal F.linear's; both timed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
