"""Hyper-parameter sweeps described in W&B's sweep YAML, run without a W&B server.

    python bert.py --sweep configs/sweeps/<name>.yaml [--storage URL] [--trials N] [--sweep-dir DIR]

The YAML is W&B's sweep configuration (its schema: wandb/sweeps, config/schema.json):
`method` grid | random | bayes, a `metric` with a goal, `parameters` named by config field
(`training.learning_rate`), optional `early_terminate` (hyperband) and `run_cap`, and the
`program`/`command` that `wandb agent` runs, which also names the base config. The same
file runs under `wandb sweep` + `wandb agent` unchanged; here Optuna proposes the values:

- grid: every point is enqueued once when the sweep is created; workers claim them;
- random: Optuna's RandomSampler; bayes: TPE with the constant liar (parallel workers);
- hyperband: Optuna's SuccessiveHalvingPruner, fed the metric after every step.

The sweep's state is an Optuna storage: SQLite in the sweep directory unless `--storage`
names a database that workers on several machines share. Each trial is an ordinary run of
`bert.train.train` in this process, with its own output_dir and metrics.jsonl.
docs/sweeps.md gives the reasons for each choice.
"""
from __future__ import annotations

import contextlib
import csv
import datetime
import io
import json
import math
import os
import re
import socket
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import yaml

from bert.config import Config, Task, with_overrides

__all__ = ["Hyperband", "Parameter", "SweepResult", "SweepSpec", "load_spec", "run_sweep", "write_report"]

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

# Liveness of workers: a heartbeat every HEARTBEAT_S; a RUNNING trial whose heartbeat is older
# than GRACE_S belonged to a dead worker. Such a trial is failed and re-run MAX_RETRY times.
HEARTBEAT_S = 30
GRACE_S = 300
MAX_RETRY = 2
POLL_S = 1.0


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

    def distribution_for(self, method: str):
        """The Optuna distribution proposals are drawn from (the raw value before `value`)."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if method == "grid" or self.distribution == "categorical":
            values = self.grid() if method == "grid" else self.values
            return CategoricalDistribution([_encode(v) for v in values])
        if self.distribution == "int_uniform":
            return IntDistribution(int(self.low), int(self.high))
        # Quantized forms are drawn continuously, then rounded to q, as W&B defines them.
        return FloatDistribution(self.low, self.high, log=self.log)

    def value(self, raw: Any, method: str) -> Any:
        """The config value for an Optuna draw from `distribution_for(method)`."""
        if method == "grid" or self.distribution in ("constant", "categorical"):
            return _decode(raw, self.grid())
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
    raw: dict = field(default_factory=dict, compare=False)

    @property
    def swept(self) -> tuple[Parameter, ...]:
        return tuple(p for p in self.parameters if p.distribution != "constant")

    @property
    def constants(self) -> dict[str, Any]:
        return {p.name: p.values[0] for p in self.parameters if p.distribution == "constant"}

    def grid_points(self) -> list[dict[str, Any]]:
        """Every combination, in W&B's order (itertools.product over the parameters by name)."""
        import itertools

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
    except yaml.YAMLError as e:
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
        source=source, raw=raw,
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
        if "s" not in spec:
            raise bad("early_terminate: max_iter needs s (the number of bands)")
        bands = [int(spec["max_iter"] / eta**k) for k in range(1, int(spec["s"]) + 1)]
        bands = [b for b in bands if b >= 1]
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


def _encode(v: Any) -> Any:
    """Optuna's categorical choices are scalars; lists and dicts travel as JSON text."""
    return v if v is None or isinstance(v, (bool, int, float, str)) else json.dumps(v)


def _decode(raw: Any, choices: list) -> Any:
    for v in choices:
        if _encode(v) == raw:
            return v
    raise AssertionError(f"{raw!r} is none of the declared values {choices}")


# ------------------------------------------------------------------- storage and claims
def default_storage(sweep_dir: Path) -> str:
    return f"sqlite:///{(sweep_dir / 'optuna.db').resolve()}"


