#!/usr/bin/env python3
"""Training throughput: this project's sessions against HuggingFace BERT, two ways.

Runners, same sizes, batch, sequence length, masked positions and precision:
  bert       our BERT: TrainingSession with the fused LAMB, anchors = the loss only
  groupbert  our GroupBERT, same width and depth
  hf         HuggingFace BertForPreTraining as its users run it: the MLM head projects
             every position onto the vocabulary (AdamW, its usual pre-training optimizer,
             whose step moves the same bytes as LAMB's)
  hf_masked  the strongest eager peer: the same HF modules (BertModel, BertPreTrainingHeads,
             no download) with the MLM head evaluated only at the masked positions,
             gathered first, as NVIDIA's BERT does; the same AdamW

Correctness first: on one batch with the same weights, our BERT's loss equals both HF
runners' and our GroupBERT's equals an independent eager GroupBERT
(tests/reference_groupbert.py). Then the runners' steps are timed alternately, several
repeats, medians. Roofline: the machine's matmul peak measured in the same run (the
faster of torch's and oneDNN's 2048³ matmul);
training FLOPs per token = 3 x forward (matmuls, einsums, the grouped conv), counted
for the work each runner does (hf projects all positions) and for the useful work
(the masked positions only), so FLOP/s show both what ran and what was needed.

GEMM fraction: the step's own GEMMs (forward and backward, read from a profile of one of
our BERT steps at their shapes, bench/_gemms.py), each run alone with the faster of torch
and oneDNN, are timed once in every repeat beside the runners: `bert_gemm_fraction_*` =
GEMMs alone / BERT step (1.0: a step at the speed of its matrix products). The same GEMMs
bound what any implementation can reach against HF: `bert_vs_hf_masked_bound_*` = HF
masked-only step / our GEMMs alone.

torch.compile: `bert_compiled` and `groupbert_compiled` are the same sessions with
`SessionOptions(compile=True)` (the kernel policy's graph=compiled), timed beside the
others at the native level (`--no-compile` leaves them out): `*_compiled_vs_eager_*`.

Every ratio is taken within each repeat (the runners alternate), then the median over the
repeats is the figure and min/max its spread (`*_spread`). The process keeps freed memory
for reuse (session.process.retain_freed_memory, as bert.py does; every runner alike).

The native run (fp32, bf16) is followed by fp32 at the AVX2 level in a child process
(our kernels and torch's capped alike, bench/_levels.py), so GroupBERT/BERT on an
AVX2-only CPU sits beside the native figure.

    python bench/train_throughput.py [--hidden 256 --layers 4 --heads 4 --seq 128 --batch 32 --masks 20]
    python bench/train_throughput.py --smoke      # tiny model, seconds, writes nothing

Writes bench/results/train_throughput.json.
"""
from __future__ import annotations

import argparse
import json
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
    _start.add_shape_arguments(parser)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--kernels", default="{}",
                        help='kernel policy overrides for our sessions, JSON (e.g. \'{"gemm": "torch"}\')')
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile runners")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model, one repeat of one step, native level only, no torch.compile, writes no results file")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "train_throughput.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    return parser


_start.check_packages(build_parser)  # before the imports that need the project's packages

import torch

import _gemms  # noqa: E402
import _hf_peer  # noqa: E402
import _levels  # noqa: E402

from bert import ModelConfig, build_model  # noqa: E402
from bert.summary import forward_flops  # noqa: E402
from bert.data import synthetic_batch  # noqa: E402
from session import SessionOptions  # noqa: E402
from session.process import retain_freed_memory  # noqa: E402
from session.dense import onednn_linear  # noqa: E402
from session.schedules import Schedule  # noqa: E402
from session.training import OptimizerSpec, TrainingSession  # noqa: E402
from tests.reference_groupbert import groupbert_pretraining  # noqa: E402

RUNNERS = ("bert", "hf", "hf_masked", "groupbert")
COMPILED = ("bert_compiled", "groupbert_compiled")
AVX2 = "avx2"
SMOKE = dict(hidden=48, layers=2, heads=3, seq=19, batch=4, masks=5, repeats=1, steps=1)


class Ours:
    def __init__(self, cfg: ModelConfig, precision: str, kernels: dict, compile: bool = False):
        spec = OptimizerSpec(kind="lamb", schedule=Schedule(1e-4, 0, 10**9, decay="constant"))
        # Anchors: the loss only, as HF computes (no accuracies).
        self.session = TrainingSession(
            build_model(cfg).builder.model_proto(), optimizer=spec,
            options=SessionOptions(precision=precision, kernels=kernels, compile=compile), anchors=("loss",),
        )

    def step(self, batch) -> float:
        return self.session.run(batch)["loss"]


