"""GroupedConv1d (custom_ops/csrc/grouped_conv1d*.cpp and its Python wrapper) against a
float64 numpy reference written out loop by loop over the kernel taps, and against
float64 F.conv1d(groups=G), at every CPU kernel level this machine runs (`cpu_level`); with
packed sequence ids against every sequence cut out and convolved alone.
Faults (bad inputs, mask values other than 0/1) are in tests/test_faults_ops.py.

Letters: B batch, S sequence, H hidden, C channels per group, G = H / C, K kernel width.
"""
from __future__ import annotations

import functools
import platform
import re
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import custom_ops
from custom_ops import library_status
from custom_ops._library import LIBRARY_PATH
from custom_ops.grouped_conv1d import _grouped_conv1d_torch, compiled_available, grouped_conv1d
from tests.helpers import assert_close
from tests.ops_levels import LEVELS

requires_compiled = pytest.mark.skipif(
    not compiled_available(), reason=f"compiled grouped_conv1d unavailable: {library_status()}"
)
GROUPBERT = dict(B=2, S=128, H=768, C=16, K=7)  # GroupBERT base: 16 channels per group, kernel 7
X86 = platform.machine().lower() in ("x86_64", "amd64")


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


def run(x, w, mask, grad_out, fn=grouped_conv1d):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    out = fn(x, w, mask)
    out.backward(grad_out)
    return out, x.grad, w.grad


def check_against_reference(x, w, mask, grad_out, rtol, fn=grouped_conv1d, expected=None):
    out, grad_x, grad_w = run(x, w, mask, grad_out, fn)
    ref_out, ref_grad_x, ref_grad_w = expected or reference(x, w, mask, grad_out)
    assert out.dtype == x.dtype and grad_x.dtype == x.dtype and grad_w.dtype == w.dtype
    assert_close(out, torch.from_numpy(ref_out), rtol, "out")
    assert_close(grad_x, torch.from_numpy(ref_grad_x), rtol, "grad_x")
    assert_close(grad_w, torch.from_numpy(ref_grad_w), rtol, "grad_w")


def assert_rounded(actual, expected, name: str) -> None:
    """fp32: 1e-5 relative to the largest value. bf16 / fp16: within one rounding of the
    float64 value (half a unit in the last place of the dtype, element by element), plus
    1e-5 of the largest value for the fp32 sums behind it and fp16's subnormal step."""
    a, e = actual.detach().double(), expected.detach().double()
    if actual.dtype == torch.float32:
        assert_close(a, e, 1e-5, name)
        return
    half_ulp = torch.finfo(actual.dtype).eps / 2
    bound = half_ulp * e.abs() + 1e-5 * e.abs().max() + 2.0**-24
    excess = (a - e).abs() - bound
    if excess.max() > 0:
        i = np.unravel_index(int(excess.argmax()), tuple(a.shape))
        raise AssertionError(f"{name}: {actual.dtype} result {a[i].item():.8g} at {tuple(int(j) for j in i)} is more "
                             f"than one rounding from {e[i].item():.8g} (|diff| {abs(a[i] - e[i]).item():.3e} > "
                             f"{bound[i].item():.3e})")


# --- the compiled op ----------------------------------------------------------------------


@functools.cache
def groupbert_case(dtype: torch.dtype, masked: bool):
    inputs = make_inputs(**GROUPBERT, dtype=dtype, masked=masked)
    return inputs, reference(*inputs)


@requires_compiled
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_fp32_groupbert_shape(masked, cpu_level):
    inputs, expected = groupbert_case(torch.float32, masked)
    check_against_reference(*inputs, rtol=1e-5, expected=expected)


@requires_compiled
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_half_precision_groupbert_shape(dtype, masked, cpu_level):
    # The reference sees the same rounded inputs; the kernel accumulates in fp32 and
    # rounds each result once.
    inputs, expected = groupbert_case(dtype, masked)
    for name, a, e in zip(["out", "grad_x", "grad_w"], run(*inputs), expected):
        assert a.dtype == dtype
        assert_rounded(a, torch.from_numpy(e), name)


