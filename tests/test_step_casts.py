"""Autocast's copies of the weights serve every micro-batch of a training step
(session/executor.py `step_weight_casts`): made once per step, not once per micro-batch, with
the arithmetic of a copy made for each."""
from __future__ import annotations

import contextlib
from collections import Counter

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import session.executor
from session import SessionOptions
from session.schedules import Schedule
from session.training import OptimizerSpec, TrainingSession


def matmul_model() -> bytes:
    """loss = mean((x · W)²): W goes to torch.matmul, whose inputs autocast casts (and caches)."""
    w = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(4, 3)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="matmul"),
             helper.make_node("Mul", ["h", "h"], ["h2"], name="square"),
             helper.make_node("ReduceMean", ["h2"], ["loss"], name="mean", keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              initializer=[numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _under(event, name: str) -> bool:
    while event is not None:
        if name in event.name:
            return True
        event = event.cpu_parent
    return False


def train(steps: int, caller_autocast: bool = False, device: str = "cpu") -> tuple[list[float], torch.Tensor, Counter]:
    """Losses, the final weight and the casts of W per step (the last step's, profiled)."""
    import onnx

    spec = OptimizerSpec(kind="lamb", schedule=Schedule(0.05, 0, 10**9, decay="constant"))
    session = TrainingSession(onnx.load_from_string(matmul_model()), optimizer=spec, anchors=("loss",),
                              options=SessionOptions(precision="bf16", gradient_accumulation=3, device=device))
    x = torch.linspace(-2.0, 2.0, 6 * 4).reshape(6, 4)
    losses, casts = [], Counter()
    outer = torch.autocast(device, dtype=torch.bfloat16) if caller_autocast else contextlib.nullcontext()
    with outer:
        for step in range(steps):
            if step < steps - 1:
                losses.append(session.run({"x": x})["loss"])
                continue
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
                losses.append(session.run({"x": x})["loss"])
            # Forward casts of W (the backward's casts of its gradient run under ToCopyBackward0).
            casts = Counter(tuple(e.input_shapes[0]) for e in prof.events()
                            if e.name == "aten::_to_copy" and e.input_shapes and tuple(e.input_shapes[0]) == (4, 3)
                            and not _under(e, "ToCopyBackward0"))
    weight = next(p for _, p in session.executor.graphs[0].named_weights())
    return losses, weight.detach().cpu(), casts


@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_weights_are_cast_once_per_step_with_the_arithmetic_of_a_cast_per_micro_batch(monkeypatch, device):
    losses, weight, casts = train(3, device=device)
    assert casts[(4, 3)] == 1, f"W cast {casts[(4, 3)]} times in a step of 3 micro-batches"
    # The same steps with a copy made for each micro-batch (the context a no-op): equal to the bit.
    monkeypatch.setattr(session.executor, "step_weight_casts", lambda device, graphs=(): contextlib.nullcontext())
    per_micro, weight_per_micro, casts_per_micro = train(3, device=device)
    assert casts_per_micro[(4, 3)] == 3
    assert losses == per_micro, "the steps after the first read their new weights, not a stale copy"
    assert torch.equal(weight, weight_per_micro)
    assert len(set(losses)) == 3, "the weights changed between steps"


def test_a_callers_autocast_keeps_no_copy_across_steps():
    """Inside a caller's own autocast, autocast's cache would outlive each step: it is cleared
    at the step's start and end, so step 2 reads the weights step 1 wrote."""
    losses, weight, _ = train(3, caller_autocast=True)
    reference, weight_ref, _ = train(3)
    assert losses == reference and torch.equal(weight, weight_ref)
