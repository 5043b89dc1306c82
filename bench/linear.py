#!/usr/bin/env python3
"""The fused linear layer's fp32 CPU paths, forward + backward (dx, dw, db):

  F.linear   torch's op and the backward autograd derives for it (MKL GEMMs, db = dy.sum(0))
  torch      session.dense.LinearFunction with torch's GEMMs (db = dyᵀ·1 as a GEMM)
  onednn     session.dense.LinearFunction with oneDNN's inner product (the kernel policy's gemm=onednn)

    python bench/linear.py
    ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 python bench/linear.py
    python bench/linear.py --smoke

The dense layers of BERT-base and of the benchmark model of bench/train_throughput.py
(and its MLM decoder), batch 32 × seq 128 tokens (20 masked positions per row for the
decoder), each path timed in turn, medians of 5 and the speed-up over F.linear measured
within each round. Correctness first: every output and gradient equals F.linear's to
1e-5 relative. Prints only.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _start  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="two tiny shapes, one repeat")
    return parser


_start.check_packages(build_parser)  # before the imports that need the project's packages

import torch
import torch.nn.functional as F

from session.dense import LinearFunction  # noqa: E402

SHAPES = [(4096, 768, 3072), (4096, 3072, 768), (4096, 768, 768), (4096, 256, 1024), (4096, 1024, 256),
          (4096, 256, 768), (4096, 256, 256), (640, 256, 30522)]  # (tokens, in, out)
SMOKE_SHAPES = [(64, 24, 40), (64, 40, 24)]


def fwd_bwd(fn, x, w, b, dy) -> tuple[float, list[torch.Tensor]]:
    for t in (x, w, b):
        t.grad = None
    start = time.perf_counter()
    fn(x, w, b).backward(dy)
    return time.perf_counter() - start, [t.grad for t in (x, w, b)]


def main() -> int:
    args = build_parser().parse_args()
    shapes, repeats = (SMOKE_SHAPES, 1) if args.smoke else (SHAPES, args.repeats)
    paths = {"F.linear": F.linear, "torch": lambda x, w, b: LinearFunction.apply(x, w, b, False)}
    if torch.backends.mkldnn.is_available():
        paths["onednn"] = lambda x, w, b: LinearFunction.apply(x, w, b, True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, ATen {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'tokens':>6} {'in':>5} {'out':>5} " + " ".join(f"{p + ' ms':>11}" for p in paths)
          + " " + " ".join(f"{p + ' x':>9}" for p in list(paths)[1:]) + f" {'GFLOP/s':>8}")
    for tokens, n_in, n_out in shapes:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, n_in, generator=g, requires_grad=True)
        w = torch.randn(n_out, n_in, generator=g, requires_grad=True)
        b = torch.randn(n_out, generator=g, requires_grad=True)
        dy = torch.randn(tokens, n_out, generator=g)
        _, want = fwd_bwd(F.linear, x, w, b, dy)
        for name, fn in paths.items():  # checks, and the warm-up run of each path
            _, got = fwd_bwd(fn, x, w, b, dy)
            for grad, a, e in zip(("dx", "dw", "db"), got, want):
                error = float((a - e).abs().max() / e.abs().max())
                assert error <= 1e-5, f"{tokens}x{n_in}x{n_out} {name} {grad}: differs from F.linear by {error:.1e}"
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(repeats):
            for name, fn in paths.items():
                times[name].append(fwd_bwd(fn, x, w, b, dy)[0])
        base = times["F.linear"]
        speedups = {name: statistics.median(a / t for a, t in zip(base, times[name])) for name in list(paths)[1:]}
        best = min(statistics.median(t) for t in times.values())
        flops = 3 * 2 * tokens * n_in * n_out
        print(f"{tokens:>6} {n_in:>5} {n_out:>5} " + " ".join(f"{statistics.median(t) * 1e3:>11.2f}" for t in times.values())
              + " " + " ".join(f"{s:>8.2f}x" for s in speedups.values()) + f" {flops / best / 1e9:>8.0f}")
    if args.smoke:
        print("smoke: every path's gradients equal F.linear's; no results file written (none is, ever)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
