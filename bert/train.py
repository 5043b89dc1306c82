"""The pre-training run behind `python bert.py --config ...` (one process or many, via torchrun).

config → graph (bert.model) → TrainingSession → steps over the configured data, with a
progress bar, `<output_dir>/metrics.jsonl`, optional wandb, and checkpoints every
`training.checkpoint_every` steps and at the end (`checkpoint-<step>`, `checkpoint-final`).

Runs and their directories (docs/design.md, "Checkpoints and runs"):
- a fresh run never writes into a directory that holds another run;
- `--checkpoint-input DIR` continues DIR's run in place (weights, optimizer, step, RNG
  and data position come back; an fp32 CPU run continues bit for bit) when the config is
  the run's own and the run has not gone past DIR; otherwise (other steps or
  hyper-parameters, another output_dir, a checkpoint the run has since passed) it
  starts a branch: a new directory that records where it came from, and nothing of
  the earlier run is touched.

Faults: a step whose loss or gradient is not finite is skipped; `divergence_patience`
of them in a row (fp16 with a dynamic loss scale: an overflow at `min_loss_scale`) stop
the run with `TrainingDiverged`, writing no checkpoint. SIGINT/SIGTERM stop every
process after the current step and write a checkpoint (`RunInterrupted`). With
several processes, logs, metrics, the progress bar and checkpoint files come from
rank 0; an error in any process stops all of them (session.distributed.Watchdog).
"""
from __future__ import annotations

import contextlib
import glob
import json
import math
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from bert.config import Config, ModelConfig, Task
from bert.model import build_model
from session import SessionOptions
from session import checkpoint as checkpoints
from session.schedules import Schedule
from session.training import STATE_FILE, OptimizerSpec, TrainingSession

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
BRANCH_FILE = "branch.json"
# Settings that change how a run is executed, not what it computes: changing them on
# resume continues the run instead of branching it.
_EXECUTION_KEYS = {
    "training": {"log_every", "checkpoint_every", "compile", "recompute", "device", "replication_factor",
                 "replicated_tensor_sharding", "pipeline", "gradient_bucket_mb", "fault_timeout"},
    "data": {"prefetch"},
}


class TrainingDiverged(RuntimeError):
    """The loss or the gradients stopped being finite and did not recover."""


