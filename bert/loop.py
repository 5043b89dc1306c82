"""The run loop: pre-training, SQuAD fine-tuning and every sweep trial step through it.

    result = run(job, checkpoint_input=None, use_wandb=False, progress=True, on_log=None)

A job says what is its own (bert/train.py: pre-training; bert/finetune.py: SQuAD): its
graph and starting weights, its training stream, its evaluation, the files of its run.
The loop owns the rest, once for all of them:

- processes: a launch context (session.distributed) around the session; with torchrun
  each replica reads its own share of the data; rank 0 alone writes files;
- the run directory (bert/rundir.py): claimed by rank 0 for the run's life (a second
  writer is refused, naming the holder), fresh, continued in place or branched from
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
  the checkpoint's metadata and the run's last line; an evaluation better than every
  earlier one is the run's best: `best.json` names the checkpoint holding its weights
  (the step's own checkpoint, else `checkpoint-best`, written then and replaced by the
  next best; with `training.save_best` off, best.json says it was not saved);
- progress: metrics.jsonl holds one record per `log_every` steps (the means over the
  steps since the last record) and one per evaluation; the console shows the same
  records: a bar on a terminal, one plain line per record otherwise
  (`steps 11-20 of 300: loss 7.558, ... (means); lr ..., tokens/s, ETA`); the start says
  how much data the run will see. `on_log` sees each record as it is written.
"""
from __future__ import annotations

import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol

import numpy as np

from bert.config import Config
from bert.errors import RunInterrupted, TrainingDiverged
from bert.rundir import (BEST_CHECKPOINT, BEST_FILE, MetricsLog, RunPlan, improves, plan_run, prepare_run_dir,
                         read_best, record_best)
from session import distributed
from session.training import TrainingSession

__all__ = ["DataSizes", "Job", "RunResult", "Stream", "round_figure", "run"]


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
        """The figures of a metrics record the console shows (means over the record's steps)."""

    def data_sizes(self) -> "DataSizes":
        """How much data the run reads (after `stream`)."""


@dataclass(frozen=True)
class DataSizes:
    """What a job's data holds, said when the run starts."""

    samples: Optional[int]  # training samples in one epoch; None: an endless stream (random tokens)
    what: str  # where they come from: "4 shards", "random tokens", ...
    eval_rows: int = 0  # rows of the held-out set (0: no evaluation)
    eval_what: str = ""
    packed: int = 0  # sequences per packed row at most (0: not packed): epochs then depend on the packing


@dataclass
class RunResult:
    output_dir: Path
    metrics: list[dict] = field(default_factory=list)
    checkpoint: Optional[Path] = None
    evaluation: dict[str, float] = field(default_factory=dict)
    best: Optional[dict] = None


# ------------------------------------------------------------------ progress
class Progress:
    """The console's view of the metrics records: a bar on a terminal (its postfix the last
    record's means), one plain line per record otherwise, each with an ETA from the steps
    this process has run (from the end of its first step, so start-up is not counted)."""

    def __init__(self, enabled: bool, total: int, start: int, title: str):
        from tqdm import tqdm

        self.enabled, self.total = enabled, total
        self.terminal = enabled and sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=start, desc=title, dynamic_ncols=True) if self.terminal else None
        self._since: Optional[tuple[float, int]] = None  # (time, step) at the end of this process's first step
        self._now: tuple[float, int] = (time.monotonic(), start)

    def step(self, step: int) -> None:
        self._now = (time.monotonic(), step)
        if self._since is None:
            self._since = self._now
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def eta(self) -> Optional[float]:
        """Seconds to the last step at the pace so far (None before two steps)."""
        if self._since is None or self._now[1] <= self._since[1]:
            return None
        (t0, s0), (t1, s1) = self._since, self._now
        return (t1 - t0) / (s1 - s0) * (self.total - s1)

    def record(self, first: int, step: int, means: dict[str, str], extra: list[str],
               seconds_left: Optional[float] = None) -> None:
        """A metrics record's line: `means` are the means over steps `first`..`step`; the ETA
        is `seconds_left` when the run has a time budget, else the pace of the steps so far."""
        steps = _span(first, step)
        figures = ", ".join(f"{k} {v}" for k, v in means.items()) + " (means)" if means else ""
        if self.bar is not None:
            self.bar.set_postfix_str(f"{steps}: {figures}" + "".join(f", {x}" for x in extra))
        elif self.enabled:
            eta = (self.eta() if seconds_left is None else max(0.0, seconds_left)) if step < self.total else None
            tail = extra + ([f"ETA {_duration(eta)}"] if eta is not None else [])
            print(f"{steps} of {self.total}: {figures}" + ("; " + ", ".join(tail) if tail else ""), flush=True)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        elif self.enabled:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _span(first: int, last: int) -> str:
    return f"steps {first}-{last}" if first < last else f"step {last}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class _Window:
    """The steps since the last metrics record: their means, and their time and tokens."""

    _LAST = {"learning_rate", "loss_scale"}  # the value at the record's step, not a mean

    def __init__(self):
        self.first: Optional[int] = None  # the step of the window's first step
        self.values: dict[str, list[float]] = {}
        self.last: dict[str, float] = {}
        self.seconds = self.sequences = self.tokens = self.skipped = 0.0

    def add(self, step: int, out: dict[str, float], seconds: float, sequences: int, tokens: int) -> None:
        self.first = step if self.first is None else self.first
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
    plan = _agree_on_plan(session, job.config, checkpoint_input)
    try:
        return _steps(job, session, stream, plan, use_wandb, progress, on_log)
    finally:
        if plan.claim is not None:  # rank 0's claim on the run directory ends with the run
            plan.claim.release()


