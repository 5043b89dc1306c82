"""The run loop: pre-training, SQuAD fine-tuning and every sweep trial step through it.

    result = run(job, checkpoint_input=None, use_wandb=False, progress=True, on_log=None)

A job says what is its own (bert/train.py: pre-training; bert/finetune.py: SQuAD): its
graph and starting weights, its training stream, its evaluation, the files of its run.
The loop owns the rest, once for all of them:

- processes: a launch context (session.distributed) around the session; with torchrun
  each replica reads its own share of the data; rank 0 alone writes files;
- the run directory (bert/rundir.py): fresh, continued in place or branched from
  `checkpoint_input`; `"auto"` (the default under torchrun when the run directory holds
  a checkpoint) continues from the run's newest checkpoint, so `torchrun --max-restarts N`
  resumes a job after a worker died, with any number of processes (docs/distributed.md);
- steps: `TrainingSession.run` on the job's batches; a step whose loss or gradient is not
  finite is skipped, `training.divergence_patience` of them in a row stop the run
  (`TrainingDiverged`, exit 3) with no checkpoint written; weights are checked finite
  before every checkpoint; SIGINT/SIGTERM stop every process after the current step
  with a checkpoint (`RunInterrupted`, exit 128 + signal);
- evaluation: every `training.eval_every` steps and at every checkpoint, the job's
  held-out figures (`eval_*`, or SQuAD's dev exact match and F1) go to metrics.jsonl, W&B,
  the checkpoint's metadata and the run's last line; `best.json` names the checkpoint
  with the best figure;
- progress: a bar on a terminal, one plain line every `training.log_every` steps
  otherwise; metrics.jsonl holds one record per `log_every` steps (the means since the
  last record) and one per evaluation; `on_log` sees each record as it is written.
"""
from __future__ import annotations

import math
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol

import numpy as np

from bert.config import Config
from bert.errors import RunInterrupted, TrainingDiverged
from bert.rundir import BEST_FILE, MetricsLog, plan_run, prepare_run_dir, read_best, update_best
from session import distributed
from session.training import TrainingSession

__all__ = ["Job", "RunResult", "Stream", "round_figure", "run"]

class Stream(Protocol):
    """A job's training batches for one replica: endless, resumable exactly."""

    def __iter__(self) -> Iterator[dict]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class Job(Protocol):
    """What a kind of run adds to the loop (bert/train.py, bert/finetune.py)."""

    config: Config
    # The evaluation figure best.json follows, and whether lower is better; None without evaluation.
    best_metric: Optional[tuple[str, bool]]

    def session(self) -> TrainingSession:
        """The training session with the run's starting weights (called inside the launch
        context; a checkpoint the run resumes from is loaded over them)."""

    def stream(self, replica: int, replicas: int) -> Stream:
        """This replica's training batches."""

    def restore_stream(self, stream: Stream, extra: dict, lead: bool) -> None:
        """Put the stream where a checkpoint's extra state says (another topology included)."""

    def evaluate(self, session: TrainingSession) -> dict[str, float]:
        """Held-out figures (collective: every process calls it); {} without evaluation data."""

    def start(self, output_dir: Path) -> None:
        """Write the job's own files into the run directory (rank 0)."""

    def finish(self, session: TrainingSession, output_dir: Optional[Path]) -> dict[str, Any]:
        """After the last step (collective; files on rank 0, `output_dir` None elsewhere)."""

    def tokens(self, batch: dict) -> int:
        """Real (not padding) tokens in this replica's batch."""

    def postfix(self, record: dict) -> dict[str, str]:
        """The progress bar's figures."""


@dataclass
class RunResult:
    output_dir: Path
    metrics: list[dict] = field(default_factory=list)
    checkpoint: Optional[Path] = None
    evaluation: dict[str, float] = field(default_factory=dict)
    best: Optional[dict] = None


