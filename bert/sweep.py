"""Hyper-parameter sweeps described in W&B's sweep YAML, run without a W&B server.

    python bert.py --sweep configs/sweeps/<name>.yaml [--storage PATH|URL] [--trials N] [--sweep-dir DIR]

The YAML is W&B's sweep configuration (schema: wandb/sweeps, config/schema.json); the same
file runs under `wandb sweep` + `wandb agent` unchanged. Optuna keeps the sweep: a study in
a journal file (or a database) that workers share, a grid enqueued whole, its samplers and
pruner, exclusive takes with `study.ask()`, heartbeats and the retry of a dead worker's
trial. Here is what is the product's own: the YAML's checks, its values on the typed config,
each trial as a run of the run loop in this process, a trial stopped by a signal queued to
resume from its checkpoint, a grid that grows in place, and the report. docs/sweeps.md
gives the reason for each piece.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import itertools
import json
import math
import os
import re
import signal
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import optuna
import sqlalchemy.exc
import yaml
from optuna.storages import JournalStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages._heartbeat import BaseHeartbeat, get_heartbeat_thread  # no public name; pinned Optuna
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from bert import finetune as squad, train as run_loop  # modules: the entry points are looked up per trial
from bert.config import Config, Task, with_overrides

__all__ = ["Hyperband", "Parameter", "SweepResult", "SweepSpec", "edge_flags", "load_spec", "open_study",
           "run_sweep", "spec_from_dict", "write_report"]

METHODS = ("grid", "random", "bayes")
# W&B top-level keys this runner honours; project/entity/description only matter to W&B.
_TOP_KEYS = {"program", "method", "metric", "parameters", "early_terminate", "command", "run_cap",
             "name", "description", "project", "entity"}
# W&B keys with no meaning without W&B's server (or no Optuna counterpart): refused, never ignored.
_UNSUPPORTED_TOP = {"apiVersion", "kind", "controller", "job", "image_uri", "scheduler", "metrics"}
_DISTRIBUTION_KEYS = {
    "constant": {"value"},
    "categorical": {"values"},
    "int_uniform": {"min", "max"},
    "uniform": {"min", "max"},
    "q_uniform": {"min", "max", "q"},
    "log_uniform_values": {"min", "max"},
    "q_log_uniform_values": {"min", "max", "q"},
    "log_uniform": {"min", "max"},  # W&B's first form: min and max are natural-log exponents
    "q_log_uniform": {"min", "max", "q"},
}
_UNBOUNDED = {"normal", "q_normal", "log_normal", "q_log_normal", "beta", "q_beta"}
_GRID_DISTRIBUTIONS = {"constant", "categorical", "int_uniform", "q_uniform"}
_LOG_DISTRIBUTIONS = {"log_uniform_values", "q_log_uniform_values", "log_uniform", "q_log_uniform"}
_COMMAND_MACROS = {"${env}", "${interpreter}", "${program}", "${args}", "${args_no_equals}"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")  # W&B's pattern for parameter names
PROGRAM = "bert.py"

# A running trial records a heartbeat every HEARTBEAT_S; one whose heartbeat is GRACE_S old
# belonged to a worker that died without warning (SIGKILL, the OOM killer, a lost machine):
# it is failed and queued again, at most MAX_RETRY times, so a run that kills its process every
# time stops being retried. A trial stopped by a signal, or by a setup error before its first
# step, is queued again every time (the count of those is the trial attribute _REQUEUED).
HEARTBEAT_S = 20
GRACE_S = 120
MAX_RETRY = 2
POLL_S = 1.0
JOURNAL = "optuna.journal"
_BEAT, _REQUEUED = "heartbeat", "requeued"
# SQuAD's dev scores under the official scripts' names (v1.1; v2.0 with its HasAns/NoAns
# parts and threshold search); they and the eval_* metrics come at evaluations, not in every record.
SQUAD_SCORES = ("exact_match", "f1", "exact", "HasAns_exact", "HasAns_f1", "NoAns_exact", "NoAns_f1",
                "best_exact", "best_f1")
EDGE = 0.1  # a best value in the outer tenth of a range (random, bayes) is at its edge


# ------------------------------------------------------------------------- the spec
@dataclass(frozen=True)
class Parameter:
    """One config field and its W&B distribution; low/high bound the values the config gets."""

    name: str
    distribution: str
    values: tuple = ()  # categorical choices, or the one constant
    low: float = 0.0
    high: float = 0.0
    q: Optional[float] = None

    @property
    def log(self) -> bool:
        return self.distribution in _LOG_DISTRIBUTIONS

    def grid(self) -> list:
        """The values a grid runs, as W&B's grid search lists them."""
        if self.distribution in ("constant", "categorical"):
            return list(self.values)
        if self.distribution == "int_uniform":
            return list(range(int(self.low), int(self.high) + 1))
        # q_uniform: W&B's grid takes numpy.arange(min, max, q), which stops short of max.
        n = math.ceil((self.high - self.low) / self.q - 1e-9)
        return [self._number(self.low + i * self.q) for i in range(n)]

    def distribution_for(self):
        """The Optuna distribution a random or bayes sweep draws from (the raw value before `value`).

        A grid draws nothing: its points are enqueued whole (`open_study`)."""
        if self.distribution == "categorical":  # by index: Optuna's choices are scalars, W&B's values need not be
            return optuna.distributions.CategoricalDistribution(list(range(len(self.values))))
        if self.distribution == "int_uniform":
            return optuna.distributions.IntDistribution(int(self.low), int(self.high))
        # Quantized forms are drawn continuously, then rounded to q, as W&B defines them.
        return optuna.distributions.FloatDistribution(self.low, self.high, log=self.log)

    def value(self, raw: Any) -> Any:
        """The config value for an Optuna draw from `distribution_for()`."""
        if self.distribution in ("constant", "categorical"):
            return self.values[raw]
        if self.distribution == "int_uniform":
            return int(raw)
        if self.q is None:
            return float(raw)
        # round(x / q) * q, kept inside [min, max] (W&B's rounding can step past either end).
        k = min(max(round(raw / self.q), math.ceil(self.low / self.q - 1e-9)), math.floor(self.high / self.q + 1e-9))
        return self._number(k * self.q)

    def _number(self, x: float):
        # W&B returns integers when q is an integer; 12 digits drop float noise (0.30000000000000004).
        return int(round(x)) if isinstance(self.q, int) else float(f"{x:.12g}")


