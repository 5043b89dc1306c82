"""GroupedConv1d (custom_ops/csrc/grouped_conv1d.cpp and its Python wrapper) against a
float64 numpy reference written out loop by loop over the kernel taps.

Letters: B batch, S sequence, H hidden, C channels per group, G = H / C, K kernel width.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import custom_ops
from custom_ops import library_status
from custom_ops.grouped_conv1d import _compiled, _grouped_conv1d_torch
from tests.helpers import assert_close

requires_compiled = pytest.mark.skipif(
    not _compiled(), reason=f"compiled grouped_conv1d unavailable: {library_status()}"
)
GROUPBERT = dict(B=2, S=128, H=768, C=16, K=7)  # GroupBERT base: 16 channels per group, kernel 7


# --- the reference ----------------------------------------------------------------------


def reference(x, w, mask, grad_out):
    """float64 numpy forward and both gradients of the masked "same" grouped convolution."""
    x, w, grad_out = (np.asarray(t.detach().double()) for t in (x, w, grad_out))
    B, S, H = x.shape
    _, C, K = w.shape
    G, P = H // C, K // 2
    m = np.ones((B, S)) if mask is None else np.asarray(mask.double())
    xp = np.pad(x * m[..., None], ((0, 0), (P, P), (0, 0))).reshape(B, S + 2 * P, G, C)  # (B, S + 2P, G, C)
    wg = w.reshape(G, C, C, K)  # (G, C out, C in, K)
    go = grad_out.reshape(B, S, G, C)
    out = np.zeros((B, S, G, C))
    grad_xp = np.zeros_like(xp)
    grad_w = np.zeros_like(wg)
    for k in range(K):  # tap k reads input row s + k - P, i.e. padded row s + k
        window = xp[:, k : k + S]  # (B, S, G, C)
        out += np.einsum("bsgc,gjc->bsgj", window, wg[..., k])
        grad_xp[:, k : k + S] += np.einsum("bsgj,gjc->bsgc", go, wg[..., k])
        grad_w[..., k] = np.einsum("bsgj,bsgc->gjc", go, window)
    grad_x = grad_xp[:, P : P + S].reshape(B, S, H) * m[..., None]
    return out.reshape(B, S, H), grad_x, grad_w.reshape(H, C, K)


def make_inputs(B, S, H, C, K, dtype=torch.float32, masked=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, generator=gen, dtype=torch.float64).to(dtype)
    w = (torch.randn(H, C, K, generator=gen, dtype=torch.float64) / (C * K) ** 0.5).to(dtype)
    grad_out = torch.randn(B, S, H, generator=gen, dtype=torch.float64).to(dtype)
    mask = None
    if masked:  # a padding tail per row, plus one hole inside the first row
        mask = torch.ones(B, S, dtype=torch.bool)
        for b in range(B):
            mask[b, S - 1 - (b * S) // (2 * B) :] = False
        mask[0, S // 3] = False
    return x, w, mask, grad_out


def run(x, w, mask, grad_out, fn=custom_ops.grouped_conv1d):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    out = fn(x, w, mask)
    out.backward(grad_out)
    return out, x.grad, w.grad


def check_against_reference(x, w, mask, grad_out, rtol, fn=custom_ops.grouped_conv1d):
    out, grad_x, grad_w = run(x, w, mask, grad_out, fn)
    ref_out, ref_grad_x, ref_grad_w = reference(x, w, mask, grad_out)
    assert out.dtype == x.dtype and grad_x.dtype == x.dtype and grad_w.dtype == w.dtype
    assert_close(out, torch.from_numpy(ref_out), rtol, "out")
    assert_close(grad_x, torch.from_numpy(ref_grad_x), rtol, "grad_x")
    assert_close(grad_w, torch.from_numpy(ref_grad_w), rtol, "grad_w")


# --- the compiled op ----------------------------------------------------------------------


@requires_compiled
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_fp32_groupbert_shape(masked):
    check_against_reference(*make_inputs(**GROUPBERT, masked=masked), rtol=1e-5)


@requires_compiled
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_bf16_groupbert_shape(masked):
    # The reference sees the same bf16-rounded inputs; the kernel accumulates in fp32.
    check_against_reference(*make_inputs(**GROUPBERT, dtype=torch.bfloat16, masked=masked), rtol=1e-2)


@requires_compiled
@pytest.mark.parametrize("B, S, H, K", [(2, 128, 768, 7), (3, 37, 48, 7), (2, 21, 32, 3), (1, 19, 64, 9), (2, 5, 16, 1)])
def test_bf16_amx_against_reference_and_avx512(B, S, H, K, monkeypatch):
    # bf16 with 16 channels per group runs on AMX tiles where the CPU has them; partial
    # tiles (S % 16), other kernel widths and the mask go through the same tiles.
    if not torch.ops.groupbert.grouped_conv1d_amx_usable():
        pytest.skip("this CPU (or OS) offers no AMX-BF16 tiles")
    inputs = make_inputs(B, S, H, 16, K, dtype=torch.bfloat16)
    check_against_reference(*inputs, rtol=1e-2)
    amx = run(*inputs)
    monkeypatch.setenv("GROUPBERT_AMX", "0")
    assert not torch.ops.groupbert.grouped_conv1d_amx_usable()
    avx512 = run(*inputs)
    for name, a, b in zip(["out", "grad_x", "grad_w"], amx, avx512):
        assert_close(a, b, 1e-2, name)
    if amx[0].numel() > 100_000:
        # The two paths sum in different orders, so some of 200k outputs round apart:
        # proof that the tiles ran (small cases may round alike everywhere).
        assert not torch.equal(amx[0], avx512[0])


@requires_compiled
@pytest.mark.parametrize(
    "B, S, H, C, K",
    [(2, 9, 12, 4, 3), (3, 5, 15, 3, 7), (1, 11, 10, 5, 5), (2, 7, 34, 17, 1)],
    ids=["C4K3", "C3K7-longer-than-S", "C5K5", "C17K1"],
)
def test_odd_shapes_float64(B, S, H, C, K):
    # Channel counts that are not lane multiples (padded lanes), K >= S, K = 1.
    x, w, mask, grad_out = make_inputs(B, S, H, C, K, dtype=torch.float64)
    check_against_reference(x, w, mask, grad_out, rtol=1e-12)


@requires_compiled
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("K", [3, 7], ids=["K3-tap-loop", "K7-unrolled"])
def test_gradcheck(masked, K):
    x, w, mask, _ = make_inputs(2, 9, 12, 4, K, dtype=torch.float64, masked=masked)
    x.requires_grad_()
    w.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: custom_ops.grouped_conv1d(a, b, mask), (x, w))


@requires_compiled
def test_mask_padded_positions_contribute_nothing():
    x, w, mask, grad_out = make_inputs(2, 23, 48, 16, 7)
    noisy = x.clone()
    noisy[~mask] = 1e3  # anything at padded positions must not reach the output
    out, grad_x, grad_w = run(x, w, mask, grad_out)
    noisy_out, noisy_grad_x, noisy_grad_w = run(noisy, w, mask, grad_out)
    assert torch.equal(out, noisy_out)
    assert torch.equal(grad_w, noisy_grad_w)
    assert torch.equal(grad_x, noisy_grad_x)
    assert torch.count_nonzero(grad_x[~mask]) == 0
    # Outputs at padded positions are not zeroed: neighbours still feed them.
    assert torch.count_nonzero(out[~mask]) > 0
    # A float mask of 0/1 is the same as the bool mask.
    float_out, float_grad_x, float_grad_w = run(x, w, mask.float(), grad_out)
    assert torch.equal(out, float_out) and torch.equal(grad_x, float_grad_x) and torch.equal(grad_w, float_grad_w)


@requires_compiled
def test_threads_agree():
    # Big enough that both the convolution and grad-weight's partial sums are shared out.
    x, w, mask, grad_out = make_inputs(4, 67, 192, 16, 7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run(x, w, mask, grad_out)
    finally:
        torch.set_num_threads(threads)
    for name, a, b in zip(["out", "grad_x", "grad_w"], run(x, w, mask, grad_out), single):
        assert_close(a, b, 1e-6, name)  # grad_w sums per-thread partials: order differs


@requires_compiled
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_opcheck(mask_kind):
    x, w, mask, _ = make_inputs(2, 10, 24, 8, 5, masked=mask_kind != "none")
    if mask_kind == "float":
        mask = mask.float()
    torch.library.opcheck(torch.ops.groupbert.grouped_conv1d.default, (x.requires_grad_(), w.requires_grad_(), mask))
    torch.library.opcheck(torch.ops.groupbert.grouped_conv1d.default, (x.detach(), w.detach(), mask))


@requires_compiled
def test_torch_compile_traces_through():
    x, w, mask, grad_out = make_inputs(2, 13, 32, 16, 7)
    compiled = torch.compile(custom_ops.grouped_conv1d, fullgraph=True, backend="aot_eager")
    check_against_reference(x, w, mask, grad_out, rtol=1e-5, fn=compiled)


@requires_compiled
def test_input_checks_name_both_shapes():
    x = torch.randn(2, 5, 32)
    with pytest.raises(RuntimeError, match=r"\[32, 16, 6\].*\[2, 5, 32\]"):  # even K
        torch.ops.groupbert.grouped_conv1d(x, torch.randn(32, 16, 6), None)
    with pytest.raises(RuntimeError, match=r"\[48, 16, 7\].*\[2, 5, 32\]"):  # H mismatch
        torch.ops.groupbert.grouped_conv1d(x, torch.randn(48, 16, 7), None)
    with pytest.raises(RuntimeError, match=r"\(2, 5\).*\[2, 4\].*\[2, 5, 32\]"):
        torch.ops.groupbert.grouped_conv1d(x, torch.randn(32, 16, 7), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.groupbert.grouped_conv1d(x, torch.randn(32, 16, 7, dtype=torch.float64), None)


# --- the Python wrapper and its fallback ------------------------------------------------------


def test_fallback_matches_reference(monkeypatch):
    """Without the compiled library the wrapper runs F.conv1d: same answer, masked."""
    monkeypatch.setattr(sys.modules["custom_ops.grouped_conv1d"], "_compiled", lambda: False)
    check_against_reference(*make_inputs(2, 19, 48, 16, 7), rtol=1e-5)


@requires_compiled
def test_fallback_matches_compiled():
    x, w, mask, grad_out = make_inputs(2, 33, 96, 16, 7)
    for a, b, name in zip(run(x, w, mask, grad_out), run(x, w, mask, grad_out, _grouped_conv1d_torch),
                          ["out", "grad_x", "grad_w"]):
        assert_close(a, b, 1e-5, name)


def test_wrapper_rejects_bad_inputs():
    x = torch.randn(2, 5, 32)
    with pytest.raises(ValueError, match=r"\(48, 16, 7\).*\(2, 5, 32\)"):
        custom_ops.grouped_conv1d(x, torch.randn(48, 16, 7))
    with pytest.raises(ValueError, match="K odd"):
        custom_ops.grouped_conv1d(x, torch.randn(32, 16, 4))
    with pytest.raises(ValueError, match=r"mask must be \(B, S\)"):
        custom_ops.grouped_conv1d(x, torch.randn(32, 16, 7), torch.ones(5, 2))


# --- CUDA ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@requires_compiled
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_cuda_matches_conv1d(dtype, rtol, masked):
    if not torch._C._dispatch_has_kernel_for_dispatch_key("groupbert::grouped_conv1d", "CUDA"):
        pytest.skip("libgroupbert_ops.so was built without CUDA kernels")
    x, w, mask, grad_out = make_inputs(4, 77, 768, 16, 7, dtype=torch.float32, masked=masked)
    cuda = [t if t is None else t.cuda() for t in (x.to(dtype), w.to(dtype), mask, grad_out.to(dtype))]
    out, grad_x, grad_w = run(*cuda)
    # The reference: F.conv1d in float64 on the same (rounded) values, on the GPU.
    ref = run(*(t.double() if t is not None and t.is_floating_point() else t for t in cuda),
              fn=_grouped_conv1d_torch)
    for name, a, e in zip(["out", "grad_x", "grad_w"], (out, grad_x, grad_w), ref):
        assert a.dtype == dtype
        assert_close(a, e, rtol, f"cuda {name}")
