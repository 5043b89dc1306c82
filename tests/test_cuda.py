"""The GPU's share of the product, each check beside its CPU counterpart.

Every test takes `device`: "cuda" is marked `gpu` (skipped without a CUDA device,
tests/conftest.py; `make gpu-check` runs it on a lent GPU, docs/gpu.md) and "cpu" runs the
same check on the CPU kernels, so the suite keeps every line of it working where no GPU is.

- GroupedConv1d forward and both gradients, fp32 and bf16, unmasked, masked and with packed
  sequence ids, at GroupBERT-Large's width and at odd shapes, against the float64 numpy
  reference of tests/test_grouped_conv1d.py, on outputs whose memory was poisoned with NaN;
  the same for the Triton kernels on CUDA (also fp16), and bf16 GroupBERT steps through them;
- the fused LAMB and AdamW step of session.optimizers.Lamb (flat buffers, gradient clipping,
  fp32 and bf16 parameters) on the device against the same optimizer on the CPU kernels (on
  the CPU: the compiled kernels against the pure-torch step);
- one training step of a tiny BERT and GroupBERT through TrainingSession in bf16 against the
  same step in fp32 (loss and every gradient within bf16's tolerance); on CUDA the fp32 step
  also equals the CPU's;
- a bf16 step's micro-batches read no value back from the device (no host sync).
"""
from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bert import build_model
from bert.model import no_weight_decay
from custom_ops import library_status, load_library
from custom_ops.grouped_conv1d import grouped_conv1d
from session import SessionOptions
from session.optimizers import AdamW, Lamb
from session.schedules import Schedule
from session.training import OptimizerSpec, TrainingSession
from tests.helpers import assert_close, random_batch, tiny_config
from tests.test_grouped_conv1d import assert_rounded, make_inputs, packed_ids, packed_reference, reference

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def on_devices(values, ids, cuda_only=()):
    """(device, value) parameters: every value on both devices, those in `cuda_only` on CUDA alone."""
    return [pytest.param(device, value, marks=[pytest.mark.gpu] if device == "cuda" else [], id=f"{device}-{ident}")
            for value, ident in zip(values, ids) for device in ("cpu", "cuda")
            if not (device == "cpu" and value in cuda_only)]
requires_ops = pytest.mark.skipif(not load_library(), reason=f"compiled ops unavailable: {library_status()}")


def require_cuda_kernels(device: str, op: str) -> None:
    """A library built without CUDA kernels fails the CUDA tests: they exist to run those kernels."""
    if device == "cuda":
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"groupbert::{op}", "CUDA"), (
            f"libgroupbert_ops.so has no CUDA kernel of {op}: build it against a CUDA torch with nvcc present "
            "(bench/gpu_check.py's build step)")


def poison(device: str) -> None:
    """Leave NaN in the memory the next allocations on `device` reuse, so an output element a
    kernel never writes shows as NaN (the caching allocator hands freed blocks back unwritten)."""
    if device == "cuda":
        blocks = [torch.full((n,), float("nan"), device=device) for n in (2**24, 2**20, 2**16, 2**12)]
        blocks.clear()  # all held at once, then freed: four cached blocks of NaN


def assert_finite(t: torch.Tensor, name: str) -> None:
    bad = ~torch.isfinite(t)
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{name}: {int(bad.sum())} non-finite elements (unwritten or overflowed), first at "
                             f"{first}: {t[first].item()}")


# --- GroupedConv1d ------------------------------------------------------------------------

# (B, S, H, C, K): GroupBERT-Large's width with a sequence that is no multiple of the CUDA
# kernel's 32-row tiles (on CUDA only: tests/test_grouped_conv1d.py covers the CPU kernels at
# GroupBERT's shapes); more channels per group than the 64-channel block holds in one group's
# multiple; few channels and a short kernel; the widest group the kernels take.
LARGE = (2, 203, 1024, 16, 7)
CONV_SHAPES = [LARGE, (2, 45, 96, 32, 9), (3, 33, 60, 4, 3), (1, 70, 128, 64, 5)]