@contextlib.contextmanager
def _exclusive(url: str) -> Iterator[None]:
    """Serialise the sweep's read-then-write steps (create + enqueue, claim, fail dead trials).

    Optuna claims a waiting trial by reading its state, then writing RUNNING. PostgreSQL and
    MySQL lock the row (SELECT ... FOR UPDATE) in between; SQLite, through Python's driver,
    does not, and two processes then claim the same trial (tests/test_sweep.py shows it). An
    SQLite file is only ever shared on one machine, so a lock file beside it serialises them.
    """
    from sqlalchemy.engine import make_url

    url_ = make_url(url)
    if url_.get_backend_name() != "sqlite" or url_.database in (None, "", ":memory:"):
        yield
        return
    import fcntl

    with open(f"{url_.database}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _proc_start(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] == "Z" else fields[19]  # a zombie has exited


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{_proc_start(os.getpid()) or ''}"


def _dead_here(worker: str) -> bool:
    """True when `worker` ran on this machine and its process is gone."""
    host, pid, start = worker.rsplit(":", 2)
    if host != socket.gethostname() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    if not Path("/proc").is_dir():
        return False  # alive as far as this system can tell
    now = _proc_start(int(pid))
    return now is None or bool(start) and now != start  # exited (zombie), or the pid is another process's


class _Heartbeat:
    """Records a trial's heartbeat while it runs, so workers elsewhere can tell a dead worker's."""

    def __init__(self, storage, trial_id: int):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(storage, trial_id), daemon=True)

    def _beat(self, storage, trial_id: int) -> None:
        while True:
            storage.record_heartbeat(trial_id)
            if self._stop.wait(HEARTBEAT_S):
                return

    def __enter__(self) -> "_Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def _quiet_optuna() -> Iterator[None]:
    """Heartbeats, stale-trial retries and ask() with heartbeats are 'experimental' in Optuna."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        yield


def make_sampler(spec: SweepSpec, seed: Optional[int] = None):
    """random: uniform draws; bayes: TPE. A grid is enqueued whole, so its sampler never proposes.

    Workers draw with different seeds (None: fresh entropy), or they would propose alike.
    """
    import optuna

    if spec.method == "bayes":  # the constant liar keeps parallel workers from proposing the same point
        return optuna.samplers.TPESampler(multivariate=True, constant_liar=True, seed=seed)
    return optuna.samplers.RandomSampler(seed=seed)


def make_pruner(spec: SweepSpec):
    """W&B's hyperband stops a run outside the best 1/eta at steps min_iter·eta^k: successive halving."""
    import optuna

    if spec.hyperband is None:
        return optuna.pruners.NopPruner()
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=spec.hyperband.min_resource,
                                                  reduction_factor=spec.hyperband.eta)


def _rdb_storage(url: str, sqlite: bool):
    import optuna
    import sqlalchemy.exc

    for attempt in range(5):
        try:
            return optuna.storages.RDBStorage(
                url, engine_kwargs={"connect_args": {"timeout": 120}} if sqlite else None,
                heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(
                    max_retry=MAX_RETRY, inherit_intermediate_values=True),
            )
        except ImportError as e:
            raise ValueError(f"storage {url}: its database driver is missing ({e.__cause__ or e}); "
                             "for postgresql:// URLs: pip install 'psycopg[binary]'") from None
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
            # Workers started together on a new database race to create Optuna's tables (seen
            # on PostgreSQL: CREATE TYPE studydirection); the losers find them made next time.
            if attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))