class RunInterrupted(RuntimeError):
    """A signal stopped the run after a step; `signal` is its number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signal = signum


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
    """Random tokens in the shapes of real batches, for benchmarks (no learnable signal).

    Each step draws the rows of all replicas from one seed and replica r takes its slice,
    so the samples of a step do not depend on the number of replicas.
    """

    def __init__(self, config: Config, batch_size: int, seed: int, replica: int = 0, replicas: int = 1):
        self.cfg, self.batch_size, self.seed, self.position = config.model, batch_size, seed, 0
        self.replica, self.replicas = replica, replicas

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
            self.position += 1
            rows = synthetic_batch(self.cfg, self.batch_size * self.replicas, generator)
            mine = slice(self.replica * self.batch_size, (self.replica + 1) * self.batch_size)
            yield {k: v[mine] for k, v in rows.items()}

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


def make_data(config: Config, batch_size: int, replica: int = 0, replicas: int = 1):
    """This replica's sample stream; real sources are checked against the model's shapes."""
    from data import PretrainingLoader, build_demo_data

    d, cfg = config.data, config.model
    if d.source == "synthetic":
        return SyntheticData(config, batch_size, config.training.seed, replica, replicas)
    if d.source == "demo":
        demo = build_demo_data(d.directory, seq_len=cfg.sequence_length, max_predictions=cfg.max_predictions)
        files = demo.train_files
    else:
        files = sorted({f for pattern in d.files for f in glob.glob(pattern)})
        if not files:
            raise ValueError(f"data.files {list(d.files)} match no file; create shards with data/create_pretraining_data.py")
    loader = PretrainingLoader(
        files, batch_size, seed=config.training.seed, shuffle_buffer=d.shuffle_buffer,
        prefetch=d.prefetch, dynamic_masking=d.dynamic_masking, model_vocab_size=cfg.vocab_size,
        replica_rank=replica, replica_count=replicas, verbose=replica == 0,
        packing=cfg.packed, max_sequences_per_pack=cfg.max_sequences_per_pack,
    )
    if loader.seq_len != cfg.sequence_length or loader.max_predictions != cfg.predictions_per_row:
        raise ValueError(
            f"shards hold sequences of {loader.seq_len} with {loader.max_predictions} masks per row, the model wants "
            f"model.sequence_length {cfg.sequence_length} and {cfg.predictions_per_row} (model.max_predictions"
            f"{' + max_sequences_per_pack' if cfg.packed else ''})"
        )
    if loader.vocab_size is not None and loader.vocab_size > cfg.vocab_size:
        raise ValueError(f"the shards' vocab has {loader.vocab_size} tokens, more than model.vocab_size {cfg.vocab_size}")
    return loader


# --------------------------------------------------------------- run dirs
def fresh_output_dir(config: Config) -> Path:
    """The configured output_dir, or the first `<dir>.N` that holds no run yet."""
    base = Path(config.training.output_dir.format(name=config.name))
    out, n = base, 0
    while out.exists() and any(out.iterdir()):
        n += 1
        out = base.with_name(f"{base.name}.{n}")
    return out


def _checkpoint_step(directory: Path) -> int:
    return int(json.loads((directory / STATE_FILE).read_text())["step"])


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
    resume_step: Optional[int] = None  # the checkpoint's step, when resuming
    branched_from: Optional[Path] = None  # the checkpoint a branch starts from
    changes: tuple[str, ...] = ()


def plan_run(config: Config, checkpoint_input: Optional[str]) -> RunPlan:
    """Where this run writes: a fresh directory, the checkpoint's run, or a branch of it."""
    if not checkpoint_input:
        return RunPlan(fresh_output_dir(config))
    source = Path(checkpoint_input).resolve()
    if not (source / STATE_FILE).exists():
        raise ValueError(f"--checkpoint-input {checkpoint_input} is not a checkpoint directory "
                         f"(no {STATE_FILE}); pass a runs/<name>/checkpoint-<step> directory")
    step = _checkpoint_step(source)
    if config.training.steps <= step:
        raise ValueError(f"{source} is at step {step} and training.steps is {config.training.steps}: nothing "
                         f"to train; pass --training.steps above {step} to train on from it")
    run = source.parent
    saved = run / CONFIG_FILE
    changes = (_config_changes(json.loads(saved.read_text()), config) if saved.exists()
               else [f"its run {run} has no {CONFIG_FILE}"])
    later = [p for p in run.glob("checkpoint-*") if p != source and (p / STATE_FILE).exists()
             and _checkpoint_step(p) > step]
    if later:
        changes.append(f"the run went on to {max(later, key=_checkpoint_step).name}")
    if not changes:
        return RunPlan(run, step)
    return RunPlan(fresh_output_dir(config), step, source, tuple(changes))


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


def _history_up_to(metrics: Path, step: int) -> str:
    """The lines of a metrics.jsonl up to and including `step`."""
    return "".join(line + "\n" for line in metrics.read_text().splitlines() if json.loads(line)["step"] <= step)


def _json_safe(value: Any) -> Any:
    """NaN and infinities as null: metrics.jsonl stays strict JSON."""
    return value if not isinstance(value, float) or math.isfinite(value) else None


class MetricsLog:
    """metrics.jsonl (one JSON object per step) and, optionally, wandb."""

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


# ------------------------------------------------------------------- run
def make_session(config: Config, model=None) -> TrainingSession:
    """The configured TrainingSession over `model` (an ONNX graph; default: config.model's pre-training graph)."""
    t = config.training
    if model is None and config.model.task is not Task.PRETRAINING:
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
        replication_factor=t.replication_factor, replicated_tensor_sharding=t.replicated_tensor_sharding,
        pipelining=t.pipeline, gradient_bucket_mb=t.gradient_bucket_mb, fault_timeout=t.fault_timeout,
    )
    if model is None:
        model = build_model(config.model, seed=t.seed).builder.model_proto()
    return TrainingSession(model, optimizer=spec, options=options, seed=t.seed)