def non_contiguous_inputs(B, S, C, K, G, dtype, masked, seed):
    """x, grad_out (B, S, H), weight (H, C, K) and mask (B, S) as strided views."""
    H = G * C
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, H, generator=gen).to(dtype).transpose(0, 1)
    grad_out = torch.randn(S, B, H, generator=gen).to(dtype).transpose(0, 1)
    w = (torch.randn(H, C, 2 * K, generator=gen) / (C * K) ** 0.5).to(dtype)[..., ::2]  # every other tap
    mask = None
    if masked:
        mask = (torch.rand(S + 2, B, generator=gen) > 0.25).t()[:, 1 : S + 1]
        mask[:, -3:] = False  # a padding tail as well as holes
    assert not (x.is_contiguous() or w.is_contiguous() or grad_out.is_contiguous())
    return x, w, mask, grad_out


def conv1d_reference(x, w, mask, grad_out):
    """float64 F.conv1d(groups=G) of x * mask and its autograd gradients."""
    G, K = x.shape[2] // w.shape[1], w.shape[2]
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    xm = x64 if mask is None else x64 * mask[..., None].double()
    out = F.conv1d(xm.transpose(1, 2), w64, padding=K // 2, groups=G).transpose(1, 2)
    out.backward(grad_out.double())
    return out.detach(), x64.grad, w64.grad


@requires_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_matches_conv1d_on_odd_non_contiguous_shapes(dtype, masked, cpu_level):
    # S = 37: three tiles, the last partial; G = 3 groups; every K and C of the issue.
    for K in (1, 3, 7, 9):
        for C in (4, 16, 32):
            inputs = non_contiguous_inputs(B=2, S=37, C=C, K=K, G=3, dtype=dtype, masked=masked, seed=K * 100 + C)
            ours = run(*inputs)
            for name, a, e in zip(["out", "grad_x", "grad_w"], ours, conv1d_reference(*inputs)):
                assert a.dtype == dtype
                assert_rounded(a, e, f"{cpu_level} K={K} C={C} {name}")


@requires_compiled
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_bf16_wide_groups_match_conv1d(masked, cpu_level):
    # C = 64, K = 7 in bf16: our kernels at every level (the session's kernel policy may
    # prefer torch's convolution for this shape on some CPUs; the op itself never does).
    inputs = non_contiguous_inputs(B=2, S=37, C=64, K=7, G=2, dtype=torch.bfloat16, masked=masked, seed=7)
    for name, a, e in zip(["out", "grad_x", "grad_w"], run(*inputs), conv1d_reference(*inputs)):
        assert a.dtype == torch.bfloat16
        assert_rounded(a, e, f"{cpu_level} {name}")


# bf16 at odd shapes, every level: at avx512_bf16 these run the AVX512-BF16 dot products
# (grouped_conv1d_avx512_bf16.cpp): input-stationary for K = 7 (x read in place where a
# tile's window is all live, else gathered), output-stationary otherwise; channel pairs
# padded for odd C; lane counts 4 to 64; sequences not a multiple of 16 or 32 rows.
BF16_SHAPES = {
    "B1-G3-C16-K7-S37": dict(B=1, S=37, H=48, C=16, K=7),
    "G3-C5-K3-S19": dict(B=2, S=19, H=15, C=5, K=3),
    "G3-C32-K7-S50": dict(B=3, S=50, H=96, C=32, K=7),
    "G2-C64-K9-S21": dict(B=1, S=21, H=128, C=64, K=9),
    "G3-C8-K1-S33": dict(B=2, S=33, H=24, C=8, K=1),
    "G3-C4-K7-S16": dict(B=2, S=16, H=12, C=4, K=7),
    "G3-C16-K7-S70": dict(B=2, S=70, H=48, C=16, K=7),
}


@requires_compiled
@pytest.mark.parametrize("rows", ["plain", "masked", "packed"])
@pytest.mark.parametrize("shape", list(BF16_SHAPES))
def test_bf16_against_float64_at_odd_shapes(shape, rows, cpu_level):
    # Forward, grad_x and grad_w within one bf16 rounding of float64 on the same bf16
    # values, with a padding mask or packed sequence ids (every sequence cut out and
    # convolved alone), at every level.
    sizes = BF16_SHAPES[shape]
    if rows == "packed":
        x, w, ids, grad_out = packed_inputs(**sizes, dtype=torch.bfloat16, seed=sizes["C"])
        got, expected = run_packed(x, w, ids, grad_out), packed_reference(x, w, ids, grad_out)
    else:
        inputs = make_inputs(**sizes, dtype=torch.bfloat16, masked=rows == "masked", seed=sizes["C"])
        got, expected = run(*inputs), reference(*inputs)
    for name, a, e in zip(["out", "grad_x", "grad_w"], got, expected):
        assert a.dtype == torch.bfloat16
        assert_rounded(a, torch.from_numpy(e), f"{cpu_level} {shape} {rows} {name}")


@requires_compiled
@pytest.mark.skipif("avx512_bf16" not in LEVELS, reason="this CPU has no AVX512-BF16")
def test_bf16_dot_products_run_at_their_level(monkeypatch):
    # The CPU's best level is avx512_bf16; avx512 forces the AVX-512 kernels without bf16
    # products (they widen to fp32). Both agree to bf16 rounding, and a few of the 480k
    # results round apart (fp32 sums in other orders: 3 outputs, 9 of grad_x, 10 of
    # grad_w here): proof that each level ran its own kernel.
    monkeypatch.delenv("GROUPBERT_CPU_CAPABILITY", raising=False)
    monkeypatch.setenv("GROUPBERT_AMX", "0")  # on an AMX CPU both levels would run the tiles
    assert custom_ops.cpu_capability() == "avx512_bf16"
    inputs, _ = groupbert_case(torch.bfloat16, False)
    dot = run(*inputs)
    monkeypatch.setenv("GROUPBERT_CPU_CAPABILITY", "avx512")
    assert custom_ops.cpu_capability() == "avx512"
    widened = run(*inputs)
    for name, a, b in zip(["out", "grad_x", "grad_w"], dot, widened):
        assert_close(a, b, 1e-2, name)
    assert sum(int((a != b).sum()) for a, b in zip(dot, widened)) > 0, "the two levels ran the same kernel"


@requires_compiled
def test_levels_follow_the_cpu_features():
    # avx512_bf16 is offered exactly where the dispatch saw AVX512-BF16 (with AVX-512).
    features = torch.ops.groupbert.cpu_features().split()
    assert ("avx512_bf16" in LEVELS) == ("avx512bf16" in features and "avx512f" in features)
    assert LEVELS == ["generic", "avx2", "avx512", "avx512_bf16"][: len(LEVELS)], LEVELS


# The AMX kernels run on the CPU's tiles where it has them, and on tiles emulated in C++
# (GROUPBERT_AMX=emulate, grouped_conv1d_amx_emulated.cpp) on any CPU: the same
# kernel code, so its logic is tested on every machine and its instructions where they exist.
AMX_TILES = [pytest.param("hardware", id="amx-hardware"), pytest.param("emulate", id="amx-emulated")]


def use_amx_tiles(tiles: str, monkeypatch) -> None:
    """Route bf16 calls with 16 channels per group to the `tiles`, or skip saying why they are off."""
    if tiles == "emulate":
        monkeypatch.setenv("GROUPBERT_AMX", "emulate")
    else:
        monkeypatch.delenv("GROUPBERT_AMX", raising=False)
    state = torch.ops.groupbert.amx_state()
    if tiles == "hardware" and state != "hardware":
        pytest.skip(f"AMX tiles {state}")
    assert state.startswith("emulated" if tiles == "emulate" else "hardware"), state


@requires_compiled
@pytest.mark.parametrize("tiles", AMX_TILES)
@pytest.mark.parametrize("B, S, H, K", [(2, 128, 768, 7), (3, 37, 48, 7), (2, 21, 32, 3), (1, 19, 64, 9), (2, 5, 16, 1)])
def test_bf16_amx_against_reference_and_avx512(B, S, H, K, tiles, monkeypatch):
    # bf16 with 16 channels per group runs on AMX tiles; partial tiles (S % 16), other
    # kernel widths and the mask go through the same tiles.
    use_amx_tiles(tiles, monkeypatch)
    inputs = make_inputs(B, S, H, 16, K, dtype=torch.bfloat16)
    check_against_reference(*inputs, rtol=1e-2)
    amx = run(*inputs)
    monkeypatch.setenv("GROUPBERT_AMX", "0")
    assert torch.ops.groupbert.amx_state() == "off: GROUPBERT_AMX=0 turns the tiles off"
    vector = run(*inputs)
    for name, a, b in zip(["out", "grad_x", "grad_w"], amx, vector):
        assert_close(a, b, 1e-2, name)
    if amx[0].numel() > 100_000 and custom_ops.cpu_capability() != "generic":
        # The two paths sum in different orders, so some of 200k outputs round apart:
        # proof that the tiles ran (small cases may round alike everywhere). The portable
        # kernels add the exact products in the tiles' order (tap, then channel): equal bits.
        assert not torch.equal(amx[0], vector[0])


@requires_compiled
@pytest.mark.parametrize(
    "B, S, H, C, K",
    [(2, 9, 12, 4, 3), (3, 5, 15, 3, 7), (1, 11, 10, 5, 5), (2, 7, 34, 17, 1)],
    ids=["C4K3", "C3K7-longer-than-S", "C5K5", "C17K1"],
)
def test_odd_shapes_float64(B, S, H, C, K, cpu_level):
    # Channel counts that are not lane multiples (padded lanes), K >= S, K = 1.
    x, w, mask, grad_out = make_inputs(B, S, H, C, K, dtype=torch.float64)
    check_against_reference(x, w, mask, grad_out, rtol=1e-12)


@requires_compiled
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("K", [3, 7], ids=["K3-tap-loop", "K7-unrolled"])
def test_gradcheck(masked, K, cpu_level):
    x, w, mask, _ = make_inputs(2, 9, 12, 4, K, dtype=torch.float64, masked=masked)
    x.requires_grad_()
    w.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: grouped_conv1d(a, b, mask), (x, w))


