"""The fused residual add and LayerNorm (session/add_norm.py) under Triton's interpreter on the CPU:
forward and every gradient against the unfused torch ops (an add, then F.layer_norm), float32
and bf16 under autocast, with and without other readers of the sum; the lowering's fusion of
the BERT and GroupBERT graphs, which then train to the unfused losses. On a GPU:
tests/test_cuda.py."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from bert import build_model
from session import SessionOptions
from session.add_norm import add_layer_norm
from session.fusions import find_fusions
from session.kernels import KernelPolicy
from session.training import TrainingSession
from tests.helpers import assert_close, random_batch, tiny_config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def inputs(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen) * 0.5 + 0.3
    hidden = shape[-1]
    gamma, beta = 1 + 0.1 * torch.randn(hidden, generator=gen), 0.1 * torch.randn(hidden, generator=gen)
    return a, b, gamma, beta


def both_ways(a, b, gamma, beta, keep_sum: bool, seed=1, autocast=None, device="cpu"):
    """(outputs, gradients of a, b, γ, β) of the fused op and of the unfused ops on `device`,
    each under `autocast` (a dtype, or None), from the same upstream gradients; on the CPU."""
    results = []
    for triton in (True, False):
        leaves = [t.detach().to(device, copy=True).requires_grad_() for t in (a, b, gamma, beta)]
        with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = add_layer_norm(*leaves, 1e-12, keep_sum=keep_sum, triton=triton)
        out = out if keep_sum else (out,)
        gen = torch.Generator().manual_seed(seed)
        grads = [torch.randn(o.shape, generator=gen).to(device, o.dtype) for o in out]
        torch.autograd.backward(out, grads)
        results.append(([o.detach().cpu() for o in out], [t.grad.cpu() for t in leaves]))
    return results


@pytest.mark.parametrize("keep_sum", [False, True], ids=["norm-only", "sum-read-too"])
@pytest.mark.parametrize("shape", [(2, 7, 48), (3, 5, 100), (1, 1, 1024)], ids=["48", "100", "1024"])
def test_fp32_forward_and_gradients_equal_the_unfused_ops(shape, keep_sum):
    (fused, fused_grads), (plain, plain_grads) = both_ways(*inputs(shape), keep_sum)
    if keep_sum:
        assert torch.equal(fused[1], plain[1]), "the sum, bit for bit"
    assert fused[0].dtype == plain[0].dtype == torch.float32
    assert_close(fused[0], plain[0], 1e-6, "LayerNorm")
    for name, got, want in zip(("a", "b", "gamma", "beta"), fused_grads, plain_grads):
        assert got.dtype == want.dtype, name
        assert_close(got, want, 1e-5, f"grad {name}")


@pytest.mark.parametrize("keep_sum", [False, True], ids=["norm-only", "sum-read-too"])
def test_bf16_under_autocast_rounds_as_the_unfused_ops(keep_sum):
    a, b, gamma, beta = inputs((4, 9, 64), seed=3)
    (fused, fused_grads), (plain, plain_grads) = both_ways(a.bfloat16(), b.bfloat16(), gamma, beta, keep_sum,
                                                           autocast=torch.bfloat16)
    assert fused[0].dtype == plain[0].dtype  # F.layer_norm's under the CPU's autocast: the input's, bf16
    if keep_sum:
        assert torch.equal(fused[1], plain[1]), "bf16 sum, rounded as torch's add"
    # Each LayerNorm output within one bf16 rounding of the other's (both round float32 values once).
    assert_close(fused[0].float(), plain[0].float(), 2 ** -7, "bf16 LayerNorm")
    for name, got, want in zip(("a", "b", "gamma", "beta"), fused_grads, plain_grads):
        assert got.dtype == want.dtype, name
        assert_close(got.float(), want.float(), 2e-2, f"bf16 grad {name}")


def test_the_norms_dtype_is_f_layer_norms_under_each_devices_autocast():
    # The probe runs on the device asked about: a CPU tensor under CUDA's autocast would have
    # answered bf16 where CUDA's layer norm gives float32.
    from session.add_norm import _norm_dtype

    assert _norm_dtype("cpu", torch.bfloat16, torch.bfloat16) == torch.bfloat16
    assert _norm_dtype("cpu", torch.float32, None) == torch.float32
    if torch.cuda.is_available():
        assert _norm_dtype("cuda", torch.bfloat16, torch.bfloat16) == torch.float32


def test_rows_of_another_shape_take_torchs_ops():
    a, b, gamma, beta = inputs((2, 5, 16))
    broadcast = b[:1, :1]  # (1, 1, H): the fused kernel takes equal shapes only
    assert torch.equal(add_layer_norm(a, broadcast, gamma, beta, 1e-5),
                       F.layer_norm(a + broadcast, (16,), gamma, beta, 1e-5))


# BERT (post-norm), 2 layers: the embeddings' sum and 2 per layer. GroupBERT (pre-norm), 2 layers
# of 4 modules: the embeddings' and each module's but the first's (it reads the embeddings'
# LayerNorm) and the final one's, 1 + 8 - 1 + 1.
@pytest.mark.parametrize("architecture, fused_count", [("bert", 5), ("groupbert", 9)])
def test_the_lowering_fuses_each_residual_norm_and_trains_as_the_unfused_graph(architecture, fused_count):
    """norm=triton: the embeddings' and every residual LayerNorm become one add_norm each, the
    sum kept where the next block reads it; three steps give the unfused graph's losses."""
    cfg = tiny_config(architecture, sequence_length=24)
    proto = build_model(cfg, seed=3, with_loss=True).builder.model_proto()
    fused, _ = find_fusions(proto.graph, {}, KernelPolicy(norm="triton"))
    kinds = [f for f in fused.values() if f.kind == "add_norm"]
    assert len(kinds) == fused_count, [f.inputs for f in kinds]
    readers: dict[str, int] = {}
    for node in proto.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    for f in kinds:  # the sum is an output where another node reads it (pre-norm's residual stream)
        total = readers[f.outputs[-1]] if len(f.outputs) == 2 else None
        assert len(f.outputs) == 1 or total > 1, f.outputs
    assert (architecture == "groupbert") == any(len(f.outputs) == 2 for f in kinds)
    assert not [f for f in find_fusions(proto.graph, {}, KernelPolicy())[0].values() if f.kind == "add_norm"]
    batches = [random_batch(cfg, 3, seed=s, pad_from=17) for s in range(3)]
    losses = {}
    for norm in ("torch", "triton"):
        session = TrainingSession(proto, "loss", options=SessionOptions(kernels={"norm": norm}))
        assert session.policy.norm == norm
        losses[norm] = [session.run(b)["loss"] for b in batches]
    assert_close(torch.tensor(losses["triton"]), torch.tensor(losses["torch"]), 1e-5, "losses over 3 steps")
