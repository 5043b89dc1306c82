"""The lowering's fusions against the same graph run node by node (`LoweredGraph(fuse=False)`),
forward and backward, fp32 and bf16, through each GEMM implementation; and the fused
linear layer's hand-written backward against float64 F.linear."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F

from bert import build_model
from session import LoweredGraph
from session.kernels import choose_kernels
from builder import attribute
from session.dense import _GroupedLinear, LinearFunction, _SoftmaxCrossEntropy, linear
from session.fusions import find_fusions
from tests.helpers import assert_close, random_batch, tiny_config

# bf16 runs the GEMMs in bf16 (8 bits of mantissa) on both sides, in different orders:
# outputs and gradients agree to a few bf16 ulps of their largest element.
RTOL = {"fp32": 1e-5, "bf16": 3e-2}
GEMMS = ["torch"] + (["onednn"] if torch.backends.mkldnn.is_available() else [])


def _fusion_kinds(proto: onnx.ModelProto, policy) -> Counter:
    constants = {n.output[0]: onnx.numpy_helper.to_array(attribute(n, "value"))
                 for n in proto.graph.node if n.op_type == "Constant"}
    fused, _ = find_fusions(proto.graph, constants, policy)
    return Counter(f.kind for f in fused.values())


def _run(graph: LoweredGraph, feeds: dict, precision: str) -> tuple[dict, dict]:
    """Outputs and every weight's gradient of the loss, after one forward and backward."""
    graph.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        out = graph(feeds)
    out["loss"].backward()
    return ({k: v.detach().float() for k, v in out.items()},
            {n: p.grad.detach().clone() for n, p in graph.named_weights() if p.grad is not None})


