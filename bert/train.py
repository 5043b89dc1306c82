"""The pre-training run behind `python bert.py --config ...`.

config → graph (bert.model) → TrainingSession → steps over the configured data, with a
progress bar, `<output_dir>/metrics.jsonl`, optional wandb, and checkpoints every
`training.checkpoint_every` steps and at the end (`checkpoint-<step>`, `checkpoint-final`).
`--checkpoint-input DIR` resumes exactly: weights, optimizer, step, RNG and the data
position come back, so an fp32 CPU run continues bit for bit as if never stopped.
"""
from __future__ import annotations

import glob
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch
from tqdm import tqdm

from bert.config import Config, ModelConfig, Task
from bert.model import build_model
from session import SessionOptions
from session.schedules import Schedule
from session.training import OptimizerSpec, TrainingSession

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"


@dataclass
class TrainResult:
    output_dir: Path
    metrics: list[dict] = field(default_factory=list)
    checkpoint: Optional[Path] = None


# ------------------------------------------------------------------- data
def synthetic_batch(cfg: ModelConfig, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random tokens in the shapes of a real batch: distinct sorted masked positions, two segments."""
    b, s, p = batch_size, cfg.sequence_length, cfg.max_predictions
    positions = torch.sort(torch.rand(b, s - 1, generator=generator).argsort(dim=1)[:, :p] + 1, dim=1).values
    return {
        "input_ids": torch.randint(5, cfg.vocab_size, (b, s), generator=generator),
        "segment_ids": (torch.arange(s) >= s // 2).long().expand(b, s).contiguous(),
        "input_mask": torch.ones(b, s, dtype=torch.long),
        "masked_lm_positions": positions,
        "masked_lm_ids": torch.randint(5, cfg.vocab_size, (b, p), generator=generator),
        "next_sentence_labels": torch.randint(0, 2, (b,), generator=generator),
    }


class SyntheticData:
    """Random tokens in the shapes of real batches, for benchmarks (no learnable signal)."""

    def __init__(self, config: Config, batch_size: int, seed: int):
        self.cfg, self.batch_size, self.seed, self.position = config.model, batch_size, seed, 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
            self.position += 1
            yield synthetic_batch(self.cfg, self.batch_size, generator)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def make_data(config: Config, batch_size: int):
    """The configured sample stream; real sources are checked against the model's shapes."""
    from data import PretrainingLoader, build_demo_data

    d, cfg = config.data, config.model
    if d.source == "synthetic":
        return SyntheticData(config, batch_size, config.training.seed)
    if d.source == "demo":
        demo = build_demo_data(d.directory, seq_len=cfg.sequence_length, max_predictions=cfg.max_predictions)
        files = demo.train_files
    else:
        files = sorted({f for pattern in d.files for f in glob.glob(pattern)})
        if not files:
            raise ValueError(f"data.files {list(d.files)} match no file; create shards with data/create_pretraining_data.py")
    loader = PretrainingLoader(
        files, batch_size, seed=config.training.seed, shuffle_buffer=d.shuffle_buffer,
        prefetch=d.prefetch, dynamic_masking=d.dynamic_masking,
    )
    if loader.seq_len != cfg.sequence_length or loader.max_predictions != cfg.max_predictions:
        raise ValueError(
            f"shards hold sequences of {loader.seq_len} with {loader.max_predictions} masks, the model wants "
            f"model.sequence_length {cfg.sequence_length} and model.max_predictions {cfg.max_predictions}"
        )
    if loader.vocab_size is not None and loader.vocab_size > cfg.vocab_size:
        raise ValueError(f"the shards' vocab has {loader.vocab_size} tokens, more than model.vocab_size {cfg.vocab_size}")
    return loader


# ----------------------------------------------------------------- output
def resolve_output_dir(config: Config, checkpoint_input: Optional[str]) -> Path:
    """A fresh run never writes into a directory that holds another run: it takes a suffix."""
    if checkpoint_input:
        return Path(checkpoint_input).resolve().parent
    base = Path(config.training.output_dir.format(name=config.name))
    out, n = base, 0
    while out.exists() and any(out.iterdir()):
        n += 1
        out = base.with_name(f"{base.name}.{n}")
    return out


class MetricsLog:
    """metrics.jsonl (one JSON object per step) and, optionally, wandb."""

    def __init__(self, output_dir: Path, config: Config, resume_step: Optional[int], use_wandb: bool):
        self.path = output_dir / METRICS_FILE
        if resume_step is not None and self.path.exists():
            # Keep the history up to the checkpoint; the old file stays beside it.
            kept = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= resume_step]
            self.path.rename(output_dir / f"metrics.before-resume-{resume_step}.jsonl")
            self.path.write_text("".join(line + "\n" for line in kept))
        self._file = open(self.path, "a")
        self._wandb = None
        if use_wandb:
            import wandb

            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self._wandb = wandb.init(
                project="groupbert", name=config.name, dir=str(output_dir), mode=mode,
                config=config.model_dump(mode="json"), resume="allow",
                settings=wandb.Settings(init_timeout=30, silent=True),
            )

    def log(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


# ------------------------------------------------------------------- run
def make_session(config: Config) -> TrainingSession:
    t = config.training
    if config.model.task is not Task.PRETRAINING:
        raise ValueError("bert.py trains model.task 'pretraining'; SQuAD fine-tuning has its own entry point")
    schedule = Schedule(
        base_lr=t.learning_rate, warmup_steps=t.warmup_steps, total_steps=t.steps, warmup=t.warmup,
        decay=t.decay, power=t.decay_power, end_lr=t.end_learning_rate,
    )
    spec = OptimizerSpec(
        kind=t.optimizer.value, schedule=schedule, betas=(t.beta1, t.beta2), eps=t.epsilon,
        weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm, max_trust_ratio=t.max_trust_ratio,
    )
    options = SessionOptions(
        device=t.device, precision=t.precision, loss_scaling=t.loss_scaling,
        gradient_accumulation=t.gradient_accumulation, recompute=t.recompute, compile=t.compile,
    )
    model = build_model(config.model, seed=t.seed)
    return TrainingSession(model.builder.model_proto(), optimizer=spec, options=options, seed=t.seed)


def train(config: Config, checkpoint_input: Optional[str] = None, use_wandb: bool = False, progress: bool = True) -> TrainResult:
    t = config.training
    # Everything that can reject the config runs before anything is written.
    session = make_session(config)
    data = make_data(config, t.global_batch_size)
    output_dir = resolve_output_dir(config, checkpoint_input)
    output_dir.mkdir(parents=True, exist_ok=True)
    print(f"output_dir: {output_dir}", flush=True)
    resume_step = None
    if checkpoint_input:
        saved = json.loads((output_dir / CONFIG_FILE).read_text()) if (output_dir / CONFIG_FILE).exists() else None
        if saved is not None and saved["model"] != config.model.model_dump(mode="json"):
            raise ValueError(f"{checkpoint_input} was written by a run with another model config; "
                             "resume with the same config, or use training.init_from to start from its weights")
        extra = session.load(checkpoint_input)
        data.load_state_dict(extra["data"])
        resume_step = session.step
    elif t.init_from:
        session.load_weights(t.init_from)
    (output_dir / CONFIG_FILE).write_text(json.dumps(config.model_dump(mode="json"), indent=2) + "\n")

    log = MetricsLog(output_dir, config, resume_step, use_wandb)
    result = TrainResult(output_dir)
    tokens_per_step = t.global_batch_size * config.model.sequence_length
    bar = tqdm(total=t.steps, initial=session.step, desc=config.name, disable=not progress, dynamic_ncols=True)
    stream = iter(data)
    try:
        while session.step < t.steps:
            batch = next(stream)
            start = time.perf_counter()
            out = session.run(batch)
            seconds = time.perf_counter() - start
            record = {"step": session.step, **{k: round(v, 6) for k, v in out.items()},
                      "sequences_per_s": round(t.global_batch_size / seconds, 2),
                      "tokens_per_s": round(tokens_per_step / seconds, 1)}
            log.log(record)
            result.metrics.append(record)
            bar.update(session.step - bar.n)
            bar.set_postfix(loss=f"{out['loss']:.3f}", mlm_acc=f"{out.get('mlm_accuracy', float('nan')):.3f}",
                            nsp_acc=f"{out.get('nsp_accuracy', float('nan')):.3f}", lr=f"{out['learning_rate']:.2e}",
                            seq_s=f"{record['sequences_per_s']:.0f}", tok_s=f"{record['tokens_per_s']:.0f}")
            if t.checkpoint_every and session.step % t.checkpoint_every == 0 and session.step < t.steps:
                session.save(output_dir / f"checkpoint-{session.step}", {"data": data.state_dict()})
        result.checkpoint = session.save(output_dir / "checkpoint-final", {"data": data.state_dict()})
    finally:
        bar.close()
        log.close()
        if hasattr(data, "close"):
            data.close()
    _print_outcome(result, config)
    return result


def _print_outcome(result: TrainResult, config: Config) -> None:
    if not result.metrics:
        return
    window = max(1, min(10, len(result.metrics) // 5))
    first, last = result.metrics[:window], result.metrics[-window:]
    mean = lambda rows, k: float(np.mean([r[k] for r in rows])) if k in rows[0] else float("nan")
    print(
        f"steps {first[0]['step']}-{last[-1]['step']}: loss {mean(first, 'loss'):.3f} → {mean(last, 'loss'):.3f}, "
        f"MLM accuracy {mean(first, 'mlm_accuracy'):.3f} → {mean(last, 'mlm_accuracy'):.3f} "
        f"(chance {1 / config.model.vocab_size:.4f}), {mean(last, 'tokens_per_s'):.0f} tokens/s"
    )
    print(f"checkpoint: {result.checkpoint}")