class HuggingFace:
    """BertForPreTraining; with `masked_only` its MLM head sees only the masked positions."""

    def __init__(self, cfg: ModelConfig, precision: str, weights: dict[str, torch.Tensor], masked_only: bool):
        import transformers

        self.model = transformers.BertForPreTraining(_hf_peer.bert_config(cfg)).train()
        self.model.load_state_dict(weights, strict=False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01)
        self.dtype = torch.bfloat16 if precision == "bf16" else None
        self.masked_only = masked_only

    def loss(self, batch) -> torch.Tensor:
        return _hf_peer.pretraining_loss(self.model, batch, self.masked_only)

    def step(self, batch) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.dtype is not None):
            loss = self.loss(batch)
        loss.backward()
        self.optimizer.step()
        return loss.item()


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """The faster of torch's n³ matmul and oneDNN's on the same matrices (on AMD CPUs torch's
    fp32 matmul runs MKL's AVX2 path, at half of what oneDNN reaches)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    runs = [lambda: a @ b]
    if torch.backends.mkldnn.is_available():
        runs.append(lambda: onednn_linear(a, b, None))
    best = float("inf")
    for run in runs:
        run()
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def time_steps(runner, batch, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        runner.step(batch)
    return (time.perf_counter() - start) / steps


def flops_per_token(bert_cfg: ModelConfig, group_cfg: ModelConfig) -> dict[str, float]:
    """Training FLOPs per token (3 x forward) of the work each runner does. The masked-only
    runners project P of the S positions through the MLM head (transform H x H, decoder
    H x V); hf projects all S."""
    s, p, h, v = bert_cfg.sequence_length, bert_cfg.max_predictions, bert_cfg.hidden_size, bert_cfg.vocab_size
    bert = 3 * forward_flops(build_model(bert_cfg)) / s
    head_per_position = 2 * h * h + 2 * h * v
    return {"bert": bert, "hf_masked": bert, "hf": bert + 3 * head_per_position * (s - p) / s,
            "groupbert": 3 * forward_flops(build_model(group_cfg)) / s}


def compare(bert_cfg: ModelConfig, group_cfg: ModelConfig, batch_size: int, precision: str, repeats: int,
            steps: int, kernels: dict, compile: bool) -> dict:
    """Seconds per step of every runner and of the BERT step's GEMMs alone, per repeat (the
    runners alternate within each repeat), after the loss checks."""
    batch = synthetic_batch(bert_cfg, batch_size, torch.Generator().manual_seed(0))
    ours = Ours(bert_cfg, precision, kernels)
    weights = {n: p.detach() for n, p in ours.session.named_weights()}
    hf = HuggingFace(bert_cfg, precision, weights, masked_only=False)
    hf_masked = HuggingFace(bert_cfg, precision, weights, masked_only=True)
    group = Ours(group_cfg, precision, kernels)
    group_weights = {k: v.detach().float() for k, v in group.session.named_weights()}
    runners = {"bert": ours, "hf": hf, "hf_masked": hf_masked, "groupbert": group}
    if compile:  # the same graphs and weights (build_model's seed), compiled
        runners |= {"bert_compiled": Ours(bert_cfg, precision, kernels, compile=True),
                    "groupbert_compiled": Ours(group_cfg, precision, kernels, compile=True)}

    # Correctness first: the first step of each runner sees the same weights and batch.
    tol = 1e-5 if precision == "fp32" else 2e-2
    first = {"hf": hf.step(batch), "hf_masked": hf_masked.step(batch), "bert": ours.step(batch)}
    with torch.no_grad():
        reference = groupbert_pretraining(group_weights, group_cfg, batch)["loss"].item()
    first["groupbert"] = group.step(batch)
    checks = {"our BERT vs HF": (first["bert"], first["hf"]), "HF masked-only vs HF": (first["hf_masked"], first["hf"]),
              "our GroupBERT vs the eager reference": (first["groupbert"], reference)}
    if compile:
        start = time.perf_counter()
        first |= {name: runners[name].step(batch) for name in COMPILED}
        print(f"torch.compile of BERT and GroupBERT (first steps) took {time.perf_counter() - start:.0f} s")
        checks |= {"our BERT compiled vs eager": (first["bert_compiled"], first["bert"]),
                   "our GroupBERT compiled vs eager": (first["groupbert_compiled"], first["groupbert"])}
    for name, (got, expected) in checks.items():
        assert abs(got - expected) <= tol * abs(expected), f"{precision} {name}: loss {got} vs {expected}"
    print(f"check {precision}: BERT loss {first['bert']:.6f} (ours) = {first['hf']:.6f} (HF) = "
          f"{first['hf_masked']:.6f} (HF masked-only); GroupBERT {first['groupbert']:.6f} (ours) = "
          f"{reference:.6f} (eager reference)" + (f"; compiled {first['bert_compiled']:.6f}, "
                                                  f"{first['groupbert_compiled']:.6f}" if compile else ""))

    for runner in runners.values():  # warm-up
        runner.step(batch)
    gemms = bert_gemms(ours, batch)
    times: dict[str, list[float]] = {name: [] for name in [*runners, "gemms"]}
    for _ in range(repeats):
        for name, runner in runners.items():
            times[name].append(time_steps(runner, batch, steps))
        times["gemms"].append(gemms.pass_seconds()[0])
    return {"seconds": times, "gemm_gflop": gemms.flops / 1e9}


def bert_gemms(ours: Ours, batch) -> _gemms.GemmTimer:
    """The GEMMs of one of our BERT steps (from a profile with shapes), ready to time alone."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        ours.step(batch)
    return _gemms.GemmTimer(_gemms.step_gemms(prof.events()))


