#!/usr/bin/env python3
"""Inference: the export in onnxruntime against the project's InferenceSession and
HuggingFace `transformers` eager, fp32 and int8 (onnxruntime dynamic quantization). The
export is timed in both forms: portable (standard ONNX) and fused for onnxruntime
(`bert.py export --optimize`: one Attention node per layer, SkipLayerNormalization, BiasGelu).

For groupbert_base and bert_base (configs/), sequence 128 and 384, the SQuAD span model
(start/end logits over every token: what serving runs). Random weights (the timing does
not depend on them). Correctness first, in the same run: onnxruntime fp32 equals the
session (≤ 1e-4 relative), HF BertForQuestionAnswering with the same weights equals the
session (BERT), and int8's deviation from fp32 is printed. Then latency (batch 1,
median of repeats) and throughput (batch 32, sequences/s, median), each runtime timed in
turn. HF has no GroupBERT: its BERT-base of the same width and depth is the peer there.
Roofline: forward FLOPs (bert.summary) over the fp32 matmul peak timed in the same run: the
faster of torch's and onnxruntime's own 2048³ matmul (both recorded).

    python bench/inference.py [--models groupbert_base bert_base] [--seqs 128 384]

Writes bench/results/inference.json; the headline keys are batch-32 throughput ratios at
sequence 128: `fused_vs_session_seq128` and `fused_vs_hf_seq128` (BERT-base, the fused
export, fp32; HF runs the same network), `fused_int8_vs_hf_seq128` (int8), and the portable
export's `ort_vs_session_seq128` and `ort_vs_hf_seq128`; `groupbert_*` are GroupBERT-base's
(against HF's BERT-base of its width and depth).

    python bench/inference.py --smoke

runs every step in seconds on tiny models of both architectures (hidden 48, 2 layers,
3 heads, vocab 101) at sequence 128, one timed run each, and writes no results file
(tests/test_bench_smoke.py runs it).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import _start  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["groupbert_base", "bert_base"])
    parser.add_argument("--seqs", nargs="+", type=int, default=[128, 384])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of batch 32 at seq 128 (fewer at 384)")
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "inference.json"))
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: tiny models of both architectures, sequence 128, no results file")
    return parser


_start.check_packages(build_parser)  # before the imports that need the project's packages

import numpy as np
import torch

import logging  # noqa: E402

from bert import ModelConfig, Task, build_model, load_config  # noqa: E402
from bert.summary import forward_flops  # noqa: E402
from session import InferenceSession  # noqa: E402
from bert.io.export import export_serving, optimize_serving  # noqa: E402

INPUTS = ("input_ids", "segment_ids", "input_mask")


def batch_of(cfg, batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    mask[1::2, seq - seq // 8 :] = 0  # some padding, as real batches have
    return {"input_ids": rng.integers(5, cfg.vocab_size, (batch, seq)) * mask,
            "segment_ids": (np.arange(seq) >= seq // 4).astype(np.int64)[None].repeat(batch, 0) * mask,
            "input_mask": mask}


class Ort:
    def __init__(self, path: Path):
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])  # default options

    def __call__(self, batch):
        return self.session.run(["start_logits", "end_logits"], {k: batch[k] for k in INPUTS})


class Session:
    def __init__(self, proto):
        self.session = InferenceSession(proto)

    def __call__(self, batch):
        out = self.session.run(batch)
        return out["start_logits"].numpy(), out["end_logits"].numpy()


class HuggingFace:
    def __init__(self, cfg, weights):
        import transformers

        hf_cfg = transformers.BertConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size,
            max_position_embeddings=cfg.max_positions, layer_norm_eps=cfg.layer_norm_eps, hidden_act="gelu",
        )  # default attention implementation (SDPA): HF's eager PyTorch model as users run it
        self.model = transformers.BertForQuestionAnswering(hf_cfg).eval()
        if weights is not None:
            missing, _ = self.model.load_state_dict(weights, strict=False)
            assert not missing, missing

    @torch.no_grad()
    def __call__(self, batch):
        out = self.model(input_ids=torch.from_numpy(batch["input_ids"]), attention_mask=torch.from_numpy(batch["input_mask"]),
                         token_type_ids=torch.from_numpy(batch["segment_ids"]))
        return out.start_logits.numpy(), out.end_logits.numpy()


def rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def timed(fn, batch, repeats: int) -> float:
    fn(batch)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peaks(n: int = 2048, repeats: int = 5) -> dict[str, float]:
    """FLOP/s of an n³ fp32 matmul in torch and in onnxruntime (their GEMMs differ: on AMD
    CPUs onnxruntime's MLAS runs AVX-512 where torch's BLAS may not)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    a, b = torch.randn(n, n), torch.randn(n, n)
    spec = [helper.make_tensor_value_info(x, TensorProto.FLOAT, [n, n]) for x in "abc"]
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "matmul", spec[:2], spec[2:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"a": a.numpy(), "b": b.numpy()}
    runs = {"torch": lambda _: a @ b, "onnxruntime": lambda _: session.run(None, feeds)}
    return {k: 2 * n**3 / min(timed(fn, None, 1) for _ in range(repeats)) for k, fn in runs.items()}


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def tiny_config(name: str) -> ModelConfig:
    """--smoke: a tiny model of the architecture of configs/<name>.json."""
    architecture = load_config(ROOT / "configs" / f"{name}.json").model.architecture
    return ModelConfig(architecture=architecture, hidden_size=48, num_layers=2, num_heads=3, vocab_size=101)


