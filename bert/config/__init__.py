"""Typed, frozen configuration; JSON maps 1:1 onto it.

A config file has a version, a name, the network, the data, and one section per concern of
training, each a frozen model that forbids unknown keys (docs/config.md lists every key):

    {"version": 3, "name": "...", "model": {...}, "data": {...}, "training": {...},
     "optimizer": {...}, "schedule": {...}, "batch": {...}, "precision": {...},
     "checkpoint": {...}, "evaluation": {...}, "parallel": {...}, "budget": {...}}

The optimizer section is one of several, tagged by `optimizer.name`: each rule takes the
common keys and its own (session/hyperparameters.py), and refuses another rule's.

Derived values are properties. `load_config` names the file, the key and the value in
every error; `with_overrides` applies `section.key=value` overrides from the command
line with the same checks. An unknown key is named with its fix: the section(s) that have
a key of that name (`model.learning_rate`: optimizer), else the key it nearly spells. A
`training.steps` override replaces the config's `training.epochs`, said in one note.
Versions 1 and 2 are still read, with one line that names the keys moved: version 1 kept
everything about training in one `training` section (its keys move to their sections,
OLD_KEYS); version 2's optimizer section had one set of keys for every rule, a rule ignoring
those it did not use (they move to the rule's own names, V2_OPTIMIZER_KEYS, or go). Old keys
given as overrides are mapped the same way.

Types are strict: a config is validated as JSON in pydantic's strict mode, so `true`
is not 1, `"5"` is not 5 and 1.5 is not an int (an int is a fine float); numbers must
be finite. Limits that the kernels and the data impose (channels per conv group,
segment ids 0/1) and the device are checked here too, so a run that starts does not
stop later over its config.
"""
from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, ValidationError, model_validator

from bert.config.errors import format_error, tagged_members
from bert.tasks.spec import LABELLED, named
from bert.config.sections import (RULE_SECTIONS, Architecture, BatchConfig, BudgetConfig, CheckpointConfig,
                                  DataConfig, EvaluationConfig, ModelConfig, OptimizerConfig, OptimizerSection,
                                  ParallelConfig, PrecisionConfig, ScheduleConfig, Section, Task, TrainingConfig,
                                  check_device)

__all__ = ["Architecture", "BatchConfig", "BudgetConfig", "CONFIG_VERSION", "CheckpointConfig", "Config", "DataConfig",
           "EvaluationConfig", "ModelConfig", "OLD_KEYS", "OptimizerConfig", "OptimizerSection", "ParallelConfig",
           "PrecisionConfig", "RULE_SECTIONS", "ScheduleConfig", "Task", "TrainingConfig", "V2_OPTIMIZER_KEYS",
           "check_device", "config_from_dict", "current_key", "load_config", "note", "sections_of", "tagged_members",
           "upgrade", "with_overrides"]

CONFIG_VERSION = 3
_TASKS = tuple(t.value for t in Task)
_FINE_TUNING = tuple(t for t in Task if t.spec.fine_tuning)


