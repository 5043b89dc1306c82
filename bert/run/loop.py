"""The run loop: pre-training, SQuAD fine-tuning and every sweep trial step through it.

    result = run(job, checkpoint_input=None, use_wandb=False, progress=True, on_log=None)

A job says what is its own (bert/tasks/pretraining.py: pre-training; bert/tasks/squad.py: SQuAD): its
graph and starting weights, its training stream, its evaluation, the files of its run.
The loop owns the rest, once for all of them:

- processes: a launch context (session.distributed) around the session; with torchrun
  each replica reads its own share of the data; rank 0 alone writes files;
- the run directory (bert/run/rundir.py, `RunDirectory`, asked for its whole life: the plan,
  the records, the best evaluation, the claim's end): claimed by rank 0 for the run's life (a second
  writer is refused, naming the holder), fresh, continued in place or branched from
  `checkpoint_input`; `"auto"` (the default under torchrun when the run directory holds
  a checkpoint) continues from the run's newest checkpoint, so `torchrun --max-restarts N`
  resumes a job after a worker died, with any number of processes (docs/distributed.md);
- the steps, each concern of the loop owning when it acts (as torchtitan's `Trainer.train`):
  the clock (bert/run/progress.py: steps and training seconds spent, the end of the run and a
  time budget's learning rate), the log (bert/run/progress.py: metrics.jsonl, W&B, the
  console), the evaluator (held-out figures every `evaluation.every` steps and at every
  checkpoint, each beside the job's baseline when it has one: pre-training's unigram
  plateau, bert/tasks/unigram.py, with one warning for a run that stays on it), the
  checkpointer (bert/run/checkpointing.py: checkpoints, best.json, the last
  good checkpoint), divergence (a step whose loss or gradient is not finite is skipped;
  `training.divergence_patience` of them in a row, or weights not finite before a
  checkpoint, end the run, `TrainingDiverged`, exit 3, with no checkpoint written) and
  stopping (SIGINT/SIGTERM stop every process after the current step with a checkpoint,
  `RunInterrupted`, exit 128 + signal); the start says how much data the run will see.
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol

import numpy as np
import torch

from bert.run.budget import Budget, flops_per_row
from bert.run.checkpointing import Checkpointer
from bert.config import Config
from bert.run.elastic import batch_record
from bert.errors import RunInterrupted, TrainingDiverged
from bert.run.progress import Clock, Logger, round_figure, span
from bert.run.rundir import BEST_FILE, RunDirectory
from bert.tasks.unigram import Unigram
from session import distributed
from session.lowering import WeightsMismatch
from session.peaks import Peak, device_peak, flops_text
from session.training import TrainingSession

__all__ = ["DataSizes", "Job", "RunResult", "Stream", "launch", "round_figure", "run",
           "with_baseline"]


class Stream(Protocol):
    """A job's training batches for one replica: endless, resumable exactly."""

    def __iter__(self) -> Iterator[dict]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def close(self) -> None: ...


class Job(Protocol):
    """What a kind of run adds to the loop (bert/tasks/pretraining.py, bert/tasks/squad.py)."""

    config: Config
    # The evaluation figure best.json follows, and whether lower is better; None without evaluation.
    best_metric: Optional[tuple[str, bool]]
    # What the run may spend besides its steps (bert/run/budget.py): Budget() for none.
    budget: Budget

    def session(self) -> TrainingSession:
        """The training session with the run's starting weights (called inside the launch
        context; a checkpoint the run resumes from is loaded over them)."""

    def stream(self, replica: int, replicas: int) -> Stream:
        """This replica's training batches."""

    def restore_stream(self, stream: Stream, extra: dict) -> None:
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

    def baseline(self) -> Optional[Unigram]:
        """What a model that learned only token frequencies scores on the held-out set (after
        `stream`); None without one."""

    def evaluation_record(self) -> dict[str, float]:
        """What the latest evaluation's record holds besides its figures, for metrics.jsonl and
        W&B but not the console: the baseline's figures, the held-out sampling error."""


@dataclass(frozen=True)
class DataSizes:
    """What a job's data holds, said when the run starts."""

    samples: Optional[int]  # training samples in one epoch; None: an endless stream (random tokens)
    what: str  # where they come from: "4 shards", "random tokens", ...
    eval_rows: int = 0  # rows of the held-out set (0: no evaluation)
    eval_what: str = ""
    packed: int = 0  # sequences per packed row at most (0: not packed): epochs then depend on the packing
    packed_per_step: bool = False  # each micro-batch's samples packed as the stream takes them: a step's rows vary


