"""The run loop: pre-training, SQuAD fine-tuning and every sweep trial step through it.

    result = run(job, checkpoint_input=None, use_wandb=False, progress=True, on_log=None)

A job says what is its own (bert/train.py: pre-training; bert/finetune.py: SQuAD): its
graph and starting weights, its training stream, its evaluation, the files of its run.
The loop owns the rest, once for all of them:

- processes: a launch context (session.distributed) around the session; with torchrun
  each replica reads its own share of the data; rank 0 alone writes files;
- the run directory: a fresh run never writes into another run's directory;
  `checkpoint_input` continues a run in place when the config is the run's own and the
  run has not gone past it, and branches into a new directory otherwise; `"auto"` (the
  default under torchrun when the run directory holds a checkpoint) continues from the
  run's newest checkpoint, so `torchrun --max-restarts N` resumes a job after a worker
  died, with any number of processes (docs/distributed.md);
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

import json
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
import torch.distributed as dist

from bert.config import Config
from bert.errors import RunInterrupted, TrainingDiverged
from session import checkpoint as checkpoints
from session import distributed
from session.training import STATE_FILE, TrainingSession

__all__ = ["BEST_FILE", "CONFIG_FILE", "METRICS_FILE", "Job", "RunPlan", "RunResult", "newest_checkpoint",
           "plan_run", "run"]

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
BRANCH_FILE = "branch.json"
BEST_FILE = "best.json"
# Settings that change how a run is executed, not what it computes: changing them on
# resume continues the run instead of branching it.
_EXECUTION_KEYS = {
    "training": {"log_every", "checkpoint_every", "eval_every", "compile", "recompute", "device",
                 "replication_factor", "replicated_tensor_sharding", "pipeline", "gradient_bucket_mb",
                 "fault_timeout", "kernels"},
    "data": {"prefetch"},
}


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


# --------------------------------------------------------------- run dirs
def fresh_output_dir(config: Config) -> Path:
    """The configured output_dir, or the first `<dir>.N` that holds no run yet."""
    base = configured_output_dir(config)
    out, n = base, 0
    while out.exists() and any(out.iterdir()):
        n += 1
        out = base.with_name(f"{base.name}.{n}")
    return out


def configured_output_dir(config: Config) -> Path:
    return Path(config.training.output_dir.format(name=config.name))


def _checkpoint_step(directory: Path) -> int:
    """The step of a checkpoint, read only after its session.json matched its checksum."""
    checkpoints.verify(directory, (STATE_FILE,), only=(STATE_FILE,))
    try:
        return int(json.loads((directory / STATE_FILE).read_text())["step"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"checkpoint {directory}: {STATE_FILE} holds no step") from None


def _verified_step(directory: Path, quiet: bool = False) -> Optional[int]:
    """The step of a checkpoint that verifies, None for one that does not (named on stdout)."""
    try:
        return _checkpoint_step(directory)
    except ValueError as e:
        if not quiet:
            print(f"note: ignoring {directory}: {e}", flush=True)
        return None


def newest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The run's checkpoint of the highest step whose files are all present and whose
    session.json verifies (each process verifies what it reads when it loads)."""
    if not run_dir.is_dir():
        return None
    found = {}
    for path in run_dir.glob("checkpoint-*"):
        if (path / checkpoints.CHECKSUMS_FILE).exists():
            step = _verified_step(path, quiet=True)
            if step is not None:
                found[path] = (step, path.name == "checkpoint-final")
    return max(found, key=found.get) if found else None


def _config_changes(saved: dict, config: Config) -> list[str]:
    """`section.key old → new` for each setting that changes what the run computes."""
    now = config.model_dump(mode="json")
    changes = []
    for section in sorted((set(saved) | set(now)) - {"name"}):  # a run's name is a label, not a setting
        old, new = saved.get(section), now.get(section)
        if not isinstance(old, dict) or not isinstance(new, dict):
            if old != new:
                changes.append(f"{section} {old!r} → {new!r}")
            continue
        for key in sorted(set(old) | set(new)):
            if key in _EXECUTION_KEYS.get(section, ()) or old.get(key) == new.get(key):
                continue
            changes.append(f"{section}.{key} {old.get(key)!r} → {new.get(key)!r}")
    return changes


@dataclass(frozen=True)
class RunPlan:
    output_dir: Path
    checkpoint: Optional[Path] = None  # the checkpoint the run starts from
    resume_step: Optional[int] = None  # its step
    branched_from: Optional[Path] = None  # the checkpoint a branch starts from
    changes: tuple[str, ...] = ()
    note: str = ""  # printed when the run starts (an automatic resume)


