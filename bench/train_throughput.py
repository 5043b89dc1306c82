#!/usr/bin/env python3
"""Training throughput: this project's session against HuggingFace BertForPreTraining.

Same sizes, batch, sequence length, masked positions, precision and optimizer family
(LAMB here, fused when built; AdamW for HF, its usual pre-training optimizer, whose
step moves the same bytes). Correctness first (the loss of both on one batch with the
same weights agrees), then steps timed alternately, several repeats, medians. The
roofline is the machine's matmul peak, measured in the same run.

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

from bert import ModelConfig, build_model  # noqa: E402
from bert.summary import forward_flops  # noqa: E402
from bert.train import synthetic_batch  # noqa: E402
from session import SessionOptions  # noqa: E402
from session.schedules import Schedule  # noqa: E402
from session.training import OptimizerSpec, TrainingSession  # noqa: E402


class Ours:
    def __init__(self, cfg: ModelConfig, precision: str):
        spec = OptimizerSpec(kind="lamb", schedule=Schedule(1e-4, 0, 10**9, decay="constant"))
        # Anchors: the loss only, as HF computes (no accuracies).
        self.session = TrainingSession(
            build_model(cfg).builder.model_proto(), optimizer=spec, options=SessionOptions(precision=precision),
            anchors=("loss",),
        )

    def step(self, batch) -> float:
        return self.session.run(batch)["loss"]


class HuggingFace:
    def __init__(self, cfg: ModelConfig, precision: str, weights: dict[str, torch.Tensor]):
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

    def step(self, batch) -> float:
        labels = torch.full_like(batch["input_ids"], -100)
        labels.scatter_(1, batch["masked_lm_positions"], batch["masked_lm_ids"])
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.dtype is not None):
            out = self.model(
                input_ids=batch["input_ids"], attention_mask=batch["input_mask"], token_type_ids=batch["segment_ids"],
                labels=labels, next_sentence_label=batch["next_sentence_labels"],
            )
        out.loss.backward()
        self.optimizer.step()
        return out.loss.item()


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n**3 / min(times)


def time_steps(runner, batch, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        runner.step(batch)
    return (time.perf_counter() - start) / steps


def compare(bert_cfg: ModelConfig, group_cfg: ModelConfig, batch_size: int, precision: str, repeats: int, steps: int):
    """Tokens/s of our BERT, HF's BERT and our GroupBERT, timed alternately in every repeat."""
    batch = synthetic_batch(bert_cfg, batch_size, torch.Generator().manual_seed(0))
    ours = Ours(bert_cfg, precision)
    hf = HuggingFace(bert_cfg, precision, ours.session.graph.weights_state_dict())
    group = Ours(group_cfg, precision)
    # Correctness first: the first step of each BERT sees the same weights and batch.
    first_hf, first_ours = hf.step(batch), ours.step(batch)
    tol = 1e-5 if precision == "fp32" else 2e-2
    assert abs(first_ours - first_hf) <= tol * abs(first_hf), f"loss {first_ours} vs HF {first_hf} ({precision})"
    print(f"check {precision}: loss {first_ours:.6f} (ours) vs {first_hf:.6f} (HF)")
    group.step(batch)
    times: dict[str, list[float]] = {"bert": [], "hf": [], "groupbert": []}
    for _ in range(repeats):
        for name, runner in (("bert", ours), ("hf", hf), ("groupbert", group)):
            times[name].append(time_steps(runner, batch, steps))
    tokens = batch_size * bert_cfg.sequence_length
    return {name: tokens / statistics.median(t) for name, t in times.items()}


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
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "train_throughput.json"))
    args = parser.parse_args()
    torch.manual_seed(0)

    def config(arch: str) -> ModelConfig:
        return ModelConfig(architecture=arch, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                           sequence_length=args.seq, max_predictions=args.masks)

    bert_cfg, group_cfg = config("bert"), config("groupbert")
    peaks = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
    flops_per_token = {
        "bert": 3 * forward_flops(build_model(bert_cfg)) / args.seq,
        "groupbert": 3 * forward_flops(build_model(group_cfg)) / args.seq,
    }
    results: dict = {"shape": vars(args) | {"vocab": bert_cfg.vocab_size}, "matmul_peak_flops": peaks,
                     "training_flops_per_token": flops_per_token}
    rows = []
    for precision in ("fp32", "bf16"):
        tps = compare(bert_cfg, group_cfg, args.batch, precision, args.repeats, args.steps)
        results[f"bert_vs_hf_{precision}"] = tps["bert"] / tps["hf"]
        results[f"groupbert_vs_bert_{precision}"] = tps["groupbert"] / tps["bert"]
        for name, value in tps.items():
            results[f"{name}_tokens_per_s_{precision}"] = value
        rows.append((f"BERT {precision}", tps["bert"], tps["hf"], tps["bert"] / tps["hf"],
                     tps["bert"] * flops_per_token["bert"] / peaks[precision]))
        rows.append((f"GroupBERT {precision}", tps["groupbert"], None, tps["groupbert"] / tps["bert"],
                     tps["groupbert"] * flops_per_token["groupbert"] / peaks[precision]))
    print(f"shape: hidden {args.hidden}, {args.layers} layers, {args.heads} heads, seq {args.seq}, "
          f"batch {args.batch}, {args.masks} masks, vocab {bert_cfg.vocab_size}")
    print(f"matmul peak (2048^3, best of 5): fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s")
    print(f"training FLOPs/token (3 x forward, masked-only MLM head): BERT {flops_per_token['bert'] / 1e6:.1f} M, "
          f"GroupBERT {flops_per_token['groupbert'] / 1e6:.1f} M")
    print(f"{'run':<16} {'tokens/s':>10} {'HF tokens/s':>12} {'ratio':>7} {'of peak':>8}")
    for name, ours, hf, ratio, frac in rows:
        peer = f"{hf:12.0f}" if hf is not None else f"{'(vs BERT)':>12}"
        print(f"{name:<16} {ours:10.0f} {peer} {ratio:7.2f} {frac:8.1%}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