@functools.cache
def conv_case(shape: tuple[int, ...], dtype: torch.dtype, mode: str):
    """Inputs (CPU) and the float64 reference of (out, grad_x, grad_w) on the same rounded values."""
    B, S, H, C, K = shape
    x, w, mask, grad_out = make_inputs(B, S, H, C, K, dtype=dtype, masked=mode == "masked", seed=sum(shape))
    if mode == "packed":
        ids = packed_ids(B, S, seed=sum(shape))
        return (x, w, None, ids, grad_out), packed_reference(x, w, ids, grad_out)
    return (x, w, mask, None, grad_out), reference(x, w, mask, grad_out)


@requires_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["unmasked", "masked", "packed"])
@pytest.mark.parametrize("device, shape", on_devices(CONV_SHAPES, ["x".join(map(str, s)) for s in CONV_SHAPES],
                                                     cuda_only=[LARGE]))
def test_grouped_conv_matches_float64_reference(device, shape, dtype, mode):
    require_cuda_kernels(device, "grouped_conv1d")
    (x, w, mask, ids, grad_out), expected = conv_case(shape, dtype, mode)
    x, w = (t.to(device, copy=True).requires_grad_() for t in (x, w))
    grad_out, mask, ids = (t if t is None else t.to(device) for t in (grad_out, mask, ids))
    poison(device)
    out = grouped_conv1d(x, w, mask, ids)
    out.backward(grad_out)
    for name, got, want in zip(("out", "grad_x", "grad_w"), (out, x.grad, w.grad), expected):
        label = f"{device} {mode} {name}"
        assert got.device.type == device and got.dtype == dtype, f"{label}: {got.device} {got.dtype}"
        assert_finite(got, label)
        # fp32: 1e-5 of the largest value; bf16: within one rounding of the float64 value
        # (the kernels accumulate in fp32 and round each result once).
        assert_rounded(got.cpu(), torch.from_numpy(want), label)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize("shape, dtype, mode", [
    *[(LARGE, dtype, "masked") for dtype in (torch.float32, torch.bfloat16, torch.float16)],
    (LARGE, torch.bfloat16, "unmasked"), (LARGE, torch.bfloat16, "packed"),
    ((3, 33, 60, 4, 3), torch.bfloat16, "masked"), ((3, 33, 60, 4, 3), torch.bfloat16, "packed"),
    ((1, 70, 128, 64, 5), torch.float32, "masked")],
    ids=["large-fp32", "large-bf16", "large-fp16", "large-bf16-unmasked", "large-bf16-packed", "C4-bf16",
         "C4-bf16-packed", "C64-fp32"])
def test_triton_conv_matches_float64_reference_on_the_device(shape, dtype, mode):
    # The Triton kernels (custom_ops/grouped_conv1d_triton.py) as the compiled ones above; on the
    # CPU they run under the interpreter in tests/test_grouped_conv1d_triton.py over more shapes.
    # Eight cases: each new shape, dtype and mode is a compilation of three kernels (seconds each),
    # inside the tests step's share of a lent GPU's minutes.
    (x, w, mask, ids, grad_out), expected = conv_case(shape, dtype, mode)
    x, w = (t.to("cuda", copy=True).requires_grad_() for t in (x, w))
    grad_out, mask, ids = (t if t is None else t.to("cuda") for t in (grad_out, mask, ids))
    poison("cuda")
    out = grouped_conv1d(x, w, mask, ids, implementation="triton")
    out.backward(grad_out)
    for name, got, want in zip(("out", "grad_x", "grad_w"), (out, x.grad, w.grad), expected):
        label = f"triton {mode} {name}"
        assert got.is_cuda and got.dtype == dtype, f"{label}: {got.device} {got.dtype}"
        assert_finite(got, label)
        assert_rounded(got.cpu(), torch.from_numpy(want), label)