@requires_compiled
def test_mask_padded_positions_contribute_nothing(cpu_level):
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
@pytest.mark.parametrize("rows", ["masked", "packed"])
def test_threads_agree(rows, cpu_level):
    # Big enough that both the convolution and grad-weight's partial sums are shared out.
    if rows == "masked":
        x, w, mask, grad_out = make_inputs(4, 67, 192, 16, 7)
        both = lambda: run(x, w, mask, grad_out)  # noqa: E731
    else:
        x, w, ids, grad_out = packed_inputs(4, 67, 192, 16, 7, torch.float32)
        both = lambda: run_packed(x, w, ids, grad_out)  # noqa: E731
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = both()
    finally:
        torch.set_num_threads(threads)
    for name, a, b in zip(["out", "grad_x", "grad_w"], both(), single):
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
    compiled = torch.compile(grouped_conv1d, fullgraph=True, backend="aot_eager")
    check_against_reference(x, w, mask, grad_out, rtol=1e-5, fn=compiled)


@requires_compiled
@pytest.mark.skipif(len(LEVELS) < 2, reason="this CPU runs only the portable kernels")
def test_levels_agree_and_really_differ(monkeypatch):
    # The library built here gives the same results forced to every lower level. Where
    # avx512 (input-stationary for K = 7) and avx2 (output-stationary) both run, they sum
    # in different orders, so some of the outputs differ in the last bits: proof that
    # each level ran its own kernels.
    inputs = make_inputs(2, 64, 192, 16, 7)
    results = {}
    for level in LEVELS:
        monkeypatch.setenv("GROUPBERT_CPU_CAPABILITY", level)
        results[level] = run(*inputs)
    for level, result in results.items():
        for name, a, b in zip(["out", "grad_x", "grad_w"], result, results[LEVELS[0]]):
            assert_close(a, b, 1e-5, f"{level} vs {LEVELS[0]} {name}")
    if {"avx2", "avx512"} <= set(results):
        assert not torch.equal(results["avx2"][0], results["avx512"][0])