@dataclass
class RunResult:
    output_dir: Path
    metrics: list[dict] = field(default_factory=list)
    checkpoint: Optional[Path] = None
    evaluation: dict[str, float] = field(default_factory=dict)
    best: Optional[dict] = None


# ------------------------------------------------------------------- run
def launch(config: Config) -> distributed.Launch:
    """The launch context (session.distributed) of a run of `config`."""
    p = config.parallel
    return distributed.launch(config.training.device, p.fault_timeout, p.collective_timeout)


def run(job: Job, checkpoint_input: Optional[str] = None, use_wandb: bool = False, progress: bool = True,
        on_log: Optional[Callable[[dict], None]] = None) -> RunResult:
    """Train `job` to `training.steps` (see the module docstring); `on_log` sees each metrics
    record right after it is logged, and an exception it raises ends the run."""
    config = job.config
    from bert.data import data_share

    replica, replicas = data_share(config)
    stream = job.stream(replica, replicas)  # the data is checked before any model is built
    try:
        with launch(config), job.session() as session:
            return _run(job, session, stream if session.needs_data else None, checkpoint_input, use_wandb,
                        progress, on_log)
    finally:
        stream.close()


def _run(job: Job, session: TrainingSession, stream: Optional[Stream], checkpoint_input: Optional[str],
         use_wandb: bool, progress: bool, on_log: Optional[Callable[[dict], None]]) -> RunResult:
    with RunDirectory.agreed(session, job.config, checkpoint_input) as run_dir:
        if distributed.current() is not None:
            distributed.current().note_run_dir(run_dir.path)  # a fault message finds its checkpoints there
        return _steps(job, session, stream, run_dir, use_wandb, progress, on_log)


def _steps(job: Job, session: TrainingSession, stream: Optional[Stream], run_dir: RunDirectory, use_wandb: bool,
           progress: bool, on_log: Optional[Callable[[dict], None]]) -> RunResult:
    config, lead = job.config, session.topology.rank == 0
    best, seconds = _resume(job, session, stream, run_dir)  # read and checked before anything is written
    clock, start = Clock(config.training.steps, job.budget, seconds), session.step
    global_batch = config.batch.samples_per_replica * session.topology.replicas
    per_row, peak = flops_per_row(config.model), _peak(config, session)
    if lead:
        _start(job, session, run_dir, global_batch, per_row, peak)
    topo = session.topology  # each virtual graph's replicas do the same work: a slow one among them shows
    peers = [[topo.rank_of(r, v) for r in range(topo.replicas)] for v in range(topo.virtual_graphs)]
    logger = Logger(config, run_dir.log(config, use_wandb), lead, start, progress, on_log, job.postfix, peers, per_row,
                    peak)
    evaluator = Evaluator(job, config.evaluation.every, logger, clock)
    checkpointer = Checkpointer(config.checkpoint, session, run_dir, stream, clock, job.best_metric, best,
                                batch_record(config, session.topology.replicas))
    divergence, batches = Divergence(config), iter(stream) if stream is not None else None
    try:
        with Stopping(session, lead) as stopping:
            while not clock.done(session.step):
                out = _step(job, session, batches, clock, logger, global_batch)
                step, last = session.step, clock.done(session.step)
                why = divergence.update(out)
                if logger.should_log(step) or last or why or stopping.requested:
                    logger.flush(step, clock)
                if why:
                    raise divergence.error(step, out, why, checkpointer.last_good)
                clean = not out["skipped"]
                saving = clean and (stopping.requested or last or checkpointer.should_save(step))
                if saving:
                    divergence.check_weights(session, checkpointer.last_good)
                figures = evaluator.evaluate(session) if clean and (saving or evaluator.should_evaluate(step)) else {}
                if stopping.requested:
                    raise stopping.interrupt(checkpointer, figures, clean)
                checkpointer.keep_best(figures, checkpointer.save_step(step, last, figures) if saving else None)
            logger.end_steps()
            evaluator.finish(session, run_dir.path if lead else None)
    finally:
        logger.close()
    result = RunResult(run_dir.path, logger.records, checkpointer.final, evaluator.figures, checkpointer.best)
    if lead:
        _print_outcome(result, start, job.baseline())
    return result