def open_study(spec: SweepSpec, base: Config, storage_url: str, sampler_seed: Optional[int] = None):
    """Create the sweep's study (enqueueing a grid once) or join it; returns (study, storage)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sqlite = storage_url.startswith("sqlite")
    sampler, pruner = make_sampler(spec, sampler_seed), make_pruner(spec)
    fingerprint = json.dumps({"spec": spec.raw, "base_config": base.model_dump(mode="json")}, sort_keys=True,
                             default=str)
    with _exclusive(storage_url), _quiet_optuna():
        storage = _rdb_storage(storage_url, sqlite)
        try:
            study = optuna.create_study(study_name=spec.name, storage=storage, sampler=sampler, pruner=pruner,
                                        direction=spec.goal)
        except optuna.exceptions.DuplicatedStudyError:
            study = optuna.load_study(study_name=spec.name, storage=storage, sampler=sampler, pruner=pruner)
        else:
            for point in spec.grid_points() if spec.method == "grid" else []:
                study.enqueue_trial({k: _encode(v) for k, v in point.items()})
            study.set_user_attr("sweep", fingerprint)  # last: marks the sweep ready to join
    # A database worker may join while the creator is still enqueueing the grid.
    deadline = time.monotonic() + 60
    while "sweep" not in study.user_attrs:
        if time.monotonic() > deadline:
            raise ValueError(f"sweep {spec.name!r} in {storage_url} never finished its creation; delete the study")
        time.sleep(POLL_S)
        study = optuna.load_study(study_name=spec.name, storage=storage, sampler=sampler, pruner=pruner)
    if study.user_attrs["sweep"] != fingerprint:
        raise ValueError(
            f"{storage_url} already holds a sweep named {spec.name!r} with another YAML or base config; "
            "give this one another name (the YAML's name:) or another --sweep-dir/--storage")
    return study, storage


# ------------------------------------------------------------------------ the worker
class _Diverged(RuntimeError):
    pass


class _MetricMissing(ValueError):
    pass


# Metrics a SQuAD fine-tuning run logs once, after predicting the dev file.
SQUAD_SCORES = ("exact_match", "f1")


class _Monitor:
    """The on_log hook: divergence check, the metric to Optuna, hyperband's verdict."""

    def __init__(self, trial, spec: SweepSpec, max_loss: float, already_reported: set[int], final_only: bool = False):
        """`final_only`: the metric comes once, in the run's last record (SQuAD's scores)."""
        self.trial, self.spec, self.max_loss, self.reported = trial, spec, max_loss, already_reported
        self.final_only = final_only
        self.last: Optional[float] = None
        self.records = 0

    def __call__(self, record: dict) -> None:
        import optuna

        name, step = self.spec.metric, record["step"]
        if name not in record and self.final_only:
            self.records += 1
            loss = record.get("loss")
            if loss is not None and not (math.isfinite(loss) and loss <= self.max_loss):
                raise _Diverged(f"diverged at step {step}: loss {loss} (bound {self.max_loss:.4g})")
            return
        if name not in record:
            raise _MetricMissing(f"metric {name!r} of sweep {self.spec.source} is not logged; the run logs "
                                 f"{sorted(k for k in record if k != 'step')}")
        value, loss = float(record[name]), record.get("loss")
        self.records += 1
        if loss is not None and not (math.isfinite(loss) and loss <= self.max_loss):
            raise _Diverged(f"diverged at step {step}: loss {loss} (bound {self.max_loss:.4g})")
        if not math.isfinite(value):
            raise _Diverged(f"diverged at step {step}: {name} {value}")
        self.last = value
        if step not in self.reported:
            self.trial.report(value, step)
        if self.spec.hyperband and self.trial.should_prune():
            raise optuna.TrialPruned(f"stopped by hyperband at step {step}: {name} {value:.6g}")


@dataclass
class SweepResult:
    name: str
    storage: str
    sweep_dir: Path
    rows: list[dict]  # every run, best first (see write_report)
    best: Optional[dict]


def run_sweep(
    spec: SweepSpec, base: Config, *, sweep_dir: Optional[str | os.PathLike] = None, storage: Optional[str] = None,
    trials: Optional[int] = None, use_wandb: bool = False, max_loss: Optional[float] = None, progress: bool = True,
    sampler_seed: Optional[int] = None,
) -> SweepResult:
    """Run trials of the sweep until it is done (or `trials` of them here); returns the report.

    `base` is the config the command line names (the YAML's --config plus fixed overrides);
    the swept values are applied over it. `max_loss` marks a run diverged (default: twice the
    loss of guessing uniformly, 2·(ln vocab + ln 2)).
    """
    sweep_dir = Path(sweep_dir or Path("runs") / "sweeps" / spec.name)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    url = storage or default_storage(sweep_dir)
    _check_parameters(spec, base)
    study, rdb = open_study(spec, base, url, sampler_seed)
    worker = _Worker(spec, base, sweep_dir, url, study, rdb, use_wandb, progress,
                     max_loss if max_loss is not None else 2 * (math.log(base.model.vocab_size) + math.log(2)))
    print(f"sweep {spec.name} ({spec.method}, {spec.goal} {spec.metric}): storage {url}, runs in {sweep_dir}",
          flush=True)
    try:
        worker.loop(trials)
    finally:
        rows, best = write_report(study, spec, sweep_dir)
    _print_best(spec, best, sweep_dir)
    return SweepResult(spec.name, url, sweep_dir, rows, best)