def ratios_per_repeat(times: dict[str, list[float]]) -> dict[str, list[float]]:
    """The headline ratios in each repeat, from the seconds per step of the runners (and of
    the BERT step's GEMMs alone). `a_vs_b` is a's tokens/s over b's: b's step time over a's."""
    def vs(a: str, b: str) -> list[float]:
        return [tb / ta for ta, tb in zip(times[a], times[b])]

    out = {
        "bert_vs_hf": vs("bert", "hf"),
        "bert_vs_hf_masked": vs("bert", "hf_masked"),
        "hf_masked_vs_hf": vs("hf_masked", "hf"),
        "groupbert_vs_bert": vs("groupbert", "bert"),
        "bert_gemm_fraction": vs("bert", "gemms"),  # GEMMs alone / step: the share of the step that is GEMM work
        "bert_vs_hf_masked_bound": vs("gemms", "hf_masked"),  # HF masked step / our GEMMs alone
    }
    if "bert_compiled" in times:
        out["bert_compiled_vs_eager"] = vs("bert_compiled", "bert")
        out["groupbert_compiled_vs_eager"] = vs("groupbert_compiled", "groupbert")
    return out


def measure(args, precisions: tuple[str, ...], level: str, compile: bool) -> dict:
    """Tokens/s, FLOP/s and ratios (median over the repeats, and their spread) for each
    precision at the level this process runs."""
    def config(arch: str) -> ModelConfig:
        extra = dict(vocab_size=101, max_positions=40) if args.smoke else {}
        return ModelConfig(architecture=arch, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                           sequence_length=args.seq, max_predictions=args.masks, **extra)

    torch.manual_seed(0)
    bert_cfg, group_cfg = config("bert"), config("groupbert")
    per_token = flops_per_token(bert_cfg, group_cfg)
    per_token |= {"bert_compiled": per_token["bert"], "groupbert_compiled": per_token["groupbert"]}
    useful = dict(per_token, hf=per_token["bert"])
    out: dict = {"level": level, "training_flops_per_token": per_token, "matmul_peak_flops": {}}
    suffix = "" if level == _levels.NATIVE else f"_{level}"
    tokens = args.batch * args.seq
    for precision in precisions:
        peak = matmul_peak(torch.float32 if precision == "fp32" else torch.bfloat16, n=256 if args.smoke else 2048)
        out["matmul_peak_flops"][precision] = peak
        measured = compare(bert_cfg, group_cfg, args.batch, precision, args.repeats, args.steps,
                           json.loads(args.kernels), compile)
        times = measured["seconds"]
        names = [n for n in times if n != "gemms"]
        tps = {name: tokens / statistics.median(times[name]) for name in names}
        ratios = ratios_per_repeat(times)
        for name in names:
            out[f"{name}_tokens_per_s_{precision}{suffix}"] = tps[name]
            out[f"{name}_flops_{precision}{suffix}"] = tps[name] * per_token[name]
            out[f"{name}_useful_flops_{precision}{suffix}"] = tps[name] * useful[name]
            out[f"{name}_step_s_{precision}{suffix}"] = times[name]
        out[f"gemms_alone_s_{precision}{suffix}"] = times["gemms"]
        out[f"gemm_gflop_{precision}{suffix}"] = measured["gemm_gflop"]
        for key, values in ratios.items():
            out[f"{key}_{precision}{suffix}"] = statistics.median(values)
            out[f"{key}_{precision}{suffix}_spread"] = [min(values), max(values)]
        print(f"\n{level} {precision}: matmul peak {peak / 1e9:.0f} GFLOP/s (n^3, n = {256 if args.smoke else 2048}, "
              "best of 5)")
        print(f"  {'runner':<19} {'tokens/s':>9} {'GFLOP/s run':>12} {'useful':>8} {'of peak':>8}")
        for name in names:
            print(f"  {name:<19} {tps[name]:9.0f} {tps[name] * per_token[name] / 1e9:12.1f} "
                  f"{tps[name] * useful[name] / 1e9:8.1f} {tps[name] * per_token[name] / peak:8.1%}")
        gemm_s = statistics.median(times["gemms"])
        print(f"  the BERT step's GEMMs alone: {measured['gemm_gflop']:.1f} GFLOP in {gemm_s * 1e3:.1f} ms "
              f"({measured['gemm_gflop'] / gemm_s:.0f} GFLOP/s); BERT step {statistics.median(times['bert']) * 1e3:.1f} ms")
        print("  per-repeat ratios, median [min, max]:")
        for key, values in ratios.items():
            print(f"    {key + '_' + precision + suffix:<36} {statistics.median(values):6.3f} "
                  f"[{min(values):.3f}, {max(values):.3f}]")
        print(f"  BERT ours / HF = (HF masked-only / HF: work avoided) x (ours / HF masked-only); "
              f"{out[f'bert_vs_hf_{precision}{suffix}']:.2f} vs {out[f'hf_masked_vs_hf_{precision}{suffix}']:.2f} x "
              f"{out[f'bert_vs_hf_masked_{precision}{suffix}']:.2f}; ours / HF masked-only can reach at most "
              f"{out[f'bert_vs_hf_masked_bound_{precision}{suffix}']:.2f} with these GEMMs (HF masked step / GEMMs alone)")
    return out


