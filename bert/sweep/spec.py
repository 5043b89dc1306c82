"""The sweep's YAML: W&B's sweep configuration (schema: wandb/sweeps, config/schema.json), read
and checked into a `SweepSpec`, with every problem a ValueError naming the key. The same file
runs under `wandb sweep` + `wandb agent` unchanged; keys this runner cannot honour are refused.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import optuna

from bert.specfile import read_yaml
from bert.tasks import SPECS

__all__ = ["Hyperband", "METHODS", "PROGRAM", "Parameter", "SCORES", "SweepSpec", "is_periodic", "load_spec",
           "spec_from_dict"]

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
# Every task's evaluation figures (its spec's scores: SQuAD's official scores, the labelled
# tasks' dev figures, pre-training's eval_*): they come at evaluations, not in every record.
SCORES = frozenset(score for spec in SPECS for score in spec.scores)


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

        A grid draws nothing: its points are enqueued whole (`worker.open_study`)."""
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
    return spec_from_dict(read_yaml(path, "sweep"), str(path))


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
        raise bad("parameters must map config fields (optimizer.learning_rate) to distributions")
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
        raise bad(f"{where}: a parameter is a config field such as optimizer.learning_rate")
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



def is_periodic(metric: str) -> bool:
    """Logged at evaluations only (every evaluation.every steps; the fine-tuning tasks' dev
    scores), not every step."""
    return metric.startswith("eval_") or metric in SCORES