def _check_parameters(spec: SweepSpec, base: Config) -> None:
    """Every declared value (grid points, range ends, choices) must make a valid config."""
    def ends(p: Parameter) -> tuple:
        return p.values if p.distribution == "categorical" else (p.value(p.low, "random"), p.value(p.high, "random"))

    probes = [dict(spec.constants, **point) for point in spec.grid_points()] if spec.method == "grid" else [
        dict(spec.constants, **{p.name: v}) for p in spec.swept for v in ends(p)]
    for probe in probes:
        for key in ("name", "training.output_dir"):
            if key in probe:
                raise ValueError(f"sweep {spec.source}: parameter {key} is set by the sweep itself")
        with_overrides(base, probe, f"sweep {spec.source} parameters {probe}")


class _Worker:
    def __init__(self, spec, base, sweep_dir, url, study, storage, use_wandb, progress, max_loss):
        self.spec, self.base, self.sweep_dir, self.url = spec, base, sweep_dir, url
        self.study, self.storage, self.use_wandb, self.progress, self.max_loss = \
            study, storage, use_wandb, progress, max_loss
        self.study_id = storage.get_study_id_from_name(spec.name)
        self.retry = storage.get_heartbeat_stale_trial_callback()  # fails and re-queues a dead worker's trial
        self.distributions = {p.name: p.distribution_for(spec.method) for p in spec.swept}
        self.me = worker_id()

    def loop(self, trials: Optional[int]) -> None:
        from optuna.trial import TrialState

        done = 0
        while trials is None or done < trials:
            claimed = self._claim()
            if claimed is None:
                if self._target_reached():
                    return
                active = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING))
                if not active:
                    return
                time.sleep(POLL_S)  # others still run: wait, to re-run any whose worker dies
                continue
            self._run(*claimed)
            done += 1
            write_report(self.study, self.spec, self.sweep_dir, plots=False)  # plots at the end (or --trials 0)

    # ---- claims
    def _claim(self):
        """(trial, trial_id, values) of the next trial this worker runs, or None."""
        import optuna
        from optuna.trial import TrialState

        with _exclusive(self.url), _quiet_optuna():
            self._recover()
            if self._target_reached():
                return None
            waiting = sorted(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)),
                             key=lambda t: t.number)
            if self.spec.method == "grid":
                trial = None
                for t in waiting:
                    tid = self._id(t.number)
                    with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                        if self.storage.set_trial_state_values(tid, TrialState.RUNNING):
                            trial = optuna.Trial(self.study, tid)  # as Study.ask() does after its claim
                            break
                if trial is None:
                    return None
                for name, dist in self.distributions.items():
                    trial.suggest_categorical(name, dist.choices)
            else:
                cap = self.spec.run_cap
                if not waiting and cap and _counted(self.study.get_trials(deepcopy=False)) >= cap:
                    return None
                trial = self.study.ask(self.distributions)  # pops a waiting retry first
                # A database shared by machines has no lock around the count and the ask: the
                # trial numbers (unique, in creation order) settle who took the last slot.
                if self.spec.run_cap and self.storage.get_trial(self._id(trial.number)).system_attrs.get(
                        "failed_trial") is None:
                    before = [t for t in self.study.get_trials(deepcopy=False) if t.number < trial.number]
                    if _counted(before) >= self.spec.run_cap:
                        trial.set_user_attr("discarded", "over run_cap")
                        self.study.tell(trial, state=TrialState.FAIL)
                        return None
            tid = self._id(trial.number)
            values = dict(self.spec.constants,
                          **{p.name: p.value(trial.params[p.name], self.spec.method) for p in self.spec.swept})
            trial.set_user_attr("worker", self.me)
            trial.set_user_attr("values", values)
            if trial.user_attrs.get("error"):  # a re-run inherits the interrupted trial's attributes
                trial.set_user_attr("error", None)
            self.storage.record_heartbeat(tid)
        return trial, tid, values

    def _id(self, number: int) -> int:
        return self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)

    def _recover(self) -> None:
        """Fail the RUNNING trials of dead workers and queue them again (Optuna's retry callback)."""
        import optuna
        from optuna.trial import TrialState

        now = datetime.datetime.now()
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            worker = t.user_attrs.get("worker")
            # No worker mark after GRACE_S: its worker died between the claim and the mark.
            unmarked = worker is None and t.datetime_start and (now - t.datetime_start).total_seconds() > GRACE_S
            if unmarked or worker and _dead_here(worker):
                tid = self._id(t.number)
                with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                    if self.storage.set_trial_state_values(tid, TrialState.FAIL):
                        print(f"trial {t.number}: its worker ({worker}) is gone; running it again", flush=True)
                        self.retry(self.study, self.storage.get_trial(tid))
        optuna.storages.fail_stale_trials(self.study)  # other machines: no heartbeat for GRACE_S

    def _target_reached(self) -> bool:
        from optuna.trial import TrialState

        if self.spec.target is None:
            return False
        done = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        return any(not self.spec.better(self.spec.target, t.value) for t in done)

    # ---- one run
    def _run(self, trial, tid: int, values: dict) -> None:
        import optuna
        from optuna.trial import TrialState

        from bert.finetune import finetune
        from bert.train import METRICS_FILE, train

        frozen = self.storage.get_trial(tid)
        out_dir, resume = self._output_dir(frozen)
        shown = ", ".join(f"{k}={_short(v, 6)}" for k, v in values.items())
        print(f"trial {trial.number} [{shown}]" + (f" resumes {resume}" if resume else ""), flush=True)
        overrides = dict(values, name=f"{self.spec.name}-trial-{trial.number}")
        overrides["training.output_dir"] = str(out_dir)
        trial.set_user_attr("output_dir", str(out_dir))
        try:
            config = with_overrides(self.base, overrides, f"sweep {self.spec.source} trial {trial.number}")
        except ValueError as e:  # a proposal inside the declared ranges can still break a config rule
            return self._finish(trial, TrialState.FAIL, error=str(e))
        if resume is not None and resume.name == "checkpoint-final":  # killed after it finished
            records = [json.loads(line) for line in (out_dir / METRICS_FILE).read_text().splitlines()]
            return self._finish(trial, TrialState.COMPLETE, value=records[-1][self.spec.metric], checkpoint=resume)

        squad = config.model.task is Task.SQUAD
        monitor = _Monitor(trial, self.spec, self.max_loss, set(frozen.intermediate_values),
                           final_only=squad and self.spec.metric in SQUAD_SCORES)
        run = finetune if squad else train
        with _Heartbeat(self.storage, tid):
            try:
                result = run(config, checkpoint_input=str(resume) if resume else None, use_wandb=self.use_wandb,
                             progress=self.progress, on_log=monitor)
            except optuna.TrialPruned as e:
                return self._finish(trial, TrialState.PRUNED, error=str(e))
            except KeyboardInterrupt:
                self._finish(trial, TrialState.FAIL, error="interrupted (Ctrl-C)")
                self.retry(self.study, self.storage.get_trial(tid))  # the next start runs it again
                raise
            except _MetricMissing as e:
                self._finish(trial, TrialState.FAIL, error=str(e))
                raise ValueError(f"{e}\nname a logged metric in the YAML (an edited YAML is a new sweep: "
                                 "give it another name)") from None
            except ValueError as e:
                if monitor.records == 0:  # before the first step: the setup (config, data), not the run
                    self._finish(trial, TrialState.FAIL, error=str(e))
                    self.retry(self.study, self.storage.get_trial(tid))  # runs again once the cause is fixed
                    raise ValueError(f"trial {trial.number} failed before its first step: {e}\nonce missing files "
                                     "are there, the same command continues this sweep; an edited YAML or "
                                     "config is a new sweep (give it another name)") from None
                return self._finish(trial, TrialState.FAIL, error=f"{type(e).__name__}: {e}")
            except Exception as e:  # diverged (ours or train()'s own check), or crashed: the sweep goes on
                return self._finish(trial, TrialState.FAIL, error=f"{type(e).__name__}: {e}")
        if monitor.last is None:  # resumed at its last step (the value is in metrics.jsonl), or never logged
            monitor.last = json.loads((out_dir / METRICS_FILE).read_text().splitlines()[-1]).get(self.spec.metric)
        if monitor.last is None:
            return self._finish(trial, TrialState.FAIL, error=f"the run never logged {self.spec.metric!r} (a SQuAD "
                                                              "run logs its scores only with data.dev_file)")
        self._finish(trial, TrialState.COMPLETE, value=monitor.last, checkpoint=result.checkpoint)

    def _output_dir(self, frozen) -> tuple[Path, Optional[Path]]:
        """A fresh directory, or the interrupted run's own with the checkpoint to resume from."""
        previous = frozen.user_attrs.get("output_dir")
        if frozen.system_attrs.get("failed_trial") is not None and previous and Path(previous).is_dir():
            old = Path(previous)
            if (old / "checkpoint-final").is_dir():
                return old, old / "checkpoint-final"
            steps = [int(p.name.split("-")[1]) for p in old.glob("checkpoint-*") if p.name.split("-")[1].isdigit()]
            if steps:
                return old, old / f"checkpoint-{max(steps)}"
        return (self.sweep_dir / f"trial-{frozen.number}").resolve(), None

    def _finish(self, trial, state, value: Optional[float] = None, error: Optional[str] = None,
                checkpoint: Optional[Path] = None) -> None:
        import optuna
        from optuna.trial import TrialState

        if error:
            trial.set_user_attr("error", error)
        if checkpoint is not None:
            trial.set_user_attr("checkpoint", str(checkpoint))
        try:
            self.study.tell(trial, value if state == TrialState.COMPLETE else None, state=state)
        except optuna.exceptions.UpdateFinishedTrialError:  # failed as stale meanwhile (missed heartbeats)
            print(f"trial {trial.number}: another worker gave it up for dead while it ran", flush=True)
            return
        done = state == TrialState.COMPLETE
        outcome = f"{self.spec.metric} {value:.6g}" if done else f"{state.name.lower()}: {error}"
        print(f"trial {trial.number}: {outcome}", flush=True)


