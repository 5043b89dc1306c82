"""Typed, frozen configuration; JSON maps 1:1 onto it.

A config file has a name and three sections, each a frozen model that forbids
unknown keys:

    {"name": "...", "model": {...}, "training": {...}, "data": {...}}

Derived values are properties. `load_config` names the file, the key and the value in
every error; `with_overrides` applies `section.key=value` overrides from the command
line with the same checks.
"""
from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class Architecture(str, enum.Enum):
    BERT = "bert"
    GROUPBERT = "groupbert"


class Task(str, enum.Enum):
    PRETRAINING = "pretraining"
    SQUAD = "squad"


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)


class ModelConfig(_Section):
    """Sizes and structure of the network (DESIGN.md, "The model")."""

    architecture: Architecture
    task: Task = Task.PRETRAINING
    vocab_size: int = Field(30522, gt=0)
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    ffn_multiplier: int = Field(4, gt=0)
    max_positions: int = Field(512, gt=0)
    type_vocab_size: int = Field(2, gt=0)
    sequence_length: int = Field(128, gt=0)
    max_predictions: int = Field(20, gt=0)
    layer_norm_eps: float = Field(1e-12, gt=0)
    hidden_dropout: float = Field(0.0, ge=0, lt=1)
    attention_dropout: float = Field(0.0, ge=0, lt=1)
    init_std: float = Field(0.02, gt=0)
    # GroupBERT only (GroupBERT paper, sections 3.1-3.2).
    conv_kernel: int = Field(7, gt=0)
    conv_group_size: int = Field(16, gt=0)
    ffn_groups: int = Field(4, gt=0)
    # Placement: encoder layers per pipeline stage; embeddings and heads on stage 0.
    layers_per_stage: Optional[tuple[int, ...]] = None

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def intermediate_size(self) -> int:
        return self.ffn_multiplier * self.hidden_size

    @property
    def conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size

    @property
    def stages(self) -> tuple[int, ...]:
        return self.layers_per_stage or (self.num_layers,)

    @model_validator(mode="after")
    def _consistent(self) -> "ModelConfig":
        h = self.hidden_size
        if h % self.num_heads:
            raise ValueError(f"hidden_size {h} is not divisible by num_heads {self.num_heads}")
        if self.sequence_length > self.max_positions:
            raise ValueError(f"sequence_length {self.sequence_length} exceeds max_positions {self.max_positions}")
        if self.max_predictions > self.sequence_length:
            raise ValueError(f"max_predictions {self.max_predictions} exceeds sequence_length {self.sequence_length}")
        if self.architecture is Architecture.GROUPBERT:
            if h % self.conv_group_size:
                raise ValueError(f"hidden_size {h} is not divisible by conv_group_size {self.conv_group_size}")
            if self.conv_kernel % 2 == 0:
                raise ValueError(f"conv_kernel {self.conv_kernel} must be odd (same padding)")
            if h % self.ffn_groups or self.intermediate_size % self.ffn_groups:
                raise ValueError(f"hidden_size {h} and its FFN width must be divisible by ffn_groups {self.ffn_groups}")
        if self.layers_per_stage is not None:
            if any(n < 0 for n in self.layers_per_stage) or sum(self.layers_per_stage) != self.num_layers:
                raise ValueError(
                    f"layers_per_stage {list(self.layers_per_stage)} must be non-negative and add up to "
                    f"num_layers {self.num_layers}"
                )
        return self


class Optimizer(str, enum.Enum):
    LAMB = "lamb"
    ADAMW = "adamw"


class TrainingConfig(_Section):
    """Optimisation and run control (the GroupBERT/BERT LAMB recipes by default)."""

    optimizer: Optimizer = Optimizer.LAMB
    learning_rate: float = Field(0.006, gt=0)
    warmup: Literal["linear", "sqrt"] = "linear"
    warmup_steps: int = Field(0, ge=0)
    decay: Literal["linear", "polynomial", "constant"] = "linear"
    decay_power: float = Field(1.0, gt=0)
    end_learning_rate: float = Field(0.0, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    epsilon: float = Field(1e-6, gt=0)
    max_grad_norm: Optional[float] = Field(None, gt=0)
    max_trust_ratio: Optional[float] = Field(None, gt=0)
    micro_batch_size: int = Field(8, gt=0)
    gradient_accumulation: int = Field(1, gt=0)
    steps: int = Field(100, gt=0)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scaling: Union[float, Literal["dynamic"], None] = None
    recompute: bool = False
    compile: bool = False
    seed: int = 0
    # Initialise the weights (only) from a checkpoint: phase 2 from phase 1, or SQuAD.
    init_from: Optional[str] = None
    output_dir: str = "runs/{name}"
    checkpoint_every: int = Field(0, ge=0)  # 0: only at the end
    log_every: int = Field(10, gt=0)
    device: str = "cpu"

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation


class DataConfig(_Section):
    """Where samples come from: HDF5 shards, the built-in demo corpus, or random tokens."""

    source: Literal["shards", "demo", "synthetic"] = "synthetic"
    files: tuple[str, ...] = ()  # globs of HDF5 shards when source == "shards"
    directory: str = "demo_data"  # where the demo corpus is built when source == "demo"
    shuffle_buffer: int = Field(2048, gt=0)
    prefetch: int = Field(4, ge=0)
    dynamic_masking: bool = False

    @model_validator(mode="after")
    def _has_files(self) -> "DataConfig":
        if self.source == "shards" and not self.files:
            raise ValueError("data.source is 'shards' but data.files is empty: list HDF5 shard globs")
        return self


class Config(_Section):
    name: str = "run"
    model: ModelConfig
    training: TrainingConfig = TrainingConfig()
    data: DataConfig = DataConfig()


def _format_error(error: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in error.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  unknown key {key!r} (value {e['input']!r}); check the spelling against bert/config.py")
        elif e["type"] == "missing":
            lines.append(f"  missing key {key!r}")
        else:
            value = e.get("input")
            shown = "" if isinstance(value, dict) else f" = {value!r}"
            lines.append(f"  {key}{shown}: {e['msg']}")
    return "\n".join(lines)


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ValueError(_format_error(e, source)) from None


def load_config(path: str | Path) -> Config:
    """Read a JSON config strictly: unknown keys and bad values name the key, value and file."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"config file {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"config file {path} is not valid JSON: {e}") from None
    return config_from_dict(data, str(path))


def with_overrides(config: Config, overrides: dict[str, Any], source: str = "command line") -> Config:
    """Apply {"section.key": value} overrides; values are validated like the file's."""
    data = config.model_dump(mode="json")
    for dotted, value in overrides.items():
        node = data
        *path, leaf = dotted.split(".")
        for part in path:
            if not isinstance(node.get(part), dict):
                raise ValueError(f"invalid override {dotted!r} from {source}: {part!r} is not a config section")
            node = node[part]
        node[leaf] = value
    return config_from_dict(data, source)
