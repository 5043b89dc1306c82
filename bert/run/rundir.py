"""The run directory: where a run writes, who may write it, and what a resumed run finds there.

    runs/<name>/                             training.output_dir ({name}: the config's name)
        run.lock                             the claim of the process writing the run (while it runs)
        config.json                          the run's config
        metrics.jsonl                        a record per log_every steps and per evaluation
        metrics.before-resume-<step>.jsonl   a continued run's history before it resumed
        branch.json                          a branch: the checkpoint it starts from, what changed
        best.json                            the best evaluation and the checkpoint holding its weights
        checkpoint-<step>/, checkpoint-final/   (session/checkpoint.py)
        checkpoint-best/                     the best evaluation's weights when no checkpoint came with it

The run loop asks one object, `RunDirectory`, for the directory's whole life: where the run
writes and the checkpoint it starts from (`RunDirectory.agreed`: rank 0's plan, on every
process), its records (`start`), its metrics log (`log`), its best evaluation so far (`best`)
and each new one (`record_best`), and the end of the claim (`close`, or the `with` block).

A run directory has one writer, which claims it (bert/run/claim.py: `run.lock`, held for the
run's life); only rank 0 claims and writes.

`plan_run` decides where a run writes, under the claim: a fresh directory (never one
holding another run: `runs/demo` taken, or being taken by a run starting beside this
one, means `runs/demo.1`), the run a checkpoint belongs to (it continues in place when
the config is the run's own, execution settings aside, and the run has not gone past
the checkpoint), or a branch of it in a fresh directory; `"auto"` (the default under
torchrun when the run directory holds a checkpoint) picks the run's newest verified
checkpoint. `prepare_run_dir` creates the records without losing anything of earlier
runs: a continued run's history up to its checkpoint is written to a new file renamed
over metrics.jsonl, while the earlier file, whole, stays as
metrics.before-resume-<step>.jsonl (a hard link, never a copy that could be cut short,
never a name that already exists); no file is ever truncated or rewritten in place.
`MetricsLog` appends to metrics.jsonl (and W&B); `read_best`/`record_best` keep best.json.
"""
from __future__ import annotations

import atexit
import errno
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from fileio import DiskFull, disk_full, staged, write_atomically
from bert.config import Config, config_from_dict, upgrade
from bert.errors import RunRefused
from bert.run.elastic import saved_batch
from bert.run.claim import LOCK_FILE, RunClaim, claim, claim_fresh, holds_run, read_holder
from session import checkpoint as checkpoints
from session.checkpoint import STATE_FILE
from session.training import TrainingSession

__all__ = ["BEST_CHECKPOINT", "BEST_FILE", "BRANCH_FILE", "CONFIG_FILE", "LOCK_FILE", "METRICS_FILE", "MetricsLog",
           "RunClaim", "RunDirectory", "RunPlan", "claim", "configured_output_dir", "fresh_output_dir", "improves",
           "newest_checkpoint", "plan_run", "prepare_run_dir", "read_best", "read_history", "read_holder",
           "record_best", "resume_step", "starting_checkpoint"]

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
BRANCH_FILE = "branch.json"
BEST_FILE = "best.json"
BEST_CHECKPOINT = "checkpoint-best"
# Settings that change how a run is executed, not what it computes: changing them on
# resume continues the run instead of branching it.
_EXECUTION_KEYS = {
    "training": {"log_every", "compile", "recompute", "device", "kernels"},
    "checkpoint": {"every", "save_best"},
    "evaluation": {"every"},
    "parallel": {"replication_factor", "replicated_tensor_sharding", "pipeline", "gradient_bucket_mb", "fault_timeout",
                 "collective_timeout", "slow_rank_factor"},
    "data": {"prefetch"},
    "batch": {"keep_global_batch"},
}