HEADLINES = ("bert_gemm_fraction_fp32", "bert_vs_hf_masked_fp32", "bert_vs_hf_masked_bound_fp32",
             "groupbert_vs_bert_fp32", "bert_vs_hf_fp32", "hf_masked_vs_hf_fp32", "bert_compiled_vs_eager_fp32",
             "groupbert_compiled_vs_eager_fp32", "bert_gemm_fraction_bf16", "bert_vs_hf_masked_bf16",
             "groupbert_vs_bert_bf16", "bert_vs_hf_bf16", "bert_compiled_vs_eager_bf16",
             "groupbert_compiled_vs_eager_bf16", f"bert_gemm_fraction_fp32_{AVX2}", f"bert_vs_hf_masked_fp32_{AVX2}",
             f"bert_vs_hf_masked_bound_fp32_{AVX2}", f"groupbert_vs_bert_fp32_{AVX2}", f"bert_vs_hf_fp32_{AVX2}")


def main() -> None:
    args = build_parser().parse_args()
    try:
        json.loads(args.kernels)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--kernels is not JSON ({e}); pass e.g. '{{\"gemm\": \"torch\"}}'")
    if args.smoke:
        vars(args).update(SMOKE)
        torch.set_num_threads(1)  # tiny ops: two threads only add scheduling waits on a busy machine
    retained = retain_freed_memory()
    if args.child:  # the capped child process: fp32 only (torch's bf16 matmuls capped at AVX2 crawl)
        _levels.check_child_level(args.child)
        Path(args.json_out).write_text(json.dumps(measure(args, ("fp32",), args.child, compile=False)))
        return

    cpu = _levels.cpu_description()
    print(_levels.cpu_line(cpu))
    print(f"freed memory kept for reuse (glibc mallopt): {'yes' if retained else 'no'}")
    load = os.getloadavg()
    shape = {k: v for k, v in vars(args).items() if k not in ("out", "child", "json_out", "smoke", "no_compile")}
    results: dict = {"cpu": cpu, "date": time.strftime("%Y-%m-%d %H:%M"), "load_average_start": load,
                     "retain_freed_memory": retained,
                     "shape": shape | {"vocab": 101 if args.smoke else ModelConfig(
                         architecture="bert", hidden_size=64, num_layers=1, num_heads=1).vocab_size}}
    results.update(measure(args, ("fp32", "bf16"), _levels.NATIVE, compile=not (args.no_compile or args.smoke)))
    if AVX2 in cpu["levels"] and cpu["levels"][-1] != AVX2 and not args.smoke:
        capped = _levels.run_child(Path(__file__), AVX2, args=[f"--{k}={v}" for k, v in shape.items()])
        results.update({k: v for k, v in capped.items() if f"_{AVX2}" in k})
        results[f"training_flops_per_token_{AVX2}"] = capped["training_flops_per_token"]
        results[f"matmul_peak_flops_{AVX2}"] = capped["matmul_peak_flops"]
    results["load_average_end"] = os.getloadavg()
    print(f"\n{_levels.cpu_line(cpu)}; load average {load[0]:.2f} at the start, "
          f"{results['load_average_end'][0]:.2f} at the end")
    for key in HEADLINES:
        if key in results:
            low, high = results[f"{key}_spread"]
            print(f"  {key:<36} {results[key]:.3f} [{low:.3f}, {high:.3f}]")
    if args.smoke:
        print("smoke: the loss checks passed and every ratio was measured; no results file written")
        return
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