@dataclass(frozen=True)
class Hyperband:
    """W&B's hyperband early termination as successive-halving rungs: min_resource × eta^k steps."""

    min_resource: int
    eta: int


@dataclass(frozen=True)
class SweepSpec:
    name: str
    method: str
    metric: str
    goal: str  # "minimize" | "maximize"
    parameters: tuple[Parameter, ...]
    program_args: tuple[str, ...]  # what `wandb agent` passes to bert.py besides the swept values
    target: Optional[float] = None
    run_cap: Optional[int] = None
    hyperband: Optional[Hyperband] = None
    description: str = ""
    source: str = ""

    @property
    def swept(self) -> tuple[Parameter, ...]:
        return tuple(p for p in self.parameters if p.distribution != "constant")

    @property
    def constants(self) -> dict[str, Any]:
        return {p.name: p.values[0] for p in self.parameters if p.distribution == "constant"}

    def grid_points(self) -> list[dict[str, Any]]:
        """Every combination, in W&B's order (itertools.product over the parameters by name)."""
        names = [p.name for p in self.swept]
        points = [dict(zip(names, combo)) for combo in itertools.product(*(p.grid() for p in self.swept))]
        return points[: self.run_cap] if self.run_cap else points

    def better(self, a: float, b: float) -> bool:
        return a < b if self.goal == "minimize" else a > b


