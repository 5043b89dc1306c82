"""The comparison's YAML, in the family of the sweeps' (docs/quality.md lists every key):

    name: tiny-compare
    budget: {flops: 2.0e+10, warmup: 0.1}     # or {seconds: 600, warmup: 0.1}
    evaluations: 6                           # held-out evaluations per run, evenly over its budget
    metric: eval_mlm_loss                    # the final held-out loss that ranks and is reached
    seeds: [0, 1]                            # the grid at the first; each config's best point at all
    data: {source: demo, directory: demo_data/seq32}
    configs:
      bert:
        config: configs/compare/tiny_bert.json
        overrides: {batch.micro_batch_size: 16}
        parameters:                          # W&B sweep parameters: the grid of this config
          optimizer.learning_rate: {values: [0.004, 0.012]}
        sizes:                               # optional: a ladder, each size a config of its own
          small: {model.hidden_size: 48, budget.flops: 1.0e+10}
          large: {model.hidden_size: 96, model.num_layers: 4, budget.flops: 4.0e+10}
    classify: {config: configs/classify_demo.json, overrides: {...}}   # the default; null: none
    squad: {config: configs/squad_tiny.json, train_file: ..., dev_file: ..., overrides: {...}}

Every problem is a ValueError naming the key, read before anything runs: the keys by the
pydantic models below (`CompareFile`; docs/compare_spec.md is made from them), then the
configs they name.
"""
from __future__ import annotations

import difflib
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, Field, field_validator, model_validator

from bert.config import Config, Task, current_key, load_config, with_overrides
from bert.tasks import LABELLED, named
from bert.config.specfile import Number, SpecModel, model_reference, read_yaml, validated

__all__ = ["Arm", "ArmSpec", "BudgetSpec", "CLASSIFY_DEFAULT", "CompareFile", "CompareSpec", "FineTune", "FineTuneSpec",
           "METRICS", "compare_from_dict", "load_compare"]

METRICS = ("eval_mlm_loss", "eval_loss")  # held-out losses the loop logs at every evaluation
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
ROOT = Path(__file__).resolve().parents[2]
# Every comparison fine-tunes its winners on this labelled task unless its YAML says otherwise
# (`classify: null`): the shipped era-of-a-sentence task of the State of the Union addresses
# (data/samples/labelled/README.md), read from the repository wherever the command runs.
CLASSIFY_DEFAULT = {"config": "configs/classify_demo.json"}


@dataclass(frozen=True)
class Arm:
    """One configuration of the comparison: its base config (with the comparison's corpus and
    budget) and the W&B parameters of its grid."""

    name: str  # `<config>-<size>` for a size of a ladder
    config: Config
    config_file: str
    parameters: dict  # W&B sweep parameters (grid), as in the YAML
    family: str = ""  # the YAML's config name (the architecture's ladder); its name without a ladder
    size: Optional[str] = None  # the size's name in its ladder

    def __post_init__(self):
        if not self.family:
            object.__setattr__(self, "family", self.name)


@dataclass(frozen=True)
class FineTune:
    """A downstream task each winner is fine-tuned on: `classify` (a labelled task, bert/tasks/labelled.py)
    or `squad`."""

    task: str  # "classify" | "squad": the YAML's key, and the stage's directory
    config: Config  # the fine-tuning config (its architecture and sizes come from each winner)
    config_file: str
    vocab_file: Optional[str]

    @property
    def metric(self) -> str:
        """The dev figure that ranks (higher is better): the task's best metric."""
        return self.config.model.task.spec.best_metric

    @property
    def scores(self) -> tuple[str, ...]:
        """The dev figures the report shows, the metric first."""
        return (self.metric, *self.config.model.task.spec.secondary_metrics)


@dataclass(frozen=True)
class CompareSpec:
    name: str
    description: str
    source: str
    budget: str  # "flops" | "seconds"
    amount: float
    warmup: float
    evaluations: Optional[int]  # a FLOPs budget: evaluations per run
    eval_every: Optional[int]  # steps between evaluations (a seconds budget needs it)
    metric: str
    seeds: tuple[int, ...]
    arms: tuple[Arm, ...]
    classify: Optional[FineTune] = None
    squad: Optional[FineTune] = None

    @property
    def fine_tunes(self) -> tuple[FineTune, ...]:
        return tuple(t for t in (self.classify, self.squad) if t is not None)


def load_compare(path: str | os.PathLike, overrides: Optional[dict[str, Any]] = None) -> CompareSpec:
    """Read and check a comparison YAML; `overrides` (`--section.key value` of the command line)
    go over every config, after the YAML's."""
    return compare_from_dict(read_yaml(path, "comparison"), str(path), overrides or {})