def _superseded(trials) -> dict[int, int]:
    """{number of an interrupted trial: number of the trial that re-runs it}."""
    out = {}
    for t in trials:
        for n in t.system_attrs.get("retry_history", []):
            out[n] = t.number
    return out


def _counted(trials) -> int:
    """Runs that count against run_cap: not re-run copies' originals, not discarded proposals."""
    replaced = _superseded(trials)
    return sum(1 for t in trials if t.number not in replaced and not t.user_attrs.get("discarded"))


# ------------------------------------------------------------------------ the report
def write_report(study, spec: SweepSpec, sweep_dir: Path, plots: bool = True) -> tuple[list[dict], Optional[dict]]:
    """runs.csv and runs.md (runs sorted by the metric) and PNG plots, in the sweep directory."""
    rows = _rows(study, spec)
    finished = [r for r in rows if r["state"] == "finished"]
    best = finished[0] if finished else None
    names = [p.name for p in spec.swept]
    columns = ["rank", "trial", "state", spec.metric, "step", *names, "output_dir", "checkpoint", "note"]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    _write(sweep_dir / "runs.csv", buffer.getvalue())
    _write(sweep_dir / "runs.md", _markdown(spec, rows, columns, best))
    if plots:
        _plots(spec, rows, sweep_dir)
    return rows, best


