"""The sections of a config (bert/config/__init__.py reads them): the network, the data, and
one section per concern of training. Every field has a description: docs/config.md is made
from them (`python -m bert.config.reference`)."""
from __future__ import annotations

import enum
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, create_model, field_validator,
                      model_validator)

from bert.tasks.spec import SPECS, Task  # the task's facts are its spec's; configs name it here (bert.config.Task)
from custom_ops import MAX_CHANNELS_PER_GROUP
from session.hyperparameters import HYPERPARAMETERS, Hyperparameters  # torch-free: each rule's own keys
from session.kernel_choices import CHOICES as KERNEL_CHOICES  # torch-free

class Architecture(str, enum.Enum):
    BERT = "bert"
    GROUPBERT = "groupbert"


class Section(BaseModel):
    """A config section: frozen, unknown keys refused, infinities and NaNs refused."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False, allow_inf_nan=False)


class ModelConfig(Section):
    """Sizes and structure of the network (docs/design.md, "Model")."""

    architecture: Architecture = Field(description="the encoder layer: BERT's, or GroupBERT's (convolution, "
                                       "grouped FFN)")
    task: Task = Field(Task.PRETRAINING, description="; ".join(f"`{s.task.value}`: {s.description}" for s in SPECS))
    vocab_size: int = Field(30522, gt=0, description="WordPiece vocabulary size")
    hidden_size: int = Field(gt=0, description="width of the encoder")
    num_layers: int = Field(gt=0, description="encoder layers")
    num_heads: int = Field(gt=0, description="attention heads; must divide hidden_size")
    ffn_multiplier: int = Field(4, gt=0, description="FFN width = ffn_multiplier × hidden_size")
    max_positions: int = Field(512, gt=0, description="rows of the position embedding")
    type_vocab_size: int = Field(2, gt=0, description="segment types (sentence A/B)")
    sequence_length: int = Field(128, gt=0, description="positions per graph row (a graph input shape)")
    max_predictions: int = Field(20, gt=0, description="masked positions per sequence (a graph input shape)")
    layer_norm_eps: float = Field(1e-12, gt=0, description="LayerNorm epsilon")
    hidden_dropout: float = Field(0.0, ge=0, lt=1, description="dropout after embeddings, attention output and "
                                  "FFN; GroupBERT pre-trains without")
    attention_dropout: float = Field(0.0, ge=0, lt=1, description="dropout of the attention probabilities")
    init_std: float = Field(0.02, gt=0, description="standard deviation of the initial weights")
    conv_kernel: int = Field(7, gt=0, description="GroupBERT: convolution kernel width (odd)")
    conv_group_size: int = Field(16, gt=0, description="GroupBERT: channels per convolution group (at most 64, "
                                 "the compiled kernels' limit)")
    ffn_groups: int = Field(4, gt=0, description="GroupBERT: groups of the grouped FFN")
    layers_per_stage: Optional[tuple[int, ...]] = Field(None, description="encoder layers per virtual graph and "
                                                        "pipeline stage, e.g. `[3, 7, 7, 7]` (bert/placement.py); "
                                                        "none: one stage")
    packed: Optional[bool] = Field(None, description="packed sequences: several per row, kept apart by attention "
                                   "and the convolution (docs/packing.md); pre-training reads them from the packing "
                                   "loader (data.source `demo` or `shards`); the export is the unpacked serving "
                                   "graph; none: labelled tasks pack their rows where it pays (bert/tasks/labelled.py), "
                                   "pre-training and SQuAD do not")
    max_sequences_per_pack: Optional[int] = Field(None, gt=0, description="sequences per packed row at most; none: "
                                                  "3 for pre-training and SQuAD (a graph shape: NSP and masked "
                                                  "slots), 16 for labelled rows")
    num_labels: Optional[int] = Field(None, gt=0, description="classification and tokens: the head's outputs; none: "
                                      "as many as the training file has labels (regression: 1)")
    labels: Optional[tuple[str, ...]] = Field(None, description="the label names in the head's order; none: the "
                                              "training file's, sorted (a run records them in its config.json, and "
                                              "so in its checkpoints and exports); given, every label of the files "
                                              "must be among them")

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
        masks of a row's sequences, at most max_predictions + pack_slots
        (the packing loader's bound, data/loader.py) and never more than S."""
        if not self.packed:
            return self.max_predictions
        return min(self.sequence_length, self.max_predictions + self.pack_slots)

    @property
    def pack_slots(self) -> int:
        """Sequences per packed row at most: max_sequences_per_pack, else the task's default."""
        return self.max_sequences_per_pack or self.task.spec.pack_slots

    @property
    def outputs(self) -> Optional[int]:
        """The width of a labelled task's head (bert/tasks/targets.py): num_labels, the labels
        named, 1 for regression."""
        targets = self.task.spec.targets
        if targets is not None:
            return targets.outputs(self)
        return self.num_labels or (len(self.labels) if self.labels is not None else None)

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
        if self.labels is not None:
            if len(set(self.labels)) != len(self.labels) or not all(self.labels):
                raise ValueError(f"labels {list(self.labels)} must be distinct, non-empty names")
            if self.num_labels is not None and self.num_labels != len(self.labels):
                raise ValueError(f"num_labels {self.num_labels} differs from the {len(self.labels)} labels named: give "
                                 "one of them")
        if self.task.spec.targets is not None:
            self.task.spec.targets.check(self)
        if self.layers_per_stage is not None:
            if any(n < 0 for n in self.layers_per_stage) or sum(self.layers_per_stage) != self.num_layers:
                raise ValueError(
                    f"layers_per_stage {list(self.layers_per_stage)} must be non-negative and add up to "
                    f"num_layers {self.num_layers}"
                )
        return self