def load_spec(path: str | os.PathLike) -> SweepSpec:
    """Read and check a W&B sweep YAML; every problem is a ValueError naming the key."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"sweep file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ValueError(f"sweep file {path} is not valid YAML: {e}") from None
    return spec_from_dict(raw, str(path))


def spec_from_dict(raw: Any, source: str = "<dict>") -> SweepSpec:
    def bad(msg: str) -> ValueError:
        return ValueError(f"sweep {source}: {msg}")

    if not isinstance(raw, dict):
        raise bad("the file must hold a mapping of W&B sweep keys (method, metric, parameters, ...)")
    for key in raw:
        if key in _UNSUPPORTED_TOP:
            raise bad(f"key {key!r} is a W&B server feature this runner cannot honour; remove it")
        if key not in _TOP_KEYS:
            raise bad(f"unknown key {key!r}; W&B's sweep keys are {sorted(_TOP_KEYS | _UNSUPPORTED_TOP)}")
    for key in ("method", "parameters"):
        if key not in raw:
            raise bad(f"missing key {key!r}")
    method = raw["method"]
    if method not in METHODS:
        raise bad(f"method {method!r} is not one of {list(METHODS)}")
    name = str(raw.get("name") or re.sub(r"[^A-Za-z0-9_.-]", "", Path(source).stem) or "sweep")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise bad(f"name {name!r} must be letters, digits, '_', '.' or '-' (it names the sweep directory)")

    metric = raw.get("metric")
    if not isinstance(metric, dict) or "name" not in metric:
        raise bad("metric: give the logged metric to rank runs by, e.g. {name: mlm_accuracy, goal: maximize}")
    for key in metric:
        if key not in ("name", "goal", "target"):
            raise bad(f"metric.{key} is not supported (Optuna's samplers skip failed runs instead of imputing)"
                      if key in ("impute", "impute_while_running") else f"unknown key metric.{key}")
    goal = metric.get("goal", "minimize")
    if goal not in ("minimize", "maximize"):
        raise bad(f"metric.goal {goal!r} must be 'minimize' or 'maximize'")
    target = metric.get("target")
    if target is not None:
        target = _number(target, "metric.target", bad)

    params = raw["parameters"]
    if not isinstance(params, dict) or not params:
        raise bad("parameters must map config fields (training.learning_rate) to distributions")
    parameters = tuple(_parameter(str(k), v, bad) for k, v in params.items())
    if method == "grid":
        for p in parameters:
            if p.distribution not in _GRID_DISTRIBUTIONS:
                raise bad(f"parameters.{p.name}: a grid needs values, value, int_uniform or q_uniform, not "
                          f"{p.distribution}; list the values or use method random or bayes")
    if not any(p.distribution != "constant" for p in parameters):
        raise bad("parameters: nothing is swept (every parameter is a single value)")

    run_cap = raw.get("run_cap")
    if run_cap is not None and (not _is_int(run_cap) or run_cap <= 0):
        raise bad(f"run_cap {run_cap!r} must be a positive integer")
    return SweepSpec(
        name=name, method=method, metric=str(metric["name"]), goal=goal, parameters=parameters,
        program_args=_program_args(raw, bad), target=target, run_cap=run_cap,
        hyperband=_hyperband(raw.get("early_terminate"), bad), description=str(raw.get("description", "")),
        source=source,
    )


def _parameter(name: str, spec: Any, bad) -> Parameter:
    where = f"parameters.{name}"
    if not _NAME.match(name):
        raise bad(f"{where}: a parameter is a config field such as training.learning_rate")
    if not isinstance(spec, dict):
        raise bad(f"{where} must be a mapping such as {{values: [...]}} or {{min: ..., max: ...}}")
    if "parameters" in spec:
        raise bad(f"{where}: nested parameters reach bert.py as one dict-valued argument it cannot read; "
                  f"name each field with dots ({name}.<key>)")
    dist = spec.get("distribution")
    if dist is not None and not isinstance(dist, str):
        raise bad(f"{where}.distribution {dist!r} must be a name such as uniform")
    if dist is None:  # W&B infers the distribution from the keys present
        if "values" in spec:
            dist = "categorical_w_probabilities" if "probabilities" in spec else "categorical"
        elif "value" in spec:
            dist = "constant"
        elif "min" in spec and "max" in spec:
            dist = "int_uniform" if _is_int(spec["min"]) and _is_int(spec["max"]) else "uniform"
        else:
            raise bad(f"{where} needs values, value, or min and max")
    if dist in _UNBOUNDED or dist.startswith("inv_log_uniform") or dist == "categorical_w_probabilities":
        raise bad(f"{where}: distribution {dist!r} is not supported (Optuna has no bounded counterpart); "
                  "use uniform, log_uniform_values, their q_ forms, int_uniform or values")
    if dist not in _DISTRIBUTION_KEYS:
        raise bad(f"{where}: unknown distribution {dist!r}; W&B's are {sorted(_DISTRIBUTION_KEYS)} and others")
    allowed = _DISTRIBUTION_KEYS[dist] | {"distribution"}
    for key in spec:
        if key not in allowed:
            raise bad(f"{where}.{key} does not belong to distribution {dist} (its keys: {sorted(allowed)})")
    for key in _DISTRIBUTION_KEYS[dist] - {"q"}:
        if key not in spec:
            raise bad(f"{where}: distribution {dist} needs {key!r}")

    if dist == "constant":
        return Parameter(name, dist, values=(spec["value"],))
    if dist == "categorical":
        values = spec["values"]
        if not isinstance(values, list) or not values:
            raise bad(f"{where}.values must be a non-empty list")
        return Parameter(name, dist, values=tuple(values))

    low, high = (_number(spec[k], f"{where}.{k}", bad) for k in ("min", "max"))
    if dist == "int_uniform" and not (_is_int(spec["min"]) and _is_int(spec["max"])):
        raise bad(f"{where}: int_uniform needs integer min and max, not {spec['min']!r} and {spec['max']!r}")
    if low > high:
        raise bad(f"{where}: min {low} is above max {high}")
    if dist in ("log_uniform", "q_log_uniform"):
        low, high = math.exp(low), math.exp(high)
    elif dist in _LOG_DISTRIBUTIONS and low <= 0:
        raise bad(f"{where}: {dist} needs min > 0, not {low}")
    q = None
    if dist.startswith("q_"):
        q = spec.get("q", 1)
        if not isinstance(q, (int, float)) or isinstance(q, bool) or q <= 0:
            raise bad(f"{where}.q {q!r} must be a positive number")
        if math.ceil(low / q - 1e-9) > math.floor(high / q + 1e-9):
            raise bad(f"{where}: no multiple of q {q} lies between min and max")
    return Parameter(name, dist, low=low, high=high, q=q)


def _hyperband(spec: Any, bad) -> Optional[Hyperband]:
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") != "hyperband":
        raise bad("early_terminate: the only type W&B defines is hyperband ({type: hyperband, min_iter: ...})")
    for key in spec:
        if key not in ("type", "min_iter", "max_iter", "s", "eta", "strict"):
            raise bad(f"unknown key early_terminate.{key}")
    eta = spec.get("eta", 3)
    if not _is_int(eta) or eta < 2:
        raise bad(f"early_terminate.eta {eta!r} must be an integer >= 2 (Optuna's successive halving)")
    if spec.get("strict", True) is not True:
        raise bad("early_terminate.strict false (W&B's conservative rule on the best value so far) is not "
                  "supported; Optuna's successive halving compares the value at each rung, as strict: true")
    if "max_iter" in spec:
        if not (_is_int(spec["max_iter"]) and _is_int(spec.get("s"))):
            raise bad("early_terminate: max_iter and s (the number of bands) must be integers")
        bands = [b for b in (spec["max_iter"] // eta**k for k in range(1, min(spec["s"], 64) + 1)) if b >= 1]
        if not bands:
            raise bad("early_terminate: max_iter / eta^k leaves no band of at least one step")
        return Hyperband(min(bands), eta)
    if "min_iter" not in spec:
        raise bad("early_terminate needs min_iter, or max_iter and s")
    if not _is_int(spec["min_iter"]) or spec["min_iter"] < 1:
        raise bad(f"early_terminate.min_iter {spec['min_iter']!r} must be a positive integer")
    return Hyperband(spec["min_iter"], eta)


def _program_args(raw: dict, bad) -> tuple[str, ...]:
    """The literal arguments of `command` after ${program}: the base config and fixed overrides."""
    program = raw.get("program")
    if program is None or Path(str(program)).name != PROGRAM:
        raise bad(f"program must be {PROGRAM} (W&B requires the key; this runner trains with bert.py), "
                  f"not {program!r}")
    command = raw.get("command", ["${env}", "${interpreter}", "${program}", "${args}"])
    if not isinstance(command, list):
        raise bad("command must be a list of tokens, as wandb agent takes it")
    tokens = [str(c) for c in command]
    for t in tokens:
        if t.startswith("${") and t not in _COMMAND_MACROS:
            raise bad(f"command macro {t} is not supported; bert.py takes {sorted(_COMMAND_MACROS)}")
    if "${program}" not in tokens:
        raise bad("command must contain ${program}")
    at = tokens.index("${program}")
    if any(t not in ("${env}", "${interpreter}") for t in tokens[:at]):
        raise bad(f"command: only ${{env}} and ${{interpreter}} may come before ${{program}}, not {tokens[:at]}")
    if not {"${args}", "${args_no_equals}"} & set(tokens[at + 1:]):
        raise bad("command must pass ${args} (or ${args_no_equals}) after ${program}: that is how wandb "
                  "agent hands bert.py the swept values")
    return tuple(t for t in tokens[at + 1:] if t not in _COMMAND_MACROS)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x: Any, where: str, bad) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        hint = ""
        if isinstance(x, str):
            with contextlib.suppress(ValueError):
                float(x)
                hint = f" (YAML reads {x} as text: write it with a decimal point, e.g. 1.0e-5)"
        raise bad(f"{where} {x!r} must be a number{hint}")
    return float(x)


# ------------------------------------------------------------------------- the storage
def default_storage(sweep_dir: Path) -> str:
    return str((sweep_dir / JOURNAL).resolve())


def _requeue(study: optuna.Study, trial) -> None:
    """Queue a failed trial's values again, with its output_dir and curve (Optuna's retry callback)."""
    retries = MAX_RETRY + trial.system_attrs.get(_REQUEUED, 0)  # only a dead worker's retries are capped
    RetryHeartbeatStaleTrialCallback(max_retry=retries, inherit_intermediate_values=True)(study, trial)


class _Journal(JournalStorage, BaseHeartbeat):
    """Optuna's journal file with the heartbeat its RDBStorage has (5.0's journal has none), so that
    `fail_stale_trials` and the retry callback work on it unchanged. A beat is the writer's clock in
    a trial attribute: machines sharing the file over NFS need their clocks in step (NTP)."""

    def __init__(self, path: str):
        super().__init__(JournalFileBackend(path))

    def record_heartbeat(self, trial_id: int) -> None:
        with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):  # given up for dead meanwhile
            self.set_trial_system_attr(trial_id, _BEAT, time.time())

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        now = time.time()  # a re-run inherits its original's beat, so its own start counts too
        return [t._trial_id for t in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,))
                if now - max(t.system_attrs.get(_BEAT, 0.0), t.datetime_start.timestamp()) > GRACE_S]

    def get_heartbeat_interval(self) -> int:
        return HEARTBEAT_S

    def get_heartbeat_stale_trial_callback(self):
        return _requeue


def open_storage(where: str):
    """The sweep's storage: a journal file (a path) or a database (an SQLAlchemy URL); one that
    cannot be read is a ValueError naming it, and is left as it was."""
    try:
        if "://" not in where:
            if os.path.getsize(where) if os.path.exists(where) else 0:  # the journal skips a torn last line
                with open(where, "rb") as f:
                    first = json.loads(f.readline())
                if not isinstance(first, dict) or "op_code" not in first:
                    raise ValueError("its first line is not a journal record")
            return _Journal(where)
        for attempt in range(5):
            try:
                return optuna.storages.get_storage(optuna.storages.RDBStorage(  # with Optuna's cache, as usual
                    where, engine_kwargs={"connect_args": {"timeout": 120}} if where.startswith("sqlite") else None,
                    heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S, heartbeat_stale_trial_callback=_requeue))
            except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
                # Workers started together on a new database race to create Optuna's tables (seen on
                # PostgreSQL: CREATE TYPE studydirection); the losers find them made next time.
                if attempt == 4:
                    raise
                time.sleep(0.2 * (attempt + 1))
    except ImportError as e:
        raise ValueError(f"storage {where}: its database driver is missing ({e.__cause__ or e}); for "
                         "postgresql:// URLs: pip install 'psycopg[binary]'") from None
    except Exception as e:  # noqa: BLE001 - whatever a damaged file makes Optuna or the database raise
        why = (str(e).strip().splitlines() or [""])[0][:300]
        raise ValueError(f"sweep storage {where} cannot be read ({type(e).__name__}: {why}); if it is damaged, "
                         "move it away to start the sweep afresh (the runs in the sweep directory stay)") from None


@contextlib.contextmanager
def _quiet_optuna() -> Iterator[None]:
    """Optuna's line per trial is noise here, and heartbeats and retries are 'experimental' in it."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
            yield
    finally:
        optuna.logging.set_verbosity(verbosity)


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
    config.pop("name", None)  # a label, as in bert.train's resume check
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
            if time.monotonic() > deadline:
                raise ValueError(f"sweep {spec.name!r} in {storage} never finished its creation; delete the study")
            time.sleep(POLL_S)
        had = study.user_attrs["sweep"]["grid"]
        changes = _changes(study.user_attrs["sweep"]["settings"], settings)
        if set(had) - set(grid):
            changes.append(f"the grid lost {len(set(had) - set(grid))} of its points, e.g. {min(set(had) - set(grid))}")
        if changes:
            raise ValueError(f"sweep {spec.name!r} in {storage} was started with other settings: {'; '.join(changes)}. "
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


# ------------------------------------------------------------------------ the worker
class _Diverged(RuntimeError):
    pass


class _MetricMissing(ValueError):
    pass


def _periodic(metric: str) -> bool:
    """Logged at evaluations only (every training.eval_every steps; SQuAD's dev scores), not every step."""
    return metric.startswith("eval_") or metric in SQUAD_SCORES


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
            if loss is not None and not _periodic(name):  # a training record without a training metric
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
    sampler_seed: Optional[int] = None,
) -> SweepResult:
    """Run trials of the sweep until it is done (or `trials` of them here); returns the report.

    `base` is the config the command line names (the YAML's --config plus fixed overrides);
    the swept values are applied over it. `max_loss` marks a run diverged (default: twice the
    loss of guessing uniformly, 2·(ln vocab + ln 2)). A trial stopped by SIGINT or SIGTERM is
    queued again, to resume from its checkpoint when the sweep runs again, and this raises
    bert.train.RunInterrupted (its `signal` set): the worker stops.
    """
    if trials is not None and trials < 0:
        raise ValueError(f"--trials {trials}: give 0 or more (0 writes the report only; leave it out to run "
                         "until the sweep is done)")
    sweep_dir = Path(sweep_dir or Path("runs") / "sweeps" / spec.name)
    if storage is None and (sweep_dir / "optuna.db").exists() and not (sweep_dir / JOURNAL).exists():
        raise ValueError(f"{sweep_dir / 'optuna.db'} holds this sweep as an earlier bert.py kept it (SQLite); continue "
                         f"it with --storage sqlite:///{(sweep_dir / 'optuna.db').resolve()} (one worker at a time)")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    where = storage or default_storage(sweep_dir)
    _check_parameters(spec, base)
    with _quiet_optuna():
        study, store = open_study(spec, base, where, sampler_seed)
        worker = _Worker(spec, base, sweep_dir, study, store, use_wandb, progress,
                         max_loss if max_loss is not None else 2 * (math.log(base.model.vocab_size) + math.log(2)))
        print(f"sweep {spec.name} ({spec.method}, {spec.goal} {spec.metric}): storage {where}, runs in {sweep_dir}",
              flush=True)
        try:
            worker.loop(trials)
        finally:
            rows, best, edges = write_report(study, spec, sweep_dir)
    _print_best(spec, best, edges, sweep_dir)
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

    def loop(self, trials: Optional[int]) -> None:
        done, waiting_for = 0, []
        while trials is None or done < trials:
            claimed = self._claim()
            if claimed is not None:
                self._run(*claimed)
                done += 1
                write_report(self.study, self.spec, self.sweep_dir, plots=False)  # plots at the end (or --trials 0)
                continue
            active = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING))
            if not active or self._target_reached(self.study.get_trials(deepcopy=False)):
                return
            running = [t.number for t in active if t.state == TrialState.RUNNING]
            if running and running != waiting_for:  # wait, to run again any whose worker dies
                print(f"waiting for trial(s) {running} of other workers; one whose worker died runs again here "
                      f"once its heartbeat is {GRACE_S} s old", flush=True)
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
            optuna.storages.fail_stale_trials(self.study)  # dead workers' trials: failed and queued again
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
        shown = ", ".join(f"{k}={_short(v, 6)}" for k, v in values.items())
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
                             "exact_match (v2.0: exact, HasAns_f1, ...) data.dev_file; name a logged metric in the YAML (a new sweep: give it "
                             "another name)")
        self._finish(trial, TrialState.COMPLETE, value, checkpoint=checkpoint)

    def _train(self, trial, tid, config, resume, monitor, out_dir):
        """The run, through the run loop: its result, or None when it failed or was stopped early."""
        run = squad.finetune if config.model.task is Task.SQUAD else run_loop.train
        with get_heartbeat_thread(tid, self.storage):
            try:
                return run(config, checkpoint_input=str(resume) if resume else None, use_wandb=self.use_wandb,
                           progress=self.progress, on_log=monitor)
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
            except ValueError as e:
                if monitor.step == 0:  # before the first step: the setup (config, data), not the run
                    self._finish(trial, TrialState.FAIL, error=str(e), requeue=True)
                    raise ValueError(f"trial {trial.number} failed before its first step: {e}; once that is fixed "
                                     "(missing files in place), the same command continues this sweep") from None
                self._finish(trial, TrialState.FAIL, error=f"{type(e).__name__}: {e}")
            except Exception as e:  # diverged (ours or the run loop's own check), or crashed: the sweep goes on
                self._finish(trial, TrialState.FAIL, error=f"{type(e).__name__}: {e}")
        return None

    def _finish(self, trial: optuna.Trial, state: TrialState, value: Optional[float] = None,
                error: Optional[str] = None, checkpoint: Optional[Path] = None, requeue: bool = False) -> None:
        tid = self._id(trial.number)
        try:
            if error:
                trial.set_user_attr("error", error)
            if checkpoint is not None:
                trial.set_user_attr("checkpoint", str(checkpoint))
            if requeue:  # not the run's fault: queued again every time (see MAX_RETRY)
                count = self.storage.get_trial(tid).system_attrs.get(_REQUEUED, 0)
                self.storage.set_trial_system_attr(tid, _REQUEUED, count + 1)
            self.study.tell(trial, value if state == TrialState.COMPLETE else None, state=state)
        except optuna.exceptions.UpdateFinishedTrialError:  # failed as stale meanwhile: re-queued then
            print(f"trial {trial.number}: another worker gave it up for dead while it ran (no heartbeat for "
                  f"{GRACE_S} s)", flush=True)
            return
        if requeue:
            _requeue(self.study, self.storage.get_trial(tid))
        done = state == TrialState.COMPLETE
        print(f"trial {trial.number}: " + (f"{self.spec.metric} {value:.6g}" if done else
                                           f"{state.name.lower()}: {error}"), flush=True)