def bench_model(name: str, seqs, repeats: dict, tmp: Path, smoke: bool = False) -> dict:
    from infer import quantize

    base = tiny_config(name) if smoke else load_config(ROOT / "configs" / f"{name}.json").model
    out = {}
    for seq in seqs:
        cfg = base.model_copy(update={"task": Task.SQUAD, "sequence_length": seq})
        model = build_model(cfg, with_loss=False, seed=0)
        flops = forward_flops(model)  # per sequence
        proto = model.builder.model_proto()
        del model
        fp32 = export_serving(proto, tmp / f"{name}_{seq}.onnx")
        int8 = quantize(fp32, tmp / f"{name}_{seq}.int8.onnx")
        fused = optimize_serving(fp32, tmp / f"{name}_{seq}.fused.onnx", cfg)
        fused_int8 = quantize(fused, tmp / f"{name}_{seq}.fused.int8.onnx")
        weights = None
        if cfg.architecture.value == "bert":
            weights = {t.name: torch.from_numpy(np.frombuffer(t.raw_data, np.float32).reshape(tuple(t.dims)).copy())
                       for t in proto.graph.initializer}
        runners = {"ort_fp32": Ort(fp32), "ort_int8": Ort(int8), "fused_fp32": Ort(fused),
                   "fused_int8": Ort(fused_int8), "session_fp32": Session(proto), "hf_fp32": HuggingFace(cfg, weights)}
        del proto
        # Correctness first.
        check = batch_of(cfg, 2, seq, seed=1)
        ref = runners["session_fp32"](check)
        errors = {k: max(rel(a, b) for a, b in zip(runners[k](check), ref))
                  for k in ("ort_fp32", "fused_fp32", "ort_int8", "fused_int8")}
        for k in ("ort_fp32", "fused_fp32"):
            assert errors[k] <= 1e-4, f"{name} seq {seq}: onnxruntime ({k}) differs from the session by {errors[k]:.2e}"
        if weights is not None:
            errors["hf_fp32"] = max(rel(a, b) for a, b in zip(runners["hf_fp32"](check), ref))
            assert errors["hf_fp32"] <= 1e-4, f"{name} seq {seq}: HF differs from the session by {errors['hf_fp32']:.2e}"
        int8_start = runners["fused_int8"](check)[0]
        agree = float(np.mean(int8_start.argmax(-1) == ref[0].argmax(-1)))
        print(f"{name} seq {seq}: check vs session: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
              + f"; int8 start argmax agrees on {agree:.0%} of rows", flush=True)
        rows = {}
        for label, batch_size, reps in (("latency_ms_b1", 1, repeats["latency"]), ("seq_per_s_b32", 32, repeats["long" if seq > 128 else "short"])):
            batch = batch_of(cfg, batch_size, seq)
            for k, fn in runners.items():
                seconds = timed(fn, batch, reps)
                rows.setdefault(k, {})[label] = round(1000 * seconds, 2) if batch_size == 1 else round(batch_size / seconds, 2)
                print(f"  {k:13s} {label}: {rows[k][label]}", flush=True)
        out[seq] = {"check_rel_error": errors, "int8_argmax_agreement": agree, "forward_gflop_per_sequence": flops / 1e9,
                    **rows}
        del runners
    return out