def _step(job: Job, session: TrainingSession, batches: Optional[Iterator[dict]], clock: Clock, logger: Logger,
          global_batch: int) -> dict[str, float]:
    """One training step: its batch, the update, its time on the clock and its figures in the log."""
    fetched = time.perf_counter()
    batch = next(batches) if batches is not None else None
    began = time.perf_counter()
    out = session.run(batch, clock.learning_rate())
    ended = time.perf_counter()
    for line in session.notes:  # a kernel choice the first step measured
        logger.warn(line)
    session.notes.clear()
    clock.add(ended - fetched, session)
    # This replica's tokens and graph rows, × the replicas: exact but where each replica packs its
    # own share of a step (a fine-tuning run with several), whose rows then differ by a few.
    replicas = session.topology.replicas
    tokens = job.tokens(batch) * replicas if batch is not None else 0
    rows = len(batch["input_ids"]) * replicas if batch is not None else global_batch
    logger.add(session.step, out, ended - began, global_batch, tokens, rows, session.rank_seconds)
    return out


def _peak(config: Config, session: TrainingSession) -> Optional[Peak]:
    """The peak of all the run's devices (one per process; None where a device's peak is
    unknown): the log's MFU."""
    world = session.topology.world_size
    peak = device_peak(config.training.device, config.precision.dtype)
    return peak and Peak(peak.flops * world, peak.source + (f" × {world}" if world > 1 else ""))


def _flops_line(per_row: int, global_batch: int, packed_per_step: bool, peak: Optional[Peak], device: str) -> str:
    """What the log's TFLOP/s count (bert.py summary's FLOPs of a row × the rows a step runs)
    and the peak its MFU is measured against."""
    flops = (f"{per_row:.4g} per row, a step's rows as its micro-batches pack (global batch {global_batch} samples)"
             if packed_per_step else f"{per_row * global_batch:.4g} per step")
    return f"model FLOPs: {flops}; MFU against " + (f"{flops_text(peak.flops)} ({peak.source})" if peak is not None
                                                      else f"no known peak of {device}")


def _resume(job: Job, session: TrainingSession, stream: Optional[Stream], run_dir: RunDirectory
            ) -> tuple[Optional[dict], float]:
    """Load the checkpoint the run starts from: the run's best evaluation so far (`RunDirectory.best`)
    and the training seconds spent."""
    if run_dir.checkpoint is None:
        return None, 0.0
    try:
        extra = session.load(run_dir.checkpoint)
    except WeightsMismatch as e:
        given = "the config and training.init_from" if job.config.training.init_from else "the config"
        raise ValueError(f"{run_dir.checkpoint} does not fit the model of {given} ({e}): a resume continues that "
                         "checkpoint's own run; resume with its run's config.json as --config, or start a new run "
                         "from it with --training.init_from instead of --checkpoint-input") from None
    if stream is not None:
        job.restore_stream(stream, extra)
    return run_dir.best(), float(extra.get("train_seconds", 0.0))


def _start(job: Job, session: TrainingSession, run_dir: RunDirectory, global_batch: int, per_row: int,
           peak: Optional[Peak]) -> None:
    """Rank 0: the run directory made ready, and what the run is about to do (`per_row`: the
    model FLOPs of a graph row, `peak`: the devices', for the line saying what the MFU counts)."""
    config, topo, sizes = job.config, session.topology, job.data_sizes()
    lines = run_dir.start(config)
    job.start(run_dir.path)
    lines += [session.policy.describe()] + [f"note: {line}" for line in session.resume_notes]
    gpus = unused_gpus(config)
    if gpus:
        lines.append(f"note: training.device {config.training.device}, while torch sees {gpus}: --training.device "
                     "cuda trains on them (docs/gpu.md)")
    lines += _data_lines(sizes, config, session.step, global_batch)
    lines.append(f"global batch {global_batch} = micro batch {config.batch.micro_batch_size} × gradient "
                 f"accumulation {config.batch.gradient_accumulation} × {topo.replicas} replica(s)"
                 + (f"; {topo.virtual_graphs} pipeline processes per replica" if topo.virtual_graphs > 1 else ""))
    lines.append(_flops_line(per_row, global_batch, sizes.packed_per_step, peak, config.training.device))
    for line in lines:
        print(line, flush=True)