class Config(Section):
    """A run: its network, its data, and one section per concern of its training."""

    version: Literal[3] = Field(CONFIG_VERSION, description="the config's format; version 1 (every training "
                                "setting in `training`) and version 2 (one set of optimizer keys for every rule) are "
                                "read as version 3, with a note naming the keys moved")
    name: str = Field("run", description="the run's name: its output directory (`training.output_dir`) and W&B run")
    model: ModelConfig
    data: DataConfig = DataConfig()
    training: TrainingConfig = TrainingConfig()
    optimizer: OptimizerConfig = RULE_SECTIONS["lamb"]()
    schedule: ScheduleConfig = ScheduleConfig()
    batch: BatchConfig = BatchConfig()
    precision: PrecisionConfig = PrecisionConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    parallel: ParallelConfig = ParallelConfig()
    budget: BudgetConfig = BudgetConfig()

    @model_validator(mode="after")
    def _task_reads_its_data(self) -> "Config":
        task, source = self.model.task, self.data.source
        if task.labelled and source != "files":
            raise ValueError(f"model.task {task.value!r} reads data.train_file (data.source 'files'), not data.source "
                             f"{source!r}: remove data.source")
        if source == "files" and not task.labelled:
            raise ValueError(f"data.source 'files' holds labelled rows for model.task "
                             f"{named(LABELLED)}, not {task.value!r}")
        return self

    @model_validator(mode="after")
    def _length_agrees(self) -> "Config":
        budget, warmup_steps = self.budget.kind, self.schedule.warmup_steps
        if budget is not None and self.model.task.spec.fine_tuning:
            raise ValueError(f"budget.{budget} applies to pre-training; fine-tuning counts training.steps or "
                             "training.epochs")
        if budget is not None and warmup_steps:
            raise ValueError(f"schedule.warmup_steps {warmup_steps} with budget.{budget}: with a budget the "
                             "warm-up is budget.warmup, a fraction of the budget (e.g. 0.1)")
        if warmup_steps > self.training.steps and self.training.epochs is None:  # epochs: bert/tasks/rows.py checks
            raise ValueError(f"schedule.warmup_steps {warmup_steps} exceeds training.steps {self.training.steps}: "
                             "lower the warm-up or train longer")
        if self.training.epochs is not None and not self.model.task.spec.fine_tuning:
            raise ValueError(f"training.epochs applies to fine-tuning ({named(_FINE_TUNING, 'and')}); pre-training "
                             "counts training.steps")
        return self

    @model_validator(mode="after")
    def _auto_batch_where_probed(self) -> "Config":
        if self.batch.micro_batch_size != "auto":
            return self
        if self.parallel.pipeline:
            raise ValueError("batch.micro_batch_size auto measures a whole model in one process; with "
                             "parallel.pipeline each stage holds a part: give the micro batch as a number")
        return self

    @model_validator(mode="after")
    def _pipeline_has_stages(self) -> "Config":
        if self.parallel.pipeline and len(self.model.stages) < 2:
            raise ValueError("parallel.pipeline needs model.layers_per_stage with two or more groups of layers "
                             "(one process each), e.g. [1, 1]")
        if self.parallel.pipeline and 0 in self.model.stages:
            empty = [i for i, n in enumerate(self.model.stages) if n == 0]
            raise ValueError(f"model.layers_per_stage {list(self.model.stages)} leaves pipeline stage(s) {empty} "
                             "without layers: with parallel.pipeline every stage runs in a process of its own and "
                             "needs at least one layer")
        return self

    @model_validator(mode="after")
    def _packed_rows_from_the_loader(self) -> "Config":
        if self.model.packed and not self.model.task.spec.fine_tuning and self.data.source not in ("demo", "shards"):
            raise ValueError(f"model.packed takes its rows from the packing loader: use data.source 'demo' or "
                             f"'shards', not {self.data.source!r}")
        return self

    @model_validator(mode="after")
    def _data_fits_model(self) -> "Config":
        # Every data source writes segment ids 0 and 1 (docs/data.md), and synthetic
        # batches draw token ids from 5 up (past the control tokens).
        if not self.model.task.spec.fine_tuning and self.model.type_vocab_size < 2:
            raise ValueError(f"model.type_vocab_size {self.model.type_vocab_size} is below 2: pre-training "
                             "samples have segment ids 0 and 1")
        if self.data.source == "synthetic" and self.model.vocab_size <= 5:
            raise ValueError(f"model.vocab_size {self.model.vocab_size} leaves no tokens for synthetic data "
                             "(ids 0-4 are control tokens): use at least 6")
        return self


