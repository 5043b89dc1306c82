"""The kernel policy (session/kernels.py): what it chooses, that the lowering obeys it, that
a private op it relies on behaves as F.linear, and that generic ops stay generic."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bert import build_model
from custom_ops import library_status, load_library
from session import SessionOptions
from session.kernels import CHOICES, KernelPolicy, choose_kernels
from session.dense import grouped_matmul_equation, onednn_linear
from session.lowering import _OPS
from session.training import TrainingSession
from tests.helpers import assert_close, random_batch, tiny_config

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------- the policy
def test_policy_follows_precision_and_overrides():
    fp32, bf16 = choose_kernels("cpu", "fp32"), choose_kernels("cpu", "bf16")
    assert (fp32.attention, fp32.grouped_matmul) == ("sdpa", "einsum")
    assert (bf16.attention, bf16.grouped_matmul, bf16.gemm) == ("composed", "block_diagonal", "torch")
    compiled = choose_kernels("cpu", "fp32", compile=True)
    assert compiled.graph == "compiled" and fp32.graph == "eager"
    assert compiled.gemm == fp32.gemm, "under torch.compile oneDNN's GEMM runs as a custom op: the choice stands"
    forced = choose_kernels("cpu", "fp32", overrides={"gemm": "torch", "attention": "composed"})
    assert (forced.gemm, forced.attention) == ("torch", "composed")
    line = forced.describe()
    assert all(f"{op}={getattr(forced, op)}" in line for op in CHOICES), line


@pytest.mark.parametrize("overrides, message", [
    ({"matmul": "torch"}, "unknown op 'matmul'"),
    ({"gemm": "mkl"}, "gemm cannot be 'mkl'; choose one of onednn, torch"),
])
def test_unknown_overrides_are_refused_naming_the_choices(overrides, message):
    """One check, one message, wherever the overrides come from: the policy, the session's
    options, a config's training.kernels."""
    from bert.config import config_from_dict

    with pytest.raises(ValueError, match=re.escape(message)):
        choose_kernels("cpu", "fp32", overrides=overrides)
    with pytest.raises(ValueError, match=re.escape(message)):
        SessionOptions(kernels=overrides)
    with pytest.raises(ValueError, match=re.escape(message)):
        config_from_dict({"training": {"kernels": overrides}})


def test_changes_from_a_recorded_policy_name_each_op():
    now = KernelPolicy(gemm="torch", conv="compiled", compiled_level="avx2")
    saved = {**now.as_dict(), "gemm": "onednn", "compiled_level": "avx512"}
    assert now.changes_from(saved) == ["gemm onednn → torch", "compiled ops avx512 → avx2"]
    assert now.changes_from(now.as_dict()) == []


def test_conv_goes_to_torch_only_where_the_policy_says(monkeypatch):
    # No shape or dtype exception: bf16 runs our AVX512-BF16 / AMX kernels (docs/custom_ops.md).
    import custom_ops.grouped_conv1d
    from custom_ops import DOMAIN, GROUPED_CONV1D
    from session.lowering import _OPS

    policy = choose_kernels("cpu", "bf16")
    assert policy.conv == ("compiled" if policy.compiled_level else "torch")
    calls = []
    monkeypatch.setattr(custom_ops.grouped_conv1d, "grouped_conv1d",
                        lambda x, w, mask, ids, implementation: calls.append(implementation) or x)
    factory = _OPS[(DOMAIN, GROUPED_CONV1D)]  # the session's lowering of the op's spec
    for dtype, channels in [(torch.bfloat16, 64), (torch.bfloat16, 16), (torch.float32, 64)]:
        x, w = torch.zeros(1, 4, channels, dtype=dtype), torch.zeros(channels, channels, 7, dtype=dtype)
        ids = torch.ones(1, 4, dtype=torch.int64)
        for conv in ("compiled", "torch", "triton"):
            fn = factory({"_policy": KernelPolicy(conv=conv)}, [None, None])
            fn(None, x, w)
            fn(None, x, w, None, ids)
        assert calls == ["compiled", "compiled", "torch", "compiled", "triton", "triton"], \
            "torch's convolution cannot keep packed sequences apart"
        calls.clear()


