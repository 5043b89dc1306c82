"""Typed, frozen configuration; JSON maps 1:1 onto it.

A config file has a name and three sections, each a frozen model that forbids
unknown keys:

    {"name": "...", "model": {...}, "training": {...}, "data": {...}}

Derived values are properties. `load_config` names the file, the key and the value in
every error; `with_overrides` applies `section.key=value` overrides from the command
line with the same checks.

Types are strict: a config is validated as JSON in pydantic's strict mode, so `true`
is not 1, `"5"` is not 5 and 1.5 is not an int (an int is a fine float); numbers must
be finite. Limits that the kernels and the data impose (channels per conv group,
segment ids 0/1) and the device are checked here too, so a run that starts does not
stop later over its config.
"""
from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from custom_ops import MAX_CHANNELS_PER_GROUP


class Architecture(str, enum.Enum):
    BERT = "bert"
    GROUPBERT = "groupbert"


class Task(str, enum.Enum):
    PRETRAINING = "pretraining"
    SQUAD = "squad"


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False, allow_inf_nan=False)


class ModelConfig(_Section):
    """Sizes and structure of the network (docs/design.md, "Model")."""

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
    # Placement (bert/placement.py): encoder layers per virtual graph and pipeline stage; the
    # embeddings with the first group, the heads back on virtual graph 0 in a stage of their own.
    layers_per_stage: Optional[tuple[int, ...]] = None
    # Packed sequences (Graphcore's packed BERT, docs/packing.md): a row holds up to
    # max_sequences_per_pack sequences, kept apart by attention and the convolution.
    packed: bool = False
    max_sequences_per_pack: int = Field(3, gt=0)

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def intermediate_size(self) -> int:
        return self.ffn_multiplier * self.hidden_size

    @property
    def stages(self) -> tuple[int, ...]:
        return self.layers_per_stage or (self.num_layers,)

    @property
    def predictions_per_row(self) -> int:
        """Masked-position slots per graph row: max_predictions per sequence; packed, the
        masks of a row's sequences, at most max_predictions + max_sequences_per_pack
        (the packing loader's bound, data/loader.py) and never more than S."""
        if not self.packed:
            return self.max_predictions
        return min(self.sequence_length, self.max_predictions + self.max_sequences_per_pack)

    def unpacked(self) -> "ModelConfig":
        """The same network on one sequence per row: the serving graph of a packed model."""
        return self.model_copy(update={"packed": False})

    def with_sizes(self, sizes: dict[str, Any], where: str) -> "ModelConfig":
        """This config (task, dropout, placement of the run) with the network sizes of weights
        made elsewhere (a HuggingFace config.json, the config.json of the run that wrote a
        checkpoint): the sequence shrinks to the positions the weights have, the masked slots
        with it, and layers_per_stage is kept where it still adds up. The one place where
        sizes are adopted; a misfit is one line naming `where`."""
        fields = {**self.model_dump(), **sizes}
        fields["sequence_length"] = min(self.sequence_length, fields["max_positions"])
        # Position 0 holds [CLS], which is never masked: at most S - 1 masked positions.
        fields["max_predictions"] = min(self.max_predictions, fields["sequence_length"] - 1)
        if self.layers_per_stage is not None and sum(self.layers_per_stage) != fields["num_layers"]:
            fields["layers_per_stage"] = None
        try:
            return ModelConfig(**fields)
        except ValidationError as e:
            problems = "; ".join(
                (f"{'.'.join(map(str, err['loc']))}: " if err["loc"] else "") + err["msg"].removeprefix("Value error, ")
                for err in e.errors())
            raise ValueError(f"{where}: the weights' sizes do not fit the run's model config: {problems}") from None

    @model_validator(mode="after")
    def _consistent(self) -> "ModelConfig":
        h = self.hidden_size
        if h % self.num_heads:
            raise ValueError(f"hidden_size {h} is not divisible by num_heads {self.num_heads}")
        if self.sequence_length > self.max_positions:
            raise ValueError(f"sequence_length {self.sequence_length} exceeds max_positions {self.max_positions}")
        if self.max_predictions >= self.sequence_length:
            raise ValueError(f"max_predictions {self.max_predictions} must be below sequence_length "
                             f"{self.sequence_length}: position 0 holds [CLS], which is never masked")
        if self.architecture is Architecture.GROUPBERT:
            if h % self.conv_group_size:
                raise ValueError(f"hidden_size {h} is not divisible by conv_group_size {self.conv_group_size}")
            if self.conv_group_size > MAX_CHANNELS_PER_GROUP:
                raise ValueError(f"conv_group_size {self.conv_group_size} exceeds {MAX_CHANNELS_PER_GROUP}, the most "
                                 "channels per group the compiled convolution supports")
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
    LION = "lion"  # epsilon and max_trust_ratio do not apply; beta2 0.99 and a smaller LR are usual


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
    # SQuAD fine-tuning: passes over the training features; when set, it decides the steps.
    epochs: Optional[int] = Field(None, gt=0)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scaling: Union[float, Literal["dynamic"], None] = None
    recompute: bool = False
    compile: bool = False
    seed: int = Field(0, ge=0, lt=2**32)
    # Initialise the weights (only) from a checkpoint: phase 2 from phase 1, or SQuAD.
    init_from: Optional[str] = None
    output_dir: str = "runs/{name}"
    checkpoint_every: int = Field(0, ge=0)  # 0: only at the end
    # Held-out evaluation every this many steps, and at every checkpoint (0: at checkpoints only).
    eval_every: int = Field(0, ge=0)
    # Keep the weights of the best evaluation (checkpoint-best, replaced when a better one comes),
    # as HF's Trainer keeps its best model; off: best.json says when the best was not saved.
    save_best: bool = True
    log_every: int = Field(10, gt=0)  # a metrics record (the steps' means) and a progress line
    device: str = "cpu"
    # Divergence: steps with a non-finite loss or gradient are skipped; this many in a row
    # (or, in fp16, a dynamic loss scale pushed below min_loss_scale) stop the run.
    divergence_patience: int = Field(3, gt=0)
    min_loss_scale: float = Field(1.0, gt=0)
    # Scale-out (docs/distributed.md), launched with torchrun. None: every process.
    replication_factor: Optional[int] = Field(None, gt=0)
    replicated_tensor_sharding: bool = False
    pipeline: bool = False  # one process per virtual graph of model.layers_per_stage
    gradient_bucket_mb: float = Field(25.0, gt=0)
    fault_timeout: float = Field(60.0, gt=0)  # seconds a process may be silent (dead or stopped)
    # Implementations forced per op, e.g. {"gemm": "torch"} (session/kernels.py lists them).
    kernels: dict[str, str] = Field(default_factory=dict)
    # A budget in place of training.steps (bert/budget.py): training FLOPs (3x the graph's forward
    # FLOPs per row, times the rows of a step: the steps follow), or seconds of training steps (the
    # learning rate follows the fraction spent, and the run stops when it is spent: not bit-
    # reproducible). Warm-up then takes budget_warmup of it and the decay the rest, so the run
    # ends fully decayed at its budget.
    budget_flops: Optional[float] = Field(None, gt=0)
    budget_seconds: Optional[float] = Field(None, gt=0)
    budget_warmup: float = Field(0.0, ge=0, lt=1)

    @property
    def samples_per_replica(self) -> int:
        """Samples each replica consumes per optimizer step (micro batch × accumulation)."""
        return self.micro_batch_size * self.gradient_accumulation

    @field_validator("kernels")
    @classmethod
    def _known_kernels(cls, kernels: dict[str, str]) -> dict[str, str]:
        from session.kernel_choices import check_overrides  # torch-free: a config is checked before torch loads

        return check_overrides(kernels)

    @field_validator("device")
    @classmethod
    def _device_available(cls, device: str) -> str:
        return check_device(device)

    @field_validator("output_dir")
    @classmethod
    def _output_dir_placeholders(cls, output_dir: str) -> str:
        try:
            output_dir.format(name="run")
        except (KeyError, IndexError, ValueError):
            raise ValueError(f"{output_dir!r} may use only the placeholder {{name}}; write other braces as {{{{ }}}}") from None
        return output_dir

    @field_validator("loss_scaling")
    @classmethod
    def _positive_loss_scale(cls, scale):
        if isinstance(scale, float) and scale <= 0:
            raise ValueError(f"a loss scale must be positive, got {scale}")
        return scale

    @property
    def budget(self) -> Optional[str]:
        """"flops", "seconds" or None: how this run's length is given."""
        return "flops" if self.budget_flops is not None else "seconds" if self.budget_seconds is not None else None

    @model_validator(mode="after")
    def _settings_agree(self) -> "TrainingConfig":
        if self.budget_flops is not None and self.budget_seconds is not None:
            raise ValueError("training.budget_flops and training.budget_seconds are two budgets: give one")
        if self.budget is None and self.budget_warmup:
            raise ValueError(f"training.budget_warmup {self.budget_warmup} is a fraction of a budget: set "
                             "training.budget_flops or training.budget_seconds, or warm up with training.warmup_steps")
        if self.budget is not None and self.warmup_steps:
            raise ValueError(f"training.warmup_steps {self.warmup_steps} with training.budget_{self.budget}: with a "
                             "budget the warm-up is training.budget_warmup, a fraction of the budget (e.g. 0.1)")
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps {self.warmup_steps} exceeds steps {self.steps}: lower the warm-up "
                             "or train longer")
        if self.loss_scaling is not None and self.precision != "fp16":
            raise ValueError(f"loss_scaling {self.loss_scaling!r} applies to precision 'fp16' only, not "
                             f"{self.precision!r}: remove it or train in fp16")
        return self