def _agree_on_plan(session: TrainingSession, config: Config, checkpoint_input: Optional[str]) -> RunPlan:
    """Rank 0's plan (claiming the run directory), on every process; a plan rank 0 refuses
    is the same one-line error on every process."""
    plan, problem = None, None
    if session.topology.rank == 0:
        try:
            plan = plan_run(config, checkpoint_input)
        except ValueError as e:
            problem = e
    try:
        shared, message = session.broadcast((plan.shared() if plan is not None else None,
                                             str(problem) if problem is not None else None))
    except BaseException:
        if plan is not None and plan.claim is not None:
            plan.claim.release()
        raise
    if problem is not None:
        raise problem
    if message is not None:
        raise ValueError(message)
    return plan if plan is not None else shared


def _steps(job: Job, session: TrainingSession, stream: Optional[Stream], plan: RunPlan, use_wandb: bool,
           progress: bool, on_log: Optional[Callable[[dict], None]]) -> RunResult:
    config = job.config
    t = config.training
    topo = session.topology
    lead = topo.rank == 0
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
        best = read_best(plan.output_dir) if lead and plan.branched_from is None else None
    global_batch, start = t.samples_per_replica * topo.replicas, session.step
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
        for line in _data_lines(job, config, session.step, global_batch):
            print(line, flush=True)
        print(f"global batch {global_batch} = micro batch {t.micro_batch_size} × gradient "
              f"accumulation {t.gradient_accumulation} × {topo.replicas} replica(s)"
              + (f"; {topo.virtual_graphs} pipeline processes per replica" if topo.virtual_graphs > 1 else ""),
              flush=True)

    log = MetricsLog(output_dir, config, use_wandb) if lead else None
    result = RunResult(output_dir, best=best)
    bar = Progress(progress and lead, t.steps, session.step, config.name)
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

    def save(name: str, figures: dict[str, float]) -> Path:
        """Write checkpoint `name` (collective); its path on every process."""
        extra = {"data": stream.state_dict() if stream is not None else {}, "evaluation": figures,
                 "train_seconds": train_seconds}
        try:
            session.save(output_dir / name, extra)  # raises on every process when any one fails
        except ValueError as e:
            earlier = last_good if last_good is not None and last_good.name != name else None
            raise ValueError(f"{e}; " + (f"the run can resume from {earlier} (--checkpoint-input {earlier})"
                                         if earlier else "this run has no earlier checkpoint to resume from")) from None
        return output_dir / name

    def keep_best(figures: dict[str, float], saved: Optional[Path]) -> None:
        """After an evaluation: if it beats every earlier one, best.json names the checkpoint
        holding its weights (`saved`, the step's own checkpoint, else checkpoint-best)."""
        if not figures or job.best_metric is None:
            return
        if not session.broadcast(improves(result.best, figures, job.best_metric) if lead else None):
            return
        note = ""
        if saved is None and t.save_best and session.weights_are_finite():
            saved = save(BEST_CHECKPOINT, figures)
        elif saved is None:
            note = (f"not saved: step {session.step} wrote no checkpoint and training.save_best is "
                    + ("off" if not t.save_best else "on but its weights are not finite"))
        if lead:
            previous = result.best
            result.best = record_best(output_dir, saved.name if saved is not None else None, session.step, figures,
                                      job.best_metric, note)
            if previous is not None and previous["checkpoint"] == BEST_CHECKPOINT and (
                    saved is None or saved.name != BEST_CHECKPOINT):
                _remove_superseded(output_dir / BEST_CHECKPOINT)

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
                window.add(session.step, {k: float(v) for k, v in out.items()}, seconds, global_batch,
                           tokens * topo.replicas)
                bar.step(session.step)
                skipped = bool(out["skipped"])
                bad_steps = bad_steps + 1 if skipped else 0
                diverged = skipped and (dynamic_fp16 and out["loss_scale"] / 2 < t.min_loss_scale
                                        or not dynamic_fp16 and bad_steps >= t.divergence_patience)
                if session.step % t.log_every == 0 or last or diverged or session.stop_agreed:
                    record = {**window.record(session.step), **spent()}
                    emit(record)
                    bar.record(window.first, session.step, job.postfix(record), _rates(record),
                               clock.seconds - clock.used if clock is not None else None)
                    window = _Window()
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
                    keep_best(figures, where)
                    raise RunInterrupted(
                        f"stopped by {name} at step {session.step}; " +
                        (f"checkpoint: {where}; resume with --checkpoint-input {where}" if where else
                         "its last step was not clean (the loss or gradients were not finite), so no checkpoint "
                         "was written" + (f"; resume with --checkpoint-input {last_good}" if last_good else
                                          "; the run has no checkpoint yet")),
                        signals.signum or signal.SIGTERM)
                saved = None
                if saving:
                    saved = save(f"checkpoint-{session.step}" if not last else "checkpoint-final", figures)
                    if not last:
                        last_good = saved
                    else:
                        result.checkpoint = saved
                keep_best(figures, saved)
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
        _print_outcome(result, config, start)
    return result


