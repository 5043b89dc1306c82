#!/usr/bin/env python3
"""Where one training step's time goes, against the time its own matrix products take alone.

The step is bench/train_throughput.py's: a TrainingSession of the lowered ONNX graph
(fused LAMB, anchors = the loss), BERT and GroupBERT at hidden 256, 4 layers, 4 heads,
sequence 128, batch 32, 20 masked positions. For each model:

1. One step under torch.profiler (shapes recorded). Each op's self time goes to a class:
   GEMM (oneDNN inner products, mm/addmm/bmm), attention (torch's fused CPU attention,
   softmax), conv (the grouped convolution), normalisation and elementwise (LayerNorm,
   GELU, adds, the loss, embeddings, reductions), copies and fills (copy_, fill_, cat:
   layout changes and zeroing), optimizer (everything under the optimizer's step and
   zero_grad); framework overhead is the rest of the step's wall time (Python, autograd's
   engine, dispatch, views, allocation, and the profiler's own cost).
2. The step's GEMMs, read from that profile at their shapes (forward and backward; the
   products inside fused attention included, bench/_gemms.py), each run alone with the
   faster of torch's matmul and oneDNN for its shape.
3. Repeats, each timing one unprofiled step and then one pass over those GEMMs alone:
   GEMM fraction = GEMMs alone / step (the share of the step that is GEMM work; 1.0 would
   be a step at the speed of its matrix products). Median and spread over the repeats.

The process keeps freed memory for reuse, as bert.py and bench/train_throughput.py do
(session.process.retain_freed_memory).

    python bench/step_profile.py                  # → bench/results/step_profile.json
    python bench/step_profile.py --precision bf16 --out /tmp/step_profile-bf16.json
    python bench/step_profile.py --smoke          # tiny model, seconds, writes nothing
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _start  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["bert", "groupbert"], choices=["bert", "groupbert"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    _start.add_shape_arguments(parser)
    parser.add_argument("--kernels", default="{}", help='kernel policy overrides, JSON (e.g. \'{"gemm": "torch"}\')')
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "step_profile.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny model, one repeat, writes no results file")
    return parser


_start.check_packages(build_parser)  # before the imports that need the project's packages

import torch

import _gemms  # noqa: E402
import _levels  # noqa: E402
from bert import ModelConfig, build_model  # noqa: E402
from bert.data import synthetic_batch  # noqa: E402
from session import SessionOptions  # noqa: E402
from session.process import retain_freed_memory  # noqa: E402
from session.schedules import Schedule  # noqa: E402
from session.training import OptimizerSpec, TrainingSession  # noqa: E402

CLASSES = ("GEMM", "attention", "conv", "normalisation and elementwise", "copies and fills", "optimizer",
           "framework overhead")
_ATTENTION = set(_gemms.ATTENTION_OPS) | {"aten::_softmax", "aten::_softmax_backward_data"}
_COPIES = {"aten::copy_", "aten::fill_", "aten::zero_", "aten::cat", "aten::index_put_", "aten::_index_put_impl_"}
# Ops that move no data (views, allocation, dispatch wrappers): their self time is overhead.
_OVERHEAD = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::t", "aten::transpose",
    "aten::permute", "aten::expand", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze",
    "aten::detach", "aten::detach_", "aten::alias", "aten::empty", "aten::empty_like", "aten::empty_strided",
    "aten::resize_", "aten::contiguous", "aten::clone", "aten::to", "aten::_to_copy", "aten::matmul",
    "aten::linear", "aten::split", "aten::split_with_sizes", "aten::unbind", "aten::narrow", "aten::flatten",
    "aten::unflatten", "aten::lift_fresh", "aten::result_type", "aten::item", "aten::_local_scalar_dense",
    "aten::zeros", "aten::zeros_like", "aten::ones", "aten::ones_like", "aten::full", "aten::new_zeros",
    "aten::new_empty", "aten::new_empty_strided", "aten::scaled_dot_product_attention", "aten::einsum",
    "aten::cross_entropy_loss", "aten::layer_norm", "aten::dropout", "aten::numpy_T", "aten::_unsafe_view",
    "aten::block_diag", "aten::conv1d", "aten::convolution", "aten::_convolution", "aten::softmax",
    "aten::log_softmax", "aten::embedding", "aten::is_nonzero", "aten::stack", "aten::tensor",
}


def classify(event, optimizer_ids: set[int]) -> str:
    """The class of one profiler event's self time."""
    name = event.name
    if event.id in optimizer_ids:
        return "optimizer"
    if name in _ATTENTION:
        return "attention"
    if name in _gemms.GEMM_OPS:  # a matrix-vector product is a reduction (bias gradients)
        return "GEMM" if _gemms.step_gemms([event]) else "normalisation and elementwise"
    if "conv" in name and name not in _OVERHEAD:
        return "conv"
    if name in _COPIES:
        return "copies and fills"
    if name in _OVERHEAD or not (name.startswith("aten::") or name.startswith("groupbert::")):
        return "framework overhead"
    return "normalisation and elementwise"