@requires_ops
@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_groupbert_trains_through_the_triton_conv_as_through_the_compiled_one(packed):
    """bf16 GroupBERT steps on the device with conv=triton: the losses of conv=compiled (each
    rounds its results once, so the two differ by bf16 roundings only)."""
    from tests.test_grouped_conv1d_triton import losses_by_conv

    losses = losses_by_conv(packed, ("compiled", "triton"), device="cuda", precision="bf16")
    assert_close(torch.tensor(losses["triton"]), torch.tensor(losses["compiled"]), 1e-2, "bf16 losses over 3 steps")


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_add_norm_fusion_equals_the_unfused_ops_on_the_device(autocast):
    # session/add_norm.py's kernels on the GPU (CPU: tests/test_add_norm.py, interpreted), at
    # BERT-Large's width with the sum read on (pre-norm): under CUDA's autocast the norm is float32.
    from tests.test_add_norm import both_ways, inputs

    a, b, gamma, beta = inputs((4, 77, 1024), seed=5)
    if autocast is not None:
        a, b = a.to(autocast), b.to(autocast)
    (fused, fused_grads), (plain, plain_grads) = both_ways(a, b, gamma, beta, True, autocast=autocast, device="cuda")
    assert torch.equal(fused[1], plain[1]) and fused[0].dtype == plain[0].dtype
    assert_close(fused[0].float(), plain[0].float(), 1e-5, "layer norm")
    for name, got, want in zip(("a", "b", "gamma", "beta"), fused_grads, plain_grads):
        assert got.dtype == want.dtype, name
        assert_close(got.float(), want.float(), 1e-5 if autocast is None else 2e-2, f"grad {name}")


# --- fused LAMB / AdamW -------------------------------------------------------------------

# Named as the model names them (no decay and no trust ratio on biases and LayerNorm), sized to
# cross the kernels' chunk boundaries: one tensor spans several 16384-element chunks, others
# are a single element, a row, a vector.
LAMB_SHAPES = [("embeddings.word_embeddings.weight", (301, 130)), ("embeddings.LayerNorm.weight", (130,)),
               ("layer.0.dense.weight", (130, 129)), ("layer.0.dense.bias", (129,)),
               ("layer.0.scale", (1,)), ("layer.1.conv.weight", (130, 16, 7)), ("pooler.bias", (7,))]


def lamb_run(device: str, fused: bool, param_dtype: torch.dtype, trust_ratio: bool, steps: int = 3):
    """Lamb over LAMB_SHAPES on `device` for `steps` steps on seeded gradients (drawn on the CPU,
    the same for every run); returns (parameters, exp_avg, exp_avg_sq, grad norms), on the CPU."""
    gen = torch.Generator().manual_seed(0)
    named = [(name, torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.05).to(device)))
             for name, shape in LAMB_SHAPES]
    rule, own = (Lamb, {"max_trust_ratio": 5.0}) if trust_ratio else (AdamW, {})
    opt = rule(named, lr=0.01, weight_decay=0.01, max_grad_norm=2.0, **own, param_dtype=param_dtype, fused=fused,
               seed=11, no_decay=no_weight_decay)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        grads = torch.randn(opt.flat_grads.numel(), generator=torch.Generator().manual_seed(100 + step))
        opt.flat_grads.copy_(grads * (0.05 if step % 2 else 0.02))  # clipped on odd steps (norm > 2)
        opt.step()
        assert not opt.skipped
        norms.append(opt.grad_norm)
    return opt.flat_params.float().cpu(), opt.exp_avg.cpu(), opt.exp_avg_sq.cpu(), torch.tensor(norms)


