"""The sweep's worker: the study made or joined (`open_study`), trials taken one after another
and each run through the run loop in this process (`run_sweep`), with divergence, hyperband,
signals and dead workers handled as docs/sweeps.md describes.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import optuna
from optuna.trial import TrialState

from bert.tasks import pretraining as run_loop
from bert.config import Config, upgrade, with_overrides
from bert.run.outputs import check_output_dir
from bert.sweep import storage as stores
from bert.sweep.report import print_best, short, write_report
from bert.sweep.spec import Parameter, SweepSpec, is_periodic
from bert.sweep.storage import StorageDamaged, open_storage, quiet_optuna, storage_errors
from fileio import DiskFull, disk_full

__all__ = ["SweepResult", "make_pruner", "make_sampler", "open_study", "run_sweep"]

POLL_S = 1.0


def make_sampler(spec: SweepSpec, seed: Optional[int] = None):
    """random: uniform draws; bayes: TPE with the constant liar, so parallel workers do not propose
    alike (nor do workers with different seeds; None: fresh entropy). A grid's sampler never proposes."""
    if spec.method == "bayes":
        return optuna.samplers.TPESampler(multivariate=True, constant_liar=True, seed=seed)
    return optuna.samplers.RandomSampler(seed=seed)


def make_pruner(spec: SweepSpec):
    """W&B's hyperband stops a run outside the best 1/eta at steps min_iter·eta^k: successive halving."""
    if spec.hyperband is None:
        return optuna.pruners.NopPruner()
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=spec.hyperband.min_resource,
                                                  reduction_factor=spec.hyperband.eta)


def _settings(spec: SweepSpec, base: Config) -> dict:
    """What makes an edited YAML the same sweep: everything but a grid's values, and the labels."""
    config = base.model_dump(mode="json")
    config.pop("name", None)  # a label, as in bert.tasks.pretraining's resume check
    settings = {"method": spec.method, "metric": spec.metric, "goal": spec.goal, "target": spec.target,
                "run_cap": spec.run_cap, "hyperband": spec.hyperband and dataclasses.asdict(spec.hyperband),
                "parameters": {p.name: "grid" if spec.method == "grid" and p.distribution != "constant"
                               else dataclasses.asdict(p) for p in spec.parameters}, "config": config}
    return json.loads(json.dumps(settings, default=str))


def _changes(old: Any, new: Any, at: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):  # config fields a later version added are no change
        keys = set(old) if at.startswith("config.") else set(old) | set(new)
        return [c for k in sorted(keys) for c in _changes(old.get(k), new.get(k), f"{at}{k}.")]
    return [] if old == new else [f"{at[:-1]} {old!r} → {new!r}"]


def open_study(spec: SweepSpec, base: Config, storage: str, sampler_seed: Optional[int] = None):
    """Create the sweep's study (enqueueing a grid) or join it; returns (study, storage).

    A grid edited to keep every point it had and gain others is the same sweep: the new points
    are enqueued. Any other change is refused, naming what changed.
    """
    store = open_storage(storage)
    with storage_errors(storage):
        if any(s.study_name == spec.name for s in store.get_all_studies()):  # checked before anything is written
            _check_records(optuna.load_study(study_name=spec.name, storage=store), storage)
        return _open_study(spec, base, storage, store, sampler_seed)


