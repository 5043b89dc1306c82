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

The native run (fp32, bf16) is followed by fp32 at the AVX2 level in a child process
(our kernels and torch's capped alike, bench/_levels.py), so GroupBERT/BERT on an
AVX2-only CPU sits beside the native figure.

    python bench/train_throughput.py [--hidden 256 --layers 4 --heads 4 --seq 128 --batch 32 --masks 20]

Writes bench/results/train_throughput.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _levels  # noqa: E402

from bert import ModelConfig, build_model  # noqa: E402
from bert.summary import forward_flops  # noqa: E402
from bert.data import synthetic_batch  # noqa: E402
from session import SessionOptions  # noqa: E402
from session.lowering import _onednn_linear  # noqa: E402
from session.schedules import Schedule  # noqa: E402
from session.training import OptimizerSpec, TrainingSession  # noqa: E402
from tests.reference_groupbert import groupbert_pretraining  # noqa: E402

RUNNERS = ("bert", "hf", "hf_masked", "groupbert")
AVX2 = "avx2"


class Ours:
    def __init__(self, cfg: ModelConfig, precision: str, kernels: dict):
        spec = OptimizerSpec(kind="lamb", schedule=Schedule(1e-4, 0, 10**9, decay="constant"))
        # Anchors: the loss only, as HF computes (no accuracies).
        self.session = TrainingSession(
            build_model(cfg).builder.model_proto(), optimizer=spec, options=SessionOptions(precision=precision, kernels=kernels),
            anchors=("loss",),
        )

    def step(self, batch) -> float:
        return self.session.run(batch)["loss"]


class HuggingFace:
    """BertForPreTraining; with `masked_only` its MLM head sees only the masked positions."""

    def __init__(self, cfg: ModelConfig, precision: str, weights: dict[str, torch.Tensor], masked_only: bool):
        import transformers

        hf_cfg = transformers.BertConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size,
            max_position_embeddings=cfg.max_positions, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            layer_norm_eps=cfg.layer_norm_eps,
        )
        self.model = transformers.BertForPreTraining(hf_cfg).train()
        self.model.load_state_dict(weights, strict=False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01)
        self.dtype = torch.bfloat16 if precision == "bf16" else None
        self.masked_only = masked_only

    def loss(self, batch) -> torch.Tensor:
        positions = batch["masked_lm_positions"]  # (B, P); 0 marks an unused slot
        labels = torch.where(positions > 0, batch["masked_lm_ids"], -100)
        inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["input_mask"],
                      token_type_ids=batch["segment_ids"])
        if not self.masked_only:
            full = torch.full_like(batch["input_ids"], -100)
            full.scatter_(1, positions, labels)
            return self.model(**inputs, labels=full, next_sentence_label=batch["next_sentence_labels"]).loss
        sequence, pooled = self.model.bert(**inputs)[:2]  # (B, S, H), (B, H)
        picked = sequence.gather(1, positions[..., None].expand(-1, -1, sequence.shape[-1]))  # (B, P, H)
        mlm, nsp = self.model.cls(picked, pooled)  # (B, P, V), (B, 2)
        ce = torch.nn.functional.cross_entropy
        return ce(mlm.flatten(0, 1).float(), labels.flatten(), ignore_index=-100) + ce(
            nsp.float(), batch["next_sentence_labels"])

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
        runs.append(lambda: _onednn_linear(a, b, None))
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
            steps: int, kernels: dict) -> dict[str, float]:
    """Tokens/s of the four runners, timed alternately in every repeat, after the loss checks."""
    batch = synthetic_batch(bert_cfg, batch_size, torch.Generator().manual_seed(0))
    ours = Ours(bert_cfg, precision, kernels)
    weights = {n: p.detach() for n, p in ours.session.named_weights()}
    hf = HuggingFace(bert_cfg, precision, weights, masked_only=False)
    hf_masked = HuggingFace(bert_cfg, precision, weights, masked_only=True)
    group = Ours(group_cfg, precision, kernels)
    group_weights = {k: v.detach().float() for k, v in group.session.named_weights()}

    # Correctness first: the first step of each runner sees the same weights and batch.
    tol = 1e-5 if precision == "fp32" else 2e-2
    first = {"hf": hf.step(batch), "hf_masked": hf_masked.step(batch), "bert": ours.step(batch)}
    with torch.no_grad():
        reference = groupbert_pretraining(group_weights, group_cfg, batch)["loss"].item()
    first["groupbert"] = group.step(batch)
    checks = {"our BERT vs HF": (first["bert"], first["hf"]), "HF masked-only vs HF": (first["hf_masked"], first["hf"]),
              "our GroupBERT vs the eager reference": (first["groupbert"], reference)}
    for name, (got, expected) in checks.items():
        assert abs(got - expected) <= tol * abs(expected), f"{precision} {name}: loss {got} vs {expected}"
    print(f"check {precision}: BERT loss {first['bert']:.6f} (ours) = {first['hf']:.6f} (HF) = "
          f"{first['hf_masked']:.6f} (HF masked-only); GroupBERT {first['groupbert']:.6f} (ours) = "
          f"{reference:.6f} (eager reference)")

    runners = {"bert": ours, "hf": hf, "hf_masked": hf_masked, "groupbert": group}
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, runner in runners.items():
            times[name].append(time_steps(runner, batch, steps))
    tokens = batch_size * bert_cfg.sequence_length
    return {name: tokens / statistics.median(t) for name, t in times.items()}


