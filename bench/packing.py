#!/usr/bin/env python3
"""Packed sequences against padded rows: real-token training throughput at sequence 512.

Phase-2-like data (S = 512, 80 masked positions per sequence) from two corpora, made
here (nothing is downloaded):
  demo            the built-in demo corpus (data/demo.py): short documents, one sample each
  wikipedia_like  articles of natural, heavy-tailed length (sentences per article
                  log-normal, median 30, sigma 1.1: a few sentences to several hundred),
                  made of the demo world's sentences, written with create_pretraining_data
                  --natural-lengths (the fill-to-maximum recipe's padding is printed too)

Runners, same GroupBERT (hidden 128, 2 layers, 2 heads: the demo model), same rows per
step, fp32 LAMB, anchors = the loss:
  padded  one sequence per row (PretrainingLoader, packing off)
  packed  up to K sequences per row (PretrainingLoader(packing=True), model.packed)

Correctness first: on the first packed batch, the packed graph's loss equals the
unpacked graph's on the same sequences one per padded row (same weights; the losses
are means over all masked tokens and sequences, so they are one number), and so do
every sequence's NSP logits. Then the steps are timed alternately (packed, padded, ...)
on batches read beforehand. Real (non-padding) tokens per second = the share of real
tokens in a runner's rows over a whole epoch (padded: every sample of the corpus;
packed: every row the loader packs in an epoch) × S × rows per step / step time: the
step time does not depend on the content of the rows, and the epoch's fill is exact
where a dozen timed batches would sample it (their own fill is recorded too). The peer
is the padded run; the roofline is the fill: per row both runners do nearly the same
work, so the ideal ratio is the packed fill over the padded fill, and the measured
ratio = that × (padded step time / packed step time).

    python bench/packing.py [--steps 12 --batch 8 --pack 16]

Writes bench/results/packing.json (`packed_vs_padded_tokens_per_s`: the smaller of the
two corpora's ratios).

    python bench/packing.py --smoke

runs every step in seconds (S = 128, 20 masks, hidden 48, 40 Wikipedia-like articles,
one timed step of 2 rows, K = 4) and writes no results file (tests/test_bench_smoke.py).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import _start  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="timed steps per runner and corpus")
    p.add_argument("--batch", type=int, default=8, help="rows per step")
    p.add_argument("--pack", type=int, default=16, help="max_sequences_per_pack (K)")
    p.add_argument("--articles", type=int, default=1500, help="Wikipedia-like articles per file (2 files)")
    p.add_argument("--work-dir", help="keep the corpora here (default: a temporary directory)")
    p.add_argument("--smoke", action="store_true", help="seconds: S = 128, a tiny model, one step; no results file")
    return p


_start.check_packages(build_parser)  # before the imports that need the project's packages

import numpy as np
import torch

from bert import ModelConfig, build_model  # noqa: E402
from data import PretrainingLoader, build_demo_data  # noqa: E402
from data.create_pretraining_data import create_pretraining_data  # noqa: E402
from data.demo import generate_documents, write_corpus  # noqa: E402
from data.pretraining import CreateOptions  # noqa: E402
from session import LoweredGraph  # noqa: E402
from session.schedules import Schedule  # noqa: E402
from session.training import OptimizerSpec, TrainingSession  # noqa: E402

SEQ, MASKS = 512, 80
SMOKE_SEQ, SMOKE_MASKS = 128, 20


def cpu_model() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def wikipedia_like(directory: Path, vocab: Path, files: int, articles: int, natural: bool,
                   seq: int = SEQ, masks: int = MASKS) -> list[Path]:
    """Shards of articles with natural lengths, written from the demo world's sentences."""
    corpus = directory / "corpus"
    if not corpus.exists():
        corpus.mkdir(parents=True)
        for f in range(files):
            rnd = random.Random(f"wikipedia-like-{f}")
            sentences = (s for doc in generate_documents(articles * 8, seed=500 + f) for s in doc)
            docs = []
            for _ in range(articles):
                n = min(500, max(2, round(rnd.lognormvariate(np.log(30), 1.1))))
                docs.append([next(sentences) for _ in range(n)])
            write_corpus(corpus / f"part{f}.txt", docs)
    out = directory / ("natural" if natural else "fill")
    opts = CreateOptions(seq_len=seq, max_predictions=masks, natural_lengths=natural, seed=0)
    return create_pretraining_data(sorted(corpus.glob("*.txt")), out, vocab=vocab, options=opts, workers=2,
                                   progress=False, overwrite=True).shards


def real_share(files) -> tuple[float, int, float]:
    """(share of real tokens in padded rows, sequences, mean tokens per sequence)."""
    import h5py

    masks = [h5py.File(f)["input_mask"][:] for f in files]
    lengths = np.concatenate([m.sum(axis=1) for m in masks])
    return float(lengths.mean() / masks[0].shape[1]), len(lengths), float(lengths.mean())


