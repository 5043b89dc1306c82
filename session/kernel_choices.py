"""The kernel policy's choices and the one check of a user's overrides, torch-free, so that a
config is checked before torch is imported (session/kernels.py chooses among them)."""
from __future__ import annotations

from typing import Mapping

from custom_ops.schema import CUSTOM_OPS

__all__ = ["CHOICES", "MEASURED", "check_overrides"]

# The custom nodes' choices come from their specs (custom_ops/): the first is the default
# where the compiled library is built.
CHOICES: dict[str, tuple[str, ...]] = {
    "gemm": ("onednn", "torch"),
    "attention": ("sdpa", "composed"),
    "grouped_matmul": ("einsum", "block_diagonal"),
    **{op.kernel: op.implementations for op in CUSTOM_OPS.values()},
    "lamb": ("compiled", "torch"),
    "cross_entropy": ("compiled", "torch"),
    "norm": ("torch", "triton"),
    "weight_cast": ("shadow", "autocast"),
    "graph": ("eager", "compiled", "cudagraphs"),
}


# Ops whose implementation may be chosen by timing both on the device (session/kernel_tuning.py):
# `measure` asks for it (the default on CUDA).
MEASURED = ("conv", "graph")


def check_overrides(overrides: Mapping[str, str]) -> dict[str, str]:
    """`overrides` ({op: implementation}) as a dict, or a ValueError naming the op or the
    implementation that is not one, and the choices."""
    for op, impl in overrides.items():
        if op not in CHOICES:
            raise ValueError(f"kernels: unknown op {op!r}; the ops are {', '.join(CHOICES)}")
        allowed = CHOICES[op] + (("measure",) if op in MEASURED else ())
        if impl not in allowed:
            raise ValueError(f"kernels: {op} cannot be {impl!r}; choose one of {', '.join(allowed)}")
    return dict(overrides)