def functions_using(lib) -> dict[str, set[str]]:
    """{demangled function: {"vex", "evex"}} for every function of lib holding AVX (VEX) or
    AVX-512 (EVEX) instructions, from the first opcode byte objdump prints: 0xC4/0xC5 is
    a VEX prefix and 0x62 an EVEX prefix in 64-bit mode."""
    text = subprocess.run(["objdump", "-d", "-C", "-w", str(lib)], capture_output=True, text=True, check=True).stdout
    header = re.compile(r"^[0-9a-f]+ <(.*)>:$")
    insn = re.compile(r"^\s*[0-9a-f]+:\t((?:[0-9a-f]{2} )+)")
    found: dict[str, set[str]] = {}
    function = None
    for line in text.splitlines():
        if m := header.match(line):
            function = m.group(1)
        elif (m := insn.match(line)) and function is not None:
            opcode = [b for b in m.group(1).split() if b not in ("2e", "3e", "26", "36", "64", "65", "67")][:1]
            kind = {"62": "evex", "c4": "vex", "c5": "vex"}.get(opcode[0] if opcode else "")
            if kind:
                found.setdefault(function, set()).add(kind)
    return found


@requires_compiled
@pytest.mark.skipif(not X86, reason="the ISA variants exist on x86-64 only")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_no_avx512_outside_its_variants():
    # One portable build: AVX-512 (EVEX) code only in functions of the avx512,
    # avx512_bf16 and AMX variants, AVX (VEX) code only in those and the avx2 variants.
    # The variants name themselves (namespaces groupbert::{conv,lamb}::{avx2,avx512,
    # avx512_bf16,amx} and groupbert::xent::{avx2,avx512}, their Isa
    # types in every template), so a stray function, such as an inline helper compiled
    # with AVX-512 flags that the linker kept for every caller, is found by name.
    found = functions_using(LIBRARY_PATH)
    # The variants this CPU runs are in the library (a portable-only build has none).
    if "avx512" in LEVELS:
        assert any("avx512::" in f for f, kinds in found.items() if "evex" in kinds), "no AVX-512 variant found"
    if "avx2" in LEVELS:
        assert any("avx2::" in f for f, kinds in found.items() if "vex" in kinds), "no AVX2 variant found"
    if "avx512_bf16" in LEVELS:
        assert any("avx512_bf16::" in f for f, kinds in found.items() if "evex" in kinds), "no AVX512-BF16 variant"
    stray_evex = [f for f, kinds in found.items()
                  if "evex" in kinds and not re.search(r"\b(avx512|avx512_bf16|amx)::", f)]
    stray_vex = [f for f, kinds in found.items()
                 if kinds == {"vex"} and not re.search(r"\b(avx2|avx512|avx512_bf16|amx)::", f)]
    assert not stray_evex, f"AVX-512 instructions outside the AVX-512 variants: {stray_evex[:5]}"
    assert not stray_vex, f"AVX instructions outside the AVX2/AVX-512 variants: {stray_vex[:5]}"