def unpacked(batch: dict[str, torch.Tensor], masks: int) -> dict[str, torch.Tensor]:
    """The sequences of a packed batch, one per padded row (positions moved back), with
    `masks` masked positions per row."""
    b = {k: v.numpy() for k, v in batch.items()}
    seq = b["input_ids"].shape[1]
    rows = []
    for r in range(len(b["input_ids"])):
        for j in range(1, int(b["sequence_index"][r].max()) + 1):
            where = np.flatnonzero(b["sequence_index"][r] == j)
            mp = b["masked_lm_positions"][r]
            mine = np.flatnonzero((mp >= where[0]) & (mp <= where[-1]) & (mp != 0))
            rows.append((b["input_ids"][r, where], b["segment_ids"][r, where], mp[mine] - where[0],
                         b["masked_lm_ids"][r, mine], b["next_sentence_labels"][r, j - 1]))
    n = len(rows)
    out = {k: np.zeros((n, seq), np.int64) for k in ("input_ids", "segment_ids", "input_mask")}
    out.update({k: np.zeros((n, masks), np.int64) for k in ("masked_lm_positions", "masked_lm_ids")})
    out["next_sentence_labels"] = np.zeros(n, np.int64)
    for i, (ids, seg, pos, lab, nsp) in enumerate(rows):
        out["input_ids"][i, : len(ids)], out["segment_ids"][i, : len(ids)], out["input_mask"][i, : len(ids)] = ids, seg, 1
        out["masked_lm_positions"][i, : len(pos)], out["masked_lm_ids"][i, : len(pos)] = pos, lab
        out["next_sentence_labels"][i] = nsp
    return {k: torch.from_numpy(v) for k, v in out.items()}


def check(cfg: ModelConfig, batch: dict[str, torch.Tensor]) -> dict:
    """The packed graph's loss and NSP logits against the unpacked graph on the same sequences."""
    packed = LoweredGraph(build_model(cfg, seed=0).builder.model_proto()).eval()
    plain = LoweredGraph(build_model(cfg.unpacked(), seed=0).builder.model_proto()).eval()
    alone = unpacked(batch, cfg.max_predictions)
    with torch.no_grad():
        a = packed({k: batch[k] for k in packed.input_names})
        b = plain({k: alone[k] for k in plain.input_names})
    loss_error = abs(a["loss"].item() - b["loss"].item()) / abs(b["loss"].item())
    used = batch["next_sentence_labels"] != -100
    nsp_error = ((a["nsp_logits"][used] - b["nsp_logits"]).abs().max() / b["nsp_logits"].abs().max()).item()
    assert loss_error < 1e-5 and nsp_error < 1e-5, (loss_error, nsp_error)
    return {"sequences": len(alone["input_ids"]), "packed_loss": round(a["loss"].item(), 6),
            "unpacked_loss": round(b["loss"].item(), 6), "loss_relative_error": loss_error,
            "nsp_logits_relative_error": nsp_error}


def session(cfg: ModelConfig) -> TrainingSession:
    spec = OptimizerSpec(kind="lamb", schedule=Schedule(1e-3, 0, 10**9, decay="constant"))
    return TrainingSession(build_model(cfg, seed=0).builder.model_proto(), optimizer=spec, anchors=("loss",))


def loader(files, cfg: ModelConfig, rows: int) -> PretrainingLoader:
    return PretrainingLoader(files, rows, seed=0, prefetch=0, shuffle_buffer=4096, packing=cfg.packed,
                             max_sequences_per_pack=cfg.pack_slots, verbose=False)


def batches(files, cfg: ModelConfig, rows: int, count: int) -> list[dict]:
    """`count` batches of `rows` rows, read before timing."""
    stream = iter(loader(files, cfg, rows))
    return [next(stream) for _ in range(count)]


def epoch_fill(files, cfg: ModelConfig, rows: int) -> tuple[float, float]:
    """(share of real tokens in the packed rows of one whole epoch, seconds the loader took)."""
    packer = loader(files, cfg, rows)
    start = time.perf_counter()
    real = total = 0
    for batch in packer:
        real += int(batch["input_mask"].sum())
        total += batch["input_mask"].numel()
        if packer.epoch == 1:
            break
    return real / total, time.perf_counter() - start


