"""What the project knows of one custom ONNX node, in one object that every layer reads.

A `CustomOp` is declared beside its torch wrapper (`custom_ops/<op>_spec.py`) and listed in
`custom_ops/schema.py`. Each field is read by one layer, which looks the op up by its type
and knows nothing else of it:

    shape         the builder (bert/model.py): output (shape, dtype) from the inputs, or a
                  ShapeError naming what does not fit (builder.Rule)
    lower         the session (session/lowering.py): lower(attrs, implementation) → fn(*inputs)
                  in torch, `implementation` being the kernel policy's choice for `kernel`
    portable      the exporter (session/export.py): portable(node, initializer_shapes) → the
                  standard ONNX nodes that compute the same, or a ValueError saying why not
    flops         the summary (bert/summary.py): forward FLOPs from the input and output shapes
    mask_inputs   the input checks (session/inference.py): inputs that hold a 0/1 mask
    kernel        the kernel policy (session/kernels.py): the op name under which it picks an
                  implementation (`training.kernels`), and `implementations`, the choices

This module and the specs import neither torch, onnx nor the builder at import time (their
functions do, when called), so a config is checked without them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

Shape = Sequence[int]


@dataclass(frozen=True)
class CustomOp:
    op_type: str
    shape: Callable[..., list]
    lower: Callable[[dict, str], Callable[..., Any]]
    portable: Callable[[Any, dict[str, tuple[int, ...]]], list]
    flops: Callable[[list[Shape], list[Shape]], int]
    kernel: str
    implementations: tuple[str, ...]
    mask_inputs: tuple[int, ...] = ()
