"""What every Triton kernel of the project shares: whether Triton can run here, and loading a
file of kernels for the device or for Triton's interpreter.

Triton kernels run on CUDA, and on the CPU under Triton's interpreter (TRITON_INTERPRET=1),
which is how the tests check them without a GPU. triton.jit decides when it decorates
whether a kernel is compiled for the device or interpreted, so each file of kernels is
loaded once for each (`load_kernels`), whatever the environment held when it was imported;
a kernel on CPU tensors always runs interpreted.

Faults of the interpreter (Triton 3.9.0) the kernels step around: its bf16/fp16 tl.dot gives
wrong values (the callers widen the operands to float32 when interpreting: exact for the
products); its float32 → bf16 cast truncates (bf16 results rounded by their bits, or staged in
float32 and rounded by torch); and the jit functions of Triton's own standard library
(tl.zeros, tl.sum, tl.max, ...) are decorated when triton is imported, so in a process that
imported it without TRITON_INTERPRET (torch.compile does) they are device functions the
interpreter cannot call ("Cannot call @triton.jit'd outside of the scope of a kernel"): the
kernels use builtins only (tl.full, tl.reduce with a combine of their own).
"""
from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

__all__ = ["interpreting", "load_kernels", "triton_available", "triton_status"]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def triton_status(device: torch.device | str = "cuda") -> Optional[str]:
    """None when Triton kernels can run on `device`, else why not (one line)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (it comes with torch's CUDA wheels: pip install triton)"
    if torch.device(device).type == "cuda":
        return None if torch.cuda.is_available() else "no CUDA device is visible"
    if interpreting():
        return None
    return f"Triton kernels run on CUDA, or on the CPU under TRITON_INTERPRET=1; this is {torch.device(device).type}"


def triton_available(device: torch.device | str = "cuda") -> bool:
    return triton_status(device) is None


@functools.cache
def load_kernels(path: Path, interpreted: bool) -> ModuleType:
    """The kernels of `path`, jitted for the device or for Triton's interpreter."""
    name = f"groupbert_triton_{path.stem}_{'interpreted' if interpreted else 'device'}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpreted else "0"
    try:
        spec.loader.exec_module(module)
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
    return module