def _open_study(spec: SweepSpec, base: Config, storage: str, store, sampler_seed: Optional[int]):
    sampler, pruner, settings = make_sampler(spec, sampler_seed), make_pruner(spec), _settings(spec, base)
    grid = [json.dumps(p, sort_keys=True) for p in spec.grid_points()] if spec.method == "grid" else []
    had: list[str] = []
    try:
        study = optuna.create_study(study_name=spec.name, storage=store, sampler=sampler, pruner=pruner,
                                    direction=spec.goal)
    except optuna.exceptions.DuplicatedStudyError:
        study = optuna.load_study(study_name=spec.name, storage=store, sampler=sampler, pruner=pruner)
        deadline = time.monotonic() + 60  # its creator may still be enqueueing the grid
        while "sweep" not in study.user_attrs:
            if any(t.state != TrialState.WAITING for t in study.get_trials(deepcopy=False)):
                # Workers claim trials only once the creator has written the attribute: it was lost.
                raise StorageDamaged(f"sweep storage {storage} cannot be read (study {spec.name!r}: trials have run, "
                                     "but its attribute 'sweep', the settings and grid written before any trial "
                                     f"runs, is missing); if it is damaged, {stores.AFRESH}")
            if time.monotonic() > deadline:
                raise ValueError(f"sweep {spec.name!r} in {storage} never finished its creation; delete the study")
            time.sleep(POLL_S)
        _check_records(study, storage, trials=False)
        had = study.user_attrs["sweep"]["grid"]
        stored = dict(study.user_attrs["sweep"]["settings"])
        if isinstance(stored.get("config"), dict):  # a sweep started under config version 1 goes on
            stored["config"] = upgrade(stored["config"], f"sweep {spec.name!r}'s stored config")
        changes = _changes(stored, settings)
        if set(had) - set(grid):
            changes.append(f"the grid lost {len(set(had) - set(grid))} of its points, e.g. {min(set(had) - set(grid))}")
        if changes:  # one line, though a damaged storage's grid points and keys may hold line breaks
            said = "; ".join(changes).replace("\r", "\\r").replace("\n", "\\n")
            raise ValueError(f"sweep {spec.name!r} in {storage} was started with other settings: {said}. "
                             "A sweep continues only with the same settings, or with a grid that gained values; give "
                             "this one another name (name: in the YAML) or another --sweep-dir")
        grid = [p for p in grid if p not in set(had)]
        if not grid:
            return study, store
        print(f"sweep {spec.name}: the grid gained {len(grid)} point(s); the {len(had)} it had are kept", flush=True)
    for point in grid:
        study.enqueue_trial({}, user_attrs={"values": dict(spec.constants, **json.loads(point))})
    study.set_user_attr("sweep", {"settings": settings, "grid": had + grid})  # last: the sweep is ready to join
    return study, store


# The attributes this module keeps in the storage, and their types: a storage that holds others
# (damaged, or written by something else) is refused before the worker reads them.
_USER_ATTRS = {"values": (dict,), "output_dir": (str,), "checkpoint": (str,), "error": (str, type(None)),
               "worker": (str,), "discarded": (str,)}
_SYSTEM_ATTRS = {stores.BEAT: (int, float), stores.REQUEUED: (int,), "failed_trial": (int,), "retry_history": (list,)}


def _check_records(study: optuna.Study, where: str, trials: bool = True) -> None:
    def bad(what: str) -> StorageDamaged:
        return StorageDamaged(f"sweep storage {where} cannot be read (study {study.study_name!r}: {what}); if it is "
                              f"damaged, {stores.AFRESH}")

    sweep = study.user_attrs.get("sweep")
    if sweep is not None and not (isinstance(sweep, dict) and isinstance(sweep.get("settings"), dict)
                                  and isinstance(sweep.get("grid"), list)
                                  and all(isinstance(p, str) for p in sweep["grid"])):
        raise bad("its attribute 'sweep' is not the settings and grid this runner writes")
    for t in study.get_trials(deepcopy=False) if trials else ():
        for attrs, types in ((t.user_attrs, _USER_ATTRS), (t.system_attrs, _SYSTEM_ATTRS)):
            for key, allowed in types.items():
                if key in attrs and (not isinstance(attrs[key], allowed) or isinstance(attrs[key], bool)):
                    raise bad(f"trial {t.number}'s attribute {key!r} is {attrs[key]!r}")
        if not all(isinstance(n, int) for n in t.system_attrs.get("retry_history", [])):
            raise bad(f"trial {t.number}'s retry history is {t.system_attrs['retry_history']!r}")
        if t.values is not None and (len(t.values) != 1 or t.state not in (TrialState.COMPLETE, TrialState.PRUNED)) \
                or (t.state == TrialState.COMPLETE and t.values is None):  # a pruned trial has its last value
            raise bad(f"trial {t.number} ({t.state.name.lower()}) has the values {t.values!r}, not one")
        if not all(isinstance(v, (int, float)) for v in t.intermediate_values.values()):
            raise bad(f"trial {t.number}'s curve holds a value that is not a number")


class _Diverged(RuntimeError):
    pass


class _MetricMissing(ValueError):
    pass