def bench_corpus(name: str, files, base: ModelConfig, args) -> dict:
    seq = base.sequence_length
    padded_fill, sequences, mean_length = real_share(files)
    packed_cfg = base.model_copy(update={"packed": True, "max_sequences_per_pack": args.pack})
    packed_fill, pack_seconds = epoch_fill(files, packed_cfg, args.batch)
    fill = {"packed": packed_fill, "padded": padded_fill}
    data = {"packed": batches(files, packed_cfg, args.batch, args.steps + 2),
            "padded": batches(files, base, args.batch, args.steps + 2)}
    checked = check(packed_cfg, data["packed"][0])
    runners = {"packed": session(packed_cfg), "padded": session(base)}
    for key, run in runners.items():  # warm-up
        for b in data[key][:2]:
            run.run(b)
    seconds = {k: 0.0 for k in runners}
    timed_real = {k: 0 for k in runners}
    for i in range(2, args.steps + 2):  # alternately, so drifts of the machine hit both
        for key, run in runners.items():
            t = time.perf_counter()
            run.run(data[key][i])
            seconds[key] += time.perf_counter() - t
            timed_real[key] += int(data[key][i]["input_mask"].sum())
    step = {k: seconds[k] / args.steps for k in runners}
    rate = {k: fill[k] * seq * args.batch / step[k] for k in runners}
    ideal = fill["packed"] / fill["padded"]
    ratio = rate["packed"] / rate["padded"]
    per_row = {k: timed_real[k] / (args.steps * args.batch) for k in runners}
    print(f"\n{name}: {sequences} sequences, mean {mean_length:.1f} tokens; padded rows {padded_fill:.1%} real; "
          f"packed rows {packed_fill:.1%} real over an epoch (K = {args.pack}; "
          f"{sequences / pack_seconds:,.0f} sequences/s read, masked and packed)")
    print(f"  check: loss {checked['packed_loss']} packed = {checked['unpacked_loss']} unpacked over "
          f"{checked['sequences']} sequences (relative {checked['loss_relative_error']:.1e}; NSP logits "
          f"{checked['nsp_logits_relative_error']:.1e})")
    for key in runners:
        print(f"  {key:6s}: {fill[key]:.1%} × {seq} × {args.batch} rows / {step[key] * 1e3:.0f} ms per step "
              f"= {rate[key]:.0f} real tokens/s (the timed rows: {per_row[key]:.1f} real tokens each)")
    print(f"  packed / padded = {rate['packed']:.0f} / {rate['padded']:.0f} = {ratio:.2f}× = fill "
          f"{fill['packed']:.1%} / {fill['padded']:.1%} ({ideal:.2f}×, the ideal) × step time "
          f"{step['padded'] * 1e3:.0f} / {step['packed'] * 1e3:.0f} ms ({ratio / ideal:.0%} of the ideal)")
    return {"sequences": sequences, "mean_tokens": round(mean_length, 1),
            "padded_real_share": round(padded_fill, 4), "packing_efficiency": round(packed_fill, 4),
            "packing_sequences_per_s": round(sequences / pack_seconds), "check": checked,
            "step_ms": {k: round(1e3 * v, 1) for k, v in step.items()},
            "timed_real_tokens_per_row": {k: round(v, 1) for k, v in per_row.items()},
            "real_tokens_per_s": {k: round(v, 1) for k, v in rate.items()},
            "packed_vs_padded_tokens_per_s": round(ratio, 3), "ideal_ratio": round(ideal, 3)}


def main() -> None:
    args = build_parser().parse_args()
    seq, masks = (SMOKE_SEQ, SMOKE_MASKS) if args.smoke else (SEQ, MASKS)
    width = {"hidden_size": 48, "num_heads": 3} if args.smoke else {"hidden_size": 128, "num_heads": 2}
    if args.smoke:
        args.steps, args.batch, args.pack, args.articles = 1, 2, 4, 20
    load = os.getloadavg()[0]
    base = ModelConfig(architecture="groupbert", num_layers=2, vocab_size=2048, sequence_length=seq,
                       max_predictions=masks, **width)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        start = time.perf_counter()
        demo = build_demo_data(work / f"demo{seq}", seq_len=seq, max_predictions=masks)
        wiki = wikipedia_like(work / "wikipedia_like", demo.vocab_path, 2, args.articles, True, seq, masks)
        fill_share = real_share(wikipedia_like(work / "wikipedia_like", demo.vocab_path, 2, args.articles,
                                               False, seq, masks))[0]
        print(f"data: demo and Wikipedia-like shards at S = {seq} in {time.perf_counter() - start:.0f} s; the "
              f"Wikipedia-like corpus written by the fill-to-maximum recipe would be {fill_share:.1%} real tokens")
        corpora = {"demo": bench_corpus("demo corpus", demo.train_files, base, args),
                   "wikipedia_like": bench_corpus("Wikipedia-like corpus (natural lengths)", wiki, base, args)}
    corpora["wikipedia_like"]["fill_recipe_real_share"] = round(fill_share, 4)
    headline = min(c["packed_vs_padded_tokens_per_s"] for c in corpora.values())
    print(f"\npacked_vs_padded_tokens_per_s = min over the corpora = {headline:.2f}× (target ≥ 1.6)")
    if args.smoke:
        print("smoke: both corpora written, packed and checked against the unpacked graph, both runners timed; "
              "no results file written")
        return
    results = {
        "machine": {"cpu": cpu_model(), "threads": torch.get_num_threads(), "load_average_1m": round(load, 2),
                    "torch": torch.__version__},
        "command": "python bench/packing.py " + " ".join(sys.argv[1:]),
        "model": {"architecture": "groupbert", "hidden_size": 128, "num_layers": 2, "num_heads": 2,
                  "sequence_length": seq, "max_predictions": masks, "max_sequences_per_pack": args.pack,
                  "rows_per_step": args.batch, "precision": "fp32", "optimizer": "lamb"},
        "timed_steps": args.steps,
        "corpora": corpora,
        "packed_vs_padded_tokens_per_s": round(headline, 3),
    }
    out = ROOT / "bench" / "results" / "packing.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