def _rule_key(key: str, value: str, rule: str) -> str:
    """The line for `key` given to optimizer.name `rule`, which does not take it: the rule, its
    keys, and whose key it is (another rule's, version 2's name of one of this rule's, or the one it
    nearly spells)."""
    leaf = key.rpartition(".")[2]
    keys = list(RULE_SECTIONS[rule].model_fields)
    owners = [other for other, section in RULE_SECTIONS.items() if leaf in section.model_fields]
    if owners:
        whose = f"{leaf} is " + " and ".join(f"{owner}'s" for owner in owners)
    elif leaf in V2_OPTIMIZER_DEFAULTS:
        meant = V2_OPTIMIZER_KEYS[rule].get(leaf) if rule in V2_OPTIMIZER_KEYS else None
        whose = (f"version 2's name of optimizer.{meant}" if meant else f"a version-2 key that {rule} never used")
    else:
        near = difflib.get_close_matches(leaf, keys, n=1, cutoff=0.75)
        whose = f"did you mean optimizer.{near[0]}?" if near else ""
    return (f"unknown key {key!r} (value {value}) for optimizer.name {rule!r}: {rule} takes {', '.join(keys)}"
            + (f" ({whose})" if whose else ""))


def _format_error(error: ValidationError, source: str, prefix: Optional[str] = None) -> str:
    """One line (bert/config/errors.py): every problem, by dotted key, with the value given.
    `prefix`: how the keys were written (None: in a config file; "--": command-line flags)."""
    def unknown(key: str) -> str:
        moved = OLD_KEYS.get(key)
        return f"version 2 names it {moved}" if moved else _unknown_key_fix(key, prefix)

    def explain(e: dict, key: str, value: str) -> Optional[tuple[str, str]]:
        given = e.get("input")
        if e["type"] in ("union_tag_invalid", "union_tag_not_found"):  # optimizer.name
            tag = given.get("name") if isinstance(given, dict) else None
            shown = repr(tag) if isinstance(tag, str) else json.dumps(tag, default=str)
            return f"{key}.name", f"{key}.name = {shown}: no such rule; use one of {', '.join(map(repr, RULE_SECTIONS))}"
        rule = e["loc"][1] if len(e["loc"]) > 2 and e["loc"][0] == "optimizer" else None
        if e["type"] == "extra_forbidden" and rule in RULE_SECTIONS:
            return key, _rule_key(key, value, rule)
        return None
    return format_error(error, f"invalid config {source}", Config, unknown, explain)


def _sections() -> dict[str, dict[str, Any]]:
    """The config's sections by name (model, data, training, optimizer, ...), each with its keys
    (the optimizer's: every rule's)."""
    found = {}
    for name, field in Config.model_fields.items():
        if members := tagged_members(field.annotation):
            found[name] = {key: f for member in members.values() for key, f in member.model_fields.items()}
        elif isinstance(field.annotation, type) and issubclass(field.annotation, Section):
            found[name] = dict(field.annotation.model_fields)
    return found


def sections_of(key: str) -> list[str]:
    """The sections that have a key named `key` (`learning_rate`: ["optimizer"]), in the config's order."""
    return [name for name, keys in _sections().items() if key in keys]


def _unknown_key_fix(key: str, prefix: Optional[str]) -> str:
    """What to do about the unknown dotted `key`: where a key of its name belongs, else the key it
    nearly spells, else the reference. `prefix` as in _format_error."""
    *path, leaf = key.split(".")
    where = ".".join(path)  # "": the top level of a file
    homes = [s for s in sections_of(leaf) if s != where]
    top = bool(where) and leaf in Config.model_fields and leaf not in _sections()  # `name`, `version`
    if (homes or top) and len(path) <= 1:
        places = " or ".join(["the top level"] * top + homes)
        if prefix is None:  # a file: where to move it
            quoted = " or ".join(f'"{s}"' for s in homes)
            fix = "move it " + " or ".join(["to the top level"] * top + [f"into the {quoted} section"] * bool(homes))
        else:  # overrides: the ones to give; no override sets a top-level key, the file's own
            given = " or ".join(f"{prefix}{s}.{leaf}" for s in homes)
            fix = " or ".join([f"use {given}"] * bool(homes) + [f"set the file's top-level {leaf}"] * top)
        return f"{leaf} belongs to {places}, not {where or 'the top level'}: {fix}"
    guess = _nearest(where, leaf)
    if guess is not None:
        return f"did you mean {prefix or ''}{guess}?"
    return "check the spelling against docs/config.md"


