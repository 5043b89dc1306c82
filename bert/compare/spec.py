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

Every problem is a ValueError naming the key, read before anything runs.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


from bert.config import Config, Task, current_key, load_config, with_overrides
from bert.specfile import read_yaml

__all__ = ["Arm", "CLASSIFY_DEFAULT", "CompareSpec", "FineTune", "METRICS", "load_compare", "compare_from_dict"]

METRICS = ("eval_mlm_loss", "eval_loss")  # held-out losses the loop logs at every evaluation
_TOP = {"name", "description", "budget", "evaluations", "eval_every", "metric", "seeds", "data", "training", "configs",
        "classify", "squad"}
_ARM = {"config", "overrides", "parameters", "sizes"}
_FINE_TUNE = {"config", "train_file", "dev_file", "vocab_file", "overrides"}
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
    """A downstream task each winner is fine-tuned on: `classify` (a labelled task: classification,
    regression or tokens) or `squad`."""

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
    def bad(msg: str) -> ValueError:
        return ValueError(f"comparison {source}: {msg}")

    if not isinstance(raw, dict):
        raise bad("the file must hold a mapping (name, budget, configs, ...)")
    for key in raw:
        if key not in _TOP:
            raise bad(f"unknown key {key!r}; the keys are {sorted(_TOP)}")
    name = str(raw.get("name") or re.sub(r"[^A-Za-z0-9_.-]", "", Path(source).stem) or "compare")
    if not _NAME.match(name):
        raise bad(f"name {name!r} must be letters, digits, '_', '.' or '-' (it names the runs' sweeps)")

    budget = raw.get("budget")
    if not isinstance(budget, dict) or len({"flops", "seconds"} & set(budget)) != 1:
        raise bad("budget must give flops or seconds (one of them), e.g. {flops: 1.0e15, warmup: 0.1}")
    for key in budget:
        if key not in ("flops", "seconds", "warmup"):
            raise bad(f"unknown key budget.{key}; budget takes flops or seconds, and warmup")
    kind = "flops" if "flops" in budget else "seconds"
    amount = _positive(budget[kind], f"budget.{kind}", bad)
    warmup = budget.get("warmup", 0.0)
    if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or not 0 <= warmup < 1:
        raise bad(f"budget.warmup {warmup!r} must be a fraction of the budget in [0, 1)")

    evaluations, eval_every = raw.get("evaluations"), raw.get("eval_every")
    for key, value in (("evaluations", evaluations), ("eval_every", eval_every)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise bad(f"{key} {value!r} must be a positive integer")
    if evaluations is not None and eval_every is not None:
        raise bad("give evaluations (per run) or eval_every (steps), not both")
    if kind == "seconds" and evaluations is not None:
        raise bad("evaluations spreads evaluations over a run's steps, which a seconds budget does not fix: "
                  "give eval_every (steps between evaluations)")
    if evaluations is None and eval_every is None:
        if kind == "seconds":
            raise bad("a seconds budget needs eval_every: the steps between held-out evaluations")
        evaluations = 10

    metric = raw.get("metric", METRICS[0])
    if metric not in METRICS:
        raise bad(f"metric {metric!r} must be one of {list(METRICS)} (a held-out loss every evaluation logs)")
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                                                        for s in seeds) or len(set(seeds)) != len(seeds):
        raise bad(f"seeds {seeds!r} must be a list of distinct integers >= 0 (the grid runs at the first)")

    common = {**_section(raw, "data", bad), **_section(raw, "training", bad)}
    budget_keys = {f"budget.{kind}": float(amount), "budget.warmup": float(warmup), "schedule.warmup_steps": 0}
    if kind == "seconds":
        budget_keys["training.steps"] = 10**9  # the time ends the run (bert/budget.py)
    if eval_every is not None:
        budget_keys["evaluation.every"] = eval_every

    configs = raw.get("configs")
    if not isinstance(configs, dict) or len(configs) < 2:
        raise bad("configs must map two or more names to {config: FILE, parameters: ...}")
    arms = []
    for arm_name, entry in configs.items():
        where = f"configs.{arm_name}"
        if not isinstance(arm_name, str) or not _NAME.match(arm_name):
            raise bad(f"{where}: a config's name must be letters, digits, '_', '.' or '-' (it names a directory)")
        if not isinstance(entry, dict) or "config" not in entry:
            raise bad(f"{where} must be a mapping with config: FILE (and overrides, parameters)")
        for key in entry:
            if key not in _ARM:
                raise bad(f"unknown key {where}.{key}; a config takes {sorted(_ARM)}")
        base = _config(entry["config"], where, bad)
        if base.model.task.spec.fine_tuning:
            raise bad(f"{where}: {entry['config']} is a {base.model.task.value} config; the comparison pre-trains")
        own = _overrides(entry.get("overrides", {}), f"{where}.overrides", bad)
        parameters = entry.get("parameters", {})
        if not isinstance(parameters, dict):
            raise bad(f"{where}.parameters must map config fields to W&B distributions, e.g. "
                      "{optimizer.learning_rate: {values: [0.002, 0.004]}}")
        for key in parameters:
            named = current_key(key, where)
            if named in ("training.seed", "training.steps", "evaluation.every") or named.startswith("budget."):
                raise bad(f"{where}.parameters.{key} is set by the comparison itself (seeds:, budget:)")
        for size, changes in _sizes(entry.get("sizes"), where, kind, bad).items():
            config = _apply(base, {**common, **own, **budget_keys, **changes, **(overrides or {})},
                            f"{source} {where}" + (f".sizes.{size}" if size else ""), bad)
            arms.append(Arm(arm_name if size is None else f"{arm_name}-{size}", config, str(entry["config"]),
                            dict(parameters), arm_name, size))
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise bad(f"configs: {twice} name two configs (a config and a size of another's ladder): rename one")

    classify = _fine_tune(raw.get("classify", CLASSIFY_DEFAULT), "classify", source, bad,
                          shipped="classify" not in raw)
    squad = _fine_tune(raw.get("squad"), "squad", source, bad)

    return CompareSpec(name=name, description=str(raw.get("description", "")).strip(), source=source, budget=kind,
                       amount=float(amount), warmup=float(warmup), evaluations=evaluations, eval_every=eval_every,
                       metric=metric, seeds=tuple(seeds), arms=tuple(arms), classify=classify, squad=squad)