class _Monitor:
    """The on_log hook: divergence check, the metric to Optuna, hyperband's verdict.

    The trial's value is the metric of the last record that carries it: for an evaluation metric,
    the run's final evaluation (not its best one, which would favour a lucky evaluation).
    """

    def __init__(self, trial: optuna.Trial, spec: SweepSpec, max_loss: float, reported: set[int]):
        self.trial, self.spec, self.max_loss, self.reported = trial, spec, max_loss, reported
        self.last: Optional[float] = None
        self.step = 0  # the last step logged in this run (0: none yet)

    def __call__(self, record: dict) -> None:
        name, self.step, loss = self.spec.metric, record["step"], record.get("loss")
        if loss is not None and not (math.isfinite(loss) and loss <= self.max_loss):
            raise _Diverged(f"diverged at step {self.step}: loss {loss} (bound {self.max_loss:.4g})")
        if record.get(name, ...) is ...:
            if loss is not None and not is_periodic(name):  # a training record without a training metric
                raise _MetricMissing(f"metric {name!r} of sweep {self.spec.source} is not logged; the run logs "
                                     f"{sorted(k for k in record if k != 'step')}")
            return
        self.last = float("nan") if record[name] is None else float(record[name])
        if not math.isfinite(self.last):
            raise _Diverged(f"diverged at step {self.step}: {name} {self.last}")
        if self.step not in self.reported:
            self.reported.add(self.step)
            self.trial.report(self.last, self.step)
        if self.spec.hyperband and self.trial.should_prune():
            raise optuna.TrialPruned(f"stopped by hyperband at step {self.step}: {name} {self.last:.6g}")


@dataclass
class SweepResult:
    name: str
    storage: str
    sweep_dir: Path
    rows: list[dict]  # every run, best first (see write_report)
    best: Optional[dict]
    edges: list[str]  # numeric parameters whose best value is at an edge of the searched range


def run_sweep(
    spec: SweepSpec, base: Config, *, sweep_dir: Optional[str | os.PathLike] = None, storage: Optional[str] = None,
    trials: Optional[int] = None, use_wandb: bool = False, max_loss: Optional[float] = None, progress: bool = True,
    sampler_seed: Optional[int] = None, wait: bool = True,
) -> SweepResult:
    """Run trials of the sweep until it is done (or `trials` of them here); returns the report.
    With `wait` False, return as soon as no trial is left to take here, without waiting for
    other workers' running trials (a worker with other sweeps to join meanwhile).

    `base` is the config the command line names (the YAML's --config plus fixed overrides);
    the swept values are applied over it. `max_loss` marks a run diverged (default: twice the
    loss of guessing uniformly, 2·(ln vocab + ln 2)). A trial stopped by SIGINT or SIGTERM is
    queued again, to resume from its checkpoint when the sweep runs again, and this raises
    bert.tasks.pretraining.RunInterrupted (its `signal` set): the worker stops.
    """
    if trials is not None and trials < 0:
        raise ValueError(f"--trials {trials}: give 0 or more (0 writes the report only; leave it out to run "
                         "until the sweep is done)")
    sweep_dir = check_output_dir(sweep_dir or Path("runs") / "sweeps" / spec.name, "sweep --sweep-dir")
    if storage is None and (sweep_dir / "optuna.db").exists() and not (sweep_dir / stores.JOURNAL).exists():
        raise ValueError(f"{sweep_dir / 'optuna.db'} holds this sweep as an earlier bert.py kept it (SQLite); continue "
                         f"it with --storage sqlite:///{(sweep_dir / 'optuna.db').resolve()} (one worker at a time)")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    where = storage or stores.default_storage(sweep_dir)
    _check_parameters(spec, base)
    with quiet_optuna():
        study, store = open_study(spec, base, where, sampler_seed)
    with quiet_optuna(), storage_errors(where):
        worker = _Worker(spec, base, sweep_dir, study, store, use_wandb, progress,
                         max_loss if max_loss is not None else 2 * (math.log(base.model.vocab_size) + math.log(2)))
        print(f"sweep {spec.name} ({spec.method}, {spec.goal} {spec.metric}): storage {where}, runs in {sweep_dir}",
              flush=True)
        try:
            try:
                worker.loop(trials, wait)
            except BaseException:
                try:
                    write_report(study, spec, sweep_dir)
                except OSError as e:  # a full disk: the error in flight says why and what to do; this would hide it
                    print(f"note: the report was not written ({e.filename or sweep_dir}: {e.strerror or e})",
                          flush=True)
                raise
            rows, best, edges = write_report(study, spec, sweep_dir)
        except OSError as e:  # the sweep's own files (its report, its journal): the runs' are the worker's
            if not _disk_full(e):
                raise
            raise DiskFull(f"sweep {spec.name}: the disk is full: cannot write {e.filename or f'in {sweep_dir}'} "
                             f"({e.strerror}); free space, then the same command continues this sweep (every "
                             "finished run is kept)") from None
    print_best(spec, best, edges, sweep_dir)
    return SweepResult(spec.name, where, sweep_dir, rows, best, edges)