def _nearest(where: str, leaf: str) -> Optional[str]:
    """The dotted key `where.leaf` nearly spells: a key of its own section (or of the top level)
    first, else one of another section; None when none is close."""
    sections = _sections()
    own = sections[where] if where in sections else Config.model_fields if not where else {}
    found = difflib.get_close_matches(leaf, list(own), n=1, cutoff=0.75)
    if found:
        return f"{where}.{found[0]}" if where else found[0]
    others = {f"{name}.{k}": k for name, keys in sections.items() if name != where for k in keys}
    found = difflib.get_close_matches(leaf, list(dict.fromkeys(others.values())), n=1, cutoff=0.75)
    return next(dotted for dotted, k in others.items() if k == found[0]) if found else None


# Version 1 kept every training setting in `training`; each moved to its section.
OLD_KEYS = {
    **{f"training.{k}": f"optimizer.{k}" for k in ("learning_rate", "weight_decay", "beta1", "beta2", "epsilon",
                                                  "max_grad_norm", "max_trust_ratio")},
    "training.optimizer": "optimizer.name",
    **{f"training.{k}": f"schedule.{k}" for k in ("warmup", "warmup_steps", "decay", "decay_power",
                                                 "end_learning_rate")},
    **{f"training.{k}": f"batch.{k}" for k in ("micro_batch_size", "gradient_accumulation")},
    "training.precision": "precision.dtype",
    **{f"training.{k}": f"precision.{k}" for k in ("loss_scaling", "min_loss_scale")},
    "training.checkpoint_every": "checkpoint.every",
    "training.save_best": "checkpoint.save_best",
    "training.eval_every": "evaluation.every",
    **{f"training.{k}": f"parallel.{k}" for k in ("replication_factor", "replicated_tensor_sharding", "pipeline",
                                                 "gradient_bucket_mb", "fault_timeout")},
    **{f"training.budget_{k}": f"budget.{k}" for k in ("flops", "seconds", "warmup")},
}
# Version 2's optimizer section had these keys besides the common ones, for every rule: each
# rule ignored those it did not use. Version 3 gives each rule its own (session/hyperparameters.py).
V2_OPTIMIZER_DEFAULTS: dict[str, Any] = {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-6, "max_trust_ratio": None}
# What each rule of version 2 took of them, by its version-3 name (`betas[0]`: the pair's first).
V2_OPTIMIZER_KEYS: dict[str, dict[str, str]] = {
    "lamb": {"beta1": "betas[0]", "beta2": "betas[1]", "epsilon": "eps", "max_trust_ratio": "max_trust_ratio"},
    "adamw": {"beta1": "betas[0]", "beta2": "betas[1]", "epsilon": "eps"},
    "lion": {"beta1": "beta1", "beta2": "beta2"},
}
_noted: set[str] = set()


def note(line: str, topic: Optional[str] = None) -> None:
    """Print `note: line` once per process for its `topic` (default: the line), on the first
    process of a launch only."""
    topic = topic or line
    if topic not in _noted and os.environ.get("RANK", "0") == "0":
        _noted.add(topic)
        print(f"note: {line}", flush=True)


def current_key(dotted: str, source: str) -> str:
    """The version-2 name of a dotted config key (`training.learning_rate` → `optimizer.learning_rate`),
    noted once per process; other keys as given."""
    new = OLD_KEYS.get(dotted)
    if new is None:
        return dotted
    note(f"{dotted} is now {new}: {source} gives its version-1 name, read for this release", topic=dotted)
    return new