class OptimizerSection(Section):
    """The update rule and its hyperparameters (session/optimizers.py; GroupBERT's LAMB recipe by
    default): `name` picks the rule, which takes the keys below and its own (session/hyperparameters.py),
    listed under its name; a key of another rule is refused. Biases and LayerNorm take no weight
    decay (nor LAMB's trust ratio)."""

    name: str = Field("lamb", description="the rule: " + ", ".join(f"`{rule}`" for rule in HYPERPARAMETERS))
    learning_rate: float = Field(0.006, gt=0, description="the peak learning rate (schedule)")
    weight_decay: float = Field(0.01, ge=0, description="decoupled weight decay")
    max_grad_norm: Optional[float] = Field(None, gt=0, description="clip the global gradient norm to this; none: "
                                           "no clipping")

    @property
    def hyperparameters(self) -> dict[str, Any]:
        """The rule's own hyperparameters by name, as session.training.OptimizerSpec takes them."""
        return {key: getattr(self, key) for key in HYPERPARAMETERS[self.name].model_fields}


def _rule_section(declared: type[Hyperparameters]) -> type[OptimizerSection]:
    """The optimizer section of one rule: the common keys, `name` fixed to the rule's, and the
    rule's own keys as its declaration gives them (names, types, defaults, limits, descriptions)."""
    own = {key: (field.annotation, field) for key, field in declared.model_fields.items()}
    name = (Literal[declared.rule], Field(declared.rule, description=f"`{declared.rule}`"))
    return create_model(f"{declared.__name__.removesuffix('Hyperparameters')}Section", __base__=OptimizerSection,
                        __doc__=declared.__doc__, __module__=__name__, name=name, **own)


def _rule_of(section: Any) -> Any:
    """The tag of an optimizer section: its `name` (LAMB when it names none)."""
    return section.get("name", "lamb") if isinstance(section, dict) else getattr(section, "name", None)


# One section per rule that session/hyperparameters.py declares, by rule name.
RULE_SECTIONS: dict[str, type[OptimizerSection]] = {rule: _rule_section(declared)
                                                    for rule, declared in HYPERPARAMETERS.items()}
# The config's `optimizer`: a union tagged by `name` (torchtitan's per-rule optimizer kwargs, STYLE.md 29).
OptimizerConfig = Annotated[Union[tuple(Annotated[section, Tag(rule)] for rule, section in RULE_SECTIONS.items())],
                            Discriminator(_rule_of)]


class ScheduleConfig(Section):
    """The learning rate over the steps (session/schedules.py): a warm-up from 0, then a decay."""

    warmup: Literal["linear", "sqrt"] = Field("linear", description="the warm-up's shape (`sqrt`: GroupBERT's)")
    warmup_steps: int = Field(0, ge=0, description="steps of warm-up from 0; with a budget, budget.warmup instead")
    decay: Literal["linear", "polynomial", "constant"] = Field("linear", description="after the warm-up, down to "
                                                               "end_learning_rate at the last step")
    decay_power: float = Field(1.0, gt=0, description="the power of a polynomial decay")
    end_learning_rate: float = Field(0.0, ge=0, description="the rate at the end of the decay")