# ------------------------------------------------- GEMM: the private oneDNN op
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize("shape", [(7, 24), (3, 5, 24), (2, 3, 4, 24)])
@pytest.mark.parametrize("bias", [True, False])
def test_private_onednn_linear_op_behaves_as_f_linear(shape, bias):
    # torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "") is private: pin it.
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(*shape, generator=g), torch.randn(40, 24, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    assert_close(onednn_linear(x, w, b).double(), F.linear(x.double(), w.double(), None if b is None else b.double()),
                 1e-5, "forward")


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_without_onednns_linear_op_the_policy_takes_torchs_gemm_and_says_so(monkeypatch):
    import types

    import session.dense as dense
    import session.kernels as kernels

    # A machine where oneDNN's GEMM is the default: AMD, AVX-512.
    monkeypatch.setattr(kernels, "_cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")
    assert dense.onednn_linear_available(), "this torch's private op computes F.linear"
    assert choose_kernels("cpu", "fp32").gemm == "onednn" and not choose_kernels("cpu", "fp32").note
    dense.onednn_linear_available.cache_clear()
    monkeypatch.setattr(torch.ops, "mkldnn", types.SimpleNamespace())  # a torch without the op
    try:
        assert not dense.onednn_linear_available()
        policy = choose_kernels("cpu", "fp32")
        assert policy.gemm == "torch"
        assert policy.describe().endswith("(gemm=torch: this torch has no working torch.ops.mkldnn._linear_pointwise)")
        with pytest.raises(ValueError, match=r"gemm=onednn, but .*_linear_pointwise.*; use gemm=torch"):
            choose_kernels("cpu", "fp32", overrides={"gemm": "onednn"})
    finally:
        dense.onednn_linear_available.cache_clear()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_sessions_train_alike_through_each_gemm_and_only_the_chosen_one_runs(monkeypatch):
    import session.dense as dense

    cfg = tiny_config("bert")
    batches = [random_batch(cfg, 4, seed=s) for s in range(3)]
    runs, calls, onednn = {}, [], dense.onednn_linear
    monkeypatch.setattr(dense, "onednn_linear", lambda *a: calls.append(1) or onednn(*a))
    for gemm in ("torch", "onednn"):
        calls.clear()
        session = TrainingSession(build_model(cfg, seed=3).builder.model_proto(),
                                  options=SessionOptions(kernels={"gemm": gemm}))
        runs[gemm] = [session.run(b)["loss"] for b in batches]
        assert bool(calls) == (gemm == "onednn"), "the fused linear layers take the chosen path"
        calls.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast keeps torch's bf16 GEMM
            session.executor.graphs[0]({k: torch.from_numpy(v) for k, v in batches[0].items()})
        assert not calls
    assert_close(torch.tensor(runs["onednn"]), torch.tensor(runs["torch"]), 1e-5, "losses over 3 steps")


@pytest.mark.parametrize("architecture", ["bert", "groupbert"])
def test_every_implementation_of_each_op_trains_alike(architecture):
    """bf16-style choices (composed attention, block-diagonal grouped matmul, torch's conv,
    LAMB and cross-entropy) run in fp32 here: the same losses as the fp32 choices, so no path is wrong."""
    cfg = tiny_config(architecture)
    batches = [random_batch(cfg, 4, seed=s) for s in range(3)]
    losses = {}
    for name, kernels in (("default", {}), ("other", {"attention": "composed", "grouped_matmul": "block_diagonal",
                                                      "conv": "torch", "lamb": "torch", "gemm": "torch",
                                                      "cross_entropy": "torch"})):
        session = TrainingSession(build_model(cfg, seed=3).builder.model_proto(),
                                  options=SessionOptions(kernels=kernels))
        losses[name] = [session.run(b)["loss"] for b in batches]
    assert_close(torch.tensor(losses["other"]), torch.tensor(losses["default"]), 1e-5, "losses over 3 steps")


# ---------------------------------------------------------- generic op lowering
def test_grouped_matmul_is_recognised_by_structure_not_by_name():
    assert grouped_matmul_equation("bsgi,gio->bsgo") and grouped_matmul_equation("ngk,gkm->ngm")
    assert grouped_matmul_equation("abcgi,gio->abcgo")
    assert not grouped_matmul_equation("bsgi,goi->bsgo") and not grouped_matmul_equation("bsi,io->bso")
    assert not grouped_matmul_equation("bsgi,gio->bsog") and not grouped_matmul_equation("...gi,gio->...go")


@pytest.mark.parametrize("data_shape, index_shape, batch_dims", [
    ((2, 5, 3), (2, 4, 1), 1), ((2, 5, 3), (2, 4, 2), 1), ((5, 3, 4), (6, 2), 0), ((5, 3, 4), (2, 3, 1), 0),
    ((2, 3, 4, 5), (2, 3, 1), 2), ((2, 3, 4, 5), (2, 6, 2), 1), ((2, 3, 4, 5), (2, 3, 2, 2), 2),
])
def test_gather_nd_follows_the_onnx_spec_against_onnxruntime(data_shape, index_shape, batch_dims):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    data = rng.standard_normal(data_shape).astype(np.float32)
    k = index_shape[-1]
    index = np.stack([rng.integers(-data_shape[batch_dims + j], data_shape[batch_dims + j], size=index_shape[:-1])
                      for j in range(k)], -1).astype(np.int64)
    node = helper.make_node("GatherND", ["d", "i"], ["o"], batch_dims=batch_dims)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("d", TensorProto.FLOAT, data_shape),
                                            helper.make_tensor_value_info("i", TensorProto.INT64, index_shape)],
                              [helper.make_tensor_value_info("o", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    expected = ort.InferenceSession(model.SerializeToString()).run(None, {"d": data, "i": index})[0]
    fn = _OPS[("", "GatherND")]({"batch_dims": batch_dims, "_policy": choose_kernels()}, [None, None])
    got = fn(None, torch.from_numpy(data), torch.from_numpy(index)).numpy()
    assert got.shape == expected.shape and np.array_equal(got, expected)


def test_session_names_no_model_weights():
    """session/ is generic: no HuggingFace BERT parameter name or model equation appears in it."""
    pattern = re.compile(r"word_embeddings|position_embeddings|token_type_embeddings|\bLayerNorm\b|qa_outputs|"
                         r"cls\.predictions|seq_relationship|pooler|encoder\.layer|bsgi|masked_lm|input_ids")
    found = [f"{path.name}:{n}: {line.strip()}" for path in sorted((ROOT / "session").glob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


@pytest.mark.skipif(not load_library(), reason=f"compiled ops unavailable: {library_status()}")
def test_the_kernels_line_names_the_amx_tiles_where_bf16_runs_on_them(monkeypatch):
    monkeypatch.setenv("GROUPBERT_AMX", "emulate")
    assert "+ emulated AMX tiles" in choose_kernels("cpu", "bf16").describe()
    assert "AMX" not in choose_kernels("cpu", "fp32").describe()  # the tiles take bf16 only
    assert "AMX" not in choose_kernels("cpu", "bf16", overrides={"conv": "torch"}).describe()
    monkeypatch.setenv("GROUPBERT_AMX", "0")
    policy = choose_kernels("cpu", "bf16")
    assert policy.amx_tiles is None and "AMX" not in policy.describe()