# ------------------------------------------------------------ the run's life
class RunDirectory:
    """One run's directory, as the run loop asks it for the run's life (every process holds
    one; rank 0, `lead`, alone claims and writes; see the module docstring)."""

    def __init__(self, plan: "RunPlan", lead: bool):
        self.plan, self.lead = plan, lead
        self.path = plan.output_dir

    @classmethod
    def agreed(cls, session: TrainingSession, config: Config, checkpoint_input: Optional[str]) -> "RunDirectory":
        """Rank 0's plan (claiming the directory), on every process; a plan rank 0 refuses is
        the same one-line error on every process (`RunRefused`), naming no process as failed."""
        lead = session.topology.rank == 0
        plan, problem = None, None
        if lead:
            try:
                plan = plan_run(config, checkpoint_input, session.topology.replicas)
            except ValueError as e:
                problem = e
        try:
            shared, message = session.broadcast((plan.shared() if plan is not None else None,
                                                 str(problem) if problem is not None else None))
        except BaseException:
            if plan is not None and plan.claim is not None:
                plan.claim.release()
            raise
        if message is not None:
            raise RunRefused(message) from None
        return cls(plan if plan is not None else shared, lead)

    def __enter__(self) -> "RunDirectory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Rank 0's claim ends with the run."""
        if self.plan.claim is not None:
            self.plan.claim.release()

    @property
    def checkpoint(self) -> Optional[Path]:
        """The checkpoint the run starts from (None: a fresh run)."""
        return self.plan.checkpoint

    def best(self) -> Optional[dict]:
        """The run's best evaluation so far: rank 0 of a run continued in place (a branch and a
        fresh run start their own), else None."""
        continued = self.checkpoint is not None and self.plan.branched_from is None
        return read_best(self.path) if self.lead and continued else None

    def start(self, config: Config) -> list[str]:
        """Rank 0: the directory and its records made ready (`prepare_run_dir`); the lines
        that say where the run writes and what it starts from."""
        plan = self.plan
        prepare_run_dir(plan, config)
        lines = [f"output_dir: {self.path}"] + ([plan.note] if plan.note else [])
        if plan.branched_from is not None:
            lines.append(f"branching from {plan.branched_from} (step {plan.resume_step}): {'; '.join(plan.changes)}; "
                         "the earlier run is left as it was")
        return lines

    def log(self, config: Config, use_wandb: bool) -> Optional["MetricsLog"]:
        """Rank 0's metrics.jsonl (and W&B run); None elsewhere."""
        return MetricsLog(self.path, config, use_wandb) if self.lead else None

    def record_best(self, checkpoint: Optional[str], step: int, figures: dict[str, float], metric: tuple[str, bool],
                    note: str = "") -> dict:
        """best.json for the evaluation at `step` (rank 0; `record_best`)."""
        return record_best(self.path, checkpoint, step, figures, metric, note)


# ------------------------------------------------------------------ the plan
def configured_output_dir(config: Config) -> Path:
    """The directory `training.output_dir` names ({name}: the config's name)."""
    return Path(config.training.output_dir.format(name=config.name))


_kept: list[RunClaim] = []


def fresh_output_dir(config: Config) -> Path:
    """The configured output directory or the first free `<dir>.N` beside it, claimed until
    this process exits (for jobs outside the run loop, whose RunDirectory ends its claim)."""
    held = claim_fresh(configured_output_dir(config))
    _kept.append(held)
    return held.directory


@atexit.register
def _release_kept() -> None:
    for held in _kept:
        held.release()


def _checkpoint_step(directory: Path) -> int:
    """The step of a checkpoint, read only after its session.json matched its checksum."""
    return checkpoints.read_state(directory).step


def _named_step(path: Path) -> Optional[int]:
    """The step a checkpoint directory's name says (checkpoint-12: 12; checkpoint-final: None)."""
    tail = path.name.removeprefix("checkpoint-")
    return int(tail) if tail.isdigit() else None