def compare_from_dict(raw: Any, source: str = "<dict>", overrides: Optional[dict[str, Any]] = None) -> CompareSpec:
    """The comparison of a YAML mapping `raw` (from the file `source`): its keys checked by
    `CompareFile`, then its configs read and each arm's made (problems name the key)."""
    if not isinstance(raw, dict):
        raise ValueError(f"comparison {source}: the file must hold a mapping (name, budget, configs, ...)")
    return validated(CompareFile, raw, f"comparison {source}", _unknown_key).spec(source, overrides or {})


def _unknown_key(key: str) -> str:
    where, _, leaf = key.rpartition(".")
    model = {"": CompareFile, "budget": BudgetSpec, "classify": FineTuneSpec, "squad": FineTuneSpec}.get(
        where, ArmSpec if where.startswith("configs.") else None)
    keys = sorted(model.model_fields) if model else []
    near = difflib.get_close_matches(leaf, keys, n=1, cutoff=0.75)
    return f"did you mean {near[0]}?" if near else f"the keys are {keys} (docs/compare_spec.md)"


def _directory_name(what: str) -> AfterValidator:
    """A name that names a directory: `what` ("a config's", "a size's") in the error."""
    def check(name: str) -> str:
        if not _NAME.match(name):
            raise ValueError(f"{what} name must be letters, digits, '_', '.' or '-' (it names a directory)")
        return name
    return AfterValidator(check)


def _dotted(key: str) -> str:
    if "." not in key:
        raise ValueError("not a dotted config key: write section.key, e.g. batch.micro_batch_size")
    return key


ConfigName, SizeName = Annotated[str, _directory_name("a config's")], Annotated[str, _directory_name("a size's")]
Overrides = dict[Annotated[str, AfterValidator(_dotted)], Any]  # `section.key: value`, checked by the config


class BudgetSpec(SpecModel):
    """What each run may spend: training FLOPs or seconds (one of them), and the warm-up."""

    flops: Optional[Number] = Field(None, description="training FLOPs per run (bert.py summary gives a step's); "
                                    "> 0, finite; e.g. 1.0e+15")
    seconds: Optional[Number] = Field(None, description="training seconds per run (needs `eval_every`); > 0, finite")
    warmup: Number = Field(0.0, description="the warm-up, a fraction of the budget in [0, 1); then linear decay to 0 "
                           "at its end")

    @model_validator(mode="after")
    def _one_budget(self) -> "BudgetSpec":
        if (self.flops is None) == (self.seconds is None):
            raise ValueError("must give flops or seconds (one of them), e.g. {flops: 1.0e+15, warmup: 0.1}")
        if not (self.amount > 0 and math.isfinite(self.amount)):
            raise ValueError(f"{self.kind} {self.flops if self.flops is not None else self.seconds!r} must be a positive "
                             "number")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"warmup {self.warmup!r} must be a fraction of the budget in [0, 1)")
        return self

    @property
    def kind(self) -> str:
        return "flops" if self.flops is not None else "seconds"

    @property
    def amount(self) -> float:
        return float(self.flops if self.flops is not None else self.seconds)


class ArmSpec(SpecModel):
    """One configuration compared (`configs.<name>`, the name a directory's): its base config and
    the grid that finds its best point. The comparison sets its seeds, budget and evaluations."""

    config: str = Field(description="the base config file (pre-training); the comparison's `data`, `training` and "
                        "budget go over it")
    overrides: Overrides = Field({}, description="`section.key: value` over this config, e.g. "
                                 "`{batch.micro_batch_size: 16}`")
    parameters: dict[str, Any] = Field({}, description="W&B sweep parameters (docs/sweep_spec.md): the grid of this "
                                       "config (`values`, `value`, `int_uniform`, `q_uniform`), usually "
                                       "`{optimizer.learning_rate: {values: [0.002, 0.004]}}`; not `training.seed`, "
                                       "`training.steps`, `evaluation.every` or `budget.*`, the comparison's own")
    sizes: Optional[dict[SizeName, Overrides]] = Field(None, description="a size ladder: two or more sizes `SIZE: "
                                                       "{section.key: value}`, each a config of its own named "
                                                       "`NAME-SIZE` (its grid, seeds and fine-tuning as any config's), "
                                                       "usually `model.hidden_size`, `model.num_layers`, "
                                                       "`model.num_heads` and the size's own `budget.flops` (or "
                                                       "`budget.seconds`; no other budget key); configs are then "
                                                       "compared size by size and the report gains the front")

    @field_validator("sizes")
    @classmethod
    def _a_ladder(cls, sizes: Optional[dict]) -> Optional[dict]:
        if sizes is not None and len(sizes) < 2:
            raise ValueError("must map two or more size names to overrides, e.g. "
                             "{small: {model.hidden_size: 64, budget.flops: 1.0e+13}, large: {...}}")
        return sizes