class DataConfig(_Section):
    """Where samples come from: HDF5 shards, the built-in demo corpus, random tokens, or SQuAD files."""

    source: Literal["shards", "demo", "synthetic", "squad"] = "synthetic"
    files: tuple[str, ...] = ()  # globs of HDF5 shards when source == "shards"
    # Held-out shards for evaluation (default with source "demo": its held-out shard), and
    # how many of their samples form the fixed evaluation set (0: no evaluation).
    eval_files: tuple[str, ...] = ()
    eval_samples: int = Field(1024, ge=0)
    directory: str = "demo_data"  # where the demo corpus is built when source == "demo"
    shuffle_buffer: int = Field(2048, gt=0)
    prefetch: int = Field(4, ge=0)
    dynamic_masking: bool = False
    # SQuAD fine-tuning (source == "squad"): JSON files, the WordPiece vocab (default: the
    # vocab.txt of a HuggingFace training.init_from), and the windowing of long contexts.
    train_file: Optional[str] = None
    dev_file: Optional[str] = None
    vocab_file: Optional[str] = None
    lower_case: bool = True
    doc_stride: int = Field(128, gt=0)
    max_query_length: int = Field(64, gt=0)

    @model_validator(mode="after")
    def _has_files(self) -> "DataConfig":
        if self.source == "shards" and not self.files:
            raise ValueError("data.source is 'shards' but data.files is empty: list HDF5 shard globs")
        if self.source == "squad" and not self.train_file:
            raise ValueError("data.source is 'squad' but data.train_file is not set: name a SQuAD JSON file")
        return self