def newest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The run's checkpoint of the highest step whose session.json verifies (each process
    verifies what it reads when it loads)."""
    return checkpoints.newest(run_dir) if run_dir.is_dir() else None


def starting_checkpoint(config: Config, checkpoint_input: Optional[str]) -> Optional[Path]:
    """The checkpoint `plan_run` would start a run given `checkpoint_input` from (None: a
    fresh run), found without claiming anything; one it would refuse is left for it to refuse."""
    launched = checkpoint_input is None and "TORCHELASTIC_RUN_ID" in os.environ
    if checkpoint_input == "auto" or (launched and configured_output_dir(config).exists()):
        newest = newest_checkpoint(configured_output_dir(config))
        if newest is None or launched and _checkpoint_step(newest) >= config.training.steps:
            return None
        return newest
    if not checkpoint_input or not (Path(checkpoint_input) / STATE_FILE).exists():
        return None
    return Path(checkpoint_input)


def resume_step(config: Config, checkpoint_input: Optional[str]) -> int:
    """The step a run given `checkpoint_input` would start from (0 for a fresh run)."""
    checkpoint = starting_checkpoint(config, checkpoint_input)
    return 0 if checkpoint is None else _checkpoint_step(checkpoint)


def _config_changes(saved: dict, config: Config, source: str) -> list[str]:
    """`section.key old → new` for each setting that changes what the run computes.

    The saved config is read through today's schema where it still validates, so a key
    added since it was written compares as its default (an older run resumes in place);
    a version-1 config is read as version 2, with one note naming the keys moved."""
    try:
        saved = upgrade(saved, source)
        saved = config_from_dict(saved, source).model_dump(mode="json")
    except ValueError:
        pass  # compared as written: each key that differs is named
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


def _batch_changes(changes: list[str], checkpoint: Path, config: Config, replicas: int) -> list[str]:
    """The changes with the gradient accumulation's judged by the global batch it makes: none
    when the checkpoint's global batch is kept, else the global batch's change named."""
    saved = saved_batch(checkpoint)
    if saved is None:
        return changes
    now = config.batch.samples_per_replica * replicas
    if now == saved.global_batch:
        return [c for c in changes if not c.startswith("batch.gradient_accumulation ")]
    replicas_changed = f" ({saved.replicas} → {replicas} replicas)" if saved.replicas != replicas else ""
    return changes + [f"global batch {saved.global_batch} → {now}{replicas_changed}"]


@dataclass(frozen=True)
class RunPlan:
    output_dir: Path
    checkpoint: Optional[Path] = None  # the checkpoint the run starts from
    resume_step: Optional[int] = None  # its step
    branched_from: Optional[Path] = None  # the checkpoint a branch starts from
    changes: tuple[str, ...] = ()
    note: str = ""  # printed when the run starts (an automatic resume, a stale lock taken over)
    claim: Optional[RunClaim] = field(default=None, compare=False, repr=False)  # rank 0's, on output_dir

    def shared(self) -> "RunPlan":
        """The plan as the other processes get it (the claim stays with rank 0)."""
        return RunPlan(self.output_dir, self.checkpoint, self.resume_step, self.branched_from, self.changes,
                       self.note)


def plan_run(config: Config, checkpoint_input: Optional[str], replicas: int = 1) -> RunPlan:
    """Where this run of `replicas` replicas writes, claimed (`plan.claim`; the caller releases
    it when the run ends): a fresh directory, the checkpoint's run, or a branch of it. A run
    directory another live process holds is refused, naming it. The gradient accumulation is
    compared as the global batch it makes (bert/run/elastic.py): another accumulation that keeps
    the checkpoint's global batch with another replica count continues the run in place.

    `checkpoint_input` "auto" (also the default in a job torchrun launched, when the run
    directory exists) is the newest checkpoint of the configured run directory, or a
    fresh start when it holds none."""
    launched = checkpoint_input is None and "TORCHELASTIC_RUN_ID" in os.environ
    held: Optional[RunClaim] = None
    try:
        note = ""
        if checkpoint_input == "auto" or (launched and configured_output_dir(config).exists()):
            run_dir = configured_output_dir(config)
            if not run_dir.exists():
                return _fresh(config, None, f"no run in {run_dir}: starting afresh")
            held = claim(run_dir)
            found, broken = checkpoints.survey(run_dir)
            newest = checkpoints.newest_of(found)
            for path, why in broken.items() if newest is not None else ():
                print(f"note: ignoring {path}: {why}", flush=True)
            if newest is None and broken:
                path, why = next(iter(broken.items()))
                raise ValueError(
                    f"{run_dir} holds {len(broken)} checkpoint director{'y' if len(broken) == 1 else 'ies'} but none "
                    f"that verifies ({why}): resume from a good copy with --checkpoint-input, start from its weights "
                    f"with --training.init_from {path}, or move {'it' if len(broken) == 1 else 'them'} away to "
                    "start afresh")
            if newest is None:
                return _fresh(config, held, f"no checkpoint in {run_dir}: starting afresh" if checkpoint_input else "")
            if launched and found[newest] >= config.training.steps:  # the job ran to its end before
                return _fresh(config, held, f"{run_dir} holds a finished run: starting a new one")
            checkpoint_input, note = str(newest), f"resuming from {newest}, the run's newest checkpoint"
        if not checkpoint_input:
            return _fresh(config, held, "")
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
        changes = (_config_changes(_read_json(saved), config, str(saved)) if saved.exists()
                   else [f"its run {run_dir} has no {CONFIG_FILE}"])
        changes = _batch_changes(changes, source, config, replicas)
        if not changes:  # continue in place: the run is claimed before its checkpoints are looked at
            if held is None or held.directory.resolve() != run_dir:
                if held is not None:
                    held.release()
                held = claim(run_dir)
            found, unreadable = checkpoints.survey(run_dir)
            later = {p: n for p, n in found.items() if p != source and n > step}
            if later:
                changes.append(f"the run went on to {max(later, key=later.get).name}")
            # A checkpoint this version cannot read (a newer format, damage) at a later step is never
            # written over: the run continues beside it.
            ahead = [p for p in unreadable if _named_step(p) is None or _named_step(p) > step]
            if ahead:
                changes.append(f"{ahead[-1]} cannot be read by this version and is kept as it is")
        if not changes:
            return RunPlan(run_dir, source, step, note=held.said(note), claim=held)
        if held is not None:
            held.release()
            held = None
        fresh = claim_fresh(configured_output_dir(config))
        return RunPlan(fresh.directory, source, step, source, tuple(changes), fresh.said(note), fresh)
    except BaseException:
        if held is not None:
            held.release()
        raise


def _fresh(config: Config, held: Optional[RunClaim], note: str) -> RunPlan:
    """A fresh run: in the directory already claimed when it holds no run, else the first free one."""
    if held is not None and not holds_run(held.directory) and held.directory == configured_output_dir(config):
        fresh = held
    else:
        if held is not None:
            held.release()
        fresh = claim_fresh(configured_output_dir(config))
    return RunPlan(fresh.directory, note=fresh.said(note), claim=fresh)


# ------------------------------------------------------------------ records
def prepare_run_dir(plan: RunPlan, config: Config) -> None:
    """Create the run directory and its records, keeping everything of earlier runs."""
    out = plan.output_dir
    for line in checkpoints.recover(out):
        print(line, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / METRICS_FILE
    if plan.branched_from is not None:
        _write_atomically(out / BRANCH_FILE, json.dumps({
            "from_checkpoint": str(plan.branched_from), "step": plan.resume_step,
            "changes": list(plan.changes)}, indent=2) + "\n")
        source = plan.branched_from.parent / METRICS_FILE
        if source.exists():  # the branch's history up to where it starts, copied
            _write_atomically(metrics, "".join(read_history(source, plan.resume_step)[0]))
    elif plan.resume_step is not None and metrics.exists():
        kept, dropped = read_history(metrics, plan.resume_step)
        keep = _link_aside(metrics, plan.resume_step)  # the whole file, under a second name
        if dropped:
            print(f"{metrics} held {dropped} record(s) past step {plan.resume_step}: kept whole as {keep.name}; the "
                  f"history up to step {plan.resume_step} continues in {METRICS_FILE}", flush=True)
        _write_atomically(metrics, "".join(kept))
    _write_atomically(out / CONFIG_FILE, json.dumps(config.model_dump(mode="json"), indent=2) + "\n")


def _write_atomically(path: Path, text: str) -> None:
    """Write `path` atomically (fileio): a reader of the old file keeps it whole, a crash
    leaves the old one."""
    try:
        write_atomically(path, text, replace=True)
    except OSError as e:
        raise (DiskFull if disk_full(e) else ValueError)(
            f"cannot write {path} ({e.strerror}); free space or fix the permissions of {path.parent}, then run "
            "again: nothing in it was changed") from None


def _link_aside(metrics: Path, step: int) -> Path:
    """A second name for the whole `metrics` file, one no file has yet: a hard link (no copy
    that a crash could leave short), or an exclusive copy where links are not supported."""
    n = 1
    while True:
        keep = metrics.with_name(f"metrics.before-resume-{step}.jsonl" if n == 1 else
                                 f"metrics.before-resume-{step}.{n}.jsonl")
        try:
            os.link(metrics, keep)
            return keep
        except FileExistsError:
            n += 1
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise (DiskFull if disk_full(e) else ValueError)(
                    f"cannot keep {metrics} as {keep.name} ({e.strerror}); free space or fix the permissions of "
                    f"{metrics.parent}, then resume again") from None
            try:
                with staged(keep) as copy, open(copy, "xb") as dst, open(metrics, "rb") as src:
                    shutil.copyfileobj(src, dst)
                return keep
            except ValueError:  # `keep` appeared meanwhile
                n += 1


def read_history(metrics: Path, step: int) -> tuple[list[str], int]:
    """(the lines of a metrics.jsonl up to and including `step`, each with its newline; how
    many records or fragments come after). A last line cut short by a killed writer counts
    as one after; any other line that is not a record is a ValueError naming it."""
    try:
        text = metrics.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{metrics} is not UTF-8 text (byte {e.start}); repair or move it away, then resume "
                         "again") from None
    except OSError as e:
        raise ValueError(f"cannot read {metrics} ({e.strerror})") from None
    lines = text.split("\n")
    torn = lines.pop() != ""  # text after the last newline: a record being written when its writer died
    kept, dropped = [], int(torn)
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            record_step = record["step"]
            if not isinstance(record_step, int) or isinstance(record_step, bool):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{metrics}, line {number} is not a metrics record (a JSON object with an integer "
                             "step); repair or remove the line, then resume again") from None
        if record_step <= step:
            kept.append(line + "\n")
        else:
            dropped += 1
    return kept, dropped


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is unreadable or not JSON ({e}); repair or remove it") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object; repair or remove it")
    return value


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
            from bert.run.wandb_run import start_wandb

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


# ------------------------------------------------------------------ best.json
def improves(best: Optional[dict], figures: dict[str, float], metric: tuple[str, bool]) -> bool:
    """Whether `figures` beat the best evaluation so far on `metric` (name, lower is better)."""
    name, lower = metric
    value = figures.get(name)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return best is None or (value < best["value"] if lower else value > best["value"])


def record_best(run_dir: Path, checkpoint: Optional[str], step: int, figures: dict[str, float],
                metric: tuple[str, bool], note: str = "") -> dict:
    """Write best.json (atomically) for the evaluation at `step`: the checkpoint directory
    holding its weights, or None with `note` saying why none does (rank 0)."""
    name, lower = metric
    best = {"checkpoint": checkpoint, "step": step, "metric": name, "value": float(figures[name]),
            "goal": "minimize" if lower else "maximize"}
    if note:
        best["note"] = note
    _write_atomically(run_dir / BEST_FILE, json.dumps(best, indent=2) + "\n")
    return best


def read_best(run_dir: Path) -> Optional[dict]:
    """best.json of a run (None without one), checked; when checkpoint-best holds a better
    evaluation than it names (a run stopped between writing the two), the checkpoint's own."""
    path = run_dir / BEST_FILE
    best = _check_best(_read_json(path), path) if path.exists() else None
    found = run_dir / BEST_CHECKPOINT
    if not (found / checkpoints.CHECKSUMS_FILE).exists():
        return best
    try:
        state = checkpoints.read_state(found)
        figures = state.per_rank[0]["extra"]["evaluation"]
    except (ValueError, IndexError, KeyError, TypeError):
        return best  # a damaged checkpoint-best is named when it is loaded, not trusted here
    if not isinstance(figures, dict):
        return best
    value = figures.get(best["metric"]) if best is not None else None
    if best is None or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return best  # without best.json there is no metric to read it by: it is written at the next evaluation
    if (best["checkpoint"] == BEST_CHECKPOINT and best["step"] != state.step or best["checkpoint"] != BEST_CHECKPOINT
            and improves(best, figures, (best["metric"], best["goal"] == "minimize"))):
        return {**best, "checkpoint": BEST_CHECKPOINT, "step": state.step, "value": float(value)}
    return best


def _check_best(best: dict, path: Path) -> dict:
    def bad(what: str) -> ValueError:
        return ValueError(f"{path} is not a best.json of this version ({what}); remove it and the run tracks its "
                          "best evaluation afresh")

    checkpoint, value = best.get("checkpoint"), best.get("value")
    if "checkpoint" not in best:
        raise bad("it names no checkpoint, not even null")
    if checkpoint is not None and (not isinstance(checkpoint, str) or "/" in checkpoint or
                                   not checkpoint.startswith("checkpoint-")):
        raise bad(f"checkpoint {checkpoint!r} is not a checkpoint directory's name")
    if not isinstance(best.get("step"), int) or isinstance(best.get("step"), bool):
        raise bad(f"step {best.get('step')!r} is not an integer")
    if not isinstance(best.get("metric"), str):
        raise bad(f"metric {best.get('metric')!r} is not a name")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(f"value {value!r} is not a finite number")
    if best.get("goal") not in ("minimize", "maximize"):
        raise bad(f"goal {best.get('goal')!r} is neither minimize nor maximize")
    return best