# ------------------------------------------------------------------------ the report
def write_report(study: optuna.Study, spec: SweepSpec, sweep_dir: Path,
                 plots: bool = True) -> tuple[list[dict], Optional[dict], list[str]]:
    """runs.csv and runs.md (runs sorted by the metric, edge flags) and PNG plots, in the sweep directory."""
    rows = _rows(study, spec)
    best = rows[0] if rows and rows[0]["state"] == "finished" else None
    edges = edge_flags(spec, best)
    columns = ["rank", "trial", "state", spec.metric, "step", *(p.name for p in spec.swept), "output_dir",
               "checkpoint", "note"]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    _write(sweep_dir / "runs.csv", buffer.getvalue())
    _write(sweep_dir / "runs.md", _markdown(spec, rows, columns, best, edges))
    if plots:
        _plots(spec, rows, sweep_dir)
    return rows, best, edges


def _rows(study: optuna.Study, spec: SweepSpec) -> list[dict]:
    trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get("discarded")]
    rerun = {n: t.number for t in trials for n in t.system_attrs.get("retry_history", [])}
    states = {TrialState.COMPLETE: "finished", TrialState.PRUNED: "pruned", TrialState.RUNNING: "running",
              TrialState.WAITING: "waiting"}
    rows = []
    for t in trials:
        state, note = states.get(t.state), t.user_attrs.get("error") or ""
        if state is None and t.number in rerun:
            state, note = "interrupted", f"{note or 'worker died'}; re-run as trial {rerun[t.number]}"
        elif state is None:
            state, note = ("diverged" if "diverged" in note.lower() else "failed", note) if note else \
                ("interrupted", "worker died; no retries left")
        last = max(t.intermediate_values) if t.intermediate_values else None
        value = t.value if t.state == TrialState.COMPLETE else t.intermediate_values.get(last)
        rows.append({"trial": t.number, "state": state, spec.metric: value, "step": last,
                     **t.user_attrs.get("values", {}), "output_dir": t.user_attrs.get("output_dir", ""),
                     "checkpoint": t.user_attrs.get("checkpoint", ""), "note": note,
                     "_curve": sorted(t.intermediate_values.items())})
    order, sign = {"finished": 0, "pruned": 1}, 1 if spec.goal == "minimize" else -1
    rows.sort(key=lambda r: (order.get(r["state"], 2),
                             sign * r[spec.metric] if r[spec.metric] is not None and r["state"] in order else 0,
                             r["trial"]))
    for rank, r in enumerate(rows, 1):
        r["rank"] = rank if r["state"] == "finished" else ""
    return rows


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def edge_flags(spec: SweepSpec, best: Optional[dict]) -> list[str]:
    """A line for each numeric parameter whose best value lies at an edge of the searched range:
    a grid's or a value list's smallest or largest value; the outer tenth of a range (random,
    bayes), on a log scale for the log distributions. The optimum may then lie beyond it."""
    flags = []
    for p in spec.swept if best else ():
        v = best.get(p.name)
        if not _numeric(v):
            continue
        if spec.method == "grid" or p.distribution == "categorical":
            values = [x for x in p.grid() if _numeric(x)]
            lo, hi = (min(values), max(values)) if len(values) > 1 else (None, None)
            side = "smallest" if v == lo else "largest" if v == hi else None
        else:
            lo, hi, at = p.low, p.high, (math.log if p.log else float)
            where = (at(v) - at(lo)) / (at(hi) - at(lo)) if hi > lo else 0.5
            side = "smallest" if where <= EDGE else "largest" if where >= 1 - EDGE else None
        if side:
            end, beyond = (lo, "below") if side == "smallest" else (hi, "above")
            flags.append(f"{p.name}: the best run's {_short(v, 6)} is at the {side} end of the searched range "
                         f"({_short(end, 6)}); the optimum may lie {beyond} it: extend the range")
    return flags