class _StopOnSignal:
    """SIGINT/SIGTERM ask every process to stop after the current step; a second one stops now."""

    def __init__(self, session: TrainingSession, announce: bool):
        self.session, self.announce, self.signum = session, announce, None
        self._previous = {}

    def __enter__(self) -> "_StopOnSignal":
        if threading.current_thread() is threading.main_thread():  # only there can Python take signals
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # the second signal: stop now
            signal.signal(signum, self._previous[signum])
            raise KeyboardInterrupt
        self.signum = signum
        self.session.request_stop()
        if self.announce:
            name = signal.Signals(signum).name
            print(f"\n{name}: stopping after this step and writing a checkpoint (again to stop at once)", flush=True)

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def _all_processes_stop_together(session: TrainingSession):
    """An error in one process of a distributed run stops all of them, naming it."""
    try:
        yield
    except (TrainingDiverged, RunInterrupted):
        raise  # decided together, from all-reduced values: every process raises it
    except BaseException as e:
        watchdog = session.watchdog
        if watchdog is not None:
            if isinstance(e, RuntimeError) and any(word in str(e) for word in ("Connection", "peer", "Timed out")):
                watchdog.await_verdict()  # a peer failed: name it
            watchdog.fail(f"{type(e).__name__}: {e}")
        raise


def _broadcast_plan(session: TrainingSession, plan: Optional[RunPlan]) -> RunPlan:
    if not session.topology.distributed:
        return plan
    box = [plan]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def train(config: Config, checkpoint_input: Optional[str] = None, use_wandb: bool = False, progress: bool = True,
          on_log: Optional[Callable[[dict], None]] = None) -> TrainResult:
    # Everything that can reject the config runs before anything is written.
    session = make_session(config)
    with _all_processes_stop_together(session):
        return _train(session, config, checkpoint_input, use_wandb, progress, on_log)


def _train(session: TrainingSession, config: Config, checkpoint_input: Optional[str], use_wandb: bool,
           progress: bool, on_log: Optional[Callable[[dict], None]]) -> TrainResult:
    t = config.training
    topo = session.topology
    lead = topo.rank == 0
    data = make_data(config, t.samples_per_replica, topo.replica, topo.replicas) if session.needs_data else None
    plan = plan_run(config, checkpoint_input) if lead else None
    plan = _broadcast_plan(session, plan)
    output_dir = plan.output_dir
    # The state to start from is read (and checked) before anything is written.
    if checkpoint_input:
        extra = session.load(checkpoint_input)
        if data is not None:
            _restore_data_position(data, extra, lead)
    elif t.init_from:
        session.load_weights(t.init_from)
    if lead:
        prepare_run_dir(plan, config)
        print(f"output_dir: {output_dir}", flush=True)
        if plan.branched_from is not None:
            print(f"branching from {plan.branched_from} (step {plan.resume_step}): {'; '.join(plan.changes)}; "
                  "the earlier run is left as it was", flush=True)
        global_batch = t.samples_per_replica * topo.replicas
        print(f"global batch {global_batch} = micro batch {t.micro_batch_size} × gradient accumulation "
              f"{t.gradient_accumulation} × {topo.replicas} replica(s)"
              + (f"; {topo.virtual_graphs} pipeline processes per replica" if topo.virtual_graphs > 1 else ""),
              flush=True)

    log = MetricsLog(output_dir, config, use_wandb) if lead else None
    result = TrainResult(output_dir)
    global_batch = t.samples_per_replica * topo.replicas
    tokens_per_step = global_batch * config.model.sequence_length
    bar = tqdm(total=t.steps, initial=session.step, desc=config.name, disable=not (progress and lead),
               dynamic_ncols=True)
    stream = iter(data) if data is not None else None
    bad_steps = 0
    last_good: Optional[Path] = Path(checkpoint_input) if checkpoint_input else None
    dynamic_fp16 = t.precision == "fp16" and t.loss_scaling == "dynamic"
    try:
        with _StopOnSignal(session, announce=lead) as signals:
            while session.step < t.steps:
                batch = next(stream) if stream is not None else None
                start = time.perf_counter()
                out = session.run(batch)
                seconds = time.perf_counter() - start
                record = {"step": session.step, **{k: _round(v) for k, v in out.items()},
                          "sequences_per_s": round(global_batch / seconds, 2),
                          "tokens_per_s": round(tokens_per_step / seconds, 1)}
                if log is not None:
                    log.log(record)
                result.metrics.append(record)
                if on_log is not None:
                    on_log(record)
                bar.update(session.step - bar.n)
                bar.set_postfix(loss=f"{out['loss']:.3f}", mlm_acc=f"{out.get('mlm_accuracy', float('nan')):.3f}",
                                nsp_acc=f"{out.get('nsp_accuracy', float('nan')):.3f}",
                                lr=f"{out['learning_rate']:.2e}", seq_s=f"{record['sequences_per_s']:.0f}",
                                tok_s=f"{record['tokens_per_s']:.0f}")
                skipped = bool(out["skipped"])
                bad_steps = bad_steps + 1 if skipped else 0
                if skipped and (dynamic_fp16 and out["loss_scale"] / 2 < t.min_loss_scale
                                or not dynamic_fp16 and bad_steps >= t.divergence_patience):
                    why = (f"the fp16 loss scale fell below training.min_loss_scale {t.min_loss_scale:g}"
                           if dynamic_fp16 else f"{bad_steps} steps in a row (training.divergence_patience)")
                    raise TrainingDiverged(
                        f"training diverged at step {session.step}: the loss or gradients were not finite "
                        f"(loss {out['loss']:.4g}, gradient norm {out['grad_norm']:.4g}); {why}. Those steps "
                        "were skipped and no checkpoint was written" +
                        (f"; the last checkpoint {last_good} is untouched" if last_good else "") +
                        ". Lower training.learning_rate or raise the warm-up")
                if not skipped and _saving_now(t, session) and not session.weights_are_finite():
                    raise TrainingDiverged(
                        f"training diverged at step {session.step}: its update made weights infinite or NaN, so no "
                        "checkpoint was written" + (f"; the last checkpoint {last_good} is untouched" if last_good
                                                    else "") + ". Lower training.learning_rate or raise the warm-up")
                if session.stop_agreed:
                    name = signal.Signals(signals.signum).name if signals.signum else "a signal in another process"
                    where = None
                    if not skipped:
                        where = session.save(output_dir / f"checkpoint-{session.step}", _extra(data))
                    raise RunInterrupted(
                        f"stopped by {name} at step {session.step}; " +
                        (f"checkpoint: {where}; resume with --checkpoint-input {where}" if where else
                         "the last step was not clean, so no checkpoint was written"),
                        signals.signum or signal.SIGTERM)
                if t.checkpoint_every and session.step % t.checkpoint_every == 0 and session.step < t.steps \
                        and not skipped:
                    last_good = session.save(output_dir / f"checkpoint-{session.step}", _extra(data)) or last_good
            result.checkpoint = session.save(output_dir / "checkpoint-final", _extra(data))
    finally:
        bar.close()
        if log is not None:
            log.close()
        if hasattr(data, "close"):
            data.close()
    if lead:
        _print_outcome(result, config)
    return result