def upgrade(data: dict[str, Any], source: str) -> dict[str, Any]:
    """A version-1 or version-2 config as version 3: every OLD_KEYS key moved to its section
    (version 1), the optimizer's keys to its rule's own names (version 2, V2_OPTIMIZER_KEYS), all
    named in one note; a key whose name stays moves silently."""
    version = data.get("version", 1)
    if type(version) is int and version > CONFIG_VERSION:
        raise ValueError(f"invalid config {source}: version {version} is newer than this bert.py reads "
                         f"(version {CONFIG_VERSION}): update the project, or write the config as version {CONFIG_VERSION}")
    if type(version) is not int or version not in (1, 2):
        return data  # version 3, or one that validation names as unknown
    data = {**data, "version": CONFIG_VERSION}
    moved = _from_version_1(data, source) if version == 1 else []
    renamed, remarks, dropped = _optimizer_from_version_2(data, source)
    came_from = {new: old for old, new in moved}  # a version-2 key that was a version-1 one
    moved = [(old, renamed.pop(new, new)) for old, new in moved if new not in dropped]
    moved += [(came_from.get(old, old), new) for old, new in renamed.items()]
    remarks = [f"{came_from.get(key, key)} {remark}" for key, remark in remarks]
    if moved or remarks:
        note(f"{source} is a version-{version} config, read as version {CONFIG_VERSION}: {_moves(moved, remarks)}")
    return data


def _from_version_1(data: dict[str, Any], source: str) -> list[tuple[str, str]]:
    """Version 1's `training` keys moved into their sections of `data` (in place): (old, new) keys."""
    if not isinstance(data.get("training"), dict):
        return []
    data["training"] = dict(data["training"])
    moved = []
    for key in [k for k in data["training"] if f"training.{k}" in OLD_KEYS]:
        section, leaf = OLD_KEYS[f"training.{key}"].split(".")
        target = data.setdefault(section, {})
        if not isinstance(target, dict):
            break  # validation names the section that is not one
        if leaf in target:
            raise ValueError(f"invalid config {source}: training.{key} and {section}.{leaf} are the same setting "
                             f"(version 1 and 2 of its name): give {section}.{leaf} only")
        data[section] = {**target, leaf: data["training"].pop(key)}
        moved.append((f"training.{key}", f"{section}.{leaf}"))
    return moved


def _optimizer_from_version_2(data: dict[str, Any], source: str
                              ) -> tuple[dict[str, str], list[tuple[str, str]], set[str]]:
    """Version 2's optimizer keys as the rule's own (in place): {old: new} for each renamed;
    (key, what became of it) for each dropped that held a value of its own (one the rule never
    used) and each filled in (a default of version 2's that the rule's own default differs
    from); and every key dropped."""
    section = data.get("optimizer", {})
    rule = section.get("name", "lamb") if isinstance(section, dict) else None
    if rule not in V2_OPTIMIZER_KEYS:
        return {}, [], set()  # validation names what is wrong
    section, takes = dict(section), V2_OPTIMIZER_KEYS[rule]
    renamed, remarks, dropped, pair = {}, [], set(), {}
    for key in [k for k in V2_OPTIMIZER_DEFAULTS if k in section]:
        value, new = section.pop(key), takes.get(key)
        if new is None:
            dropped.add(f"optimizer.{key}")
            if value != V2_OPTIMIZER_DEFAULTS[key]:  # a default is only what a saved config.json writes out
                remarks.append((f"optimizer.{key}", f"{json.dumps(value)} dropped: {rule} never used it"))
            continue
        name, index = new.partition("[")[::2]
        if name in section:
            raise ValueError(f"invalid config {source}: optimizer.{key} and optimizer.{name} are the same setting "
                             f"(its version-2 and version-3 names): give one, with the file's version")
        if index:
            pair[int(index.rstrip("]"))] = value
        else:
            section[name] = value
        if new != key:
            renamed[f"optimizer.{key}"] = f"optimizer.{new}"
    if pair:
        section["betas"] = [pair.get(i, V2_OPTIMIZER_DEFAULTS[f"beta{i + 1}"]) for i in range(2)]
    own = RULE_SECTIONS[rule].model_fields
    for key, new in takes.items():  # version 2's default held where the config gave none
        if "[" not in new and new not in section and own[new].default != V2_OPTIMIZER_DEFAULTS[key]:
            section[new] = V2_OPTIMIZER_DEFAULTS[key]
            remarks.append((f"optimizer.{new}", f"{json.dumps(V2_OPTIMIZER_DEFAULTS[key])} kept, version 2's default "
                                                f"({rule}'s own is {json.dumps(own[new].default)})"))
    if section or "optimizer" in data:
        data["optimizer"] = section
    return renamed, remarks, dropped