def _rates(record: dict) -> list[str]:
    """The figures of a record besides the job's means: the learning rate at its step, the
    pace over its steps, steps skipped."""
    out = []
    if record.get("learning_rate") is not None:
        out.append(f"lr {record['learning_rate']:.2e}")
    if record.get("tokens_per_s"):
        out.append(f"{record['tokens_per_s']:.0f} tokens/s")
    if record.get("skipped"):
        out.append(f"{record['skipped']} skipped (not finite)")
    return out


def _data_lines(job: Job, config: Config, step: int, global_batch: int) -> list[str]:
    """What the run will read: training samples and epochs, the held-out set."""
    sizes = job.data_sizes() if hasattr(job, "data_sizes") else None
    if sizes is None:
        return []
    t = config.training
    steps = t.steps - step
    span = f"steps {step + 1}-{t.steps}" if step else f"{t.steps} steps"
    if sizes.samples is None:
        lines = [f"training data: {sizes.what}; {span} × global batch {global_batch} = {steps * global_batch} "
                 "samples"]
    elif sizes.packed:
        lines = [f"training data: {sizes.samples} samples ({sizes.what}), packed up to {sizes.packed} per row; "
                 f"{span} × global batch {global_batch} rows (the epochs depend on the packing)"]
    else:
        seen = steps * global_batch
        lines = [f"training data: {sizes.samples} samples ({sizes.what}); {span} × global batch {global_batch} = "
                 f"{seen} samples, {seen / max(sizes.samples, 1):.2f} epochs"]
    if sizes.eval_rows:
        when = (f"every {t.eval_every} steps and at each checkpoint" if t.eval_every else "at each checkpoint")
        lines.append(f"evaluation: {sizes.eval_rows} rows ({sizes.eval_what}), {when}")
    return lines


def _remove_superseded(directory: Path) -> None:
    """Remove a checkpoint best.json no longer names (renamed to a name `recover` tidies first)."""
    aside = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    try:
        directory.rename(aside)
        shutil.rmtree(aside)
    except OSError as e:
        print(f"note: could not remove {directory}, which best.json no longer names ({e.strerror})", flush=True)


def _print_outcome(result: RunResult, config: Config, start: int) -> None:
    rows = [r for r in result.metrics if "loss" in r]
    if rows:
        window = max(1, min(10, len(rows) // 5))
        first, last = rows[:window], rows[-window:]

        def mean(part: list[dict], key: str) -> float:
            values = [r[key] for r in part if r.get(key) is not None]
            return float(np.mean(values)) if values else float("nan")

        # A record holds the means of the steps after the record before it (or the run's start).
        begins = {id(row): step + 1 for row, step in zip(rows, [start] + [r["step"] for r in rows[:-1]])}
        spans = [_span(begins[id(part[0])], part[-1]["step"]) for part in (first, last)]
        line = f"{spans[0]} → {spans[1]}: loss {mean(first, 'loss'):.3f} → {mean(last, 'loss'):.3f}"
        if "mlm_accuracy" in rows[0]:
            line += (f", MLM accuracy {mean(first, 'mlm_accuracy'):.3f} → {mean(last, 'mlm_accuracy'):.3f} "
                     f"(chance {1 / config.model.vocab_size:.4f})")
        if rows[-1].get("tokens_per_s"):
            line += f", {mean(last, 'tokens_per_s'):.0f} tokens/s"
        print(line)
    if result.best is not None:
        best = result.best
        at = f"{best['metric']} {best['value']:.4g} at step {best['step']}"
        print(f"best: {best['checkpoint']} ({at}; {BEST_FILE})" if best["checkpoint"] else
              f"best: {at}, {best.get('note', 'not saved')} ({BEST_FILE})")
    figures = ", ".join(f"{k} {v:.4g}" for k, v in result.evaluation.items() if isinstance(v, (int, float)))
    print(f"checkpoint: {result.checkpoint}" + (f" ({figures})" if figures else ""))  # the last line
