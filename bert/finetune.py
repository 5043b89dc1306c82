"""SQuAD v1.1 / v2.0 fine-tuning behind `python bert.py --config configs/squad_*.json`.

    training.init_from   a pre-training checkpoint (directory or .onnx) or a HuggingFace
                         BERT directory: its encoder weights start the run; the span head
                         `qa_outputs` starts from random values
    --checkpoint-input   resumes exactly (weights, optimizer, step, RNG, data position)
    --eval-only          scores the starting weights on data.dev_file, no training

Steps over shuffled training features (one permutation per epoch, seeded), with the
configured optimizer (AdamW or LAMB), dropout from the model config and the learning
rate schedule (linear warm-up, linear decay in the shipped configs); a progress bar,
`metrics.jsonl` and checkpoints as the pre-training run writes them (bert/train.py).
Then it answers the dev file and writes `predictions.json`, `nbest_predictions.json`
and `eval_results.json` (the official script's figures: exact match and F1 for v1.1;
exact, F1, HasAns/NoAns for v2.0) into the run directory and a final line of
`metrics.jsonl`.

SQuAD v2.0: unanswerable training questions are trained on, every window pointing at
[CLS] (the null answer); on a v2.0 dev file the threshold on (null score − best span
score) is tuned for the best F1 as the official script's threshold search does, the
predictions use it, and it is recorded (`null_threshold` in eval_results.json, and so
in an export of the run's checkpoints, where infer.py applies it).
"""
from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import onnx
import torch
from tqdm import tqdm

from bert.config import Config, Task
from bert.sources import HEAD_PREFIXES, Start, build_with_weights, starting_point
from bert.loop import MetricsLog, RunPlan, fresh_output_dir, plan_run, prepare_run_dir
from bert.train import make_session
from data.squad import (Example, SquadData, apply_null_threshold, convert_examples_to_features, evaluate,
                        feature_arrays, load_squad, predict_answers)
from data.vocab import make_tokenizer
from session import InferenceSession

VOCAB_FILE = "vocab.txt"

__all__ = ["FinetuneResult", "evaluate_only", "finetune", "squad_scores"]
EVAL_RESULTS = "eval_results.json"


@dataclass
class FinetuneResult:
    output_dir: Path
    metrics: list[dict] = field(default_factory=list)
    checkpoint: Optional[Path] = None
    scores: Optional[dict[str, float]] = None


class _Features:
    """Training features in a seeded order per epoch; the position resumes exactly."""

    def __init__(self, arrays: dict[str, np.ndarray], batch_size: int, seed: int):
        self.arrays, self.batch_size, self.seed = arrays, batch_size, seed
        self.count = len(arrays["input_ids"])
        if self.count < batch_size:
            raise ValueError(f"the training file gives {self.count} features, fewer than one batch of {batch_size}; "
                             "lower training.micro_batch_size or use a larger file")
        self.epoch, self.offset = 0, 0

    def next(self) -> dict[str, torch.Tensor]:
        if self.offset + self.batch_size > self.count:  # the rest of an epoch waits for the next order
            self.epoch, self.offset = self.epoch + 1, 0
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.count)
        rows = order[self.offset : self.offset + self.batch_size]
        self.offset += self.batch_size
        return {k: torch.from_numpy(v[rows]) for k, v in self.arrays.items()}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


def _check(config: Config) -> None:
    if config.model.task is not Task.SQUAD:
        raise ValueError(f"fine-tuning needs model.task 'squad', the config says {config.model.task.value!r}")
    if config.data.source != "squad":
        raise ValueError(f"model.task 'squad' needs data.source 'squad' with data.train_file and data.dev_file, "
                         f"the config says data.source {config.data.source!r}")


def _features(config: Config, data: SquadData, path: str, tokenizer, training: bool):
    """(examples, features) of a loaded SQuAD file: for training the examples with a span to
    learn (located answers, and v2.0's unanswerable questions: the [CLS] null answer)."""
    cfg, d = config.model, config.data
    examples = data.trainable if training else data.examples
    if training and not examples:
        raise ValueError(f"SQuAD file {path} has no question to train on (no located answer, no unanswerable "
                         "question)")
    features = convert_examples_to_features(examples, tokenizer, max_seq_length=cfg.sequence_length,
                                            doc_stride=d.doc_stride, max_query_length=d.max_query_length)
    return examples, features


def _load(path: str, scored: bool = False) -> SquadData:
    data = load_squad(path)
    print(data.summary(path), flush=True)
    if scored and len(data.ungraded) == len(data.examples):
        raise ValueError(f"dev file {path} has no gold answers to score: add them, or answer its questions with "
                         "infer.py --task squad")
    return data