def _markdown(spec: SweepSpec, rows: list[dict], columns: list[str], best: Optional[dict], edges: list[str]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return ""
        return f"{v:.6g}" if isinstance(v, float) else str(v).replace("|", "\\|").replace("\n", " ")

    counts = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    lines = [f"# Sweep {spec.name}", "", f"{spec.method} sweep from {spec.source}; {spec.goal} `{spec.metric}` "
             f"(each run's {_value_is(spec)}). Runs: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".", ""]
    if spec.description:
        lines[1:1] = ["", spec.description.strip()]
    if spec.constants:
        lines += ["Fixed: " + ", ".join(f"`{k}={v}`" for k, v in spec.constants.items()) + ".", ""]
    if best:
        lines += [f"Best: trial {best['trial']}, {spec.metric} {cell(best[spec.metric])}, checkpoint "
                  f"`{best['checkpoint']}` (phase 2: `--training.init_from {best['checkpoint']}`).", ""]
    if edges:
        lines += ["At the edge of the search:", "", *(f"- {e}" for e in edges), ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _value_is(spec: SweepSpec) -> str:
    return "final evaluation" if _periodic(spec.metric) else "last logged value"


def _plots(spec: SweepSpec, rows: list[dict], sweep_dir: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: Figure renders with Agg, no display needed

    styles = {"finished": dict(marker="o"), "pruned": dict(marker="o", facecolors="none"),
              "diverged": dict(marker="x"), "failed": dict(marker="x"), "interrupted": dict(marker="+")}
    for p in spec.swept:
        ax = Figure(figsize=(6, 4)).subplots()
        values = p.grid() if p.distribution == "categorical" else []
        labels = [_label(v) for v in values] if any(not _numeric(v) for v in values) else []
        for state, style in styles.items():
            pts = [(r[p.name], r[spec.metric]) for r in rows if r["state"] == state and p.name in r
                   and r[spec.metric] is not None and math.isfinite(r[spec.metric])]
            if pts:
                xs = [labels.index(_label(x)) if labels else x for x, _ in pts]
                ax.scatter(xs, [y for _, y in pts], label=state, color=f"C{list(styles).index(state)}", **style)
        if labels:
            ax.set_xticks(range(len(labels)), labels)
        elif p.log or values and min(values) > 0 and max(values) >= 100 * min(values):
            ax.set_xscale("log")
        ax.set(xlabel=p.name, ylabel=f"{spec.metric} ({_value_is(spec)})",
               title=f"{spec.name}: {spec.metric} against {p.name}")
        if ax.collections:
            ax.legend(fontsize="small")
        _save(ax.figure, sweep_dir / f"{spec.metric}_vs_{p.name}.png")

    ax = Figure(figsize=(7, 4.5)).subplots()
    for r in sorted(rows, key=lambda r: r["trial"]):
        curve = [(s, v) for s, v in r["_curve"] if math.isfinite(v)]
        if curve:
            label = f"{r['trial']}: " + ", ".join(f"{p.name.split('.')[-1]}={_short(r.get(p.name), 4)}"
                                                  for p in spec.swept)
            ax.plot(*zip(*curve), label=label, marker="o" if _periodic(spec.metric) else None,
                    linestyle="-" if r["state"] == "finished" else "--")
    ax.set(xlabel="step", ylabel=spec.metric, title=f"{spec.name}: {spec.metric} over steps (dashed: stopped early)")
    if ax.lines:
        ax.legend(fontsize="x-small", ncol=1 + len(ax.lines) // 12)
    _save(ax.figure, sweep_dir / f"{spec.metric}_curves.png")


def _short(v: Any, digits: int) -> str:
    return f"{v:.{digits}g}" if isinstance(v, float) else str(v)


def _label(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")  # whole files only: workers share the directory
    tmp.write_text(text)
    os.replace(tmp, path)


def _save(fig, path: Path) -> None:
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    os.replace(tmp, path)


def _print_best(spec: SweepSpec, best: Optional[dict], edges: list[str], sweep_dir: Path) -> None:
    print(f"report: {sweep_dir / 'runs.md'} (and runs.csv, *.png)")
    if best is None:
        print("no run has finished yet")
        return
    shown = ", ".join(f"{p.name}={_short(best.get(p.name), 6)}" for p in spec.swept)
    print(f"best: trial {best['trial']} [{shown}] {spec.metric} {best[spec.metric]:.6g}")
    for edge in edges:
        print(f"edge: {edge}")
    print(f"best checkpoint: {best['checkpoint']}")
