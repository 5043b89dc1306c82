"""BERT and GroupBERT graphs written with the builder, with their typed config."""
from bert.config import Architecture, Config, ModelConfig, Task, config_from_dict, load_config, with_overrides
from bert.model import IGNORE_INDEX, Model, build_model

__all__ = [
    "Architecture", "Config", "IGNORE_INDEX", "Model", "ModelConfig", "Task",
    "build_model", "config_from_dict", "load_config", "with_overrides",
]