def _rows(study, spec: SweepSpec) -> list[dict]:
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    replaced = _superseded(trials)
    rows = []
    for t in trials:
        if t.user_attrs.get("discarded"):
            continue
        values = t.user_attrs.get("values") or _drawn(t, spec)
        last = max(t.intermediate_values) if t.intermediate_values else None
        state, note = t.state.name.lower(), t.user_attrs.get("error") or ""
        value = t.value if t.state == TrialState.COMPLETE else t.intermediate_values.get(last)
        if t.state == TrialState.COMPLETE:
            state = "finished"
        elif t.state == TrialState.FAIL and not note:
            state = "interrupted"
            note = f"worker died; re-run as trial {replaced[t.number]}" if t.number in replaced else \
                "worker died; no retries left"
        elif t.state == TrialState.FAIL and t.number in replaced:
            state, note = "interrupted", f"{note}; re-run as trial {replaced[t.number]}"
        elif t.state == TrialState.FAIL:
            state = "diverged" if "diverged" in note.lower() else "failed"
        rows.append({"trial": t.number, "state": state, spec.metric: value, "step": last, **values,
                     "output_dir": t.user_attrs.get("output_dir", ""), "checkpoint": t.user_attrs.get("checkpoint", ""),
                     "note": note, "_curve": sorted(t.intermediate_values.items())})
    order = {"finished": 0, "pruned": 1}
    sign = 1 if spec.goal == "minimize" else -1
    rows.sort(key=lambda r: (order.get(r["state"], 2),
                             sign * r[spec.metric] if r[spec.metric] is not None and r["state"] in order else 0,
                             r["trial"]))
    for rank, r in enumerate(rows, 1):
        r["rank"] = rank if r["state"] == "finished" else ""
    return rows