def squad_scores(model, examples: list[Example], features, batch_size: int, progress: bool = False):
    """(official scores, answers, n-best) of `model` (anything InferenceSession runs).

    On a v2.0 set the null threshold is tuned first (best F1, evaluate-v2.0.py's search on
    null score − best span score), the answers use it, and the scores carry it as
    `null_threshold` with `null_odds` {id: score} beside them."""
    session = model if isinstance(model, InferenceSession) else InferenceSession(model)

    def run(batch):
        out = session.run(batch)
        return out["start_logits"].float().numpy(), out["end_logits"].float().numpy()

    details, nbest = predict_answers(examples, features, run, batch_size=batch_size, progress=progress, details=True)
    if not any(e.is_impossible for e in examples):
        predictions = apply_null_threshold(details, None)
        return evaluate(examples, predictions), predictions, nbest
    odds = {q: p.null_odds for q, p in details.items()}
    threshold = evaluate(examples, apply_null_threshold(details, None), na_probs=odds)["best_f1_thresh"]
    predictions = apply_null_threshold(details, threshold)
    scores = evaluate(examples, predictions)
    return {**scores, "null_threshold": threshold, "null_odds": odds}, predictions, nbest


def _score_line(where: str, scores: dict) -> str:
    if "exact_match" in scores:
        return f"{where}: exact match {scores['exact_match']:.2f}, F1 {scores['f1']:.2f}"
    parts = [f"exact {scores['exact']:.2f}, f1 {scores['f1']:.2f}"]
    for group in ("HasAns", "NoAns"):
        if f"{group}_total" in scores:
            parts.append(f"{group}_exact {scores[group + '_exact']:.2f}, {group}_f1 {scores[group + '_f1']:.2f} "
                         f"({scores[group + '_total']} questions)")
    return f"{where} (official SQuAD v2.0): " + "; ".join(parts) + f"; null threshold {scores['null_threshold']:.3f}"


def finetune(config: Config, checkpoint_input: Optional[str] = None, use_wandb: bool = False,
             progress: bool = True, on_log: Optional[Callable[[dict], None]] = None) -> FinetuneResult:
    """`on_log` sees each metrics record (the scores last) right after it is logged, as in
    `bert.train.train`; an exception it raises ends the run (a sweep's pruning)."""
    _check(config)
    t, d = config.training, config.data
    start = starting_point(config, t.init_from)
    config = config.model_copy(update={"model": start.model})  # sizes of an imported HF checkpoint
    if start.vocab is None:
        raise ValueError("no vocab for the SQuAD files: set data.vocab_file, or start from a HuggingFace "
                         "directory (training.init_from) that holds vocab.txt")
    # Everything that can reject the config runs before anything is written.
    train_data = _load(d.train_file)
    dev_data = _load(d.dev_file, scored=True) if d.dev_file else None
    tokenizer = _tokenizer(start)
    _, train_features = _features(config, train_data, d.train_file, tokenizer, training=True)
    arrays = feature_arrays(train_features)
    if t.epochs is not None:  # the steps follow from the epochs and the batch
        steps = max(1, math.ceil(t.epochs * len(arrays["input_ids"]) / t.samples_per_replica))
        config = config.model_copy(update={"training": t.model_copy(update={"steps": steps})})
        t = config.training
        print(f"training.steps {steps}: {t.epochs} epoch(s) of {len(arrays['input_ids'])} features in batches "
              f"of {t.samples_per_replica}", flush=True)
    proto, fresh = build_with_weights(config.model, start, with_loss=True, seed=t.seed, allow_missing=HEAD_PREFIXES)
    if start.weights is not None and fresh:
        print(f"from {start.origin}; new (random) weights: {', '.join(fresh)}", flush=True)
    session = make_session(config, proto)
    data = _Features(arrays, t.samples_per_replica, t.seed)
    if checkpoint_input:
        data.load_state_dict(session.load(checkpoint_input)["data"])
    plan = plan_run(config, checkpoint_input)
    prepare_run_dir(plan, config)
    output_dir = plan.output_dir
    print(f"output_dir: {output_dir}", flush=True)
    start.vocab.write(output_dir / VOCAB_FILE)

    log = MetricsLog(output_dir, config, use_wandb)
    result = FinetuneResult(output_dir)
    bar = tqdm(total=t.steps, initial=session.step, desc=config.name, disable=not progress, dynamic_ncols=True)
    try:
        while session.step < t.steps:
            batch = data.next()
            began = time.perf_counter()
            out = session.run(batch)
            seconds = time.perf_counter() - began
            record = {"step": session.step, **{k: round(v, 6) for k, v in out.items()},
                      "epoch": round(data.epoch + data.offset / data.count, 3),
                      "sequences_per_s": round(t.samples_per_replica / seconds, 2)}
            log.log(record)
            result.metrics.append(record)
            if on_log is not None:
                on_log(record)
            bar.update(session.step - bar.n)
            bar.set_postfix(loss=f"{out['loss']:.3f}", lr=f"{out['learning_rate']:.2e}", epoch=f"{record['epoch']:.2f}")
            if t.checkpoint_every and session.step % t.checkpoint_every == 0 and session.step < t.steps:
                session.save(output_dir / f"checkpoint-{session.step}", {"data": data.state_dict()})
        result.checkpoint = session.save(output_dir / "checkpoint-final", {"data": data.state_dict()})
        bar.close()
        if d.dev_file:
            result.scores = _predict_dev(config, session, dev_data, tokenizer, output_dir, progress)
            record = {"step": session.step, **result.scores}
            log.log(record)
            if on_log is not None:
                on_log(record)
    finally:
        bar.close()
        log.close()
    if result.metrics:
        print(f"steps {result.metrics[0]['step']}-{result.metrics[-1]['step']}: "
              f"loss {result.metrics[0]['loss']:.3f} → {result.metrics[-1]['loss']:.3f}")
    if result.scores:
        print(_score_line(d.dev_file, result.scores))
    print(f"checkpoint: {result.checkpoint}")
    return result