class FineTuneSpec(SpecModel):
    """A downstream task each winner is fine-tuned on (`classify`: a labelled task; `squad`)."""

    config: str = Field(description="the fine-tuning config: its task, labels, optimizer and length; the "
                        "architecture, sizes and vocab come from each checkpoint")
    train_file: Optional[str] = Field(None, description="over the config's `data.train_file`")
    dev_file: Optional[str] = Field(None, description="over the config's `data.dev_file`: the scores the report shows")
    vocab_file: Optional[str] = Field(None, description="checked against the checkpoints' own vocab when given")
    overrides: Overrides = Field({}, description="`section.key: value` over the config")


class CompareFile(SpecModel):
    """A comparison: two or more configurations at an equal budget, each at its best point of a grid,
    over several seeds, each winner fine-tuned downstream (docs/quality.md)."""

    name: Optional[str] = Field(None, description="the comparison's name: its runs' sweeps (letters, digits, `_`, "
                                "`.`, `-`); default: the file's stem")
    description: str = Field("", description="a line in the report")
    budget: BudgetSpec = Field(description="each run's budget")
    evaluations: Optional[int] = Field(None, ge=1, description="held-out evaluations per run, evenly over its steps "
                                       "(a FLOPs budget; default 10); each is also a checkpoint, so a killed run loses "
                                       "little")
    eval_every: Optional[int] = Field(None, ge=1, description="steps between held-out evaluations instead (required "
                                      "with a seconds budget, whose steps are not known in advance)")
    metric: Literal[METRICS] = Field(METRICS[0], description="the final held-out loss that ranks each grid and that "
                                     "the other configs must reach: `eval_mlm_loss` (the masked-LM loss GroupBERT's "
                                     "claim is about) or `eval_loss` (MLM + NSP)")
    seeds: list[Annotated[int, Field(ge=0)]] = Field([0], min_length=1, description="distinct seeds: the grid runs at "
                                                     "the first; each config's best point runs again at every other "
                                                     "seed, and the comparison is over all of them")
    data: dict[str, Any] = Field({}, description="`data` keys put on every config: one corpus (`source`, `files`, "
                                 "`eval_files`, `eval_samples`), e.g. `{source: demo, directory: demo_data/seq32}`")
    training: dict[str, Any] = Field({}, description="`training` keys put on every config (a shared batch size)")
    configs: dict[ConfigName, ArmSpec] = Field(description="two or more configurations by name")
    classify: Optional[FineTuneSpec] = Field(FineTuneSpec(**CLASSIFY_DEFAULT), description="the labelled task every "
                                             "final run is fine-tuned on (any task of labelled files, "
                                             "bert/tasks/labelled.py); "
                                             "default: the shipped era-of-a-sentence task of the State of the Union "
                                             "addresses, read from the repository wherever the command runs; null: "
                                             "none")
    squad: Optional[FineTuneSpec] = Field(None, description="SQuAD fine-tuning of every final run; default: none")

    @field_validator("seeds")
    @classmethod
    def _distinct(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError("must be a list of distinct integers >= 0 (the grid runs at the first)")
        return seeds

    @model_validator(mode="after")
    def _fits_the_budget(self) -> "CompareFile":
        kind = self.budget.kind
        if self.evaluations is not None and self.eval_every is not None:
            raise ValueError("give evaluations (per run) or eval_every (steps), not both")
        if kind == "seconds" and self.evaluations is not None:
            raise ValueError("evaluations spreads evaluations over a run's steps, which a seconds budget does not fix: "
                             "give eval_every (steps between evaluations)")
        if kind == "seconds" and self.eval_every is None:
            raise ValueError("a seconds budget needs eval_every: the steps between held-out evaluations")
        if len(self.configs) < 2:
            raise ValueError("configs must map two or more names to {config: FILE, parameters: ...}")
        for arm_name, arm in self.configs.items():
            where = f"configs.{arm_name}"
            for key in arm.parameters:
                named = current_key(key, where)
                if named in ("training.seed", "training.steps", "evaluation.every") or named.startswith("budget."):
                    raise ValueError(f"{where}.parameters.{key} is set by the comparison itself (seeds:, budget:)")
            for size, changes in (arm.sizes or {}).items():
                for key in changes:
                    if key.startswith("budget.") and key != f"budget.{kind}":
                        raise ValueError(f"{where}.sizes.{size}.{key}: a size may set its own budget.{kind}, no other "
                                         "budget key")
        return self

    def spec(self, source: str, overrides: dict[str, Any]) -> CompareSpec:
        """The comparison: every arm's config read and made (the comparison's keys over it, then
        `overrides`), and the fine-tuning stages' configs."""
        def bad(msg: str) -> ValueError:
            return ValueError(f"comparison {source}: {msg}")

        name = self.name or re.sub(r"[^A-Za-z0-9_.-]", "", Path(source).stem) or "compare"
        if not _NAME.match(name):
            raise bad(f"name {name!r} must be letters, digits, '_', '.' or '-' (it names the runs' sweeps)")
        budget = self.budget
        evaluations = 10 if budget.kind == "flops" and self.evaluations is None and self.eval_every is None \
            else self.evaluations
        common = {**{f"data.{k}": v for k, v in self.data.items()},
                  **{f"training.{k}": v for k, v in self.training.items()}}
        budget_keys = {f"budget.{budget.kind}": budget.amount, "budget.warmup": float(budget.warmup),
                       "schedule.warmup_steps": 0}
        if budget.kind == "seconds":
            budget_keys["training.steps"] = 10**9  # the time ends the run (bert/run/budget.py)
        if self.eval_every is not None:
            budget_keys["evaluation.every"] = self.eval_every
        arms = []
        for arm_name, entry in self.configs.items():
            where = f"configs.{arm_name}"
            base = _config(entry.config, where, bad)
            if base.model.task.spec.fine_tuning:
                raise bad(f"{where}: {entry.config} is a {base.model.task.value} config; the comparison pre-trains")
            for size, changes in (entry.sizes or {None: {}}).items():
                config = _apply(base, {**common, **entry.overrides, **budget_keys, **changes, **overrides},
                                f"{source} {where}" + (f".sizes.{size}" if size else ""), bad)
                arms.append(Arm(arm_name if size is None else f"{arm_name}-{size}", config, entry.config,
                                dict(entry.parameters), arm_name, size))
        names = [a.name for a in arms]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise bad(f"configs: {twice} name two configs (a config and a size of another's ladder): rename one")
        classify = self.classify and _fine_tune(self.classify, "classify", source, bad,
                                                shipped="classify" not in self.model_fields_set)
        squad = self.squad and _fine_tune(self.squad, "squad", source, bad)
        return CompareSpec(name=name, description=self.description.strip(), source=source, budget=budget.kind,
                           amount=budget.amount, warmup=float(budget.warmup), evaluations=evaluations,
                           eval_every=self.eval_every, metric=self.metric, seeds=tuple(self.seeds), arms=tuple(arms),
                           classify=classify, squad=squad)


def _fine_tune(entry: FineTuneSpec, task: str, source: str, bad, shipped: bool = False) -> FineTune:
    """The YAML's `classify:` or `squad:` stage; `shipped`: the default, whose files are the
    repository's wherever the command runs."""
    files = {f"data.{k}": getattr(entry, k) for k in ("train_file", "dev_file") if getattr(entry, k) is not None}
    config = _config(ROOT / entry.config if shipped else entry.config, task, bad)
    if shipped:
        files = {f"data.{k}": str(ROOT / getattr(config.data, k)) for k in ("train_file", "dev_file")}
    config = _apply(config, {**files, **entry.overrides}, f"{source} {task}", bad)
    if task == "squad" and config.model.task is not Task.SQUAD:
        raise bad(f"squad.config {entry.config} is not a SQuAD config (model.task 'squad')")
    if task == "classify" and not config.model.task.labelled:
        raise bad(f"classify.config {entry.config} is not a labelled-task config (model.task "
                  f"{named(LABELLED)})")
    if not config.data.dev_file:
        raise bad(f"{task}: give dev_file, the file whose scores the report shows")
    for key in ("train_file", "dev_file"):
        path = getattr(config.data, key)
        if not path or not Path(path).is_file():
            made = " (make squad-demo writes demo_data/squad)" if task == "squad" else ""
            raise bad(f"{task}.{key} {path} does not exist{made}")
    return FineTune(task, config, entry.config, entry.vocab_file)


def _config(path: Any, where: str, bad) -> Config:
    try:
        return load_config(str(path))
    except ValueError as e:
        raise bad(f"{where}: {e}") from None


def _apply(config: Config, overrides: dict[str, Any], where: str, bad) -> Config:
    try:
        return with_overrides(config, overrides, where)
    except ValueError as e:
        raise bad(str(e)) from None


_HEADER = """# Comparison YAML reference

<!-- Generated by `python -m bert.config.specfile comparison docs/compare_spec.md` from the models in
bert/compare/spec.py; edit those, not this file (tests/test_spec_pages.py checks that it matches). -->

A comparison (`python bert.py compare spec.yaml`, docs/quality.md) is one YAML file. Every mapping
forbids keys it does not know, and values are checked strictly (`true` is not 1, `"5"` is not 5;
YAML reads `1e15` and `1.0e15` as text: write `1.0e+15`). Each problem is one line naming the file
and the key, read before anything runs; so are the configs it names, each with the comparison's
keys over it.
"""


def reference() -> str:
    """docs/compare_spec.md (`python -m bert.config.specfile comparison docs/compare_spec.md` writes it)."""
    return model_reference(CompareFile, _HEADER)
