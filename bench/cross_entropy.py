#!/usr/bin/env python3
"""The MLM loss's softmax cross-entropy, forward + backward: the compiled ops
(custom_ops/softmax_xent.py, the kernel policy's cross_entropy=compiled) against
F.cross_entropy of the scores cast to fp32 (cross_entropy=torch, torch's own CPU path), on
(masked positions, vocabulary) scores, and the training step they sit in.

1. Check: both sides' loss and gradient against float64 (the gradient to its dtype's rounding).
2. The op: forward + backward of each side, alternating, `--repeats` times (medians, min,
   max). Roofline: the least memory traffic of a forward + backward, reading the scores
   twice (forward, backward) and writing the gradient once, at the copy bandwidth measured
   in the same run (a clone of an fp32 array of the same size).
3. The step: bench/train_throughput.py's BERT step in bf16 (hidden 256, 4 layers, batch 32,
   20 masked positions, so the scores are 640 × 30522), one session per side, alternating.

    python bench/cross_entropy.py           # → bench/results/cross_entropy.json
    python bench/cross_entropy.py --smoke   # tiny sizes, seconds, writes nothing

Keys: xent_vs_torch_{bf16,fp32} (speed-up of the op), xent_vs_floor_{bf16,fp32} (our time
over the roofline), step_vs_torch_bf16 (speed-up of the training step), "cpu" (model,
flags of note, date, load).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _start  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[640, 1280],
                        help="masked positions per step (640: batch 32 × 20; 1280: BERT-Large's batch 64 × 20)")
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--step-repeats", type=int, default=12)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "cross_entropy.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 2 repeats; writes no results file")
    return parser


_start.check_packages(build_parser)  # before the imports that need the project's packages

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import _levels  # noqa: E402
from bert import ModelConfig, build_model  # noqa: E402
from bert.data import synthetic_batch  # noqa: E402
from custom_ops import load_library  # noqa: E402
from session import SessionOptions  # noqa: E402
from session.dense import COMPILED_CROSS_ENTROPY_MIN_COLUMNS, softmax_cross_entropy  # noqa: E402
from session.process import retain_freed_memory  # noqa: E402
from session.schedules import Schedule  # noqa: E402
from session.training import OptimizerSpec, TrainingSession  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def ours(scores: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores = scores.detach().requires_grad_()
    loss = softmax_cross_entropy(scores, labels, -100)
    loss.backward()
    return loss, scores.grad


def torchs(scores: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores = scores.detach().requires_grad_()
    loss = F.cross_entropy(scores.float(), labels, ignore_index=-100)
    loss.backward()
    return loss, scores.grad


def check(scores: torch.Tensor, labels: torch.Tensor) -> dict:
    """Each side's loss and gradient against float64: the largest error, relative to the
    largest reference value."""
    ref_scores = scores.double().requires_grad_()
    ref_loss = F.cross_entropy(ref_scores, labels, ignore_index=-100)
    ref_loss.backward()
    out = {}
    for name, run in (("ours", ours), ("torch", torchs)):
        loss, grad = run(scores, labels)
        out[name] = {"loss_error": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
                     "grad_error": ((grad.double() - ref_scores.grad).abs().max()
                                    / ref_scores.grad.abs().max()).item()}
    return out


def alternate(runs: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each runner, alternating (the order flipped every repeat), after one warm-up each."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(repeats):
        for name in (list(runs) if i % 2 else list(reversed(runs))):
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    return times


def summary(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def op_figures(rows: int, vocab: int, dtype_name: str, repeats: int) -> dict:
    dtype = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(rows)
    scores = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[::7] = -100  # padding of the masked positions
    checked = check(scores, labels)
    buffer = torch.empty(rows, vocab)
    times = alternate({"ours": lambda: ours(scores, labels), "torch": lambda: torchs(scores, labels),
                       "copy": lambda: buffer.clone()}, repeats)
    bandwidth = 2 * buffer.numel() * 4 / statistics.median(times["copy"])  # read + write, bytes/s
    floor_s = 3 * scores.numel() * scores.element_size() / bandwidth
    ours_s, torch_s = statistics.median(times["ours"]), statistics.median(times["torch"])
    return {"rows": rows, "vocab": vocab, "dtype": dtype_name, "check": checked,
            "ours": summary(times["ours"]), "torch": summary(times["torch"]),
            "copy_bandwidth_gb_s": bandwidth / 1e9, "floor_s": floor_s,
            "speedup": torch_s / ours_s, "over_floor": ours_s / floor_s}


def step_figures(smoke: bool, repeats: int) -> dict:
    # The smoke model keeps a vocabulary wide enough for the compiled ops (session/lowering.py).
    shape = (dict(hidden_size=48, num_layers=2, num_heads=3, sequence_length=19, max_predictions=5,
                  vocab_size=COMPILED_CROSS_ENTROPY_MIN_COLUMNS, max_positions=40) if smoke else
             dict(hidden_size=256, num_layers=4, num_heads=4, sequence_length=128, max_predictions=20))
    cfg = ModelConfig(architecture="bert", **shape)
    batch = synthetic_batch(cfg, 4 if smoke else 32, torch.Generator().manual_seed(0))
    spec = OptimizerSpec(kind="lamb", schedule=Schedule(1e-4, 0, 10**9, decay="constant"))
    sessions, losses = {}, {}
    for name, impl in (("ours", "compiled"), ("torch", "torch")):
        torch.manual_seed(0)
        sessions[name] = TrainingSession(build_model(cfg).builder.model_proto(), optimizer=spec, anchors=("loss",),
                                         options=SessionOptions(precision="bf16", kernels={"cross_entropy": impl}))
        losses[name] = float(sessions[name].run(batch)["loss"])
    times = alternate({name: (lambda s=s: s.run(batch)) for name, s in sessions.items()}, repeats)
    return {"first_losses": losses, "ours": summary(times["ours"]), "torch": summary(times["torch"]),
            "speedup": statistics.median(times["torch"]) / statistics.median(times["ours"]),
            "kernels": sessions["ours"].policy.describe()}


def main() -> int:
    args = build_parser().parse_args()
    if not load_library():
        sys.exit("error: the compiled ops are not built (the cross-entropy's kernels are among them): run `make`")
    if args.smoke:
        args.rows, args.vocab, args.repeats, args.step_repeats = [40], COMPILED_CROSS_ENTROPY_MIN_COLUMNS, 2, 2
    retained = retain_freed_memory()
    cpu = _levels.cpu_description()
    print(_levels.cpu_line(cpu))
    print(f"freed memory kept for reuse (glibc mallopt, as bert.py): {'yes' if retained else 'no'}")
    results: dict = {"cpu": cpu, "command": "python bench/cross_entropy.py" + (" --smoke" if args.smoke else ""),
                     "load_average_start": os.getloadavg(), "ops": []}
    for rows in args.rows:
        for dtype_name in DTYPES:
            r = op_figures(rows, args.vocab, dtype_name, args.repeats)
            results["ops"].append(r)
            c = r["check"]
            print(f"{rows} × {args.vocab} {dtype_name}: check vs float64: ours loss {c['ours']['loss_error']:.1e} "
                  f"grad {c['ours']['grad_error']:.1e}, torch loss {c['torch']['loss_error']:.1e} "
                  f"grad {c['torch']['grad_error']:.1e}")
            print(f"  forward + backward: ours {r['ours']['median_s'] * 1e3:.2f} ms "
                  f"(min {r['ours']['min_s'] * 1e3:.2f}, max {r['ours']['max_s'] * 1e3:.2f}), "
                  f"torch {r['torch']['median_s'] * 1e3:.2f} ms "
                  f"(min {r['torch']['min_s'] * 1e3:.2f}, max {r['torch']['max_s'] * 1e3:.2f}): "
                  f"{r['speedup']:.2f}x; roofline {r['floor_s'] * 1e3:.2f} ms (3 passes over the scores at the "
                  f"copy's {r['copy_bandwidth_gb_s']:.1f} GB/s): ours at {r['over_floor']:.2f}x the floor")
            if rows == args.rows[0]:
                results[f"xent_vs_torch_{dtype_name}"] = r["speedup"]
                results[f"xent_vs_floor_{dtype_name}"] = r["over_floor"]
    step = step_figures(args.smoke, args.step_repeats)
    results["step"] = step
    results["step_vs_torch_bf16"] = step["speedup"]
    print(f"BERT bf16 training step ({step['kernels']}):")
    print(f"  cross_entropy=compiled {step['ours']['median_s'] * 1e3:.1f} ms (min {step['ours']['min_s'] * 1e3:.1f}, "
          f"max {step['ours']['max_s'] * 1e3:.1f}), cross_entropy=torch {step['torch']['median_s'] * 1e3:.1f} ms "
          f"(min {step['torch']['min_s'] * 1e3:.1f}, max {step['torch']['max_s'] * 1e3:.1f}): {step['speedup']:.3f}x; "
          f"first losses {step['first_losses']['ours']:.5f} and {step['first_losses']['torch']:.5f}")
    return _start.finish(results, args.out, args.smoke, "the op checked and timed, the step timed both ways")


if __name__ == "__main__":
    sys.exit(main())