def _tokenizer(start: Start):
    with tempfile.TemporaryDirectory() as tmp:
        return make_tokenizer(start.vocab.write(Path(tmp) / VOCAB_FILE), lower_case=start.vocab.lower_case)


def _predict_dev(config: Config, session, dev: SquadData, tokenizer, output_dir: Path, progress: bool,
                 weights=None) -> dict[str, float]:
    """Answer and score the dev file; write predictions.json, nbest_predictions.json,
    (v2.0) null_odds.json, and eval_results.json into `output_dir`."""
    if weights is None:
        weights = {n: p.detach().cpu().numpy() for n, p in session.graph.named_weights()}
    model, _ = build_with_weights(config.model, Start(config.model, weights, None, "the run"), with_loss=False)
    examples, features = _features(config, dev, config.data.dev_file, tokenizer, training=False)
    options = session.options if session is not None else None
    scores, predictions, nbest = squad_scores(InferenceSession(model, options), examples, features,
                                              config.training.micro_batch_size, progress)
    (output_dir / "predictions.json").write_text(json.dumps(predictions, indent=2, ensure_ascii=False) + "\n")
    (output_dir / "nbest_predictions.json").write_text(json.dumps(nbest, indent=2, ensure_ascii=False) + "\n")
    odds = scores.pop("null_odds", None)
    if odds is not None:  # as BERT's run_squad.py writes it: evaluate-v2.0.py --na-prob-file
        (output_dir / "null_odds.json").write_text(json.dumps(
            {q: v if math.isfinite(v) else 1e9 for q, v in odds.items()}, indent=2) + "\n")
    scores = {k: round(v, 4) if isinstance(v, float) else v for k, v in scores.items()}
    (output_dir / EVAL_RESULTS).write_text(json.dumps({"dev_file": config.data.dev_file, **scores}, indent=2) + "\n")
    return scores


def evaluate_only(config: Config, checkpoint_input: Optional[str] = None, progress: bool = True) -> FinetuneResult:
    """`bert.py --eval-only`: score the starting weights (`--checkpoint-input`, else
    `training.init_from`: a checkpoint or a HuggingFace directory) on data.dev_file without
    training; a span head the source lacks starts from the run's seeded random values (the
    "before fine-tuning" score). Writes into a fresh run directory."""
    _check(config)
    d, t = config.data, config.training
    if not d.dev_file:
        raise ValueError("--eval-only scores data.dev_file: set it to a SQuAD JSON file with answers")
    source = checkpoint_input or t.init_from
    start = starting_point(config, source)
    config = config.model_copy(update={"model": start.model})
    if start.vocab is None:
        raise ValueError("no vocab for the SQuAD file: set data.vocab_file, or score a checkpoint or HuggingFace "
                         "directory that holds its vocab")
    dev = _load(d.dev_file, scored=True)
    tokenizer = _tokenizer(start)
    proto, fresh = build_with_weights(config.model, start, with_loss=False, seed=t.seed, allow_missing=HEAD_PREFIXES)
    if start.weights is not None and fresh:
        print(f"from {start.origin}; new (random, seed {t.seed}) weights: {', '.join(fresh)}", flush=True)
    output_dir = fresh_output_dir(config)
    prepare_run_dir(RunPlan(output_dir), config)
    print(f"output_dir: {output_dir}", flush=True)
    start.vocab.write(output_dir / VOCAB_FILE)
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    result = FinetuneResult(output_dir)
    result.scores = _predict_dev(config, None, dev, tokenizer, output_dir, progress, weights=weights)
    print(_score_line(d.dev_file, result.scores))
    return result
