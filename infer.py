#!/usr/bin/env python3
"""Run a portable export (python bert.py export ... --output model.onnx) in onnxruntime.

    python infer.py --model model.onnx --task mlm --text "the river [MASK] flows past the town ."
    python infer.py --model model.onnx --task mlm --shards 'demo_data/eval/*.hdf5'   # MLM accuracy
    python infer.py --model model.onnx --task squad --squad questions.json [--output answers.jsonl]
    python infer.py --model model.onnx --task classify --text "a text" [--pair "its second text"]
    python infer.py --model model.onnx --task classify --score dev.tsv                # the run's dev figures
    python infer.py --model model.onnx --task tokens --text "Mr. Lincoln went to Ohio ."  # named entities
    python infer.py --model model.onnx --quantize model.int8.onnx                    # int8 dynamic quantization

Batched (`--batch-size`), with a progress bar; the CUDA provider when onnxruntime has it,
else the CPU provider. The WordPiece vocab is read from the export's metadata
(`groupbert.vocab`, written by bert.py export), or from `--vocab vocab.txt`.

`--task classify` gives each text (or pair: `--pair`, or a tab between the two texts of a
`--file` line) its top-k labels with their probabilities, or a regression model's value;
`--task tokens` gives each text's named entities with their character spans; both read
`--score FILE`, a labelled file in the run's own format (its dev file, say; `--format` for
another), and print the run's figures on it (bert/io/serve.py), with a bar of the rows scored and
a last line that counts them. `--output` writes JSON lines instead.

`--task squad` answers every question of a SQuAD-format file, with or without gold
answers: one line per question (answer, score, character span) on stdout, or JSON lines
in `--output`; the official scores follow only when the file has gold answers (the same
post-processing as fine-tuning's evaluation: data/squad `answer_questions`).

Outputs never replace a file: `--output` and `--quantize` must name new files, in a place
that can be written; both are checked before any work starts (one `error: ...` line, exit
2) and written through a temporary file renamed into place.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

import numpy as np


class OnnxModel:
    """An exported model in onnxruntime, with its metadata and tokenizer."""

    def __init__(self, path: str | os.PathLike, provider: str = "auto", vocab: Optional[str] = None,
                 lower_case: Optional[bool] = None, threads: Optional[int] = None):
        import onnxruntime as ort

        from session.export import metadata

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"model {path} does not exist; write one with python bert.py export ... --output {path}")
        try:
            self.meta = metadata(path)
            config = json.loads(self.meta.get("config", "{}"))
        except Exception as e:  # protobuf and json raise several types for a damaged file
            raise ValueError(f"{path} is not a readable ONNX export ({type(e).__name__}: {_first_line(e)}); "
                             "export it again with python bert.py export ...") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path}: its groupbert.config metadata is not a config object")
        self._config = config
        available = ort.get_available_providers()
        if provider == "auto":
            providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
        else:
            name = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}[provider]
            if name not in available:
                raise ValueError(f"onnxruntime here has no {name} (it has {available}); use --provider cpu")
            providers = [name]
        self.path = path
        options = ort.SessionOptions()  # default options: all optimizations
        options.intra_op_num_threads = threads or 0  # it reads no OMP_NUM_THREADS; 0: its default, one per core
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as e:  # onnxruntime's InvalidProtobuf, Fail, ... for a damaged or foreign graph
            raise ValueError(f"onnxruntime cannot load {path} ({type(e).__name__}: {_first_line(e)}); export it "
                             "again with python bert.py export ...") from None
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._vocab, self._lower_case = vocab, lower_case
        self._tokenizer = None

    @property
    def config(self) -> dict:
        return self._config

    @property
    def max_positions(self) -> int:
        return int(self._config.get("max_positions", 512))

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = self.session.run(None, {n: np.ascontiguousarray(feeds[n], dtype=np.int64) for n in self.input_names})
        return dict(zip(self.output_names, values))

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from data.vocab import make_tokenizer

            lower = self._lower_case
            if lower is None:
                lower = json.loads(self.meta.get("lower_case", "true"))
            if self._vocab is not None:
                self._tokenizer = make_tokenizer(self._vocab, lower_case=lower)
            elif "vocab" in self.meta:
                with tempfile.TemporaryDirectory() as tmp:
                    path = Path(tmp) / "vocab.txt"
                    path.write_text(self.meta["vocab"], encoding="utf-8")
                    self._tokenizer = make_tokenizer(path, lower_case=lower)
            else:
                raise ValueError(f"{self.path} holds no vocab (groupbert.vocab metadata); pass --vocab vocab.txt")
        return self._tokenizer

    def require(self, outputs: Sequence[str], task: str) -> None:
        missing = [o for o in outputs if o not in self.output_names]
        if missing:
            raise ValueError(f"{self.path} has outputs {self.output_names}, not {missing}: --task {task} needs a "
                             f"{'pre-training' if task == 'mlm' else 'SQuAD'} export")


# ----------------------------------------------------------------------- MLM
def fill_masks(model: OnnxModel, texts: Sequence[str], top_k: int = 5, batch_size: int = 32,
               progress: bool = False) -> list[list[list[tuple[str, float]]]]:
    """For each text, for each [MASK] in it: the top_k (token, probability), the probabilities
    the model gives. A control token ([UNK], [PAD], [CLS], [SEP], [MASK], [unused…]) is never
    proposed: an [UNK] fill says nothing."""
    from tqdm import tqdm

    from data.vocab import is_control_token

    _positive(top_k=top_k, batch_size=batch_size)
    model.require(["mlm_logits"], "mlm")
    tok = model.tokenizer
    mask_id = tok.token_to_id("[MASK]")
    limit = model.max_positions
    # Ids never proposed: control tokens, and the model's rows past the tokenizer's vocab.
    fillable = np.array([not is_control_token(tok.id_to_token(t)) for t in range(tok.get_vocab_size())])
    results = []
    for i in tqdm(range(0, len(texts), batch_size), desc="fill-mask", unit="batch", disable=not progress):
        encodings = tok.encode_batch(list(texts[i : i + batch_size]))
        length = max(len(e.ids) for e in encodings)
        masks = [[p for p, t in enumerate(e.ids) if t == mask_id] for e in encodings]
        for text, e, m in zip(texts[i : i + batch_size], encodings, masks):
            if not m:
                raise ValueError(f"no [MASK] in {text!r}: write [MASK] where a token is to be filled")
            if len(e.ids) > limit:
                raise ValueError(f"{text[:40]!r}... is {len(e.ids)} tokens; the model takes at most {limit}")
        rows = len(encodings)
        feeds = {
            "input_ids": np.zeros((rows, length), np.int64), "segment_ids": np.zeros((rows, length), np.int64),
            "input_mask": np.zeros((rows, length), np.int64),
            "masked_lm_positions": np.zeros((rows, max(len(m) for m in masks)), np.int64),
        }
        for r, (e, m) in enumerate(zip(encodings, masks)):
            feeds["input_ids"][r, : len(e.ids)] = e.ids
            feeds["input_mask"][r, : len(e.ids)] = 1
            feeds["masked_lm_positions"][r, : len(m)] = m
        logits = model.run(feeds)["mlm_logits"]  # (B, P, V)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        proposed = np.zeros(probs.shape[-1], bool)
        proposed[: len(fillable)] = fillable[: probs.shape[-1]]
        for r, m in enumerate(masks):
            best = np.argsort(-np.where(proposed, probs[r, : len(m)], -1.0), axis=-1)[:, :top_k]
            results.append([[(tok.id_to_token(int(t)), float(probs[r, j, t])) for t in best[j]] for j in range(len(m))])
    return results


def filled_text(text: str, fills: list[list[tuple[str, float]]]) -> str:
    for candidates in fills:
        token = candidates[0][0]
        text = text.replace("[MASK]", token[2:] if token.startswith("##") else token, 1)
    return text


def mlm_accuracy(model: OnnxModel, patterns: Sequence[str], batch_size: int = 32, progress: bool = False) -> dict:
    """Accuracy of the argmax at the masked positions of HDF5 shards (one pass); [UNK] targets
    (shards masked before [UNK] stopped being one) are not scored, and counted. Beside it the
    unigram baseline of the same targets (always answering their most frequent one: a model
    below PLATEAU_FACTOR × it is on the plateau, bert/tasks/unigram.py)."""
    from tqdm import tqdm

    from bert.tasks.unigram import PLATEAU_FACTOR, on_plateau
    from data import PretrainingLoader

    _positive(batch_size=batch_size)
    model.require(["mlm_logits"], "mlm")
    files = sorted({f for p in patterns for f in glob.glob(p)} | {p for p in patterns if Path(p).is_file()})
    if not files:
        raise ValueError(f"--shards {list(patterns)} match no file")
    loader = PretrainingLoader(files, batch_size, drop_last=False, prefetch=0, verbose=False)
    hits = count = 0
    targets: Counter = Counter()  # how often each id is a target
    stream = iter(loader)
    for _ in tqdm(range(loader.batches_per_epoch), desc="MLM accuracy", unit="batch", disable=not progress):
        batch = {k: v.numpy() for k, v in next(stream).items()}
        logits = model.run(batch)["mlm_logits"]
        used = batch["masked_lm_positions"] > 0
        hits += int(((logits.argmax(-1) == batch["masked_lm_ids"]) & used).sum())
        count += int(used.sum())
        targets.update(batch["masked_lm_ids"][used].tolist())
    top, most = targets.most_common(1)[0] if targets else (None, 0)
    accuracy, unigram = hits / max(count, 1), most / max(count, 1)
    stuck = bool(count) and on_plateau(accuracy, unigram)
    if stuck:
        print(f"note: MLM accuracy {accuracy:.3f} is below {PLATEAU_FACTOR:g}× the unigram baseline {unigram:.3f} "
              f"(always answering token id {top}): the model is on the unigram plateau", file=sys.stderr, flush=True)
    return {"mlm_accuracy": accuracy, "unigram_mlm_accuracy": unigram, "on_unigram_plateau": stuck,
            "masked_tokens": count, "files": len(files),
            **({"unk_targets_ignored": loader.unk_targets} if loader.unk_targets else {})}


# --------------------------------------------------------------------- SQuAD
def answer_squad(model: OnnxModel, path: str, batch_size: int = 32, max_seq_length: Optional[int] = None,
                 doc_stride: Optional[int] = None, max_query_length: Optional[int] = None, progress: bool = False,
                 null_threshold: Optional[float] = None):
    """The answers (data.squad.Answers: texts, details, n-best, and scores when the file has
    gold answers) of the export on a SQuAD-format file; every question is answered.
    Window settings default to those the model was fine-tuned with (export metadata), else
    BERT's 384/128/64; the SQuAD v2.0 null threshold to the one tuned on the run's dev file
    (none: a span is always given). From the logits on, this is fine-tuning's own
    evaluation (data.squad.answer_questions)."""
    from data.squad import answer_questions, convert_examples_to_features, load_squad, span_logits

    if null_threshold is not None and not _is_finite(null_threshold):  # it is written into the scores' JSON
        raise ValueError(f"--null-threshold must be a finite number, got {null_threshold!r}")
    model.require(["start_logits", "end_logits"], "squad")
    try:
        windows = json.loads(model.meta.get("squad", "{}"))
    except ValueError:
        raise ValueError(f"{model.path}: its groupbert.squad metadata is not JSON; export it again") from None
    seq = max_seq_length if max_seq_length is not None else min(int(model.config.get("sequence_length", 384)),
                                                                model.max_positions)
    stride = doc_stride if doc_stride is not None else windows.get("doc_stride", min(128, seq // 2))
    query = max_query_length if max_query_length is not None else windows.get("max_query_length", 64)
    _positive(batch_size=batch_size, max_seq_length=seq, doc_stride=stride, max_query_length=query)
    if seq > model.max_positions:
        raise ValueError(f"--max-seq-length {seq} exceeds the {model.max_positions} positions of {model.path}; "
                         f"use at most {model.max_positions} (longer contexts are split into windows)")
    data = load_squad(path)
    print(data.summary(path, training=False), file=sys.stderr, flush=True)
    features = convert_examples_to_features(data.examples, model.tokenizer, max_seq_length=seq, doc_stride=stride,
                                            max_query_length=query)

    def run(batch):
        out = model.run(batch)
        return out["start_logits"], out["end_logits"]

    start, end = span_logits(features, run, batch_size=batch_size, progress=progress)
    if null_threshold is None:
        null_threshold = windows.get("null_threshold")
        if null_threshold is not None and not _is_finite(null_threshold):
            raise ValueError(f"{model.path}: its groupbert.squad metadata holds the null threshold {null_threshold!r}, "
                             "not a finite number; pass --null-threshold or export the model again")
    return answer_questions(data.examples, features, start, end, null_threshold=null_threshold)


# -------------------------------------------------------------- quantization
def quantize(source: str | os.PathLike, target: str | os.PathLike) -> Path:
    """int8 dynamic quantization (onnxruntime.quantization) of an export's matmul weights.

    The builder applies dense weights as MatMul(x, Transpose(W)); the quantizer only takes
    a MatMul whose weight is an initializer, so the transposes are folded first (W.T
    stored). An export fused for onnxruntime (bert.py export --optimize) has its Attention
    nodes quantized too (QAttention). Activations are quantized per batch at run time; the
    metadata is kept.
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from bert.run.outputs import check_output
    from fileio import staged
    from session.export import fold_weight_transposes, metadata, quiet_logger
    from session.model_io import load_model, save_model

    source = Path(source)
    target = check_output(target, "--quantize", inputs=[source], suffix=".onnx")
    folded = fold_weight_transposes(load_model(source))
    large = sum(len(t.raw_data) for t in folded.graph.initializer) > (1 << 30)
    with tempfile.TemporaryDirectory() as tmp:
        folded_path, quantized = Path(tmp) / "folded.onnx", Path(tmp) / "quantized.onnx"
        save_model(folded, folded_path)
        # DefaultTensorType: the type of values that shape inference cannot follow through
        # onnxruntime's fused operators (all float here).
        with quiet_logger():  # the quantizer's advice to pre-process, as a root-logger warning
            quantize_dynamic(folded_path, quantized, weight_type=QuantType.QInt8,
                             op_types_to_quantize=["MatMul", "Attention"], per_channel=True,
                             use_external_data_format=large,
                             extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        model = onnx.load(str(quantized))
    props = {p.key: p.value for p in model.metadata_props}
    props.update({f"groupbert.{k}": v for k, v in metadata(source).items()})
    props["groupbert.quantization"] = "int8 dynamic: MatMul weights per channel (onnxruntime.quantization)"
    onnx.helper.set_model_props(model, props)
    with staged(target) as path:  # the model and its external data, if any, renamed into place together
        save_model(model, path)
    return target


# ------------------------------------------------------------------- checks
def _positive(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")


def _is_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _finite_float(text: str) -> float:
    """An argparse type: a float that JSON can hold (no nan, inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


# Options whose value may be a negative number that argparse does not recognise as one (it
# takes "-1e3" and "-inf" for options: only "-1" and "-1.5" are numbers to it).
_NUMBER_OPTIONS = ("--null-threshold",)


def _joined_numbers(argv: Sequence[str]) -> list[str]:
    """`--null-threshold -1e3` as `--null-threshold=-1e3`, so that argparse reads the value."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in _NUMBER_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-") and _parses(argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _parses(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else ""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, as every other error of infer.py
        raise ValueError(f"{message} (see python infer.py --help)")


# ---------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    from session.process import use_cpu_threads

    parser = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="exported .onnx (python bert.py export ...)")
    parser.add_argument("--task", choices=["mlm", "squad", "classify", "tokens"],
                        help="fill [MASK] tokens / answer SQuAD questions / label texts / find named entities")
    parser.add_argument("--text", action="append", default=[],
                        help="a text (repeatable); mlm: with [MASK] tokens")
    parser.add_argument("--pair", action="append", default=[],
                        help="classify: the second text of a sentence pair, one per --text")
    parser.add_argument("--file", help="mlm, classify, tokens: a text file, one text per line (classify: a tab "
                                       "between the two texts of a pair)")
    parser.add_argument("--score", metavar="FILE",
                        help="classify, tokens: a labelled file in the run's format; prints the run's figures on it")
    parser.add_argument("--format", choices=["auto", "tsv", "csv", "jsonl", "conll"],
                        help="--score: the file's format (default: the run's data.format, which the export records; "
                             "auto: by the file's suffix)")
    parser.add_argument("--shards", nargs="+", help="mlm: HDF5 shards (globs) to measure MLM accuracy on")
    parser.add_argument("--squad", help="squad: a SQuAD-format JSON file to answer (scored when it has answers)")
    parser.add_argument("--output", help="squad, classify, tokens: write one JSON line per question or text here "
                                         "(a new file)")
    parser.add_argument("--null-threshold", type=_finite_float,
                        help="squad: answer \"\" where null score - best span score exceeds this (SQuAD v2.0; "
                             "a finite number, negative ones too; default: the one tuned on the run's dev file, none "
                             "for v1.1 models)")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-seq-length", type=int, help="squad: window length (default: the model's training length)")
    parser.add_argument("--doc-stride", type=int, help="squad: window stride (default: as fine-tuned, else 128)")
    parser.add_argument("--vocab", help="vocab.txt, when the export holds none")
    parser.add_argument("--provider", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--quantize", metavar="OUT", help="write an int8 dynamically quantized copy of --model to OUT")
    parser.add_argument("--int8", action="store_true", help="quantize to a temporary file first, then run the task")
    parser.add_argument("--no-progress", action="store_true")
    try:
        threads = use_cpu_threads()  # as bert.py: as many as the CPUs this process may use allow
        args = parser.parse_args(_joined_numbers(sys.argv[1:] if argv is None else argv))
        progress = not args.no_progress
        _check_outputs(args)
        if args.format is not None and not args.score:
            raise ValueError("--format goes with --score: the format of the labelled file it scores")
        with tempfile.TemporaryDirectory() as tmp:
            path = args.model
            if args.quantize or args.int8:
                path = str(quantize(args.model, args.quantize or Path(tmp) / "model.int8.onnx"))
                print(f"int8 model: {path}", file=sys.stderr)
            if args.task is None:
                if not args.quantize:
                    parser.error("give --task mlm|squad|classify|tokens (or --quantize OUT)")
                return 0
            model = OnnxModel(path, args.provider, args.vocab, threads=threads.count)
            if args.task == "mlm":
                return _mlm(model, args, progress)
            if args.task == "squad":
                return _squad(model, args, progress)
            return _labelled(model, args, progress)
    except ValueError as e:
        from fileio import say

        say(f"error: {e}")
        return 2


def _mlm(model: OnnxModel, args, progress: bool) -> int:
    if args.shards:
        print(json.dumps(mlm_accuracy(model, args.shards, args.batch_size, progress)))
        return 0
    texts = list(args.text)
    texts += _file_lines(args)
    if not texts:
        raise ValueError("--task mlm needs --text, --file or --shards")
    for text, fills in zip(texts, fill_masks(model, texts, args.top_k, args.batch_size, progress)):
        print(filled_text(text, fills))
        for j, candidates in enumerate(fills):
            print(f"  [MASK] {j + 1}: " + ", ".join(f"{t} {p:.3f}" for t, p in candidates))
    return 0


def _squad(model: OnnxModel, args, progress: bool) -> int:
    if not args.squad:
        raise ValueError("--task squad needs --squad FILE (SQuAD-format JSON)")
    path = _input_file(Path(args.squad), "--squad")
    answers = answer_squad(model, str(path), args.batch_size, args.max_seq_length, args.doc_stride,
                           progress=progress, null_threshold=args.null_threshold)
    details, scores = answers.details, answers.scores
    lines = [{"id": qid, "answer": text, "score": round(details[qid].probability, 4),
              "start": details[qid].start if text else None, "end": details[qid].end if text else None,
              "null_odds": round(details[qid].null_odds, 4) if np.isfinite(details[qid].null_odds) else None}
             for qid, text in answers.texts.items()]
    if args.output:
        from fileio import write_atomically

        out = write_atomically(args.output, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines),
                               replace=False)
        print(f"{len(lines)} answers: {out}", file=sys.stderr)
    else:
        for line in lines:
            span = f"characters {line['start']}-{line['end']}" if line["answer"] else "no answer"
            print(f"{line['id']}: {line['answer']!r} (score {line['score']:.3f}, {span})")
    if scores is not None:
        print(json.dumps({k: round(v, 4) for k, v in scores.items()}))
    return 0


def _labelled(model: OnnxModel, args, progress: bool) -> int:
    from bert.io.serve import classify, score_file, tag

    _positive(top_k=args.top_k, batch_size=args.batch_size)
    if args.score:
        path, started = _input_file(Path(args.score), "--score"), time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):  # the reading's notes (rows truncated): stdout is the figures
            figures = score_file(model, str(path), args.batch_size, progress, args.format)
        rows = figures["rows"]
        print(f"{rows:,} row{'' if rows == 1 else 's'} of {path} scored in {time.perf_counter() - started:.1f} s",
              file=sys.stderr)
        print(json.dumps(figures))
        return 0
    texts = _texts(args, model)
    if args.task == "classify":
        found = classify(model, texts, args.top_k, args.batch_size, progress)
        lines = [{"text": list(t) if len(t) > 1 else t[0], **f} for t, f in zip(texts, found)]
        shown = [" | ".join(t) + " → " + (f"{f['value']:.4f}" if "value" in f else
                                            ", ".join(f"{label} {p:.3f}" for label, p in f["labels"]))
                 for t, f in zip(texts, found)]
    else:
        texts = [t[0] for t in texts]
        found = tag(model, texts, args.batch_size, progress)
        lines = [{"text": t, "entities": [vars(e) for e in entities]} for t, entities in zip(texts, found)]
        shown = ["\n".join([t] + [f"  {e.type} {e.text!r} (characters {e.start}-{e.end}, {e.score:.3f})"
                                  for e in entities]) for t, entities in zip(texts, found)]
    if args.output:
        from fileio import write_atomically

        out = write_atomically(args.output, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines),
                               replace=False)
        print(f"{len(lines)} {'texts' if args.task == 'classify' else 'texts tagged'}: {out}", file=sys.stderr)
    else:
        print("\n".join(shown))
    return 0


def _texts(args, model: OnnxModel) -> list[tuple[str, ...]]:
    """--text (with --pair) and --file's lines, as one text or a pair each: a line is split at
    its tab unless the export's run read single texts (bert/io/serve.py `text_columns`)."""
    from bert.io.serve import text_columns

    if args.pair and (len(args.pair) != len(args.text) or args.task != "classify"):
        raise ValueError("--pair goes with --task classify, one for each --text")
    texts = [(t, p) for t, p in zip(args.text, args.pair)] if args.pair else [(t,) for t in args.text]
    pairs = args.task == "classify" and len(text_columns(model) or "ab") == 2  # unrecorded: a tab makes a pair
    texts += [tuple(line.split("\t")) if pairs else (line,) for line in _file_lines(args)]
    if not texts:
        raise ValueError(f"--task {args.task} needs --text, --file or --score")
    for t in texts:
        if len(t) > 2:
            raise ValueError(f"--file line {t!r} has {len(t) - 1} tabs: a line of a pairs model is its two texts "
                             "with one tab between")
    return texts


def _file_lines(args) -> list[str]:
    if not args.file:
        return []
    text = _read_text(Path(args.file), "--file")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"--file {args.file} is empty{' (blank lines only)' if text else ''}: give it one text per "
                         "line")
    return lines


def _check_outputs(args) -> None:
    """Every output path, before any work: a new file in a place that can be written (bert/run/outputs.py)."""
    from bert.run.outputs import check_output

    if args.output is not None:
        if args.task not in ("squad", "classify", "tokens") or args.score:
            raise ValueError("--output goes with --task squad, classify or tokens (the answers as JSON lines)")
        check_output(args.output, "--output", inputs=[args.model, args.squad, args.file])
    if args.quantize is not None:
        check_output(args.quantize, "--quantize", inputs=[args.model], suffix=".onnx")


def _input_file(path: Path, flag: str) -> Path:
    """`path`, a file the option `flag` names to read; else one line that says what it is."""
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory, not a file; name the file")
    if not path.is_file():
        raise ValueError(f"{flag} {path} does not exist" if not path.exists() else f"{flag} {path} is not a file")
    return path


def _read_text(path: Path, flag: str) -> str:
    _input_file(path, flag)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path} is not UTF-8 text (byte {e.start})") from None


if __name__ == "__main__":
    sys.exit(main())