class BatchConfig(Section):
    """Samples per step: each replica runs gradient_accumulation micro batches, then updates."""

    micro_batch_size: Union[Annotated[int, Field(gt=0)], Literal["auto"]] = Field(
        8, description="samples per forward and backward pass; `auto`: the largest that fits the device, of the "
        "micro batches that split batch.global_batch_size evenly (bert/run/fit.py; not with parallel.pipeline)")
    gradient_accumulation: int = Field(1, gt=0, description="micro batches per optimizer step and replica (with "
                                       "micro_batch_size auto: chosen with it)")
    global_batch_size: Optional[int] = Field(None, gt=0, description="with micro_batch_size auto: the samples of one "
                                             "optimizer step over all replicas, kept whatever micro batch is chosen")
    auto_memory_gib: Optional[float] = Field(None, gt=0, description="with micro_batch_size auto: the memory a step "
                                             "may take (default: 90 % of the device's; of the host's on the CPU, "
                                             "shared by its processes)")
    keep_global_batch: bool = Field(True, description="a resume with another number of replicas keeps the "
                                    "checkpoint's global batch by changing gradient_accumulation (refused, naming "
                                    "the replica counts that work, where none does); false: the batch follows the "
                                    "processes and the resume is a branch")

    @model_validator(mode="after")
    def _auto_has_a_global_batch(self) -> "BatchConfig":
        if self.micro_batch_size == "auto":
            if self.global_batch_size is None:
                raise ValueError("micro_batch_size auto splits batch.global_batch_size into micro batches that fit "
                                 "the device: set it (e.g. 256), the samples of one step over all replicas")
            if self.gradient_accumulation != 1:
                raise ValueError(f"micro_batch_size auto chooses gradient_accumulation: remove it (it says "
                                 f"{self.gradient_accumulation})")
        else:
            for key in ("global_batch_size", "auto_memory_gib"):
                if getattr(self, key) is not None:
                    raise ValueError(f"batch.{key} is read with micro_batch_size auto only; with micro batch "
                                     f"{self.micro_batch_size} the global batch is micro batch × "
                                     "gradient_accumulation × replicas: remove it, or set micro_batch_size auto")
        return self

    def global_batch(self, replicas: int) -> int:
        """Samples per optimizer step over `replicas` replicas (however auto will split them)."""
        return self.global_batch_size if self.micro_batch_size == "auto" else self.samples_per_replica * replicas

    @property
    def samples_per_replica(self) -> int:
        """Samples each replica consumes per optimizer step (micro batch × accumulation)."""
        if self.micro_batch_size == "auto":
            raise ValueError("batch.micro_batch_size auto is chosen when the run starts (bert/run/fit.py "
                             "fit_micro_batch); it has no samples per replica before that")
        return self.micro_batch_size * self.gradient_accumulation


class PrecisionConfig(Section):
    """The dtype of weights and activations (docs/design.md, "Precision")."""

    dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="weights and activations; bf16 weights are "
                                                 "updated with stochastic rounding")
    loss_scaling: Union[float, Literal["dynamic"], None] = Field(None, description="fp16 only: a fixed loss scale, "
                                                                 "or `dynamic` (halved on overflow, doubled after "
                                                                 "2000 good steps)")
    min_loss_scale: float = Field(1.0, gt=0, description="a dynamic loss scale pushed below this ends the run as "
                                  "diverged")

    @field_validator("loss_scaling")
    @classmethod
    def _positive_loss_scale(cls, scale):
        if isinstance(scale, float) and scale <= 0:
            raise ValueError(f"a loss scale must be positive, got {scale}")
        return scale

    @model_validator(mode="after")
    def _scale_for_fp16(self) -> "PrecisionConfig":
        if self.loss_scaling is not None and self.dtype != "fp16":
            raise ValueError(f"loss_scaling {self.loss_scaling!r} applies to dtype 'fp16' only, not {self.dtype!r}: "
                             "remove it or train in fp16")
        return self


class CheckpointConfig(Section):
    """When checkpoints are written (bert/run/checkpointing.py)."""

    every: int = Field(0, ge=0, description="steps between checkpoints; 0: only at the end")
    save_best: bool = Field(True, description="keep the weights of the best evaluation (`checkpoint-best/` when it "
                            "comes between checkpoints, replaced by a better one); false: best.json says when the "
                            "best was not saved")


class EvaluationConfig(Section):
    """When the held-out set (data.eval_files, data.eval_samples) is scored."""

    every: int = Field(0, ge=0, description="steps between held-out evaluations (data.eval_files; SQuAD: "
                       "data.dev_file), besides every checkpoint and the end; 0: at those only")