# ------------------------------------------------------------------ progress
class Progress:
    """A bar on a terminal; one plain line every `log_every` steps when the output is not one."""

    def __init__(self, enabled: bool, total: int, start: int, title: str, log_every: int):
        from tqdm import tqdm

        self.enabled, self.total, self.log_every = enabled, total, log_every
        self.terminal = enabled and sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=start, desc=title, dynamic_ncols=True) if self.terminal else None

    def update(self, step: int, figures: dict[str, str]) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(figures)
        elif self.enabled and (step % self.log_every == 0 or step == self.total):
            print(f"step {step}/{self.total}: " + ", ".join(f"{k} {v}" for k, v in figures.items()), flush=True)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        elif self.enabled:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Window:
    """The steps since the last metrics record: their means, and their time and tokens."""

    _LAST = {"learning_rate", "loss_scale"}  # the value at the record's step, not a mean

    def __init__(self):
        self.values: dict[str, list[float]] = {}
        self.last: dict[str, float] = {}
        self.seconds = self.sequences = self.tokens = self.skipped = 0.0

    def add(self, out: dict[str, float], seconds: float, sequences: int, tokens: int) -> None:
        self.seconds += seconds
        self.sequences += sequences
        self.tokens += tokens
        self.skipped += out["skipped"]
        for key, value in out.items():
            if key in self._LAST:
                self.last[key] = value
            elif key != "skipped":
                self.values.setdefault(key, []).append(value)

    def record(self, step: int) -> dict:
        """Means over the finite values (a step skipped for a non-finite loss adds none);
        NaN (null in metrics.jsonl) where every step of the window was non-finite."""
        out = {"step": step}
        for key, values in self.values.items():
            finite = [v for v in values if math.isfinite(v)]
            out[key] = round_figure(float(np.mean(finite))) if finite else float("nan")
        out.update({k: round(v, 9) for k, v in self.last.items()})
        out["skipped"] = int(self.skipped)
        out["sequences_per_s"] = round(self.sequences / self.seconds, 2) if self.seconds else None
        out["tokens_per_s"] = round(self.tokens / self.seconds, 1) if self.seconds else None
        return out




def round_figure(value: float) -> float:
    """Nine significant digits (a small accuracy keeps its precision, as decimals would not)."""
    return float(f"{value:.9g}") if isinstance(value, float) and math.isfinite(value) else value


# ------------------------------------------------------------------- run
def run(job: Job, checkpoint_input: Optional[str] = None, use_wandb: bool = False, progress: bool = True,
        on_log: Optional[Callable[[dict], None]] = None) -> RunResult:
    """Train `job` to `training.steps` (see the module docstring); `on_log` sees each metrics
    record right after it is logged, and an exception it raises ends the run."""
    config = job.config
    t = config.training
    from bert.data import data_share

    replica, replicas = data_share(config)
    stream = job.stream(replica, replicas)  # the data is checked before any model is built
    try:
        with distributed.launch(t.device, t.fault_timeout), job.session() as session:
            return _run(job, session, stream if session.needs_data else None, checkpoint_input, use_wandb,
                        progress, on_log)
    finally:
        if hasattr(stream, "close"):
            stream.close()