def _moves(moved: list[tuple[str, str]], remarks: list[str]) -> str:
    """`training.{a, b} → optimizer.*; training.precision → precision.dtype; ...` by section, then
    the remarks."""
    kept: dict[str, list[str]] = {}  # by section: version-1 keys whose name stays
    renamed: dict[str, list[str]] = {}  # by section: `training.a → section.b`
    for old, new in moved:
        section, leaf = new.split(".", 1)
        kept.setdefault(section, [])
        if old == f"training.{leaf}":
            kept[section].append(leaf)
        else:
            renamed.setdefault(section, []).append(f"{old} → {new}")
    parts = []
    for section, keys in kept.items():
        if len(keys) > 1:
            parts.append(f"training.{{{', '.join(keys)}}} → {section}.*")
        elif keys:
            parts.append(f"training.{keys[0]} → {section}.{keys[0]}")
        parts += renamed.get(section, [])
    return "; ".join(parts + remarks)


def _task_source(data: dict[str, Any]) -> dict[str, Any]:
    """A fine-tuning task that names no data.source reads its own files (`squad`, `files`)."""
    model, section = data.get("model"), data.get("data", {})
    if not isinstance(model, dict) or not isinstance(section, dict) or "source" in section:
        return data
    task = model.get("task")
    own = Task(task).spec.source if task in _TASKS else None
    return data if own is None else {**data, "data": {**section, "source": own}}


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    """Validate `data` as its JSON text in strict mode: JSON types map 1:1 onto the fields.
    A version-1 config is read as version 2 (OLD_KEYS), with one note naming the keys moved."""
    return _validated(data, source)


def _validated(data: dict[str, Any], source: str, prefix: Optional[str] = None) -> Config:
    """config_from_dict, its errors naming keys as they were written (`prefix`, _format_error)."""
    if isinstance(data, dict):
        data = _task_source(upgrade(data, source))
    try:
        text = json.dumps(data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"invalid config {source}: not representable as JSON ({e})") from None
    try:
        return Config.model_validate_json(text, strict=True)
    except ValidationError as e:
        raise ValueError(_format_error(e, source, prefix)) from None


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ValueError(f"key {repeated[0]!r} appears more than once")
    return dict(pairs)


