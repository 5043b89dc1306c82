"""GroupedConv1d's Triton kernels (custom_ops/grouped_conv1d_triton.py) under Triton's interpreter
on the CPU (TRITON_INTERPRET=1): forward and both gradients against the float64 reference of
tests/test_grouped_conv1d.py, masked, unmasked and packed, at GroupBERT's group size and at odd
ones; through the op's entry point, the kernel policy and a training session. The same kernels
on a GPU are checked by tests/test_cuda.py (`make gpu-check`)."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from bert import build_model
from custom_ops.grouped_conv1d import grouped_conv1d
from session import SessionOptions
from session.kernels import choose_kernels
from session.training import TrainingSession
from tests.helpers import assert_close, random_batch, tiny_config
from tests.test_grouped_conv1d import (assert_rounded, make_inputs, packed_inputs, packed_reference, reference, run,
                                       run_packed)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def triton_conv(x, w, mask, ids=None):
    return grouped_conv1d(x, w, mask, ids, implementation="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("B, S, H, C, K", [(2, 40, 48, 16, 7), (1, 9, 24, 12, 5), (3, 17, 64, 32, 3),
                                           (2, 5, 8, 4, 9), (1, 33, 64, 64, 1)],
                         ids=["groupbert-group", "C12", "C32", "C4-K9-longer-than-S", "C64-K1"])
def test_forward_and_both_gradients_match_the_reference(B, S, H, C, K, dtype, masked):
    # Each result within one rounding of the float64 result on the same (rounded) inputs: the
    # products are exact and summed in float32, as on the device's tensor cores.
    x, w, mask, grad_out = make_inputs(B, S, H, C, K, dtype=dtype, masked=masked, seed=C + K)
    expected = reference(x, w, mask, grad_out)
    for name, got, e in zip(["out", "grad_x", "grad_w"], run(x, w, mask, grad_out, fn=triton_conv), expected):
        assert got.dtype == dtype, name
        assert_rounded(got, torch.from_numpy(e), f"triton {dtype} {name}")


def test_a_float_mask_is_a_bool_mask_and_other_values_are_refused():
    x, w, mask, grad_out = make_inputs(2, 20, 32, 16, 7)
    as_bool = run(x, w, mask, grad_out, fn=triton_conv)
    as_float = run(x, w, mask.float(), grad_out, fn=triton_conv)
    for a, b in zip(as_bool, as_float):
        assert torch.equal(a, b)
    half = mask.float()
    half[1, 3] = 0.5
    with pytest.raises(ValueError, match=r"mask must hold only 0 and 1.*found 0.5 at \(b, s\) = \(1, 3\)"):
        triton_conv(x, w, half)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("C, K", [(16, 7), (4, 3), (8, 1)])
def test_packed_sequences_are_convolved_apart(dtype, C, K):
    # Each sequence of a packed row gives what it gives alone, zero padded; padding gives 0.
    x, w, ids, grad_out = packed_inputs(4, 83, 2 * C, C, K, dtype, seed=C + K)
    expected = packed_reference(x, w, ids, grad_out)
    for name, got, e in zip(["out", "grad_x", "grad_w"], run_packed(x, w, ids, grad_out, fn=triton_conv), expected):
        assert_rounded(got, torch.from_numpy(e), f"packed C={C} K={K} {name}")


def test_padded_positions_and_other_sequences_contribute_nothing():
    x, w, mask, _ = make_inputs(2, 24, 32, 16, 7)
    y = triton_conv(x, w, mask)
    noisy = x.clone()
    noisy[~mask] = 1e6  # what padding holds never reaches an output
    assert torch.equal(triton_conv(noisy, w, mask), y)
    ids = torch.tensor([[1] * 10 + [2] * 10 + [0] * 4, [3] * 24])
    y = triton_conv(x, w, None, ids)
    other = x.clone()
    other[0, 10:] = -7.0  # the second sequence and the padding of row 0
    assert torch.equal(triton_conv(other, w, None, ids)[0, :10], y[0, :10])
    assert torch.equal(y[0, 20:], torch.zeros_like(y[0, 20:]))


def test_nothing_to_convolve_is_empty_as_on_the_other_paths():
    x, w = torch.randn(2, 0, 32, requires_grad=True), torch.randn(32, 16, 7, requires_grad=True)
    y = triton_conv(x, w, None)
    y.sum().backward()
    assert y.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))


def test_the_policy_takes_triton_only_where_it_runs(monkeypatch):
    assert choose_kernels("cpu", "fp32", overrides={"conv": "triton"}).conv == "triton"  # the interpreter
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"^kernels: conv=triton, but Triton kernels run on CUDA, or on the CPU "
                                         r"under TRITON_INTERPRET=1; this is cpu; use conv=compiled or conv=torch$"):
        choose_kernels("cpu", "fp32", overrides={"conv": "triton"})
    with pytest.raises(RuntimeError, match="the Triton kernels cannot run here"):
        triton_conv(*make_inputs(1, 8, 16, 16, 3)[:3])


def losses_by_conv(packed: bool, convs: tuple[str, ...], **options) -> dict[str, list[float]]:
    """Each convolution's losses over 3 steps of one tiny GroupBERT (packed rows or padded ones)
    from the same weights and batches; `options` go to SessionOptions."""
    from tests.test_packing import make_sequences, packed_batch, packed_config

    if packed:
        cfg = packed_config("groupbert")
        batches = [packed_batch(make_sequences(cfg, seed=s), cfg.predictions_per_row)[0] for s in range(3)]
    else:
        cfg = tiny_config("groupbert", sequence_length=40)
        batches = [random_batch(cfg, 3, seed=s, pad_from=9) for s in range(3)]
    proto = build_model(cfg, seed=3).builder.model_proto()
    inputs = {i.name for i in proto.graph.input}
    losses = {}
    for conv in convs:
        session = TrainingSession(proto, "loss", options=SessionOptions(kernels={"conv": conv}, **options))
        assert session.policy.conv == conv
        losses[conv] = [session.run({k: v for k, v in b.items() if k in inputs})["loss"] for b in batches]
    assert np.isfinite(losses["triton"]).all()
    return losses


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_groupbert_session_trains_through_triton_as_through_torch(packed):
    """The lowered GroupBERT graph with conv=triton: the same losses over 3 steps as torch's
    convolution (the compiled kernels for the packed graph), float32."""
    losses = losses_by_conv(packed, ("torch", "triton"))
    assert_close(torch.tensor(losses["triton"]), torch.tensor(losses["torch"]), 1e-5, "losses over 3 steps")