def plan_run(config: Config, checkpoint_input: Optional[str]) -> RunPlan:
    """Where this run writes: a fresh directory, the checkpoint's run, or a branch of it.

    `checkpoint_input` "auto" (also the default in a job torchrun launched, when the run
    directory exists) is the newest checkpoint of the configured run directory, or a
    fresh start when it holds none."""
    launched = checkpoint_input is None and "TORCHELASTIC_RUN_ID" in os.environ
    note = ""
    if checkpoint_input == "auto" or (launched and configured_output_dir(config).exists()):
        run_dir = configured_output_dir(config)
        newest = newest_checkpoint(run_dir)
        if newest is None:
            if checkpoint_input == "auto":
                return RunPlan(fresh_output_dir(config), note=f"no checkpoint in {run_dir}: starting afresh")
            return RunPlan(fresh_output_dir(config))
        if launched and _checkpoint_step(newest) >= config.training.steps:  # the job ran to its end before
            return RunPlan(fresh_output_dir(config), note=f"{run_dir} holds a finished run: starting a new one")
        checkpoint_input, note = str(newest), f"resuming from {newest}, the run's newest checkpoint"
    if not checkpoint_input:
        return RunPlan(fresh_output_dir(config))
    source = Path(checkpoint_input).resolve()
    if not (source / STATE_FILE).exists():
        raise ValueError(f"--checkpoint-input {checkpoint_input} is not a checkpoint directory "
                         f"(no {STATE_FILE}); pass a runs/<name>/checkpoint-<step> directory, or auto")
    step = _checkpoint_step(source)
    if config.training.steps <= step:
        raise ValueError(f"{source} is at step {step} and training.steps is {config.training.steps}: nothing "
                         f"to train; pass --training.steps above {step} to train on from it")
    run_dir = source.parent
    saved = run_dir / CONFIG_FILE
    changes = (_config_changes(_read_json(saved), config) if saved.exists()
               else [f"its run {run_dir} has no {CONFIG_FILE}"])
    steps = {p: _verified_step(p) for p in run_dir.glob("checkpoint-*")
             if p != source and (p / STATE_FILE).exists()}
    later = {p: n for p, n in steps.items() if n is not None and n > step}
    if later:
        changes.append(f"the run went on to {max(later, key=later.get).name}")
    if not changes:
        return RunPlan(run_dir, source, step, note=note)
    return RunPlan(fresh_output_dir(config), source, step, source, tuple(changes), note)


def prepare_run_dir(plan: RunPlan, config: Config) -> None:
    """Create the run directory and its records, keeping everything of earlier runs."""
    out = plan.output_dir
    for line in checkpoints.recover(out):
        print(line, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / METRICS_FILE
    if plan.branched_from is not None:
        (out / BRANCH_FILE).write_text(json.dumps({
            "from_checkpoint": str(plan.branched_from), "step": plan.resume_step,
            "changes": list(plan.changes)}, indent=2) + "\n")
        source = plan.branched_from.parent / METRICS_FILE
        if source.exists():  # the branch's history up to where it starts, copied
            metrics.write_text(_history_up_to(source, plan.resume_step))
    elif plan.resume_step is not None and metrics.exists():
        # Keep the history up to the checkpoint; the whole old file stays beside it.
        history = _history_up_to(metrics, plan.resume_step)
        shutil.copyfile(metrics, out / f"metrics.before-resume-{plan.resume_step}.jsonl")
        metrics.write_text(history)
    (out / CONFIG_FILE).write_text(json.dumps(config.model_dump(mode="json"), indent=2) + "\n")


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is unreadable or not JSON ({e}); repair or remove it") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object; repair or remove it")
    return value


def _history_up_to(metrics: Path, step: int) -> str:
    """The lines of a metrics.jsonl up to and including `step`."""
    return "".join(line + "\n" for line in metrics.read_text().splitlines() if json.loads(line)["step"] <= step)


def _json_safe(value: Any) -> Any:
    """NaN and infinities as null: metrics.jsonl stays strict JSON."""
    return value if not isinstance(value, float) or math.isfinite(value) else None


class MetricsLog:
    """metrics.jsonl (one JSON object per record) and, optionally, wandb."""

    def __init__(self, output_dir: Path, config: Config, use_wandb: bool):
        self.path = output_dir / METRICS_FILE
        self._file = open(self.path, "a")
        self._wandb = None
        if use_wandb:
            from bert.wandb_run import start_wandb

            self._wandb = start_wandb(output_dir, config)

    def log(self, record: dict) -> None:
        self._file.write(json.dumps({k: _json_safe(v) for k, v in record.items()}) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


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


def _broadcast(session: TrainingSession, value: Any) -> Any:
    """Rank 0's value on every process."""
    if not session.topology.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
    plan = _broadcast(session, plan_run(config, checkpoint_input) if lead else None)
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
        best = _read_best(plan.output_dir) if plan.branched_from is None else None
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
        if session.kernel_changes:
            print(f"note: this host runs other kernels than the run it resumes ({'; '.join(session.kernel_changes)}): "
                  "it continues, but not bit for bit", flush=True)
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
            result.best = _update_best(output_dir, result.best, path, session.step, figures, job.best_metric)
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
                    train_seconds = clock.used = _broadcast(session, train_seconds)
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


def _read_best(run_dir: Path) -> Optional[dict]:
    path = run_dir / BEST_FILE
    return _read_json(path) if path.exists() else None


def _update_best(run_dir: Path, best: Optional[dict], checkpoint: Path, step: int, figures: dict[str, float],
                 metric: tuple[str, bool]) -> Optional[dict]:
    """best.json names the checkpoint with the best evaluation figure so far (rank 0)."""
    name, lower = metric
    value = figures.get(name)
    if value is None or not math.isfinite(value):
        return best
    if best is not None and (value >= best["value"] if lower else value <= best["value"]):
        return best
    best = {"checkpoint": checkpoint.name, "step": step, "metric": name, "value": value,
            "goal": "minimize" if lower else "maximize"}
    tmp = run_dir / f".{BEST_FILE}.tmp"
    tmp.write_text(json.dumps(best, indent=2) + "\n")
    tmp.replace(run_dir / BEST_FILE)
    return best


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