def load_config(path: str | Path) -> Config:
    """Read a JSON config strictly: unknown keys and bad values name the key, value and file."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"config file {path} does not exist")
    if not path.is_file():
        raise ValueError(f"config file {path} is not a file; pass a JSON file such as configs/demo.json")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"config file {path} is not UTF-8 text (byte {e.start}); save it as UTF-8 JSON") from None
    except OSError as e:
        raise ValueError(f"config file {path} cannot be read ({e.strerror})") from None
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise ValueError(f"config file {path} is not valid JSON: {e}") from None
    except ValueError as e:
        raise ValueError(f"config file {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} holds a JSON {type(data).__name__}, not an object "
                         '{"version": 2, "name": ..., "model": {...}, "data": {...}, "training": {...}, ...}')
    return config_from_dict(data, str(path))


def with_overrides(config: Config, overrides: dict[str, Any], source: str = "command line", *,
                   flags: bool = False) -> Config:
    """Apply {"section.key": value} overrides; values are validated like the file's. A list
    field given one string takes it as its only item (`--data.files 'shards/*.hdf5'`). `flags`:
    the overrides were written as `--section.key` (an error names its fix so).

    The run's length is the one given last, as every other setting is: a training.steps
    override replaces the config's training.epochs (said in one note); both in one set of
    overrides is refused."""
    data = config.model_dump(mode="json")
    prefix = "--" if flags else ""
    given = _for_the_rule(config, data, {current_key(dotted, source): value for dotted, value in overrides.items()},
                          source)
    for dotted, value in given.items():
        node = data
        *path, leaf = dotted.split(".")
        for part in path:
            if not isinstance(node.get(part), dict):
                sections = ", ".join(k for k, v in node.items() if isinstance(v, dict))
                raise ValueError(f"invalid override {dotted!r} from {source}: {part!r} is not a config section"
                                 + (f" (sections: {sections})" if sections else "")
                                 + (_section_meant(part, leaf, prefix) if node is data else ""))
            node = node[part]
        node[leaf] = [value] if isinstance(node.get(leaf), list) and isinstance(value, str) else value
    steps, epochs = given.get("training.steps"), config.training.epochs
    if steps is not None and given.get("training.epochs") is not None:
        raise ValueError(f"invalid overrides from {source}: training.steps {steps} and training.epochs "
                         f"{given['training.epochs']} both set the run's length: give one")
    replaces = steps is not None and "training.epochs" not in given and epochs is not None
    if replaces:
        data["training"]["epochs"] = None
    config = _validated(data, source, prefix)
    if replaces:
        note(f"training.steps {steps} from {source} replaces the config's training.epochs {epochs}: the run takes "
             f"{steps} steps", topic="training.steps over training.epochs")
    return config


def _for_the_rule(config: Config, data: dict[str, Any], given: dict[str, Any], source: str) -> dict[str, Any]:
    """Overrides of the optimizer section for the rule they leave it with: another rule named by
    `optimizer.name` keeps the keys it shares with the config's (`data`, in place) and drops the
    others, said in one note; version 2's key names map to the rule's own (`optimizer.beta1` is
    LAMB's `optimizer.betas[0]`), each noted once. A key the rule does not take stays, for
    validation to refuse."""
    was, rule = config.optimizer.name, given.get("optimizer.name", config.optimizer.name)
    if rule not in RULE_SECTIONS:
        return given  # validation names it
    keys = RULE_SECTIONS[rule].model_fields
    if rule != was:
        # The config's own settings of the rule it leaves, where they are not that rule's defaults.
        ours = RULE_SECTIONS[was].model_fields
        dropped = [f"optimizer.{key} {json.dumps(value)}" for key, value in data["optimizer"].items()
                   if key not in keys and value != json.loads(json.dumps(ours[key].default))]
        data["optimizer"] = {key: value for key, value in data["optimizer"].items() if key in keys}
        if dropped:
            note(f"optimizer.name {rule!r} from {source} replaces {was!r}: {', '.join(dropped)} ({was}'s own) "
                 f"dropped", topic=f"optimizer.name {was} → {rule}")
    given = dict(given)
    for old in [k for k in V2_OPTIMIZER_DEFAULTS if f"optimizer.{k}" in given and k not in keys]:
        new = V2_OPTIMIZER_KEYS.get(rule, {}).get(old)
        if new is None:
            continue  # refused by validation, naming the rule's keys
        value = given.pop(f"optimizer.{old}")
        name, index = new.partition("[")[::2]
        if index:
            pair = list(given.get("optimizer.betas") or data["optimizer"].get("betas") or keys["betas"].default)
            pair[int(index.rstrip("]"))] = value
            value = pair
        given[f"optimizer.{name}"] = value
        note(f"optimizer.{old} is {rule}'s optimizer.{new}: {source} gives its version-2 name, read for this release",
             topic=f"optimizer.{old} → {rule}")
    return given


def _section_meant(part: str, leaf: str, prefix: str) -> str:
    """`: did you mean --model.hidden_size?` for an override whose section `part` is misspelt
    (`modle.hidden_size`); "" when no key is clear."""
    homes = sections_of(leaf)
    near = difflib.get_close_matches(part, list(_sections()), n=1, cutoff=0.75)
    if homes and not (near and near[0] in homes):  # `trainer.learning_rate`: the sections that have the key
        meant = [f"{s}.{leaf}" for s in homes]
    else:  # the section misspelt: the key meant in it (or, misspelt too, in another)
        guess = _nearest(near[0], leaf) if near else None
        meant = [guess] if guess else []
    return ": did you mean " + " or ".join(prefix + m for m in meant) + "?" if meant else ""