class Config(_Section):
    name: str = "run"
    model: ModelConfig
    training: TrainingConfig = TrainingConfig()
    data: DataConfig = DataConfig()

    @model_validator(mode="after")
    def _budget_for_pretraining(self) -> "Config":
        if self.training.budget is not None and self.model.task is not Task.PRETRAINING:
            raise ValueError(f"training.budget_{self.training.budget} applies to pre-training; SQuAD fine-tuning "
                             "counts training.steps or training.epochs")
        return self

    @model_validator(mode="after")
    def _epochs_for_fine_tuning(self) -> "Config":
        if self.training.epochs is not None and self.model.task is not Task.SQUAD:
            raise ValueError("training.epochs applies to SQuAD fine-tuning (model.task 'squad'); pre-training "
                             "counts training.steps")
        return self

    @model_validator(mode="after")
    def _pipeline_has_stages(self) -> "Config":
        if self.training.pipeline and len(self.model.stages) < 2:
            raise ValueError("training.pipeline needs model.layers_per_stage with two or more groups of layers "
                             "(one process each), e.g. [1, 1]")
        if self.training.pipeline and 0 in self.model.stages:
            empty = [i for i, n in enumerate(self.model.stages) if n == 0]
            raise ValueError(f"model.layers_per_stage {list(self.model.stages)} leaves pipeline stage(s) {empty} "
                             "without layers: with training.pipeline every stage runs in a process of its own and "
                             "needs at least one layer")
        return self

    @model_validator(mode="after")
    def _packed_rows_from_the_loader(self) -> "Config":
        if self.model.packed and self.model.task is Task.PRETRAINING and self.data.source not in ("demo", "shards"):
            raise ValueError(f"model.packed takes its rows from the packing loader: use data.source 'demo' or "
                             f"'shards', not {self.data.source!r}")
        return self

    @model_validator(mode="after")
    def _data_fits_model(self) -> "Config":
        # Every data source writes segment ids 0 and 1 (docs/data.md), and synthetic
        # batches draw token ids from 5 up (past the control tokens).
        if self.model.task is Task.PRETRAINING and self.model.type_vocab_size < 2:
            raise ValueError(f"model.type_vocab_size {self.model.type_vocab_size} is below 2: pre-training "
                             "samples have segment ids 0 and 1")
        if self.data.source == "synthetic" and self.model.vocab_size <= 5:
            raise ValueError(f"model.vocab_size {self.model.vocab_size} leaves no tokens for synthetic data "
                             "(ids 0-4 are control tokens): use at least 6")
        return self


