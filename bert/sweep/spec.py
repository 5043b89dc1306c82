"""The sweep's YAML: W&B's sweep configuration (schema: wandb/sweeps, config/schema.json), read
and checked into a `SweepSpec`, with every problem a ValueError naming the key. The same file
runs under `wandb sweep` + `wandb agent` unchanged; keys this runner cannot honour are refused.
The file's keys are pydantic models (`SweepFile` and the models of its mappings), strict as a
run config's and with its one-line errors; docs/sweep_spec.md is made from them.
"""
from __future__ import annotations

import difflib
import itertools
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import optuna
from pydantic import AfterValidator, Field, field_validator, model_validator

from bert.config.specfile import Number, SpecModel, model_reference, read_yaml, validated
from bert.tasks import SPECS

__all__ = ["EarlyTerminate", "Hyperband", "METHODS", "MetricSpec", "PROGRAM", "Parameter", "ParameterSpec", "SCORES",
           "SweepFile", "SweepSpec", "is_periodic", "load_spec", "spec_from_dict"]

METHODS = ("grid", "random", "bayes")
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
    """The sweep of a W&B sweep YAML's mapping `raw` (from the file `source`)."""
    if not isinstance(raw, dict):
        raise ValueError(f"sweep {source}: the file must hold a mapping of W&B sweep keys (method, metric, "
                         "parameters, ...)")
    return validated(SweepFile, raw, f"sweep {source}", _unknown_key).spec(source)


def _unknown_key(key: str) -> str:
    where, _, leaf = key.rpartition(".")
    if where == "metric" and leaf in ("impute", "impute_while_running"):
        return "not supported (Optuna's samplers skip failed runs instead of imputing): remove it"
    if where.startswith("parameters."):
        return f"a parameter's keys are {sorted(ParameterSpec.model_fields)}"
    model = {"": SweepFile, "metric": MetricSpec, "early_terminate": EarlyTerminate}.get(where)
    keys = sorted(model.model_fields) if model else []
    near = difflib.get_close_matches(leaf, keys, n=1, cutoff=0.75)
    return f"did you mean {near[0]}?" if near else f"the keys are {keys} (docs/sweep_spec.md)"


class MetricSpec(SpecModel):
    """What ranks the runs. A run's value is the metric of the last record that carries it:
    for a training metric its last logged value, what W&B's sweep table shows; for an evaluation
    metric the run's final evaluation (W&B's own bayes controller uses the best logged value, which
    favours lucky batches and lucky evaluations)."""

    name: str = Field(description="a key of metrics.jsonl (`loss`, `mlm_accuracy`, ...) or an evaluation figure "
                      "(`eval_loss`, SQuAD's `f1`, a labelled task's `accuracy`, ...)")
    goal: Literal["minimize", "maximize"] = Field("minimize", description="which way is better")
    target: Optional[Number] = Field(None, description="no new runs once a run reaches it")