def _check_parameters(spec: SweepSpec, base: Config) -> None:
    """Every declared value (grid points, range ends, choices) must make a valid config."""
    def ends(p: Parameter) -> tuple:
        return p.values if p.distribution == "categorical" else (p.value(p.low), p.value(p.high))

    probes = [dict(spec.constants, **point) for point in spec.grid_points()] if spec.method == "grid" else [
        dict(spec.constants, **{p.name: v}) for p in spec.swept for v in ends(p)]
    for probe in probes:
        for key in ("name", "training.output_dir"):
            if key in probe:
                raise ValueError(f"sweep {spec.source}: parameter {key} is set by the sweep itself")
        with_overrides(base, probe, f"sweep {spec.source} parameters {probe}")


def _first_generation(trials) -> list:
    """Trials that count as runs: not re-runs of interrupted ones, not discarded claims."""
    return [t for t in trials if "failed_trial" not in t.system_attrs and not t.user_attrs.get("discarded")]


def _newest_checkpoint(run: Path) -> Optional[Path]:
    steps = [int(p.name[11:]) for p in run.glob("checkpoint-*") if p.name[11:].isdigit()]  # "checkpoint-" is 11
    return run / "checkpoint-final" if (run / "checkpoint-final").is_dir() else \
        run / f"checkpoint-{max(steps)}" if steps else None


def _disk_full(error: Optional[BaseException]) -> bool:
    """Whether `error`, or an error it was raised from, is a write that failed for want of space
    (fileio.disk_full: the OSError itself, or a writer's DiskFull naming what it could not write)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if disk_full(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _full_where(error: BaseException, out_dir: Path) -> str:
    """What could not be written, naming the path: the run's own words, or the run directory."""
    if isinstance(error, OSError):
        return f"cannot write {error.filename or f'in {out_dir}'} ({error.strerror or error})"
    text = " ".join(str(error).split()).split("; ")[0]
    return text.removeprefix("the disk is full: ")


def _final_value(run: Path, metric: str) -> Optional[float]:
    """The metric of the last record in the run's metrics.jsonl that carries it."""
    path = run / run_loop.METRICS_FILE
    values = [r[metric] for r in map(json.loads, path.read_text().splitlines() if path.exists() else [])
              if r.get(metric) is not None]
    return values[-1] if values else None