def library_bytes(lib, address: int, n: int) -> bytes:
    """n bytes of lib's image at virtual `address`, as `objdump -s` prints them."""
    text = subprocess.run(["objdump", "-s", f"--start-address={address:#x}", f"--stop-address={address + n:#x}",
                           str(lib)], capture_output=True, text=True, check=True).stdout
    data = b""
    for line in text.splitlines():
        if m := re.match(r"^ ([0-9a-f]+) ((?:[0-9a-f]{2,8} ?){1,4})", line):
            data += bytes.fromhex(m.group(2).replace(" ", ""))
    return data[:n]


@requires_compiled
@pytest.mark.skipif(not X86, reason="the AMX kernels exist on x86-64 only")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_every_tile_configuration_is_the_constant():
    # Issue 51: the AMX kernels filled a local TileConfig and gave it to GCC 12's
    # _tile_loadconfig, whose asm declares an 8-byte operand; the optimizer deleted the
    # stores of rows and bytes per row, every tile had 0 rows and the first TILEZERO raised
    # SIGILL on every AMX CPU. Now every LDTILECFG reads one constant of the library's
    # read-only data; here each is found in the built library and its 64 bytes are read
    # back: palette 1, tiles 0-2 of 16 rows x 64 bytes, everything else 0. Runs wherever
    # the library is built, AMX or not (the old code fails it: its operand is a stack slot).
    text = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", "-w", str(LIBRARY_PATH)],
                          capture_output=True, text=True, check=True).stdout
    loads = [line.strip() for line in text.splitlines() if re.search(r"\bldtilecfg\b", line)]
    assert loads, "no LDTILECFG in the library: were the AMX kernels built?"
    expected = (bytes([1, 0]) + bytes(14) + struct.pack("<16H", *([64] * 3 + [0] * 13))
                + bytes([16] * 3 + [0] * 13))
    for line in loads:
        m = re.search(r"ldtilecfg\s+-?(?:0x)?[0-9a-f]*\(%rip\)\s+# ([0-9a-f]+)", line)
        assert m, f"LDTILECFG reads memory filled at run time, not the constant configuration: {line}"
        config = library_bytes(LIBRARY_PATH, int(m.group(1), 16), 64)
        assert config == expected, f"{line}: the configuration reads {config.hex()}, expected {expected.hex()}"


