"""`bert.py summary`: parameters, forward FLOPs per token and the placement table."""
from __future__ import annotations

import math
from collections import defaultdict

from bert.model import Model
from builder import IPU_NUMBER, PIPELINE_STAGE, attribute, attributes
from custom_ops.schema import custom_op

# Multiply-accumulate ops count 2 FLOPs. Elementwise ops, norms and softmax are left
# out: they are memory-bound and a few percent of the matmul work.


def _sizes(shape, dims) -> tuple[int, ...]:
    """`shape` with its symbolic dimensions (e.g. batch) given their sizes."""
    return tuple(dims.get(d, d) if isinstance(d, str) else int(d) for d in shape)


def _numel(shape, dims) -> int:
    return math.prod(_sizes(shape, dims))


def forward_flops(model: Model, batch: int = 1) -> int:
    """FLOPs of one forward pass over `batch` sequences (matmuls, einsums, the custom ops' own count)."""
    b = model.builder
    dims = {"batch": batch}
    total = 0
    for node in b.nodes:
        if node.op_type == "MatMul":
            x, out = b.tensor(node.input[0]), b.tensor(node.output[0])
            total += 2 * _numel(out.shape, dims) * int(x.shape[-1])
        elif node.op_type == "Einsum":
            x, out = b.tensor(node.input[0]), b.tensor(node.output[0])
            equation = attribute(node, "equation")
            contracted = set(equation.split("->")[0].replace(",", "")) - set(equation.split("->")[1])
            lhs = equation.split(",")[0]
            total += 2 * _numel(out.shape, dims) * math.prod(int(x.shape[lhs.index(c)]) for c in contracted)
        elif (op := custom_op(node)) is not None:
            inputs, outputs = ([_sizes(b.tensor(n).shape, dims) for n in names if n] for names in (node.input, node.output))
            total += op.flops(inputs, outputs)
    return total


def placement_table(model: Model) -> list[tuple[int, int, str, int]]:
    """(virtual graph, pipeline stage, layers, parameters) rows; a weight counts where first used."""
    b = model.builder
    weights = b.weight_specs
    seen: set[str] = set()
    layers: dict[tuple[int, int], set[int]] = defaultdict(set)
    params: dict[tuple[int, int], int] = defaultdict(int)
    for node in b.nodes:
        attrs = {k: v for k, v in attributes(node).items() if k in (IPU_NUMBER, PIPELINE_STAGE)}
        if not attrs:
            continue
        key = (attrs.get(IPU_NUMBER, 0), attrs.get(PIPELINE_STAGE, 0))
        params[key] += 0
        parts = node.name.split("/")
        if "layer" in parts:
            layers[key].add(int(parts[parts.index("layer") + 1]))
        for name in node.input:
            if name in weights and name not in seen:
                seen.add(name)
                params[key] += math.prod(weights[name].shape)
    rows = []
    for key in sorted(params, key=lambda k: (k[1], k[0])):
        ids = sorted(layers[key])
        span = "-" if not ids else (f"{ids[0]}" if len(ids) == 1 else f"{ids[0]}-{ids[-1]}")
        rows.append((key[0], key[1], span, params[key]))
    return rows


def summary(model: Model) -> str:
    cfg = model.config
    tokens = cfg.sequence_length
    flops = forward_flops(model) / tokens
    lines = [
        f"{cfg.architecture.value}: hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_heads} heads, "
        f"vocab {cfg.vocab_size}, sequence {cfg.sequence_length}, {cfg.max_predictions} masked positions",
        f"forward FLOPs per token: {flops / 1e9:.3f} GFLOP ({flops:.4g}; matmuls, einsums and the grouped conv)",
        f"training FLOPs per token (3x forward): {3 * flops / 1e9:.3f} GFLOP",
        "placement:",
        f"  {'virtual graph':>13}  {'stage':>5}  {'layers':>7}  {'parameters':>12}",
    ]
    for vgraph, stage, span, n in placement_table(model):
        lines.append(f"  {vgraph:>13}  {stage:>5}  {span:>7}  {n:>12,}")
    lines.append(f"parameters: {model.builder.parameter_count()}")
    return "\n".join(lines)
