"""The run directory: where a run writes, and what a resumed run finds there.

    runs/<name>/                             training.output_dir ({name}: the config's name)
        config.json                          the run's config
        metrics.jsonl                        a record per log_every steps and per evaluation
        metrics.before-resume-<step>.jsonl   a continued run's history before it resumed
        branch.json                          a branch: the checkpoint it starts from, what changed
        best.json                            the checkpoint with the best evaluation figure
        checkpoint-<step>/, checkpoint-final/   (session/checkpoint.py)

`plan_run` decides where a run writes: a fresh directory (never one holding another
run: `runs/demo` taken means `runs/demo.1`), the run a checkpoint belongs to (it
continues in place when the config is the run's own, execution settings aside, and
the run has not gone past the checkpoint), or a branch of it in a fresh directory;
`"auto"` (the default under torchrun when the run directory holds a checkpoint) picks
the run's newest verified checkpoint. `prepare_run_dir` creates the directory and its
records without losing anything of earlier runs; `MetricsLog` appends to metrics.jsonl
(and W&B); `update_best` keeps best.json. Rank 0 alone calls what writes.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from bert.config import Config, config_from_dict
from session import checkpoint as checkpoints
from session.checkpoint import STATE_FILE

__all__ = ["BEST_FILE", "BRANCH_FILE", "CONFIG_FILE", "METRICS_FILE", "MetricsLog", "RunPlan",
           "configured_output_dir", "fresh_output_dir", "newest_checkpoint", "plan_run", "prepare_run_dir",
           "read_best", "update_best"]

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
    return checkpoints.read_state(directory).step


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
    """`section.key old → new` for each setting that changes what the run computes.

    The saved config is read through today's schema where it still validates, so a key
    added since it was written compares as its default (an older run resumes in place)."""
    try:
        saved = config_from_dict(saved).model_dump(mode="json")
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


def read_best(run_dir: Path) -> Optional[dict]:
    path = run_dir / BEST_FILE
    return _read_json(path) if path.exists() else None


def update_best(run_dir: Path, best: Optional[dict], checkpoint: Path, step: int, figures: dict[str, float],
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