# --- packed sequences (sequence_ids) --------------------------------------------------------------


def packed_reference(x, w, ids, grad_out):
    """float64 forward and both gradients with sequence ids: every sequence of every row cut
    out and convolved alone by `reference` (zero padded at its ends); rows of id 0 give 0."""
    B, S, H = x.shape
    out, grad_x = np.zeros((B, S, H)), np.zeros((B, S, H))
    grad_w = np.zeros(tuple(w.shape))
    for b in range(B):
        for q in ids[b].unique().tolist():
            if q == 0:
                continue
            rows = (ids[b] == q).nonzero().flatten()
            assert (rows.diff() == 1).all(), "a sequence is a run of consecutive rows"
            o, gx, gw = reference(x[b, rows][None], w, None, grad_out[b, rows][None])
            out[b, rows.numpy()], grad_x[b, rows.numpy()] = o[0], gx[0]
            grad_w += gw
    return out, grad_x, grad_w


def packed_ids(B, S, seed=0):
    """(B, S) ids of packed rows: sequences of 1 to 40 rows (some shorter than K, boundaries
    inside tiles and on their edges), a padding tail, a row of one sequence, a row of padding."""
    rng = np.random.default_rng(seed)
    ids = torch.zeros(B, S, dtype=torch.int64)
    for b in range(B):
        if b == 1:
            ids[b] = 1
            continue
        if b == 3:
            continue
        start, q = 0, 1
        while start < S - (b * 7) % 23:
            length = int(rng.choice([1, 2, 3, 16, 5, 11, 40, 16 - start % 16]))
            ids[b, start : start + length] = q
            start, q = start + length, q + 1
    return ids