class ParameterSpec(SpecModel):
    """One config field (`parameters.<name>`, dotted: `optimizer.learning_rate`) and its W&B
    distribution, inferred from the keys given when `distribution` is not: `values` categorical,
    `value` constant, integer `min` and `max` int_uniform, other `min` and `max` uniform. Each
    distribution takes its own keys (docs/sweeps.md). Refused: W&B's unbounded distributions
    (normal, beta, inv_log_uniform, ...) and `probabilities`, which Optuna has no bounded
    counterpart of, and nested `parameters:`, which reach bert.py as one dict-valued argument."""

    distribution: Optional[str] = Field(None, description="one of " + ", ".join(f"`{d}`" for d in _DISTRIBUTION_KEYS)
                                        + "; default: inferred from the keys given")
    value: Any = Field(None, description="constant: the one value every run gets")
    values: Optional[list] = Field(None, min_length=1, description="categorical: the choices (any YAML values)")
    min: Optional[Number] = Field(None, description="the lower end (log_uniform, q_log_uniform: a natural-log "
                                  "exponent; log_uniform_values: > 0)")
    max: Optional[Number] = Field(None, description="the upper end, ≥ min")
    q: Optional[Number] = Field(None, gt=0, description="q_ forms: the quantum a value is rounded to (default 1); "
                                "an integer q gives integers")

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, raw: Any) -> Any:
        """W&B's forms with no Optuna counterpart, refused by name before their keys are read."""
        if not isinstance(raw, dict):
            return raw
        if "parameters" in raw:
            raise ValueError("nested parameters reach bert.py as one dict-valued argument it cannot read; name each "
                             "field with dots (<section>.<key>)")
        dist = raw.get("distribution")
        if dist is None and "values" in raw and "probabilities" in raw:
            dist = "categorical_w_probabilities"
        if isinstance(dist, str) and (dist in _UNBOUNDED or dist.startswith("inv_log_uniform")
                                      or dist == "categorical_w_probabilities"):
            raise ValueError(f"distribution {dist!r} is not supported (Optuna has no bounded counterpart); "
                             "use uniform, log_uniform_values, their q_ forms, int_uniform or values")
        return raw

    @model_validator(mode="after")
    def _keys_fit_the_distribution(self) -> "ParameterSpec":
        dist, given = self.kind, self.model_fields_set - {"distribution"}
        if dist is None:
            raise ValueError("needs values, value, or min and max")
        if dist not in _DISTRIBUTION_KEYS:
            raise ValueError(f"unknown distribution {dist!r}; W&B's are {sorted(_DISTRIBUTION_KEYS)} and others")
        stray, lacking = sorted(given - _DISTRIBUTION_KEYS[dist]), sorted(_DISTRIBUTION_KEYS[dist] - {"q"} - given)
        if stray:
            raise ValueError(f"{stray[0]} does not belong to distribution {dist} (its keys: "
                             f"{sorted(_DISTRIBUTION_KEYS[dist] | {'distribution'})})")
        if lacking:
            raise ValueError(f"distribution {dist} needs {lacking[0]!r}")
        if dist in ("constant", "categorical"):
            return self
        if dist == "int_uniform" and not (_is_int(self.min) and _is_int(self.max)):
            raise ValueError(f"int_uniform needs integer min and max, not {self.min!r} and {self.max!r}")
        if self.min > self.max:
            raise ValueError(f"min {float(self.min)} is above max {float(self.max)}")
        low, high = self.bounds
        if dist in _LOG_DISTRIBUTIONS and dist not in ("log_uniform", "q_log_uniform") and low <= 0:
            raise ValueError(f"{dist} needs min > 0, not {low}")
        q = self.q if self.q is not None else 1
        if dist.startswith("q_") and math.ceil(low / q - 1e-9) > math.floor(high / q + 1e-9):
            raise ValueError(f"no multiple of q {q} lies between min and max")
        return self

    @property
    def kind(self) -> Optional[str]:
        """The distribution, as given or as W&B infers it from the keys present."""
        given = self.model_fields_set
        if self.distribution is not None:
            return self.distribution
        if "values" in given:
            return "categorical_w_probabilities" if "probabilities" in given else "categorical"
        if "value" in given:
            return "constant"
        if "min" in given and "max" in given:
            return "int_uniform" if _is_int(self.min) and _is_int(self.max) else "uniform"
        return None

    @property
    def bounds(self) -> tuple[float, float]:
        """min and max as values of the config (log_uniform's are exponents)."""
        if self.kind in ("log_uniform", "q_log_uniform"):
            return math.exp(self.min), math.exp(self.max)
        return float(self.min), float(self.max)

    def parameter(self, name: str) -> Parameter:
        dist = self.kind
        if dist == "constant":
            return Parameter(name, dist, values=(self.value,))
        if dist == "categorical":
            return Parameter(name, dist, values=tuple(self.values))
        low, high = self.bounds
        q = (self.q if self.q is not None else 1) if dist.startswith("q_") else None
        return Parameter(name, dist, low=low, high=high, q=q)