def main() -> int:
    args = build_parser().parse_args()
    if args.smoke:
        args.seqs = [128]
    torch.manual_seed(0)
    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime.quantization's advice to pre-process
    load = os.getloadavg()
    peaks = {k: round(v / 1e9, 1) for k, v in matmul_peaks(*((256, 1) if args.smoke else ())).items()}
    repeats = ({"latency": 1, "short": 1, "long": 1} if args.smoke else
               {"latency": 10, "short": args.repeats, "long": max(2, args.repeats - 1)})
    results = {"machine": {"cpu": cpu_model(), "threads": torch.get_num_threads(), "loadavg_at_start": load,
                           "fp32_matmul_gflops": peaks, "fp32_matmul_peak_gflops": max(peaks.values()),
                           "torch": torch.__version__}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            results[name] = bench_model(name, args.seqs, repeats, Path(tmp), smoke=args.smoke)
    for name in args.models:
        for seq, r in results[name].items():
            tput = r["fused_fp32"]["seq_per_s_b32"]
            achieved = tput * r["forward_gflop_per_sequence"]
            print(f"{name} seq {seq}: onnxruntime fused fp32 {tput:.1f} seq/s × {r['forward_gflop_per_sequence']:.1f} GFLOP "
                  f"= {achieved:.0f} GFLOP/s = {achieved / results['machine']['fp32_matmul_peak_gflops']:.0%} of the "
                  f"{results['machine']['fp32_matmul_peak_gflops']:.0f} GFLOP/s matmul peak; vs session "
                  f"{tput / r['session_fp32']['seq_per_s_b32']:.2f}×, vs HF {tput / r['hf_fp32']['seq_per_s_b32']:.2f}×, "
                  f"portable {r['ort_fp32']['seq_per_s_b32'] / tput:.2f}×, int8 {r['fused_int8']['seq_per_s_b32'] / tput:.2f}×")
    for name, prefix in (("bert_base", ""), ("groupbert_base", "groupbert_")):
        if name in results and 128 in results[name]:
            r = results[name][128]
            tput = {k: v["seq_per_s_b32"] for k, v in r.items() if isinstance(v, dict) and "seq_per_s_b32" in v}
            results[f"{prefix}fused_vs_session_seq128"] = round(tput["fused_fp32"] / tput["session_fp32"], 3)
            results[f"{prefix}fused_vs_hf_seq128"] = round(tput["fused_fp32"] / tput["hf_fp32"], 3)
            results[f"{prefix}fused_int8_vs_hf_seq128"] = round(tput["fused_int8"] / tput["hf_fp32"], 3)
            results[f"{prefix}ort_vs_session_seq128"] = round(r["ort_fp32"]["seq_per_s_b32"] / r["session_fp32"]["seq_per_s_b32"], 3)
            results[f"{prefix}ort_vs_hf_seq128"] = round(r["ort_fp32"]["seq_per_s_b32"] / r["hf_fp32"]["seq_per_s_b32"], 3)
            results[f"{prefix}int8_vs_fp32_seq128"] = round(r["ort_int8"]["seq_per_s_b32"] / r["ort_fp32"]["seq_per_s_b32"], 3)
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    if args.smoke:
        print("smoke: tiny models checked against the session (and HF for BERT) and timed in every runtime; "
              "headline " + ", ".join(f"{k} {v}" for k, v in results.items() if k.endswith("_seq128"))
              + "; no results file written")
        return 0
    Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