def packed_inputs(B, S, H, C, K, dtype, seed=0):
    x, w, _, grad_out = make_inputs(B, S, H, C, K, dtype=dtype, masked=False, seed=seed)
    return x, w, packed_ids(B, S, seed), grad_out


def run_packed(x, w, ids, grad_out, fn=grouped_conv1d):
    return run(x, w, None, grad_out, fn=lambda a, b, _: fn(a, b, None, ids))


@requires_compiled
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.float64, 1e-12)], ids=["fp32", "fp64"])
@pytest.mark.parametrize("C, K", [(16, 7), (4, 3), (32, 9), (5, 5), (8, 1)])
def test_sequence_ids_keep_sequences_apart(dtype, rtol, C, K, cpu_level):
    # Each sequence of a packed row gives what it gives alone, zero padded, in the forward
    # pass and both gradients (grad_w sums over the sequences), at every kernel level.
    x, w, ids, grad_out = packed_inputs(4, 83, 3 * C, C, K, dtype, seed=C + K)
    expected = packed_reference(x, w, ids, grad_out)
    for name, a, e in zip(["out", "grad_x", "grad_w"], run_packed(x, w, ids, grad_out), expected):
        assert a.dtype == dtype
        assert_close(a, torch.from_numpy(e), rtol, f"{cpu_level} C={C} K={K} {name}")


@requires_compiled
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sequence_ids_half_precision_groupbert_shape(dtype, cpu_level):
    x, w, ids, grad_out = packed_inputs(2, 128, 768, 16, 7, dtype)
    for name, a, e in zip(["out", "grad_x", "grad_w"], run_packed(x, w, ids, grad_out),
                          packed_reference(x, w, ids, grad_out)):
        assert a.dtype == dtype
        assert_rounded(a, torch.from_numpy(e), f"{cpu_level} {name}")


@requires_compiled
def test_sequence_ids_wide_bf16_groups_use_our_kernels(cpu_level):
    # bf16, C = 64, K = 7 (a shape the kernel policy may send to torch's convolution):
    # with sequence ids our kernels run, which keep sequences apart.
    x, w, ids, grad_out = packed_inputs(2, 37, 128, 64, 7, torch.bfloat16)
    for name, a, e in zip(["out", "grad_x", "grad_w"], run_packed(x, w, ids, grad_out),
                          packed_reference(x, w, ids, grad_out)):
        assert_rounded(a, torch.from_numpy(e), f"{cpu_level} {name}")


@requires_compiled
def test_sequence_ids_gradcheck_and_opcheck(cpu_level):
    x, w, ids, _ = packed_inputs(3, 21, 12, 4, 5, torch.float64)
    x.requires_grad_()
    w.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: grouped_conv1d(a, b, None, ids), (x, w))
    torch.library.opcheck(torch.ops.groupbert.grouped_conv1d.default, (x.float(), w.float(), None, ids))


@requires_compiled
def test_sequence_ids_other_sequences_and_padding_contribute_nothing(cpu_level):
    x, w, ids, grad_out = packed_inputs(4, 67, 48, 16, 7, torch.float32)
    out, grad_x, grad_w = run_packed(x, w, ids, grad_out)
    noisy = x.clone()
    noisy[ids == 0] = 1e3
    noisy_grad_out = grad_out.clone()
    noisy_grad_out[ids == 0] = 1e3  # outputs at padding are 0: their gradient is ignored
    noisy_out, noisy_grad_x, noisy_grad_w = run_packed(noisy, w, ids, noisy_grad_out)
    assert torch.equal(out, noisy_out) and torch.equal(grad_x, noisy_grad_x) and torch.equal(grad_w, noisy_grad_w)
    assert torch.count_nonzero(out[ids == 0]) == 0 and torch.count_nonzero(grad_x[ids == 0]) == 0
    # One sequence per row (ids = the padding mask) is the masked convolution, away from padding.
    mask = ids[1:2] != 0
    one = run_packed(x[1:2], w, mask.long(), grad_out[1:2])
    masked = run(x[1:2], w, mask, grad_out[1:2])
    assert_close(one[0], masked[0], 1e-6, "one sequence per row: out")
    assert_close(one[2], masked[2], 1e-6, "one sequence per row: grad_w")