@pytest.mark.parametrize("architecture", ["bert", "groupbert"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("gemm", GEMMS)
def test_fused_graph_equals_the_graph_node_by_node(architecture, precision, gemm):
    cfg = tiny_config(architecture)
    proto = build_model(cfg, seed=5).builder.model_proto()
    policy = choose_kernels("cpu", precision, overrides={"gemm": gemm})
    kinds = _fusion_kinds(proto, policy)
    # Every layer's query/key/value are one sibling group, its attention core one SDPA, and
    # every other dense layer one linear: a pattern that stops matching fails here.
    dense_per_layer = {"bert": 3, "groupbert": 7}[architecture]  # besides query/key/value
    assert kinds["siblings"] == cfg.num_layers, kinds
    assert kinds["attention"] == cfg.num_layers, kinds
    assert kinds["linear"] == dense_per_layer * cfg.num_layers + 4, kinds  # + MLM transform, decoder, pooler, NSP
    grouped = 2 * cfg.num_layers if architecture == "groupbert" and policy.grouped_matmul == "einsum" else 0
    assert kinds["grouped"] == grouped, kinds
    conv_modules = cfg.num_layers if architecture == "groupbert" else 0  # GLU → … → Swish
    assert kinds["glu"] == kinds["swish"] == conv_modules, kinds
    fused = LoweredGraph(proto, policy=policy).train()
    plain = LoweredGraph(proto, fuse=False, policy=policy).train()
    plain.load_weights(fused.weights_state_dict())
    feeds = {k: torch.from_numpy(v) for k, v in random_batch(cfg, 3, seed=2, pad_from=4).items()}
    out_f, grads_f = _run(fused, feeds, precision)
    out_p, grads_p = _run(plain, feeds, precision)
    rtol = RTOL[precision]
    for name in ("mlm_logits", "nsp_logits", "loss"):
        assert_close(out_f[name], out_p[name], rtol, f"{architecture} {precision} gemm={gemm} {name}")
    assert grads_f.keys() == grads_p.keys() == {n for n, _ in fused.named_weights()}
    # Key-bias gradients are zero in exact arithmetic (softmax cancels them): rounding noise.
    noise = 1e-6 * max(g.abs().max().item() for g in grads_p.values())
    for name, g in grads_p.items():
        assert_close(grads_f[name], g, rtol, f"{architecture} {precision} gemm={gemm} grad {name}", atol=noise)


def test_siblings_group_only_linears_reading_the_same_input_in_the_same_place():
    cfg = tiny_config("bert")
    proto = build_model(cfg).builder.model_proto()
    constants = {n.output[0]: onnx.numpy_helper.to_array(attribute(n, "value"))
                 for n in proto.graph.node if n.op_type == "Constant"}
    fused, replaced = find_fusions(proto.graph, constants, choose_kernels())
    groups = [f for f in fused.values() if f.kind == "siblings"]
    for group in groups:
        weights = group.inputs[1::2]
        assert [w.rsplit(".", 2)[-2] for w in weights] == ["query", "key", "value"], weights
        assert len(group.outputs) == 3
    # A group's step runs where its first member (the query) ran: nothing it reads comes later.
    position = {n.name: i for i, n in enumerate(proto.graph.node)}
    producer = {o: n.name for n in proto.graph.node for o in n.output}
    for key, group in fused.items():
        for i in group.inputs:
            assert i not in producer or position[producer[i]] < position[key], (key, i)


# ------------------------------------------------ the fused linear layer itself
def _linear_case(shape, n_out, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    w = torch.randn(n_out, shape[-1], generator=g, dtype=torch.float64)
    b = torch.randn(n_out, generator=g, dtype=torch.float64) if bias else None
    dy = torch.randn(*shape[:-1], n_out, generator=g, dtype=torch.float64)
    return x, w, b, dy


@pytest.mark.parametrize("onednn", [False] + ([True] if torch.backends.mkldnn.is_available() else []))
@pytest.mark.parametrize("shape, n_out", [((3, 5, 24), 40), ((7, 40), 24), ((2, 3, 4, 24), 24)])  # N > K, N < K, N = K
@pytest.mark.parametrize("bias", [True, False])
def test_linear_equals_float64_forward_and_backward(onednn, shape, n_out, bias):
    x, w, b, dy = _linear_case(shape, n_out, bias)
    ref = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
    y_ref = F.linear(*ref)
    y_ref.backward(dy)
    ours = [t.float().requires_grad_() for t in (x, w, b) if t is not None]
    y = LinearFunction.apply(*ours, *(() if bias else (None,)), onednn)
    y.backward(dy.float())
    assert_close(y, y_ref, 1e-5, "y")
    for name, r, o in zip(("dx", "dw", "db"), ref, ours):
        assert o.grad.shape == r.grad.shape, name
        assert_close(o.grad, r.grad, 1e-5, name)


def test_linear_under_autocast_runs_in_its_dtype_and_returns_fp32_gradients():
    x, w, b, dy = _linear_case((4, 6, 32), 48, True, seed=3)
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    F.linear(*ref).backward(dy)
    ours = [t.float().requires_grad_() for t in (x, w, b)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear(*ours, onednn=True)  # oneDNN's path is fp32-only: bf16 takes torch's
        expected_dtype = F.linear(*[t.float() for t in (x, w, b)]).dtype
    assert y.dtype == expected_dtype == torch.bfloat16
    y.backward(dy.to(torch.bfloat16))
    for name, r, o in zip(("dx", "dw", "db"), ref, ours):
        assert o.grad.dtype == torch.float32, name
        assert_close(o.grad, r.grad, RTOL["bf16"], name)


def test_bias_gradient_is_a_gemm_not_a_column_sum():
    """db = dyᵀ·1 (session/lowering.py: torch's column sum over rows is 2-25x slower)."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(64, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    y = LinearFunction.apply(x, w, b, False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y.backward(torch.ones(64, 8))
    names = {e.name for e in prof.events()}
    assert "aten::sum" not in names and "aten::mm" in names, sorted(names)
    assert np.allclose(b.grad.numpy(), 64.0)


@pytest.mark.parametrize("lead", [(3, 5), (7,)])
def test_grouped_linear_equals_float64_einsum_forward_and_backward(lead):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(*lead, 4, 6, generator=g, dtype=torch.float64)  # (..., G, I)
    w = torch.randn(4, 6, 5, generator=g, dtype=torch.float64)  # (G, I, O)
    b = torch.randn(20, generator=g, dtype=torch.float64)
    dy = torch.randn(*lead, 20, generator=g, dtype=torch.float64)
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    y_ref = torch.einsum("...gi,gio->...go", ref[0], ref[1]).flatten(-2) + ref[2]
    y_ref.backward(dy)
    ours = [t.float().requires_grad_() for t in (x, w, b)]
    y = _GroupedLinear.apply(*ours)
    y.backward(dy.float())
    assert_close(y, y_ref, 1e-5, "y")
    for name, r, o in zip(("dx", "dw", "db"), ref, ours):
        assert_close(o.grad, r.grad, 1e-5, name)


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("n, c", [(40, 1009), (7, 2)])  # masked positions × vocabulary; NSP
def test_softmax_cross_entropy_equals_float64_cross_entropy_forward_and_backward(dtype, rtol, n, c):
    g = torch.Generator().manual_seed(n)
    scores = torch.randn(n, c, generator=g, dtype=torch.float64) * 4
    labels = torch.randint(0, c, (n,), generator=g)
    labels[::3] = -100  # padding of the masked positions
    ref = scores.to(dtype).double().requires_grad_()
    loss_ref = F.cross_entropy(ref, labels, ignore_index=-100)
    (loss_ref * 3).backward()
    ours = scores.to(dtype).requires_grad_()
    loss = _SoftmaxCrossEntropy.apply(ours, labels, -100)
    (loss * 3).backward()
    assert loss.dtype == torch.float32 and ours.grad.dtype == dtype
    assert_close(loss, loss_ref, 1e-6, "loss")
    assert_close(ours.grad, ref.grad, rtol, "dscores")
    assert not ours.grad[::3].any(), "an ignored row has a gradient"


def test_softmax_cross_entropy_of_no_labels_is_nan_with_zero_gradients_and_runs_backward_twice():
    """As F.cross_entropy: every label ignored gives nan and zero gradients. Nothing saved is
    overwritten, so a second backward (retain_graph) adds the same gradient again."""
    scores = torch.randn(3, 5, requires_grad=True)
    loss = _SoftmaxCrossEntropy.apply(scores, torch.full((3,), -100), -100)
    loss.backward(retain_graph=True)
    assert loss.isnan() and torch.equal(scores.grad, torch.zeros(3, 5))
    labels = torch.tensor([1, -100, 4])
    loss = _SoftmaxCrossEntropy.apply(scores, labels, -100)
    loss.backward(retain_graph=True)
    once = scores.grad.clone()
    loss.backward()
    assert torch.equal(scores.grad, 2 * once) and once.abs().sum() > 0


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["bert", "groupbert"])
def test_compiled_graph_equals_the_eager_graph(architecture):
    """graph=compiled (torch.compile of the lowered program, oneDNN's GEMM and the compiled
    ops as extern kernels) computes what the eager program computes, forward and backward."""
    cfg = tiny_config(architecture)
    proto = build_model(cfg, seed=7).builder.model_proto()
    eager = LoweredGraph(proto, policy=choose_kernels("cpu", "fp32")).train()
    compiled = LoweredGraph(proto, policy=choose_kernels("cpu", "fp32", compile=True)).train()
    compiled.load_weights(eager.weights_state_dict())
    feeds = {k: torch.from_numpy(v) for k, v in random_batch(cfg, 3, seed=1, pad_from=4).items()}
    out_e, grads_e = _run(eager, feeds, "fp32")
    torch._dynamo.utils.counters.clear()
    out_c, grads_c = _run(compiled, feeds, "fp32")
    # One graph: a break would leave the ops after it to eager, op by op (dynamo's counters).
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    for name in ("mlm_logits", "nsp_logits", "loss"):
        assert_close(out_c[name], out_e[name], RTOL["fp32"], f"compiled {name}")
    noise = 1e-6 * max(g.abs().max().item() for g in grads_e.values())
    for name, g in grads_e.items():
        assert_close(grads_c[name], g, RTOL["fp32"], f"compiled grad {name}", atol=noise)