def measure(args, precisions: tuple[str, ...], level: str) -> dict:
    """Tokens/s, FLOP/s and ratios for each precision at the level this process runs."""
    def config(arch: str) -> ModelConfig:
        return ModelConfig(architecture=arch, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                           sequence_length=args.seq, max_predictions=args.masks)

    torch.manual_seed(0)
    bert_cfg, group_cfg = config("bert"), config("groupbert")
    per_token = flops_per_token(bert_cfg, group_cfg)
    useful = dict(per_token, hf=per_token["bert"])
    out: dict = {"level": level, "training_flops_per_token": per_token, "matmul_peak_flops": {}}
    suffix = "" if level == _levels.NATIVE else f"_{level}"
    for precision in precisions:
        peak = matmul_peak(torch.float32 if precision == "fp32" else torch.bfloat16)
        out["matmul_peak_flops"][precision] = peak
        tps = compare(bert_cfg, group_cfg, args.batch, precision, args.repeats, args.steps, json.loads(args.kernels))
        for name in RUNNERS:
            out[f"{name}_tokens_per_s_{precision}{suffix}"] = tps[name]
            out[f"{name}_flops_{precision}{suffix}"] = tps[name] * per_token[name]
            out[f"{name}_useful_flops_{precision}{suffix}"] = tps[name] * useful[name]
        out[f"bert_vs_hf_{precision}{suffix}"] = tps["bert"] / tps["hf"]
        out[f"bert_vs_hf_masked_{precision}{suffix}"] = tps["bert"] / tps["hf_masked"]
        out[f"hf_masked_vs_hf_{precision}{suffix}"] = tps["hf_masked"] / tps["hf"]
        out[f"groupbert_vs_bert_{precision}{suffix}"] = tps["groupbert"] / tps["bert"]
        print(f"\n{level} {precision}: matmul peak {peak / 1e9:.0f} GFLOP/s (2048^3, best of 5)")
        print(f"  {'runner':<10} {'tokens/s':>9} {'GFLOP/s run':>12} {'useful':>8} {'of peak':>8}")
        for name in RUNNERS:
            print(f"  {name:<10} {tps[name]:9.0f} {tps[name] * per_token[name] / 1e9:12.1f} "
                  f"{tps[name] * useful[name] / 1e9:8.1f} {tps[name] * per_token[name] / peak:8.1%}")
        print(f"  BERT ours / HF {tps['bert'] / tps['hf']:.2f} = (HF masked-only / HF "
              f"{tps['hf_masked'] / tps['hf']:.2f}: work avoided) x (ours / HF masked-only "
              f"{tps['bert'] / tps['hf_masked']:.2f}); GroupBERT / BERT {tps['groupbert'] / tps['bert']:.2f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--masks", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--kernels", default="{}",
                        help='kernel policy overrides for our sessions, JSON (e.g. \'{"gemm": "torch"}\')')
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "train_throughput.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # the capped child process: fp32 only (torch's bf16 matmuls capped at AVX2 crawl)
        _levels.check_child_level(args.child)
        Path(args.json_out).write_text(json.dumps(measure(args, ("fp32",), args.child)))
        return

    cpu = _levels.cpu_description()
    print(_levels.cpu_line(cpu))
    shape = {k: v for k, v in vars(args).items() if k not in ("out", "child", "json_out")}
    results: dict = {"cpu": cpu, "shape": shape | {"vocab": ModelConfig(architecture="bert", hidden_size=64,
                                                                         num_layers=1, num_heads=1).vocab_size}}
    results.update(measure(args, ("fp32", "bf16"), _levels.NATIVE))
    if AVX2 in cpu["levels"] and cpu["levels"][-1] != AVX2:
        capped = _levels.run_child(Path(__file__), AVX2, args=[f"--{k}={v}" for k, v in shape.items()])
        results.update({k: v for k, v in capped.items() if k.endswith(f"_{AVX2}")})
        results[f"training_flops_per_token_{AVX2}"] = capped["training_flops_per_token"]
        results[f"matmul_peak_flops_{AVX2}"] = capped["matmul_peak_flops"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"\n{_levels.cpu_line(cpu)}")
    for key in ("bert_vs_hf_fp32", "bert_vs_hf_masked_fp32", "hf_masked_vs_hf_fp32", "groupbert_vs_bert_fp32",
                "bert_vs_hf_bf16", "bert_vs_hf_masked_bf16", "hf_masked_vs_hf_bf16", "groupbert_vs_bert_bf16",
                f"bert_vs_hf_fp32_{AVX2}", f"groupbert_vs_bert_fp32_{AVX2}"):
        if key in results:
            print(f"  {key:<28} {results[key]:.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