def unused_gpus(config: Config) -> str:
    """The GPUs torch sees ("2 GPUs (NVIDIA H200)") when the run trains on the CPU; "" otherwise."""
    if torch.device(config.training.device).type != "cpu" or not torch.cuda.is_available():
        return ""
    count = torch.cuda.device_count()
    return f"{count} GPU{'s' if count > 1 else ''} ({torch.cuda.get_device_name(0)})"


# -------------------------------------------------------- the loop's concerns
class Evaluator:
    """The job's held-out figures every `evaluation.every` steps (and at every checkpoint:
    the loop asks), into the log and the console beside the job's baseline; one warning when
    the baseline says the run is stuck; the job's own figures after the last step."""

    def __init__(self, job: Job, every: int, logger: Logger, clock: Clock):
        self.job, self.every, self.logger, self.clock = job, every, logger, clock
        self.figures: dict[str, float] = {}  # the latest
        self.warned = False

    def should_evaluate(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0)

    def evaluate(self, session: TrainingSession) -> dict[str, float]:
        figures, step = self.job.evaluate(session), session.step
        if figures:
            self.figures, baseline = figures, self.job.baseline()
            self.logger.emit({"step": step, **{k: round_figure(v) for k, v in figures.items()},
                              **self.job.evaluation_record(), **self.clock.spent(step)})
            self.logger.write(f"step {step}: {with_baseline(figures, baseline)}")
            warning = (baseline.warning(figures, step, self.clock.share(step), self.job.config.model.architecture.value)
                       if baseline is not None else None)
            if warning and not self.warned:
                self.warned = True
                self.logger.warn(warning)
        return figures

    def finish(self, session: TrainingSession, output_dir: Optional[Path]) -> None:
        finished = self.job.finish(session, output_dir)
        if finished:
            self.figures = {**self.figures, **finished}
            self.logger.emit({"step": session.step, **finished})


class Divergence:
    """A step whose loss or gradient is not finite is skipped (the session does); with
    `training.divergence_patience` of them in a row, or with dynamic fp16 loss scaling a scale
    below `precision.min_loss_scale`, the run has diverged, as it has when an update leaves
    weights that are not finite. Either ends it (`TrainingDiverged`) with no checkpoint written."""

    def __init__(self, config: Config):
        precision = config.precision
        self.patience, self.min_loss_scale = config.training.divergence_patience, precision.min_loss_scale
        self.dynamic_fp16 = precision.dtype == "fp16" and precision.loss_scaling == "dynamic"
        self.in_a_row = 0

    def update(self, out: dict[str, float]) -> Optional[str]:
        """Why the run has diverged after this step; None while it has not."""
        skipped = bool(out["skipped"])
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if skipped and self.dynamic_fp16 and out["loss_scale"] / 2 < self.min_loss_scale:
            return f"the fp16 loss scale fell below precision.min_loss_scale {self.min_loss_scale:g}"
        if skipped and not self.dynamic_fp16 and self.in_a_row >= self.patience:
            return f"{self.in_a_row} steps in a row (training.divergence_patience)"
        return None

    def error(self, step: int, out: dict[str, float], why: str, last_good: Optional[Path]) -> TrainingDiverged:
        return _diverged(step, f"the loss or gradients were not finite (loss {out['loss']:.4g}, gradient norm "
                               f"{out['grad_norm']:.4g}); {why}. Those steps were skipped and no checkpoint was "
                               "written", last_good)

    def check_weights(self, session: TrainingSession, last_good: Optional[Path]) -> None:
        """Before a checkpoint: its weights are finite (collective)."""
        if not session.weights_are_finite():
            raise _diverged(session.step, "its update made weights infinite or NaN, so no checkpoint was written",
                            last_good)


def _diverged(step: int, what: str, last_good: Optional[Path]) -> TrainingDiverged:
    return TrainingDiverged(f"training diverged at step {step}: {what}"
                            + (f"; the last checkpoint {last_good} is untouched" if last_good else "")
                            + ". Lower optimizer.learning_rate or raise the warm-up")