class ParallelConfig(Section):
    """Scale-out (docs/distributed.md), launched with torchrun."""

    replication_factor: Optional[int] = Field(None, gt=0, description="data-parallel replicas; none: every process "
                                              "torchrun started (÷ pipeline processes)")
    replicated_tensor_sharding: bool = Field(False, description="each replica holds 1/R of the optimizer state and "
                                             "gradients (PopART's RTS, ZeRO-2)")
    pipeline: bool = Field(False, description="run model.layers_per_stage's stages as a pipeline, one process per "
                           "virtual graph")
    gradient_bucket_mb: float = Field(25.0, gt=0, description="gradient communication bucket size")
    fault_timeout: float = Field(60.0, gt=0, description="seconds a process may be silent (dead or stopped) before "
                                 "every process stops, naming it")
    slow_rank_factor: float = Field(1.5, gt=1, description="a rank whose work per step takes more than this many "
                                    "times its peers' median (the replicas of its virtual graph) is named on the "
                                    "console; every metrics record holds each rank's seconds (min, median, max)")
    collective_timeout: float = Field(600.0, gt=0, description="seconds a process waits to connect to the others "
                                      "or in one collective before it gives up (torch.distributed's process-group "
                                      "timeout): a job whose processes cannot reach each other ends instead of "
                                      "hanging; raise it where one process does long work while the others wait")


class BudgetConfig(Section):
    """A budget in place of training.steps (bert/run/budget.py, docs/quality.md): training FLOPs (3x the
    graph's forward FLOPs per row, times the rows of a step: the steps follow), or seconds of
    training steps (the learning rate follows the fraction spent, and the run stops when it is
    spent: not reproducible bit for bit). The warm-up takes `warmup` of it and the decay the
    rest, so the run ends fully decayed at its budget."""

    flops: Optional[float] = Field(None, gt=0, description="training FLOPs (`bert.py summary` counts them per "
                                   "token): the run takes ⌊flops / FLOPs per step⌋ steps")
    seconds: Optional[float] = Field(None, gt=0, description="seconds of training steps; training.steps is then a "
                                     "cap (not bit-reproducible)")
    warmup: float = Field(0.0, ge=0, lt=1, description="the fraction of the budget the warm-up takes; the decay ends "
                          "exactly at the budget")

    @property
    def kind(self) -> Optional[str]:
        """"flops", "seconds" or None: how this run's length is given."""
        return "flops" if self.flops is not None else "seconds" if self.seconds is not None else None

    @model_validator(mode="after")
    def _one_budget(self) -> "BudgetConfig":
        if self.flops is not None and self.seconds is not None:
            raise ValueError("flops and seconds are two budgets: give one")
        if self.kind is None and self.warmup:
            raise ValueError(f"warmup {self.warmup} is a fraction of a budget: set budget.flops or budget.seconds, "
                             "or warm up with schedule.warmup_steps")
        return self


class TrainingConfig(Section):
    """The run itself: its length, seed, starting weights, output, device and execution."""

    steps: int = Field(100, gt=0, description="optimizer steps; a config with training.epochs takes the steps "
                       "they make instead")
    epochs: Optional[int] = Field(None, gt=0, description="fine-tuning: passes over the training rows; when set, it "
                                  "decides the steps (the run says how many); a training.steps override replaces "
                                  "it, with a note")
    seed: int = Field(0, ge=0, lt=2**32, description="weights, data order, dropout")
    init_from: Optional[str] = Field(None, description="a checkpoint directory, .onnx file or HuggingFace directory "
                                     "whose weights (only) start the run: phase 2 from phase 1, or fine-tuning (its sizes "
                                     "are adopted)")
    output_dir: str = Field("runs/{name}", description="the run's directory (`{name}`: the config's name); a new "
                            "run never reuses one")
    log_every: int = Field(10, gt=0, description="steps per metrics.jsonl record (the steps' means) and per progress "
                           "line when the output is not a terminal")
    device: str = Field("cpu", description="torch device: `cpu`, `cuda` or `cuda:<index>`")
    divergence_patience: int = Field(3, gt=0, description="steps with a non-finite loss or gradient are skipped; "
                                     "this many in a row stop the run")
    recompute: bool = Field(False, description="recompute activations in the backward pass (the graph's recompute "
                            "marks) instead of keeping them")
    compile: bool = Field(False, description="`torch.compile` the lowered graph")
    kernels: dict[str, str] = Field(default_factory=dict, description="implementations forced per op, e.g. "
                                    f'`{{"gemm": "torch"}}` (ops {", ".join(KERNEL_CHOICES)}; '
                                    'session/kernels.py; conv and norm also "triton" on a GPU); `{"conv": "measure"}` '
                                    "times the convolutions that run there (compiled, torch's, Triton's on a GPU) "
                                    'on the device and keeps the fastest, and `{"graph": "measure"}` times the '
                                    "first micro-batch eager, through torch.compile and (CUDA) as CUDA graphs "
                                    '(`{"graph": "cudagraphs"}`) and keeps the fastest where the run pays the compile '
                                    "back (the first is the default on CUDA; "
                                    "session/kernel_tuning.py; a compiled run is not reproducible to the last bit)")

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


