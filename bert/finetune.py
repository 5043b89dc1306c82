"""SQuAD v1.1 fine-tuning behind `python bert.py --config configs/squad_*.json`.

    training.init_from   a pre-training checkpoint (directory or .onnx) or a HuggingFace
                         BERT directory: its encoder weights start the run; the span head
                         `qa_outputs` starts from random values
    --checkpoint-input   resumes exactly (weights, optimizer, step, RNG, data position)

Steps over shuffled training features (one permutation per epoch, seeded), with the
configured optimizer (AdamW or LAMB), dropout from the model config and the learning
rate schedule (linear warm-up, linear decay in the shipped configs); a progress bar,
`metrics.jsonl` and checkpoints as the pre-training run writes them (bert/train.py).
Then it answers the dev file and writes `predictions.json`, `nbest_predictions.json`
and `eval_results.json` (exact match, F1, as the official v1.1 script) into the run
directory and a final line of `metrics.jsonl`.
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
import torch
from tqdm import tqdm

from bert.config import Config, Task
from bert.sources import HEAD_PREFIXES, Start, build_with_weights, starting_point
from bert.loop import MetricsLog, plan_run, prepare_run_dir
from bert.train import make_session
from data.squad import Example, convert_examples_to_features, evaluate, feature_arrays, load_squad, predict_answers
from data.vocab import make_tokenizer
from session import InferenceSession

VOCAB_FILE = "vocab.txt"

__all__ = ["FinetuneResult", "finetune", "squad_scores"]


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


def _features(config: Config, path: str, tokenizer, training: bool):
    cfg, d = config.model, config.data
    data = load_squad(path)
    print(data.summary(path), flush=True)
    examples = data.examples
    if training:
        # Only an answer located in its context gives a span to learn (data/squad.py).
        examples = [e for e in examples if e.answer_starts[0] is not None]
    features = convert_examples_to_features(examples, tokenizer, max_seq_length=cfg.sequence_length,
                                            doc_stride=d.doc_stride, max_query_length=d.max_query_length)
    return examples, features


def squad_scores(model, examples: list[Example], features, batch_size: int, progress: bool = False):
    """Answers and scores of `model` (anything InferenceSession runs) on the features."""
    session = model if isinstance(model, InferenceSession) else InferenceSession(model)

    def run(batch):
        out = session.run(batch)
        return out["start_logits"].float().numpy(), out["end_logits"].float().numpy()

    predictions, nbest = predict_answers(examples, features, run, batch_size=batch_size, progress=progress)
    return evaluate(examples, predictions), predictions, nbest


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
    for path in (d.train_file, d.dev_file):
        if path and not Path(path).is_file():
            raise ValueError(f"SQuAD file {path} does not exist")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = make_tokenizer(start.vocab.write(Path(tmp) / VOCAB_FILE), lower_case=start.vocab.lower_case)
    _, train_features = _features(config, d.train_file, tokenizer, training=True)
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
            result.scores = _predict_dev(config, session, tokenizer, output_dir, progress)
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
        print(f"{d.dev_file}: exact match {result.scores['exact_match']:.2f}, F1 {result.scores['f1']:.2f}")
    print(f"checkpoint: {result.checkpoint}")
    return result


def _predict_dev(config: Config, session, tokenizer, output_dir: Path, progress: bool) -> dict[str, float]:
    weights = {n: p.detach().cpu().numpy() for n, p in session.graph.named_weights()}
    model, _ = build_with_weights(config.model, Start(config.model, weights, None, "the run"), with_loss=False)
    examples, features = _features(config, config.data.dev_file, tokenizer, training=False)
    scores, predictions, nbest = squad_scores(InferenceSession(model, session.options), examples, features,
                                              config.training.micro_batch_size, progress)
    (output_dir / "predictions.json").write_text(json.dumps(predictions, indent=2, ensure_ascii=False) + "\n")
    (output_dir / "nbest_predictions.json").write_text(json.dumps(nbest, indent=2, ensure_ascii=False) + "\n")
    scores = {k: round(v, 4) for k, v in scores.items()}
    (output_dir / "eval_results.json").write_text(json.dumps({"dev_file": config.data.dev_file, **scores}, indent=2) + "\n")
    return scores