def _saving_now(t: Any, session: TrainingSession) -> bool:
    """A checkpoint follows this step (periodic, final, or on a stop request)."""
    periodic = t.checkpoint_every and session.step % t.checkpoint_every == 0
    return bool(periodic or session.step >= t.steps or session.stop_agreed)


def _round(value: float) -> float:
    return round(value, 6) if isinstance(value, float) and math.isfinite(value) else value


def _extra(data: Any) -> dict:
    return {"data": data.state_dict()} if data is not None else {}


def _restore_data_position(data: Any, extra: dict, lead: bool) -> None:
    if "resharded_from" not in extra:
        data.load_state_dict(extra["data"])
        return
    if isinstance(data, SyntheticData):  # its stream does not depend on the replicas
        data.load_state_dict(extra["data"])
        return
    epoch, fraction = data.epoch_fraction(extra["data"])
    data.seek(epoch, fraction)
    if lead:
        print(f"note: the checkpoint was written by {extra['resharded_from']['replicas']} replica(s); each of the "
              f"{data.replica_count} now continues epoch {epoch} from {fraction:.1%} of its new share of the data",
              flush=True)


def _print_outcome(result: TrainResult, config: Config) -> None:
    rows = [r for r in result.metrics if not r.get("skipped")]
    if not rows:
        return
    window = max(1, min(10, len(rows) // 5))
    first, last = rows[:window], rows[-window:]
    mean = lambda rows, k: float(np.mean([r[k] for r in rows])) if k in rows[0] else float("nan")
    print(
        f"steps {first[0]['step']}-{last[-1]['step']}: loss {mean(first, 'loss'):.3f} → {mean(last, 'loss'):.3f}, "
        f"MLM accuracy {mean(first, 'mlm_accuracy'):.3f} → {mean(last, 'mlm_accuracy'):.3f} "
        f"(chance {1 / config.model.vocab_size:.4f}), {mean(last, 'tokens_per_s'):.0f} tokens/s"
    )
    print(f"checkpoint: {result.checkpoint}")