def check_device(device: str) -> str:
    """`device` if this torch can run on it; otherwise a ValueError saying what it lacks."""
    if device == "cpu":
        return device  # without importing torch: reading a config stays fast
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"{device!r} is not a torch device; use 'cpu', 'cuda' or 'cuda:<index>'") from None
    if parsed.type == "cpu":
        return device
    if parsed.type != "cuda":
        raise ValueError(f"device type {parsed.type!r} is not supported; use 'cpu' or 'cuda'")
    if torch.version.cuda is None:
        raise ValueError(f"{device!r} needs a CUDA build of torch, but torch {torch.__version__} is CPU-only; "
                         "use 'cpu' or install a CUDA build")
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError(f"{device!r}: torch sees no CUDA device (check CUDA_VISIBLE_DEVICES and the driver); use 'cpu'")
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(f"{device!r}: torch sees only {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device


def _field_key(loc: tuple) -> str:
    """The dotted config key of an error location, without pydantic's union-member tags."""
    model: Any = Config
    parts = []
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if fields is not None:
            parts.append(str(part))
            if part not in fields:  # an unknown key
                break
            model = fields[part].annotation
        elif isinstance(part, int):  # an index into a list
            parts.append(str(part))
        else:  # the tag of a union member
            break
    return ".".join(parts)


def _format_error(error: ValidationError, source: str) -> str:
    """One line: every problem, by dotted key, with the value given (JSON literals, quoted strings)."""
    problems: dict[str, list[str]] = {}
    for e in error.errors():
        key = _field_key(e["loc"])
        given = e.get("input")
        value = repr(given) if isinstance(given, str) else json.dumps(given, default=str)  # true, not True
        if not key:
            what = e["msg"].removeprefix("Value error, ")
        elif e["type"] == "extra_forbidden":
            what = f"unknown key {key!r} (value {value}); check the spelling against bert/config.py"
        elif e["type"] == "missing":
            what = f"missing key {key!r}"
        else:
            shown = "" if isinstance(given, dict) else f" = {value}"
            what = f"{key}{shown}: {e['msg'].removeprefix('Value error, ')}"
        problems.setdefault(key, []).append(what)
    # A union reports one error per member: join them as alternatives.
    merged = [whats[0] if len(whats) == 1 else whats[0] + " or " + ", ".join(w.split(": ", 1)[-1] for w in whats[1:])
              for whats in problems.values()]
    return f"invalid config {source}: " + "; ".join(merged)


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    """Validate `data` as its JSON text in strict mode: JSON types map 1:1 onto the fields."""
    try:
        text = json.dumps(data)
    except (TypeError, ValueError) as e:
        raise ValueError(f"invalid config {source}: not representable as JSON ({e})") from None
    try:
        return Config.model_validate_json(text, strict=True)
    except ValidationError as e:
        raise ValueError(_format_error(e, source)) from None


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
                         '{"name": ..., "model": {...}, "training": {...}, "data": {...}}')
    return config_from_dict(data, str(path))


def with_overrides(config: Config, overrides: dict[str, Any], source: str = "command line") -> Config:
    """Apply {"section.key": value} overrides; values are validated like the file's. A list
    field given one string takes it as its only item (`--data.files 'shards/*.hdf5'`)."""
    data = config.model_dump(mode="json")
    for dotted, value in overrides.items():
        node = data
        *path, leaf = dotted.split(".")
        for part in path:
            if not isinstance(node.get(part), dict):
                sections = ", ".join(k for k, v in node.items() if isinstance(v, dict))
                raise ValueError(f"invalid override {dotted!r} from {source}: {part!r} is not a config section"
                                 + (f" (sections: {sections})" if sections else ""))
            node = node[part]
        node[leaf] = [value] if isinstance(node.get(leaf), list) and isinstance(value, str) else value
    return config_from_dict(data, source)