@requires_compiled
def test_sequence_ids_torch_compile_traces_through():
    x, w, ids, grad_out = packed_inputs(2, 29, 32, 16, 7, torch.float32)
    compiled = torch.compile(grouped_conv1d, fullgraph=True, backend="aot_eager")
    for name, a, e in zip(["out", "grad_x", "grad_w"], run_packed(x, w, ids, grad_out, fn=compiled),
                          packed_reference(x, w, ids, grad_out)):
        assert_close(a, torch.from_numpy(e), 1e-5, name)


@requires_compiled
@pytest.mark.parametrize("tiles", AMX_TILES)
@pytest.mark.parametrize("B, S, H, K", [(2, 128, 768, 7), (4, 45, 48, 7), (4, 37, 32, 3)])
def test_sequence_ids_bf16_amx(B, S, H, K, tiles, monkeypatch):
    use_amx_tiles(tiles, monkeypatch)
    x, w, ids, grad_out = packed_inputs(B, S, H, 16, K, torch.bfloat16)
    for name, a, e in zip(["out", "grad_x", "grad_w"], run_packed(x, w, ids, grad_out),
                          packed_reference(x, w, ids, grad_out)):
        assert_close(a, torch.from_numpy(e), 1e-2, f"amx {name}")


def test_sequence_ids_fallback_matches_reference(monkeypatch):
    monkeypatch.setattr(sys.modules["custom_ops.grouped_conv1d"], "compiled_available", lambda: False)
    x, w, ids, grad_out = packed_inputs(4, 41, 48, 16, 7, torch.float64)
    for name, a, e in zip(["out", "grad_x", "grad_w"], run_packed(x, w, ids, grad_out),
                          packed_reference(x, w, ids, grad_out)):
        assert_close(a, torch.from_numpy(e), 1e-12, f"fallback {name}")


# --- the Python wrapper and its fallback ------------------------------------------------------


def test_fallback_matches_reference(monkeypatch):
    """Without the compiled library the wrapper runs F.conv1d: same answer, masked."""
    monkeypatch.setattr(sys.modules["custom_ops.grouped_conv1d"], "compiled_available", lambda: False)
    check_against_reference(*make_inputs(2, 19, 48, 16, 7), rtol=1e-5)


@requires_compiled
def test_fallback_matches_compiled():
    x, w, mask, grad_out = make_inputs(2, 33, 96, 16, 7)
    for a, b, name in zip(run(x, w, mask, grad_out), run(x, w, mask, grad_out, _grouped_conv1d_torch),
                          ["out", "grad_x", "grad_w"]):
        assert_close(a, b, 1e-5, name)


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@requires_compiled
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-3)],
                         ids=["fp32", "bf16", "fp16"])
def test_cuda_sequence_ids_match_reference(dtype, rtol):
    if not torch._C._dispatch_has_kernel_for_dispatch_key("groupbert::grouped_conv1d", "CUDA"):
        pytest.skip("libgroupbert_ops.so was built without CUDA kernels")
    x, w, ids, grad_out = packed_inputs(4, 77, 768, 16, 7, dtype)
    expected = packed_reference(x, w, ids, grad_out)
    got = run_packed(*(t.cuda() for t in (x, w, ids, grad_out)))
    for name, a, e in zip(["out", "grad_x", "grad_w"], got, expected):
        assert a.dtype == dtype
        assert_close(a.cpu(), torch.from_numpy(e), rtol, f"cuda {name}")