def _run(job: Job, session: TrainingSession, stream: Optional[Stream], checkpoint_input: Optional[str],
         use_wandb: bool, progress: bool, on_log: Optional[Callable[[dict], None]]) -> RunResult:
    config = job.config
    t = config.training
    topo = session.topology
    lead = topo.rank == 0
    plan = session.broadcast(plan_run(config, checkpoint_input) if lead else None)
    output_dir = plan.output_dir
    # What the run has spent (metrics.jsonl's train_seconds and train_flops); with a seconds
    # budget its clock sets the learning rate and ends the run (bert/budget.py).
    flops_per_step, clock = getattr(job, "flops_per_step", None), getattr(job, "time_budget", None)
    train_seconds = 0.0
    # The state to start from is read (and checked) before anything is written.
    best = None
    if plan.checkpoint is not None:
        extra = session.load(plan.checkpoint)
        train_seconds = float(extra.get("train_seconds", 0.0))
        if stream is not None:
            job.restore_stream(stream, extra, lead)
        best = read_best(plan.output_dir) if plan.branched_from is None else None
    if lead:
        prepare_run_dir(plan, config)
        job.start(output_dir)
        print(f"output_dir: {output_dir}", flush=True)
        if plan.note:
            print(plan.note, flush=True)
        if plan.branched_from is not None:
            print(f"branching from {plan.branched_from} (step {plan.resume_step}): {'; '.join(plan.changes)}; "
                  "the earlier run is left as it was", flush=True)
        print(session.policy.describe(), flush=True)
        for line in session.resume_notes:
            print(f"note: {line}", flush=True)
        print(f"global batch {t.samples_per_replica * topo.replicas} = micro batch {t.micro_batch_size} × gradient "
              f"accumulation {t.gradient_accumulation} × {topo.replicas} replica(s)"
              + (f"; {topo.virtual_graphs} pipeline processes per replica" if topo.virtual_graphs > 1 else ""),
              flush=True)

    log = MetricsLog(output_dir, config, use_wandb) if lead else None
    result = RunResult(output_dir, best=best)
    bar = Progress(progress and lead, t.steps, session.step, config.name, t.log_every)
    batches = iter(stream) if stream is not None else None
    window, bad_steps = _Window(), 0
    last_good: Optional[Path] = plan.checkpoint
    dynamic_fp16 = t.precision == "fp16" and t.loss_scaling == "dynamic"

    def spent() -> dict:  # a job with a budget (bert/budget.py) says what it has spent in every record
        if not flops_per_step:
            return {}
        return {"train_seconds": round(train_seconds, 3), "train_flops": session.step * flops_per_step}

    def emit(record: dict) -> None:
        if log is not None:
            log.log(record)
        result.metrics.append(record)
        if on_log is not None:
            on_log(record)

    def evaluate() -> dict[str, float]:
        figures = job.evaluate(session)
        if figures:
            result.evaluation = figures
            emit({"step": session.step, **{k: round_figure(v) for k, v in figures.items()}, **spent()})
            bar.write(f"step {session.step}: " + ", ".join(f"{k} {v:.4g}" for k, v in figures.items()))
        return figures

    def save(name: str, figures: dict[str, float]) -> Optional[Path]:
        extra = {"data": stream.state_dict() if stream is not None else {}, "evaluation": figures,
                 "train_seconds": train_seconds}
        path = session.save(output_dir / name, extra)
        if path is not None and figures and job.best_metric is not None:
            result.best = update_best(output_dir, result.best, path, session.step, figures, job.best_metric)
        return path

    try:
        # SIGINT/SIGTERM belong to the launch context: inside this block the first one asks every
        # process to stop after the current step (docs/distributed.md, "Signals").
        with distributed.current().stop_on_signal(session.request_stop, announce=lead) as signals:
            if clock is not None:
                clock.used = train_seconds
            while session.step < t.steps and not (clock is not None and clock.spent):
                fetched = time.perf_counter()
                batch = next(batches) if batches is not None else None
                began = time.perf_counter()
                out = session.run(batch)
                seconds = time.perf_counter() - began
                train_seconds += time.perf_counter() - fetched
                if clock is not None:  # one clock for every process, so they agree on the rate and the end
                    train_seconds = clock.used = session.broadcast(train_seconds)
                last = session.step >= t.steps or (clock is not None and clock.spent)
                tokens = job.tokens(batch) if batch is not None else 0
                window.add({k: float(v) for k, v in out.items()}, seconds, t.samples_per_replica * topo.replicas,
                           tokens * topo.replicas)
                skipped = bool(out["skipped"])
                bad_steps = bad_steps + 1 if skipped else 0
                diverged = skipped and (dynamic_fp16 and out["loss_scale"] / 2 < t.min_loss_scale
                                        or not dynamic_fp16 and bad_steps >= t.divergence_patience)
                if session.step % t.log_every == 0 or last or diverged or session.stop_agreed:
                    emit({**window.record(session.step), **spent()})
                    window = _Window()
                bar.update(session.step, job.postfix(out))
                if diverged:
                    why = (f"the fp16 loss scale fell below training.min_loss_scale {t.min_loss_scale:g}"
                           if dynamic_fp16 else f"{bad_steps} steps in a row (training.divergence_patience)")
                    raise TrainingDiverged(
                        f"training diverged at step {session.step}: the loss or gradients were not finite "
                        f"(loss {out['loss']:.4g}, gradient norm {out['grad_norm']:.4g}); {why}. Those steps "
                        "were skipped and no checkpoint was written" +
                        (f"; the last checkpoint {last_good} is untouched" if last_good else "") +
                        ". Lower training.learning_rate or raise the warm-up")
                saving = not skipped and (session.stop_agreed or last or
                                          bool(t.checkpoint_every and session.step % t.checkpoint_every == 0))
                if saving and not session.weights_are_finite():
                    raise TrainingDiverged(
                        f"training diverged at step {session.step}: its update made weights infinite or NaN, so no "
                        "checkpoint was written" + (f"; the last checkpoint {last_good} is untouched" if last_good
                                                    else "") + ". Lower training.learning_rate or raise the warm-up")
                evaluating = not skipped and (saving or bool(t.eval_every and session.step % t.eval_every == 0))
                figures = evaluate() if evaluating else {}
                if session.stop_agreed:
                    name = signal.Signals(signals.signum).name if signals.signum else "a signal in another process"
                    where = save(f"checkpoint-{session.step}", figures) if not skipped else None
                    raise RunInterrupted(
                        f"stopped by {name} at step {session.step}; " +
                        (f"checkpoint: {where}; resume with --checkpoint-input {where}" if where else
                         "the last step was not clean, so no checkpoint was written"),
                        signals.signum or signal.SIGTERM)
                if saving and not last:
                    last_good = save(f"checkpoint-{session.step}", figures) or last_good
                elif saving:
                    result.checkpoint = save("checkpoint-final", figures)
            bar.close()
            finished = job.finish(session, output_dir if lead else None)
            if finished:
                result.evaluation = {**result.evaluation, **finished}
                emit({"step": session.step, **finished})
    finally:
        bar.close()
        if log is not None:
            log.close()
    if lead:
        _print_outcome(result, config)
    return result


