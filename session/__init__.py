"""Runs the builder's ONNX graphs on PyTorch: PopART's role in this project.

The names below are imported on first use, so that torch-free modules of the package
(`session.ranks`) can be read before torch is (bert.py's checks of a run's config).
"""
import importlib

__all__ = ["InferenceSession", "LoweredGraph", "Precision", "SessionOptions", "load_model", "save_model"]

_HOME = {"InferenceSession": "session.inference", "LoweredGraph": "session.lowering",
         "load_model": "session.model_io", "save_model": "session.model_io",
         "Precision": "session.options", "SessionOptions": "session.options"}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'session' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)