def _under_optimizer(events) -> set[int]:
    """Ids of the events inside the optimizer's step or zero_grad (their children too)."""
    inside: set[int] = set()
    for event in events:
        parent = event
        while parent is not None:
            if parent.name.startswith("Optimizer."):
                inside.add(event.id)
                break
            parent = parent.cpu_parent
    return inside


def profile_step(session: TrainingSession, batch: dict) -> tuple[list, float]:
    """(profiler events, wall seconds) of one step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        session.run(batch)
        wall = time.perf_counter() - start
    return list(prof.events()), wall


def breakdown(events, wall: float) -> tuple[dict[str, float], dict[str, list[tuple[str, float]]]]:
    """Seconds per class (overhead = the wall time no op's self time covers, plus
    dispatch-only ops) and each class's ops by self time."""
    optimizer_ids = _under_optimizer(events)
    seconds: dict[str, float] = dict.fromkeys(CLASSES, 0.0)
    ops: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for event in events:
        cls = classify(event, optimizer_ids)
        self_s = event.self_cpu_time_total / 1e6
        ops[cls][event.name] += self_s
        if cls != "framework overhead":
            seconds[cls] += self_s
    seconds["framework overhead"] = wall - sum(v for k, v in seconds.items() if k != "framework overhead")
    top = {cls: sorted(by_op.items(), key=lambda kv: -kv[1]) for cls, by_op in ops.items()}
    return seconds, top


def make_session(cfg: ModelConfig, precision: str, kernels: dict) -> TrainingSession:
    """bench/train_throughput.py's session: LAMB at a constant rate, anchors = the loss only."""
    spec = OptimizerSpec(kind="lamb", schedule=Schedule(1e-4, 0, 10**9, decay="constant"))
    return TrainingSession(build_model(cfg).builder.model_proto(), optimizer=spec,
                           options=SessionOptions(precision=precision, kernels=kernels), anchors=("loss",))


def gemm_fraction(session: TrainingSession, batch: dict, timer: _gemms.GemmTimer, repeats: int) -> dict:
    """Per repeat: one unprofiled step, then one pass over the step's GEMMs alone."""
    steps, passes = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(batch)
        steps.append(time.perf_counter() - start)
        passes.append(timer.pass_seconds()[0])
    fractions = [g / s for g, s in zip(passes, steps)]
    return {"step_s": steps, "gemms_alone_s": passes, "fractions": fractions,
            "step_s_median": statistics.median(steps), "gemms_alone_s_median": statistics.median(passes),
            "gemm_fraction": statistics.median(fractions), "gemm_fraction_min": min(fractions),
            "gemm_fraction_max": max(fractions)}