class Stopping:
    """SIGINT/SIGTERM belong to the launch context: inside this block the first one asks every
    process to stop after the current step (docs/distributed.md, "Signals"), which then writes
    its checkpoint and ends the run (`RunInterrupted`, exit 128 + signal)."""

    def __init__(self, session: TrainingSession, lead: bool):
        self.session = session
        self._context = distributed.current().stop_on_signal(session.request_stop, announce=lead)

    def __enter__(self) -> "Stopping":
        self.signals = self._context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._context.__exit__(*exc)

    @property
    def requested(self) -> bool:
        """Every process agrees after each step (the session reduces the request)."""
        return self.session.stop_agreed

    def interrupt(self, checkpointer: Checkpointer, figures: dict[str, float], clean: bool) -> RunInterrupted:
        """The step's checkpoint (when its step was clean) and the error that ends the run."""
        step, signum = self.session.step, self.signals.signum
        name = signal.Signals(signum).name if signum else "a signal in another process"
        where = checkpointer.save(f"checkpoint-{step}", figures) if clean else None
        checkpointer.keep_best(figures, where)
        last_good = checkpointer.last_good
        return RunInterrupted(
            f"stopped by {name} at step {step}; " +
            (f"checkpoint: {where}; resume with --checkpoint-input {where}" if where else
             "its last step was not clean (the loss or gradients were not finite), so no checkpoint was written"
             + (f"; resume with --checkpoint-input {last_good}" if last_good else "; the run has no checkpoint yet")),
            signum or signal.SIGTERM)


def _data_lines(sizes: DataSizes, config: Config, step: int, global_batch: int) -> list[str]:
    """What the run will read (`sizes`: the job's): training samples and epochs, the held-out set."""
    total = config.training.steps
    steps = total - step
    span = f"steps {step + 1}-{total}" if step else f"{total} steps"
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
        every = config.evaluation.every
        if every and (step // every + 1) * every < total:  # a step of the cadence before the last
            when = f"every {every} steps and at each checkpoint"
        else:
            when = "at each checkpoint" + (f" (evaluation.every {every} reaches past the run's last step, {total})"
                                           if every else "")
        lines.append(f"evaluation: {sizes.eval_rows} rows ({sizes.eval_what}), {when}")
    return lines


def with_baseline(figures: dict[str, float], baseline: Optional[Unigram]) -> str:
    """`figures` for the console, each beside its baseline: `eval_mlm_accuracy 0.056 (unigram 0.061)`."""
    base = baseline.figures() if baseline is not None else {}
    return ", ".join(f"{k} {v:.4g}" + (f" (unigram {base[k]:.4g})" if k in base else "") for k, v in figures.items())


def _print_outcome(result: RunResult, start: int, baseline: Optional[Unigram]) -> None:
    rows = [r for r in result.metrics if "loss" in r]
    if rows:
        window = max(1, min(10, len(rows) // 5))
        first, last = rows[:window], rows[-window:]

        def mean(part: list[dict], key: str) -> float:
            values = [r[key] for r in part if r.get(key) is not None]
            return float(np.mean(values)) if values else float("nan")

        # A record holds the means of the steps after the record before it (or the run's start).
        begins = {id(row): step + 1 for row, step in zip(rows, [start] + [r["step"] for r in rows[:-1]])}
        spans = [span(begins[id(part[0])], part[-1]["step"]) for part in (first, last)]
        line = f"{spans[0]} → {spans[1]}: loss {mean(first, 'loss'):.3f} → {mean(last, 'loss'):.3f}"
        if "mlm_accuracy" in rows[0]:
            line += f", MLM accuracy {mean(first, 'mlm_accuracy'):.3f} → {mean(last, 'mlm_accuracy'):.3f}" + (
                f" (unigram {baseline.train_accuracy:.3f})" if baseline is not None else "")
        if rows[-1].get("tokens_per_s"):
            line += f", {mean(last, 'tokens_per_s'):.0f} tokens/s"
        print(line)
    verdict = baseline.verdict(result.evaluation) if baseline is not None else None
    if verdict:
        print(verdict)
    if result.best is not None:
        best = result.best
        at = f"{best['metric']} {best['value']:.4g} at step {best['step']}"
        print(f"best: {best['checkpoint']} ({at}; {BEST_FILE})" if best["checkpoint"] else
              f"best: {at}, {best.get('note', 'not saved')} ({BEST_FILE})")
    figures = ", ".join(f"{k} {v:.4g}" for k, v in result.evaluation.items() if isinstance(v, (int, float)))
    print(f"checkpoint: {result.checkpoint}" + (f" ({figures})" if figures else ""))  # the last line