@requires_ops
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("trust_ratio", [True, False], ids=["lamb", "adamw"])
def test_fused_lamb_matches_the_cpu_kernel(device, param_dtype, trust_ratio):
    require_cuda_kernels(device, "lamb_stage1")
    got = lamb_run(device, fused=True, param_dtype=param_dtype, trust_ratio=trust_ratio)
    # On CUDA the reference is the compiled CPU kernel; on the CPU, the pure-torch step.
    want = lamb_run("cpu", fused=device != "cpu", param_dtype=param_dtype, trust_ratio=trust_ratio)
    params, exp_avg, exp_avg_sq, norms = got
    for name, t in zip(("params", "exp_avg", "exp_avg_sq", "grad norms"), got):
        assert_finite(t, f"{device} {name}")
    assert_close(norms, want[3], 1e-6, f"{device} global gradient norms")
    assert_close(exp_avg, want[1], 1e-6, f"{device} exp_avg")
    assert_close(exp_avg_sq, want[2], 1e-6, f"{device} exp_avg_sq")
    if param_dtype == torch.float32:
        assert_close(params, want[0], 1e-6, f"{device} fp32 parameters")
    else:
        # bf16 parameters are rounded stochastically from the same bits of (seed, element) on both
        # sides: equal, except where the fp32 values differ in their last place and the rounding
        # flips; such an element is one bf16 step (2^-8 relative, at most 2^-7) away.
        step = torch.finfo(torch.bfloat16).eps * want[0].abs()
        excess = (params - want[0]).abs() - step - 1e-30
        i = int(excess.argmax())
        assert excess[i] <= 0, f"{device} bf16 parameter {i}: {params[i].item()} vs {want[0][i].item()}"
        assert (params != want[0]).float().mean() < 1e-3, "bf16 parameters: more than 0.1 % differ"


# --- a training step in bf16 against fp32 --------------------------------------------------


def training_step(architecture: str, device: str, precision: str):
    """Two steps of a tiny model through TrainingSession; the losses and the gradients of the
    first step by weight name (read from the flat gradient buffer before the optimizer step
    turns it into the update)."""
    cfg = tiny_config(architecture)
    batch = random_batch(cfg, 4, seed=1, pad_from=3)  # padding tails: masks in attention and the conv
    session = TrainingSession(
        build_model(cfg, seed=0).builder.model_proto(),
        optimizer=OptimizerSpec(kind="lamb", schedule=Schedule(1e-3, 0, 10**9, decay="constant")),
        options=SessionOptions(device=device, precision=precision, kernels={"graph": "eager"}), seed=0)
    grads: list[torch.Tensor] = []
    step = session.optimizer.step

    def capture(*args, **kwargs):
        grads.append(session.optimizer.flat_grads.detach().float().cpu().clone())
        return step(*args, **kwargs)

    session.optimizer.step = capture
    losses = [session.run(batch)["loss"] for _ in range(2)]
    layout = session.optimizer.layout
    by_name = {name: grads[0][start : start + n] for name, start, n in zip(layout.names, layout.starts, layout.numels)}
    return losses, by_name, session.policy


@requires_ops
@pytest.mark.gpu
def test_the_graph_choice_times_both_programs_on_the_device(tmp_path, monkeypatch):
    """graph=measure on CUDA (its default once this passes on a GPU): the first step of a long run
    compiles the program and captures it as CUDA graphs, all three agree, the fastest is kept and
    cached, and training goes on finite."""
    monkeypatch.setenv("GROUPBERT_KERNEL_CACHE", str(tmp_path / "choices.json"))
    require_cuda_kernels("cuda", "grouped_conv1d")
    cfg = tiny_config("groupbert", hidden_dropout=0.1)
    batch = random_batch(cfg, 4, seed=1, pad_from=3)
    proto = build_model(cfg, seed=0).builder.model_proto()
    spec = OptimizerSpec(kind="lamb", schedule=Schedule(1e-3, 0, 10**9, decay="constant"))
    options = SessionOptions(device="cuda", precision="bf16", kernels={"graph": "measure"})
    session = TrainingSession(proto, optimizer=spec, options=options, seed=0)
    assert session.policy.graph == "measure"
    losses = [session.run(batch)["loss"] for _ in range(3)]
    (note,) = session.notes
    assert session.policy.graph in ("eager", "compiled", "cudagraphs") and " measured " in note, note
    assert "failed here" not in note and "disagreed" not in note, note
    assert all(f"than {mode}" in note for mode in ("eager", "compiled", "cudagraphs")
               if mode != session.policy.graph), note
    assert np.isfinite(losses).all(), losses
    again = TrainingSession(proto, optimizer=spec, options=options, seed=0)
    again.run(batch)
    assert again.policy.graph == session.policy.graph and again.notes[0].endswith("(cached)"), again.notes