def run_model(cfg: ModelConfig, batch_size: int, precision: str, kernels: dict, repeats: int) -> dict:
    torch.manual_seed(0)
    session = make_session(cfg, precision, kernels)
    batch = synthetic_batch(cfg, batch_size, torch.Generator().manual_seed(0))
    for _ in range(2):  # warm-up: first-touch allocation, oneDNN primitive caches
        session.run(batch)
    events, wall = profile_step(session, batch)
    seconds, top = breakdown(events, wall)
    gemms = _gemms.step_gemms(events)
    timer = _gemms.GemmTimer(gemms)
    measured = gemm_fraction(session, batch, timer, repeats)
    _, per_gemm = timer.pass_seconds()
    impl = timer.implementations()
    tokens = batch_size * cfg.sequence_length
    return {
        "kernels": session.policy.describe(),
        "profiled_step_s": wall,
        "classes_s": seconds,
        "top_ops_s": {cls: ops[:6] for cls, ops in top.items()},
        "gemms": [{"gemm": str(g), "calls": gemms[g], "implementation": impl[g], "seconds": per_gemm[g],
                   "gflop": g.flops * gemms[g] / 1e9} for g in sorted(gemms)],
        "gemm_gflop": timer.flops / 1e9,
        "tokens_per_s": tokens / measured["step_s_median"],
        **measured,
    }


def report(name: str, r: dict) -> None:
    wall = r["profiled_step_s"]
    print(f"\n{name}: {r['kernels']}")
    print(f"  profiled step {wall * 1e3:.1f} ms (profiler overhead included), by class of each op's self time:")
    for cls in CLASSES:
        s = r["classes_s"][cls]
        ops = ", ".join(f"{op.replace('aten::', '')} {t * 1e3:.1f}" for op, t in r["top_ops_s"].get(cls, [])[:3])
        print(f"    {cls:<30} {s * 1e3:8.1f} ms {s / wall:6.1%}   {ops}")
    print(f"  the step's GEMMs ({r['gemm_gflop']:.1f} GFLOP), each alone at its shape:")
    for g in r["gemms"]:
        print(f"    {g['calls']:>3} x {g['gemm']:<44} {g['implementation']:<7} {g['seconds'] * 1e3:8.2f} ms "
              f"{g['gflop'] / max(g['seconds'], 1e-12):6.0f} GFLOP/s")
    steps, passes = r["step_s"], r["gemms_alone_s"]
    print(f"  repeats: step {', '.join(f'{s * 1e3:.0f}' for s in steps)} ms; "
          f"GEMMs alone {', '.join(f'{g * 1e3:.0f}' for g in passes)} ms")
    print(f"  GEMM fraction = GEMMs alone / step = {r['gemms_alone_s_median'] * 1e3:.1f} / "
          f"{r['step_s_median'] * 1e3:.1f} ms (medians); median of the per-repeat ratios {r['gemm_fraction']:.3f} "
          f"(min {r['gemm_fraction_min']:.3f}, max {r['gemm_fraction_max']:.3f}); GEMMs alone run at "
          f"{r['gemm_gflop'] / r['gemms_alone_s_median']:.0f} GFLOP/s; the GEMM class of the profile "
          f"took {r['classes_s']['GEMM'] * 1e3:.1f} ms")


def main() -> int:
    args = build_parser().parse_args()
    shape = dict(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads, sequence_length=args.seq,
                 max_predictions=args.masks)
    if args.smoke:
        shape = dict(hidden_size=48, num_layers=2, num_heads=3, sequence_length=19, max_predictions=5,
                     vocab_size=101, max_positions=40)
        args.batch, args.repeats = 4, 1
        torch.set_num_threads(1)  # tiny ops: two threads only add scheduling waits on a busy machine
    try:
        kernels = json.loads(args.kernels)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--kernels is not JSON ({e}); pass e.g. '{{\"gemm\": \"torch\"}}'")
    retained = retain_freed_memory()
    cpu = _levels.cpu_description()
    print(_levels.cpu_line(cpu))
    print(f"freed memory kept for reuse (glibc mallopt, as bench/train_throughput.py): {'yes' if retained else 'no'}")
    load = os.getloadavg()
    results: dict = {"cpu": cpu, "precision": args.precision, "batch": args.batch, "shape": shape,
                     "load_average_start": load, "date": time.strftime("%Y-%m-%d")}
    for arch in args.models:
        cfg = ModelConfig(architecture=arch, **shape)
        results[arch] = run_model(cfg, args.batch, args.precision, kernels, args.repeats)
        report(arch, results[arch])
    print(f"\nload average {load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    return _start.finish(results, args.out, args.smoke, "both models profiled by op class")


if __name__ == "__main__":
    sys.exit(main())