class _Worker:
    """Takes the sweep's trials one after another and runs each through the run loop, in this process."""

    def __init__(self, spec, base, sweep_dir, study, storage, use_wandb, progress, max_loss):
        self.spec, self.base, self.sweep_dir, self.study, self.storage = spec, base, sweep_dir, study, storage
        self.use_wandb, self.progress, self.max_loss = use_wandb, progress, max_loss
        self.study_id = storage.get_study_id_from_name(spec.name)
        self.distributions = None if spec.method == "grid" else {p.name: p.distribution_for() for p in spec.swept}
        self.me = f"{socket.gethostname()}:{os.getpid()}"

    def loop(self, trials: Optional[int], wait: bool = True) -> None:
        done, waiting_for = 0, []
        while trials is None or done < trials:
            claimed = self._claim()
            if claimed is not None:
                self._run(*claimed)
                done += 1
                write_report(self.study, self.spec, self.sweep_dir, plots=False)  # plots at the end (or --trials 0)
                continue
            active = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING))
            if not active or not wait or self._target_reached(self.study.get_trials(deepcopy=False)):
                return
            running = [t.number for t in active if t.state == TrialState.RUNNING]
            if running and running != waiting_for:  # wait, to run again any whose worker dies
                print(f"waiting for trial(s) {running} of other workers; one whose worker died runs again here "
                      f"once its heartbeat is {stores.GRACE_S} s old", flush=True)
            waiting_for = running
            time.sleep(POLL_S)

    def _id(self, number: int) -> int:
        return self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)

    def _target_reached(self, trials) -> bool:
        return self.spec.target is not None and any(
            t.state == TrialState.COMPLETE and not self.spec.better(self.spec.target, t.value) for t in trials)

    def _claim(self) -> Optional[tuple[optuna.Trial, dict]]:
        """The next trial to run here and its config values, or None when there is none now."""
        while True:
            stores.fail_stale_trials(self.study, self.storage, self.study_id)  # dead workers' trials: queued again
            trials = self.study.get_trials(deepcopy=False)
            cap = self.spec.run_cap if self.spec.method != "grid" else None
            if self._target_reached(trials) or not any(t.state == TrialState.WAITING for t in trials) and (
                    self.spec.method == "grid" or cap and len(_first_generation(trials)) >= cap):
                return None
            trial = self.study.ask(self.distributions)  # a waiting trial first; the storage makes it ours alone
            frozen = self.storage.get_trial(self._id(trial.number))
            surplus = self._surplus(frozen)
            if surplus is None:
                break
            trial.set_user_attr("discarded", surplus)
            self.study.tell(trial, state=TrialState.FAIL)
        values = frozen.user_attrs.get("values") or dict(
            self.spec.constants, **{p.name: p.value(trial.params[p.name]) for p in self.spec.swept})
        trial.set_user_attr("values", values)
        trial.set_user_attr("worker", self.me)
        if frozen.user_attrs.get("error"):  # a re-run inherits its original's attributes
            trial.set_user_attr("error", None)
        return trial, values

    def _surplus(self, frozen) -> Optional[str]:
        """Why a trial just taken must not run. No lock spans a check and a take, so workers may take
        one too many; the trial numbers (unique, in creation order) decide which."""
        if "failed_trial" in frozen.system_attrs:  # a re-run of an interrupted trial always runs
            return None
        earlier = _first_generation(t for t in self.study.get_trials(deepcopy=False) if t.number < frozen.number)
        if self.spec.method != "grid":
            return "over run_cap" if self.spec.run_cap and len(earlier) >= self.spec.run_cap else None
        if "values" not in frozen.user_attrs:
            return "no grid point left"
        if any(t.user_attrs.get("values") == frozen.user_attrs["values"] for t in earlier):
            return "grid point enqueued twice (two workers extended the grid at once)"
        return None

    def _run(self, trial: optuna.Trial, values: dict) -> None:
        tid = self._id(trial.number)
        frozen, metric = self.storage.get_trial(tid), self.spec.metric
        previous = Path(frozen.user_attrs.get("output_dir") or self.sweep_dir / "-")
        resume = _newest_checkpoint(previous) if "failed_trial" in frozen.system_attrs else None
        out_dir = previous if resume else (self.sweep_dir / f"trial-{trial.number}").resolve()  # or afresh
        shown = ", ".join(f"{k}={short(v, 6)}" for k, v in values.items())
        print(f"trial {trial.number} [{shown}]" + (f" resumes {resume}" if resume else ""), flush=True)
        trial.set_user_attr("output_dir", str(out_dir))
        overrides = dict(values, name=f"{self.spec.name}-trial-{trial.number}")
        overrides["training.output_dir"] = str(out_dir)
        try:
            config = with_overrides(self.base, overrides, f"sweep {self.spec.source} trial {trial.number}")
        except ValueError as e:  # a proposal inside the declared ranges can still break a config rule
            return self._finish(trial, TrialState.FAIL, error=str(e))
        monitor = _Monitor(trial, self.spec, self.max_loss, set(frozen.intermediate_values))
        if resume is not None and resume.name == "checkpoint-final":  # its worker died after the run ended
            checkpoint = resume
        elif (result := self._train(trial, tid, config, resume, monitor, out_dir)) is not None:
            checkpoint = result.checkpoint
        else:  # failed or stopped early, and recorded so
            return
        value = monitor.last if monitor.last is not None else _final_value(out_dir, metric)  # resumed at its end
        if value is None:
            self._finish(trial, TrialState.FAIL, error=f"the run logged no {metric!r}")
            raise ValueError(f"trial {trial.number} logged no {metric!r}: eval_loss, eval_mlm_loss, eval_mlm_accuracy "
                             "and eval_nsp_accuracy need held-out data (data.eval_files, or the demo's), SQuAD's f1 and "
                             "exact_match (v2.0: exact, HasAns_f1, ...) and the labelled tasks' accuracy, f1, pearson, "
                             "... data.dev_file; name a logged metric in the YAML (a new sweep: give it "
                             "another name)")
        self._finish(trial, TrialState.COMPLETE, value, checkpoint=checkpoint)

    def _train(self, trial, tid, config, resume, monitor, out_dir):
        """The run, through the run loop: its result, or None when it failed or was stopped early."""
        run = config.model.task.spec.train_entry()  # looked up per trial (bert/tasks/spec.py)
        with stores.heartbeat(self.storage, tid):
            try:
                return run(config, checkpoint_input=str(resume) if resume else None, use_wandb=self.use_wandb,
                           progress=self.progress, on_log=monitor)
            except StorageDamaged:  # the sweep's own records, not the run: the worker stops
                raise
            except optuna.TrialPruned as e:
                self._finish(trial, TrialState.PRUNED, error=str(e))
            except (run_loop.RunInterrupted, KeyboardInterrupt) as e:  # the trial waits; the worker stops
                how = f"stopped by {signal.Signals(getattr(e, 'signal', signal.SIGINT)).name} at step {monitor.step}"
                self._finish(trial, TrialState.FAIL, error=f"interrupted: {how}", requeue=True)
                if isinstance(e, KeyboardInterrupt):  # a second Ctrl-C, or one before the run took signals
                    raise
                raise run_loop.RunInterrupted(
                    f"sweep {self.spec.name}: trial {trial.number} {how}; it is queued again and resumes from "
                    f"{_newest_checkpoint(out_dir) or 'step 0 (no checkpoint yet)'} when the same command runs again",
                    e.signal) from None
            except _MetricMissing as e:
                self._finish(trial, TrialState.FAIL, error=str(e))
                raise ValueError(f"{e}; name a logged metric in the YAML (a new sweep: give it another name)") from None
            except Exception as e:
                if _disk_full(e):  # not the trial's fault, nor will the next one run: the worker stops
                    self._stop_on_full_disk(trial, e, out_dir)
                if isinstance(e, ValueError) and monitor.step == 0:  # before the first step: the setup, not the run
                    self._finish(trial, TrialState.FAIL, error=str(e), requeue=True)
                    raise ValueError(f"trial {trial.number} failed before its first step: {e}; once that is fixed "
                                     "(missing files in place), the same command continues this sweep") from None
                # diverged (ours or the run loop's own check), or crashed: the sweep goes on
                self._finish(trial, TrialState.FAIL, error=f"{type(e).__name__}: {e}")
        return None

    def _stop_on_full_disk(self, trial, error: Exception, out_dir: Path) -> None:
        """The trial waits, as an interrupted one does, to resume from its last checkpoint once
        there is space; the worker stops with one line naming what could not be written."""
        where = _full_where(error, out_dir)
        try:
            self._finish(trial, TrialState.FAIL, error=f"interrupted: the disk is full: {where}", requeue=True)
            waits = "is queued again and"
        except OSError:  # the journal is on the full disk too: the trial is given up for dead instead
            waits = f"is given up for dead {stores.GRACE_S} s after its last heartbeat, then"
        raise ValueError(f"sweep {self.spec.name}: the disk is full: {where}; trial {trial.number} {waits} resumes "
                         f"from {_newest_checkpoint(out_dir) or 'step 0 (no checkpoint yet)'}: free space, then "
                         "the same command continues this sweep") from None

    def _finish(self, trial: optuna.Trial, state: TrialState, value: Optional[float] = None,
                error: Optional[str] = None, checkpoint: Optional[Path] = None, requeue: bool = False) -> None:
        tid = self._id(trial.number)
        try:
            if error:
                trial.set_user_attr("error", error)
            if checkpoint is not None:
                trial.set_user_attr("checkpoint", str(checkpoint))
            if requeue:  # not the run's fault: queued again every time (see MAX_RETRY)
                count = self.storage.get_trial(tid).system_attrs.get(stores.REQUEUED, 0)
                self.storage.set_trial_system_attr(tid, stores.REQUEUED, count + 1)
            self.study.tell(trial, value if state == TrialState.COMPLETE else None, state=state)
        except optuna.exceptions.UpdateFinishedTrialError:  # failed as stale meanwhile: re-queued then
            print(f"trial {trial.number}: another worker gave it up for dead while it ran (no heartbeat for "
                  f"{stores.GRACE_S} s)", flush=True)
            return
        if requeue:
            stores.requeue(self.study, self.storage.get_trial(tid))
        done = state == TrialState.COMPLETE
        print(f"trial {trial.number}: " + (f"{self.spec.metric} {value:.6g}" if done else
                                           f"{state.name.lower()}: {error}"), flush=True)