@requires_ops
@pytest.mark.gpu
def test_auto_micro_batch_predicts_the_allocators_peak_on_the_device():
    """batch.micro_batch_size auto on CUDA (bert/run/fit.py): the peak fitted from steps at 1
    and 2 rows predicts a step's at 16 rows within 10 %, and the micro batch chosen under a
    limit between 8 and 16 rows' peaks is 8."""
    from bert import config_from_dict
    from bert.run.fit import fit_micro_batch, measure_memory
    from bert.tasks.pretraining import make_session

    require_cuda_kernels("cuda", "grouped_conv1d")
    raw = {"name": "fit", "data": {"source": "synthetic"}, "precision": {"dtype": "bf16"},
           "model": dict(architecture="groupbert", hidden_size=256, num_layers=2, num_heads=4, vocab_size=1000,
                         sequence_length=128, max_predictions=20),
           "training": {"device": "cuda", "steps": 4, "kernels": {"graph": "eager"}}}
    fit = measure_memory(config_from_dict({**raw, "batch": {"micro_batch_size": 1}}), torch.device("cuda"),
                         make_session)
    at_16 = measure_memory(config_from_dict({**raw, "batch": {"micro_batch_size": 1}}), torch.device("cuda"),
                           make_session, rows=(16,))
    assert "CUDA allocator" in fit.how and fit.per_row > 0
    assert fit.peak(16) == pytest.approx(at_16.peak(16), rel=0.10), (fit, at_16)
    limit_gib = (fit.peak(8) + fit.peak(16)) / 2 / 2**30
    auto = config_from_dict({**raw, "batch": {"micro_batch_size": "auto", "global_batch_size": 32,
                                              "auto_memory_gib": limit_gib}})
    fitted, line = fit_micro_batch(auto, 1, None, make_session)
    assert (fitted.batch.micro_batch_size, fitted.batch.gradient_accumulation) == (8, 4), line


@requires_ops
@pytest.mark.gpu
def test_cuda_graphs_train_and_evaluate_as_the_eager_program():
    """graph=cudagraphs (torch.compile's reduce-overhead mode): two micro-batches a step, three
    steps, the losses within bf16's tolerance of the eager program's; an evaluation's micro-batches
    each keep their own figures (a replay writes over the last one's outputs)."""
    require_cuda_kernels("cuda", "grouped_conv1d")
    cfg = tiny_config("groupbert", hidden_dropout=0.0, attention_dropout=0.0)
    batch = random_batch(cfg, 8, seed=1, pad_from=3)
    proto = build_model(cfg, seed=0).builder.model_proto()
    spec = OptimizerSpec(kind="lamb", schedule=Schedule(1e-3, 0, 10**9, decay="constant"))

    def session(graph: str) -> TrainingSession:
        options = SessionOptions(device="cuda", precision="bf16", gradient_accumulation=2, kernels={"graph": graph})
        return TrainingSession(proto, optimizer=spec, options=options, seed=0)

    eager, graphs = session("eager"), session("cudagraphs")
    assert graphs.policy.graph == "cudagraphs"
    for _ in range(3):
        want, got = eager.run(batch)["loss"], graphs.run(batch)["loss"]
        assert got == pytest.approx(want, rel=2e-2), (got, want)
    outputs = ["mlm_loss", "nsp_loss"]
    want, got = eager.evaluate(batch, outputs, microbatches=2), graphs.evaluate(batch, outputs, microbatches=2)
    for name in outputs:
        w, g = [float(t) for t in want[name]], [float(t) for t in got[name]]
        assert g == pytest.approx(w, rel=3e-2), (name, g, w)
        assert g[0] != g[1], (name, g)  # two micro-batches, two figures