def _drawn(trial, spec: SweepSpec) -> dict:
    """The values of a trial that has not started: its draw, or the grid point it waits with."""
    raw = dict(trial.system_attrs.get("fixed_params") or {}, **trial.params)
    return {p.name: p.value(raw[p.name], spec.method) for p in spec.swept if p.name in raw}


def _markdown(spec: SweepSpec, rows: list[dict], columns: list[str], best: Optional[dict]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return ""
        return f"{v:.6g}" if isinstance(v, float) else str(v).replace("|", "\\|").replace("\n", " ")

    counts = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    lines = [f"# Sweep {spec.name}", "", f"{spec.method} sweep from {spec.source}; {spec.goal} `{spec.metric}` "
             f"(its last logged value). Runs: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".", ""]
    if spec.description:
        lines[1:1] = ["", spec.description.strip()]
    if spec.constants:
        lines += ["Fixed: " + ", ".join(f"`{k}={v}`" for k, v in spec.constants.items()) + ".", ""]
    if best:
        lines += [f"Best: trial {best['trial']}, {spec.metric} {cell(best[spec.metric])}, checkpoint "
                  f"`{best['checkpoint']}` (phase 2: `--training.init_from {best['checkpoint']}`).", ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _plots(spec: SweepSpec, rows: list[dict], sweep_dir: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: Figure renders with Agg, no display needed

    styles = {"finished": dict(marker="o"), "pruned": dict(marker="o", facecolors="none"),
              "diverged": dict(marker="x"), "failed": dict(marker="x"), "interrupted": dict(marker="+")}
    for p in spec.swept:
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        values = p.grid() if p.distribution == "categorical" else []
        categorical = any(isinstance(v, (bool, str, list, dict)) or v is None for v in values)
        labels = [_label(v) for v in values] if categorical else []
        for state, style in styles.items():
            pts = [(r[p.name], r[spec.metric]) for r in rows if r["state"] == state and p.name in r
                   and r[spec.metric] is not None and math.isfinite(r[spec.metric])]
            if pts:
                xs = [labels.index(_label(x)) for x, _ in pts] if categorical else [x for x, _ in pts]
                ax.scatter(xs, [y for _, y in pts], label=state, color=f"C{list(styles).index(state)}", **style)
        if categorical:
            ax.set_xticks(range(len(labels)), labels)
        elif p.log or values and min(values) > 0 and max(values) >= 100 * min(values):
            ax.set_xscale("log")
        ax.set_xlabel(p.name)
        ax.set_ylabel(f"{spec.metric} (last logged)")
        ax.set_title(f"{spec.name}: {spec.metric} against {p.name}")
        if ax.collections:
            ax.legend(fontsize="small")
        _save(fig, sweep_dir / f"{spec.metric}_vs_{p.name}.png")

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for r in sorted(rows, key=lambda r: r["trial"]):
        curve = [(s, v) for s, v in r["_curve"] if math.isfinite(v)]
        if curve:
            label = f"{r['trial']}: " + ", ".join(f"{p.name.split('.')[-1]}={_short(r.get(p.name), 4)}"
                                                  for p in spec.swept)
            ax.plot([s for s, _ in curve], [v for _, v in curve], label=label,
                    linestyle="-" if r["state"] == "finished" else "--")
    ax.set_xlabel("step")
    ax.set_ylabel(spec.metric)
    ax.set_title(f"{spec.name}: {spec.metric} over steps (dashed: stopped early)")
    if ax.lines:
        ax.legend(fontsize="x-small", ncol=1 + len(ax.lines) // 12)
    _save(fig, sweep_dir / f"{spec.metric}_curves.png")


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


def _print_best(spec: SweepSpec, best: Optional[dict], sweep_dir: Path) -> None:
    print(f"report: {sweep_dir / 'runs.md'} (and runs.csv, *.png)")
    if best is None:
        print("no run has finished yet")
        return
    shown = ", ".join(f"{p.name}={_short(best.get(p.name), 6)}" for p in spec.swept)
    print(f"best: trial {best['trial']} [{shown}] {spec.metric} {best[spec.metric]:.6g}")
    print(f"best checkpoint: {best['checkpoint']}")