class DataConfig(Section):
    """Where samples come from: HDF5 shards, the built-in demo corpus, random tokens, SQuAD files, or
    the labelled files of the labelled tasks (bert/tasks/labelled.py)."""

    source: Literal["shards", "demo", "synthetic", "squad", "files"] = Field(
        "synthetic", description="`shards` (HDF5 files), `demo` (the built-in corpus), `synthetic` (random tokens, "
        "for benchmarks), `squad` (SQuAD fine-tuning) or `files` (labelled files: model.task "
        + ", ".join(f"`{s.task.value}`" for s in SPECS if s.labelled)
        + "); a fine-tuning task that names none takes its own (`squad`, `files`)")
    files: tuple[str, ...] = Field((), description="globs of HDF5 shards (source `shards`); on the command line one "
                                   "glob or a JSON list")
    eval_files: tuple[str, ...] = Field((), description="globs of held-out shards (the demo uses its own held-out "
                                        "shard); a file the run trains on is an error")
    eval_samples: int = Field(1024, ge=0, description="the evaluation set: this many samples of eval_files, in one "
                              "fixed order for every replica count and pipeline; 0: no evaluation")
    directory: str = Field("demo_data", description="where the demo corpus is built (source `demo`)")
    shuffle_buffer: int = Field(2048, gt=0, description="samples the shard loader shuffles among")
    prefetch: int = Field(4, ge=0, description="batches read ahead in a background thread")
    dynamic_masking: bool = Field(False, description="draw new masks each time a sample is read")
    train_file: Optional[str] = Field(None, description="fine-tuning's training file: SQuAD JSON (v1.1 or v2.0); "
                                      "TSV, CSV or JSON lines (a task of labelled rows); CoNLL columns or JSON "
                                      "lines (tokens)")
    dev_file: Optional[str] = Field(None, description="fine-tuning's dev file, of the training file's format, scored "
                                    "at every evaluation")
    format: Literal["auto", "tsv", "csv", "jsonl", "conll"] = Field("auto", description="the labelled files' format; "
                                                                    "`auto`: by suffix (.tsv, .csv, .jsonl/.json; "
                                                                    "tokens: .jsonl/.json, else CoNLL columns)")
    text_columns: Optional[tuple[Union[str, int], ...]] = Field(None, description="a task of labelled rows: "
                                                               "the text column, or two for sentence pairs, by name "
                                                               "(a header row) or 0-based index (no header); tokens: "
                                                               "the word column's index (default 0)")
    label_column: Union[str, int, None] = Field(None, description="the label's column, by name or 0-based index "
                                                "(tokens: the tag column, default the last)")
    header: Optional[bool] = Field(None, description="TSV/CSV: whether the first row names the columns; none: when "
                                   "the columns are given by name")
    max_line_bytes: int = Field(1 << 20, gt=0, description="the labelled files' longest line: a longer one is "
                                "refused before it is parsed (a row, a CoNLL word or a JSON line is one line)")
    vocab_file: Optional[str] = Field(None, description="a vocab.txt for starting weights that bring none (the "
                                      "vocab of a HuggingFace directory or a checkpoint's run is used)")
    lower_case: bool = Field(True, description="the casing of data.vocab_file: lower-case the text (the vocab of a "
                             "checkpoint or HuggingFace directory brings its own)")
    doc_stride: int = Field(128, gt=0, description="SQuAD: the stride of windows over long contexts")
    max_query_length: int = Field(64, gt=0, description="SQuAD: question tokens kept")

    @model_validator(mode="after")
    def _has_files(self) -> "DataConfig":
        if self.source == "shards" and not self.files:
            raise ValueError("data.source is 'shards' but data.files is empty: list HDF5 shard globs")
        if self.source == "squad" and not self.train_file:
            raise ValueError("data.source is 'squad' but data.train_file is not set: name a SQuAD JSON file")
        if self.source == "files" and not self.train_file:
            raise ValueError("data.source is 'files' but data.train_file is not set: name the labelled training file")
        if self.text_columns is not None and not 1 <= len(self.text_columns) <= 2:
            raise ValueError(f"text_columns {list(self.text_columns)}: name one text column, or two for sentence pairs")
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
    from session.ranks import process_device  # the one place a process's GPU is decided (an index it sees, ...)

    process_device(device, visible=count)
    return device