@pytest.mark.gpu
def test_a_batch_the_gpu_cannot_hold_ends_in_one_line_naming_the_batch_keys(tmp_path, capsys):
    from tests.tiny_runs import bert_cli

    root = Path(__file__).resolve().parents[1]
    torch.cuda.set_per_process_memory_fraction(0.002)  # about 0.3 GiB of an 80-140 GiB GPU
    try:
        code = bert_cli()(["train", "--config", str(root / "configs" / "demo.json"), "--training.device", "cuda",
                           "--data.directory", str(root / "demo_data"), "--batch.micro_batch_size", "4096",
                           "--training.steps", "1", "--schedule.warmup_steps", "0",
                           "--training.output_dir", str(tmp_path / "run")])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    err = capsys.readouterr().err
    assert code == 2 and "error: out of device memory (" in err and "batch.micro_batch_size auto" in err, err
    assert "internal error" not in err


def assert_gradients_close(got: dict, want: dict, rtol: float, global_share: float, label: str) -> float:
    """Per tensor ‖got − want‖ ≤ rtol·‖want‖ + global_share·‖all of want‖ (the second term for
    tensors whose gradient is rounding noise: an attention key bias, which softmax cancels, is 0
    in exact arithmetic); returns the relative error over all tensors."""
    total = torch.cat(list(want.values())).norm().item()
    for name, w in want.items():
        err, size = (got[name] - w).norm().item(), w.norm().item()
        assert err <= rtol * size + global_share * total, (
            f"{label}: gradient of {name}: |diff| {err:.3e} > {rtol} x |grad| {size:.3e} + {global_share} x "
            f"|all grads| {total:.3e}")
    return (torch.cat(list(got.values())) - torch.cat(list(want.values()))).norm().item() / total


@requires_ops
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("architecture", ["bert", "groupbert"])
def test_bf16_training_step_matches_fp32(device, architecture):
    require_cuda_kernels(device, "grouped_conv1d")
    check_bf16_step(device, architecture)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("architecture", ["bert", "groupbert"])
def test_a_training_steps_micro_batches_read_nothing_back_from_the_device(device, architecture):
    """Forward and backward of a bf16 step's micro-batches read no value back (`.item()`, a
    data-dependent branch): on a GPU each read stops the host until the device's queue has
    drained, and GroupBERT's convolution checked its mask so twice per layer and micro-batch.
    On CUDA, torch's sync debug mode fails the step at any sync; on both devices no op that
    reads a value (`_local_scalar_dense`, `nonzero`, `is_nonzero`, `equal`) runs. The feeds are
    checked and copied before, the optimizer (whose gradient norm decides a skip) after."""
    from torch.profiler import ProfilerActivity, profile

    require_cuda_kernels(device, "grouped_conv1d")
    cfg = tiny_config(architecture)
    session = TrainingSession(build_model(cfg, seed=3).builder.model_proto(),
                              options=SessionOptions(precision="bf16", gradient_accumulation=2, device=device))
    batch = random_batch(cfg, 4, seed=1, pad_from=7)
    session.run(batch)  # warm-up
    feeds = session._feeds(batch, session.executor.input_names)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:  # sees the ops a compiled op calls too
            session.executor.train_step(feeds, 1.0)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    reads = [e.name for e in prof.events()
             if e.name in ("aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::equal")]
    assert not reads, reads


