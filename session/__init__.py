"""Runs the builder's ONNX graphs on PyTorch: PopART's role in this project."""
from session.inference import InferenceSession
from session.lowering import LoweredGraph
from session.model_io import load_model, save_model
from session.options import Precision, SessionOptions

__all__ = ["InferenceSession", "LoweredGraph", "Precision", "SessionOptions", "load_model", "save_model"]