def _parameter_name(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError("a parameter is a config field such as optimizer.learning_rate")
    return name


class EarlyTerminate(SpecModel):
    """W&B's hyperband, run as Optuna's successive halving: rungs at min_iter × eta^k
    steps, a trial below the rung's best fraction stopped there."""

    type: Literal["hyperband"] = Field(description="`hyperband`, the only type W&B defines")
    min_iter: Optional[int] = Field(None, ge=1, description="the first rung, in steps; or give max_iter and s")
    max_iter: Optional[int] = Field(None, description="with s: the first rung is the least max_iter / eta^k ≥ 1, "
                                    "k = 1..s")
    s: Optional[int] = Field(None, description="with max_iter: the number of bands")
    eta: int = Field(3, ge=2, description="the factor between rungs (an integer, Optuna's successive halving)")
    strict: bool = Field(True, description="only true: Optuna compares the value at each rung (W&B's strict rule)")

    @model_validator(mode="after")
    def _rungs(self) -> "EarlyTerminate":
        if not self.strict:
            raise ValueError("strict false (W&B's conservative rule on the best value so far) is not supported; "
                             "Optuna's successive halving compares the value at each rung, as strict: true")
        if self.max_iter is not None:
            if self.s is None:
                raise ValueError("max_iter and s (the number of bands) must be integers: give s")
            if self.min_resource is None:
                raise ValueError("max_iter / eta^k leaves no band of at least one step")
        elif self.min_iter is None:
            raise ValueError("needs min_iter, or max_iter and s")
        return self

    @property
    def min_resource(self) -> Optional[int]:
        if self.max_iter is None:
            return self.min_iter
        bands = [b for b in (self.max_iter // self.eta**k for k in range(1, min(self.s, 64) + 1)) if b >= 1]
        return min(bands) if bands else None


class SweepFile(SpecModel):
    """A sweep: W&B's sweep configuration (wandb/sweeps, config/schema.json). The keys W&B's server
    alone can honour (`apiVersion`, `kind`, `controller`, `job`, `image_uri`, `scheduler`, `metrics`)
    are refused, never ignored."""

    program: str = Field(description=f"must be `{PROGRAM}` (W&B requires the key; this runner trains with bert.py)")
    command: list[Union[str, int, float]] = Field(
        ["${env}", "${interpreter}", "${program}", "${args}"],
        description="what `wandb agent` runs. The literal arguments after `${program}` are read by bert.py's own "
        "argument parser as `bert.py train` takes them (the word `train` may come first; no other subcommand): "
        "`--config FILE` (required: the base config), `--wandb` (each run then logs to wandb: offline into its "
        "directory without credentials), fixed `--section.key=value` overrides. Macros: `${env}` and "
        "`${interpreter}` (before `${program}` only), `${program}`, `${args}` or `${args_no_equals}` (one of the two "
        "is required: it is how the agent hands bert.py the values)")
    method: Literal[METHODS] = Field(description="`grid` (every point enqueued once), `random` (Optuna "
                                     "`RandomSampler`), `bayes` (Optuna `TPESampler`, multivariate, with the constant "
                                     "liar so parallel workers do not propose the same point)")
    metric: MetricSpec = Field(description="what ranks the runs")
    parameters: dict[Annotated[str, AfterValidator(_parameter_name)], ParameterSpec] = Field(
        min_length=1, description="config fields in dotted form (`optimizer.learning_rate`), each a distribution")
    early_terminate: Optional[EarlyTerminate] = Field(None, description="hyperband: stop runs early")
    run_cap: Optional[int] = Field(None, gt=0, description="the most runs, across all workers")
    name: Optional[str] = Field(None, description="the sweep's name and directory (letters, digits, `_`, `.`, `-`); "
                                "default: the file's stem")
    description: str = Field("", description="a line in the report")
    project: Optional[str] = Field(None, description="W&B's only")
    entity: Optional[str] = Field(None, description="W&B's only")

    @model_validator(mode="before")
    @classmethod
    def _no_server_keys(cls, raw: Any) -> Any:
        for key in raw if isinstance(raw, dict) else ():
            if key in _UNSUPPORTED_TOP:
                raise ValueError(f"key {key!r} is a W&B server feature this runner cannot honour; remove it")
        return raw

    @field_validator("name")
    @classmethod
    def _a_directory_name(cls, name: Optional[str]) -> Optional[str]:
        if name and not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError("must be letters, digits, '_', '.' or '-' (it names the sweep directory)")
        return name

    @field_validator("program")
    @classmethod
    def _bert(cls, program: str) -> str:
        if Path(program).name != PROGRAM:
            raise ValueError(f"must be {PROGRAM} (W&B requires the key; this runner trains with bert.py)")
        return program

    @field_validator("command")
    @classmethod
    def _runs_bert(cls, command: list) -> list:
        tokens = [str(c) for c in command]
        for t in tokens:
            if t.startswith("${") and t not in _COMMAND_MACROS:
                raise ValueError(f"macro {t} is not supported; bert.py takes {sorted(_COMMAND_MACROS)}")
        if "${program}" not in tokens:
            raise ValueError("must contain ${program}")
        at = tokens.index("${program}")
        if any(t not in ("${env}", "${interpreter}") for t in tokens[:at]):
            raise ValueError(f"only ${{env}} and ${{interpreter}} may come before ${{program}}, not {tokens[:at]}")
        if not {"${args}", "${args_no_equals}"} & set(tokens[at + 1:]):
            raise ValueError("must pass ${args} (or ${args_no_equals}) after ${program}: that is how wandb agent "
                             "hands bert.py the swept values")
        return command

    @model_validator(mode="after")
    def _something_swept(self) -> "SweepFile":
        kinds = {name: p.kind for name, p in self.parameters.items()}
        if self.method == "grid":
            for name, kind in kinds.items():
                if kind not in _GRID_DISTRIBUTIONS:
                    raise ValueError(f"parameters.{name}: a grid needs values, value, int_uniform or q_uniform, not "
                                     f"{kind}; list the values or use method random or bayes")
        if all(kind == "constant" for kind in kinds.values()):
            raise ValueError("parameters: nothing is swept (every parameter is a single value)")
        return self

    def spec(self, source: str) -> SweepSpec:
        """The sweep this file describes, read from `source` (the default name: its stem)."""
        name = self.name or re.sub(r"[^A-Za-z0-9_.-]", "", Path(source).stem) or "sweep"
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):  # the stem of a `source` that is no file
            raise ValueError(f"sweep {source}: name {name!r} must be letters, digits, '_', '.' or '-' (it names the "
                             "sweep directory)")
        tokens = [str(c) for c in self.command]
        program_args = tuple(t for t in tokens[tokens.index("${program}") + 1:] if t not in _COMMAND_MACROS)
        hyperband = self.early_terminate and Hyperband(self.early_terminate.min_resource, self.early_terminate.eta)
        return SweepSpec(name=name, method=self.method, metric=self.metric.name, goal=self.metric.goal,
                         parameters=tuple(p.parameter(n) for n, p in self.parameters.items()),
                         program_args=program_args,
                         target=None if self.metric.target is None else float(self.metric.target),
                         run_cap=self.run_cap, hyperband=hyperband, description=self.description, source=source)


_HEADER = """# Sweep YAML reference

<!-- Generated by `python -m bert.config.specfile sweep docs/sweep_spec.md` from the models in
bert/sweep/spec.py; edit those, not this file (tests/test_spec_pages.py checks that it matches). -->

A sweep is W&B's sweep configuration (schema: `config/schema.json` of wandb/sweeps); the same file
runs under `wandb sweep` + `wandb agent` unchanged (docs/sweeps.md). Every mapping forbids keys it
does not know, and values are checked strictly (`true` is not 1, `"5"` is not 5; YAML reads `1e-5`
as text: write `1.0e-5`). A key this runner cannot honour is an error naming it, never ignored: W&B's
server features `apiVersion`, `kind`, `controller`, `job`, `image_uri`, `scheduler` and `metrics`,
`metric.impute`, and the distributions with no bounded Optuna counterpart. Each problem is one line
naming the file and the key.
"""


def reference() -> str:
    """docs/sweep_spec.md (`python -m bert.config.specfile sweep docs/sweep_spec.md` writes it)."""
    return model_reference(SweepFile, _HEADER)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_periodic(metric: str) -> bool:
    """Logged at evaluations only (every evaluation.every steps; the fine-tuning tasks' dev
    scores), not every step."""
    return metric.startswith("eval_") or metric in SCORES