def _print_outcome(result: RunResult, config: Config) -> None:
    rows = [r for r in result.metrics if "loss" in r]
    if rows:
        window = max(1, min(10, len(rows) // 5))
        first, last = rows[:window], rows[-window:]

        def mean(part: list[dict], key: str) -> float:
            values = [r[key] for r in part if r.get(key) is not None]
            return float(np.mean(values)) if values else float("nan")

        every = config.training.log_every  # a record is the mean of the log_every steps up to its step
        spans = (f"steps {max(1, first[0]['step'] - every + 1)}-{first[-1]['step']}",
                 f"steps {max(1, last[0]['step'] - every + 1)}-{last[-1]['step']}")
        line = f"{spans[0]} → {spans[1]}: loss {mean(first, 'loss'):.3f} → {mean(last, 'loss'):.3f}"
        if "mlm_accuracy" in rows[0]:
            line += (f", MLM accuracy {mean(first, 'mlm_accuracy'):.3f} → {mean(last, 'mlm_accuracy'):.3f} "
                     f"(chance {1 / config.model.vocab_size:.4f})")
        if rows[-1].get("tokens_per_s"):
            line += f", {mean(last, 'tokens_per_s'):.0f} tokens/s"
        print(line)
    if result.best is not None:
        print(f"best: {result.best['checkpoint']} ({result.best['metric']} {result.best['value']:.4g}; {BEST_FILE})")
    figures = ", ".join(f"{k} {v:.4g}" for k, v in result.evaluation.items() if isinstance(v, (int, float)))
    print(f"checkpoint: {result.checkpoint}" + (f" ({figures})" if figures else ""))  # the last line