def _sizes(sizes: Any, where: str, kind: str, bad) -> dict[Optional[str], dict[str, Any]]:
    """A config's ladder: each size's overrides (its model sizes, and its own `budget.flops`, which
    a front spreads over); {None: {}} without one."""
    if sizes is None:
        return {None: {}}
    if not isinstance(sizes, dict) or len(sizes) < 2:
        raise bad(f"{where}.sizes must map two or more size names to overrides, e.g. "
                  "{small: {model.hidden_size: 64, budget.flops: 1.0e+13}, large: {...}}")
    ladder = {}
    for size, changes in sizes.items():
        if not isinstance(size, str) or not _NAME.match(size):
            raise bad(f"{where}.sizes: a size's name must be letters, digits, '_', '.' or '-' (it names a directory)")
        changes = _overrides(changes, f"{where}.sizes.{size}", bad)
        for key in changes:
            if key.startswith("budget.") and key != f"budget.{kind}":
                raise bad(f"{where}.sizes.{size}.{key}: a size may set its own budget.{kind}, no other budget key")
        ladder[size] = changes
    return ladder


def _fine_tune(entry: Any, task: str, source: str, bad, shipped: bool = False) -> Optional[FineTune]:
    """The YAML's `classify:` or `squad:` entry; `shipped`: the default, whose files are the
    repository's wherever the command runs."""
    if entry is None:
        return None
    if not isinstance(entry, dict) or "config" not in entry:
        raise bad(f"{task} must be a mapping with config: FILE (and train_file, dev_file, vocab_file, overrides)"
                  + (", or null for none" if task == "classify" else ""))
    for key in entry:
        if key not in _FINE_TUNE:
            raise bad(f"unknown key {task}.{key}; {task} takes {sorted(_FINE_TUNE)}")
    files = {f"data.{k}": str(entry[k]) for k in ("train_file", "dev_file") if entry.get(k) is not None}
    own = _overrides(entry.get("overrides", {}), f"{task}.overrides", bad)
    config = _config(ROOT / entry["config"] if shipped else entry["config"], task, bad)
    if shipped:
        files = {f"data.{k}": str(ROOT / getattr(config.data, k)) for k in ("train_file", "dev_file")}
    config = _apply(config, {**files, **own}, f"{source} {task}", bad)
    if task == "squad" and config.model.task is not Task.SQUAD:
        raise bad(f"squad.config {entry['config']} is not a SQuAD config (model.task 'squad')")
    if task == "classify" and not config.model.task.labelled:
        raise bad(f"classify.config {entry['config']} is not a labelled-task config (model.task 'classification', "
                  "'regression' or 'tokens')")
    if not config.data.dev_file:
        raise bad(f"{task}: give dev_file, the file whose scores the report shows")
    for key in ("train_file", "dev_file"):
        path = getattr(config.data, key)
        if not path or not Path(path).is_file():
            made = " (make squad-demo writes demo_data/squad)" if task == "squad" else ""
            raise bad(f"{task}.{key} {path} does not exist{made}")
    return FineTune(task, config, str(entry["config"]), entry.get("vocab_file"))


def _positive(value: Any, where: str, bad) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        hint = " (YAML reads 1e15 and 1.0e15 as text: write 1.0e+15)" if isinstance(value, str) else ""
        raise bad(f"{where} {value!r} must be a positive number{hint}")
    return float(value)


def _section(raw: dict, section: str, bad) -> dict[str, Any]:
    value = raw.get(section, {})
    if not isinstance(value, dict):
        raise bad(f"{section} must map {section} keys to values, e.g. {{source: demo}}")
    return {f"{section}.{k}": v for k, v in value.items()}


def _overrides(value: Any, where: str, bad) -> dict[str, Any]:
    if not isinstance(value, dict) or any(not isinstance(k, str) or "." not in k for k in value):
        raise bad(f"{where} must map dotted config keys to values, e.g. {{batch.micro_batch_size: 16}}")
    return dict(value)


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