@pytest.mark.gpu
def test_a_float_mask_that_is_not_0_or_1_fails_on_the_device_without_a_read_back():
    """On a GPU the compiled convolution checks a float mask on the device (a device-side
    assert, no host sync): a 0.5 still fails, at the next synchronisation. In a child process:
    a device-side assert leaves its CUDA context unusable."""
    code = ("import torch, custom_ops; from custom_ops.grouped_conv1d import grouped_conv1d; "
            "x = torch.randn(2, 8, 32, device='cuda'); w = torch.randn(32, 16, 7, device='cuda'); "
            "m = torch.ones(2, 8, device='cuda'); m[1, 3] = 0.5; "
            "y = grouped_conv1d(x, w, m); torch.cuda.synchronize(); print('no error')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode != 0 and "no error" not in done.stdout, done.stdout + done.stderr[-2000:]
    assert "device-side assert" in done.stderr or "mask must hold only 0 and 1" in done.stderr, done.stderr[-2000:]


@requires_ops
def test_bf16_groupbert_step_on_emulated_amx_tiles(monkeypatch):
    # The test that aborted `make test-fast` on AMX Xeons (issue 51: SIGILL in the AMX
    # convolution), through the AMX kernels' code on tiles emulated in C++, on any CPU.
    monkeypatch.setenv("GROUPBERT_AMX", "emulate")
    assert torch.ops.groupbert.amx_state().startswith("emulated")
    check_bf16_step("cpu", "groupbert")


def check_bf16_step(device: str, architecture: str) -> None:
    """Two bf16 steps against fp32: losses to 0.5 %, gradients to bf16's tolerance."""
    losses32, grads32, _ = training_step(architecture, device, "fp32")
    losses16, grads16, policy = training_step(architecture, device, "bf16")
    assert policy.device == device and policy.precision == "bf16"
    for step, (a, b) in enumerate(zip(losses16, losses32), 1):
        assert np.isfinite(a) and abs(a - b) <= 5e-3 * abs(b), f"{device} step {step}: bf16 loss {a} vs fp32 {b}"
    # bf16 matmuls with fp32 accumulation: about 0.5 % of the gradient over all tensors (measured
    # on the CPU: 0.44 % BERT, 0.46 % GroupBERT), at most 1.1 % on any tensor of real size.
    overall = assert_gradients_close(grads16, grads32, 5e-2, 2e-3, f"{device} bf16 vs fp32")
    assert overall <= 2e-2, f"{device}: bf16 gradients {overall:.2e} from fp32 over all tensors"
    # And bf16 really ran: autocast left out would give fp32's gradients to rounding.
    assert overall > 1e-4, f"{device}: bf16 gradients equal fp32's ({overall:.1e}): autocast did not run"
    if device != "cpu":
        losses_cpu, grads_cpu, _ = training_step(architecture, "cpu", "fp32")
        for a, b in zip(losses32, losses_cpu):
            assert abs(a - b) <= 1e-5 * abs(b), f"fp32 loss on {device} {a} vs the CPU's {b}"
        assert_gradients_close(grads32, grads_cpu, 1e-3, 1e-5, f"fp32 {device} vs cpu")


# --- the fine-tuning jobs -------------------------------------------------------------------

LABELLED = Path(__file__).resolve().parents[1] / "data" / "samples" / "labelled"
FINE_TUNING = {  # the shipped demo sets (data/samples/labelled/README.md)
    "classification": {"train_file": "sotu_era_train.tsv", "dev_file": "sotu_era_dev.tsv",
                       "text_columns": ["sentence"], "label_column": "era"},
    "pairs": {"train_file": "sotu_next_train.tsv", "dev_file": "sotu_next_dev.tsv",
              "text_columns": ["sentence1", "sentence2"], "label_column": "label"},
    "regression": {"train_file": "sotu_era_train.tsv", "dev_file": "sotu_era_dev.tsv",
                   "text_columns": ["sentence"], "label_column": "year"},
    "tokens": {"train_file": "sotu_entities_train.conll", "dev_file": "sotu_entities_dev.conll"},
}


def demo_vocab(directory: Path) -> Path:
    """A word-level vocab of the demo sets' 400 most frequent lower-cased words (the rest [UNK])."""
    from collections import Counter

    counts = Counter(word for path in sorted(LABELLED.glob("*_train.*"))
                     for word in path.read_text().lower().replace("\t", " ").split())
    words = [w for w, _ in counts.most_common() if w.isalpha()][:400]
    path = directory / "vocab.txt"
    path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    return path


def fine_tuning_run(tmp_path: Path, job: str, device: str, precision: str, packed: bool) -> tuple[list[float], dict]:
    """A tiny GroupBERT (the compiled grouped convolution) fine-tuned from random weights for 4
    steps on a shipped demo set, on `device` in `precision`, its rows packed or one per row: its
    losses and its dev figures."""
    from bert.tasks.labelled import fine_tune
    from bert.config import config_from_dict

    vocab = demo_vocab(tmp_path)
    data = {key: str(LABELLED / value) if key.endswith("_file") else value for key, value in FINE_TUNING[job].items()}
    output_dir = tmp_path / f"{job}-{device}-{precision}-{'packed' if packed else 'padded'}"
    config = config_from_dict({
        "version": 2, "name": job,
        "model": {"architecture": "groupbert", "task": "classification" if job == "pairs" else job,
                  "hidden_size": 32, "num_layers": 2, "num_heads": 2, "vocab_size": 405, "sequence_length": 64,
                  "max_positions": 64, "packed": packed},
        "data": {**data, "vocab_file": str(vocab)},
        "training": {"steps": 4, "device": device, "output_dir": str(output_dir), "log_every": 1},
        "precision": {"dtype": precision},
        "optimizer": {"name": "adamw", "learning_rate": 3e-3},
        "batch": {"micro_batch_size": 16}})
    result = fine_tune(config, progress=False)
    return [r["loss"] for r in result.metrics if "loss" in r], json.loads((output_dir / "eval_results.json").read_text())


@requires_ops
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("job", list(FINE_TUNING))
def test_fine_tuning_jobs_run_on_the_device(tmp_path, device, job, packed):
    """Each labelled fine-tuning job (bert/tasks/labelled.py) whole on `device`, one row per sequence or
    packed (a step's row count varies): the batches, labels and heads placed there, the dev
    figures computed from its logits. bf16 stays within its tolerance of fp32; on CUDA, fp32
    equals the CPU's run (losses and dev figures)."""
    require_cuda_kernels(device, "grouped_conv1d")
    losses32, figures32 = fine_tuning_run(tmp_path, job, device, "fp32", packed)
    losses16, figures16 = fine_tuning_run(tmp_path, job, device, "bf16", packed)
    assert len(losses32) == len(losses16) == 4 and figures32.keys() == figures16.keys()
    for step, (a, b) in enumerate(zip(losses16, losses32), 1):
        assert np.isfinite(a) and abs(a - b) <= 2e-2 * abs(b), f"{device} {job} step {step}: bf16 {a} vs fp32 {b}"
    assert losses16 != losses32, f"{device} {job}: bf16 losses equal fp32's: autocast did not run"
    metric = "pearson" if job == "regression" else "f1" if job == "tokens" else "accuracy"
    assert figures16[metric] is not None and figures32[metric] is not None, (figures32, figures16)
    if device != "cpu":
        losses_cpu, figures_cpu = fine_tuning_run(tmp_path, job, "cpu", "fp32", packed)
        # Four AdamW steps apart, fp32 on two devices: reduction orders differ, nothing else.
        np.testing.assert_allclose(losses32, losses_cpu, rtol=1e-4, err_msg=f"{job}: fp32 on {device} vs the CPU")
        for name, value in figures_cpu.items():
            assert figures32[name] == pytest.approx(value, rel=1e-3, abs=1e-3), (name, figures32, figures_cpu)
