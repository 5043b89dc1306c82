"""Faults in the custom ops: bad inputs to the grouped convolution and the fused LAMB step,
on every path (compiled op, Python wrapper, pure-torch fallback), each answered by a
ValueError that names the culprit; and fp16 GroupBERT training, which used to fail in the
compiled conv (issue 10). Each test fails if its protection is removed: without the check
the input either runs (silently wrong) or dies with an error that names nothing.
"""
from __future__ import annotations

import sys

import pytest
import torch

from custom_ops import lamb, library_status, load_library
from custom_ops.grouped_conv1d import grouped_conv1d

requires_ops = pytest.mark.skipif(not load_library(), reason=f"compiled ops unavailable: {library_status()}")

# --- GroupedConv1d --------------------------------------------------------------------------

X_SHAPE = (2, 5, 32)  # (B, S, H)


def conv_inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*X_SHAPE, generator=gen).to(dtype)
    w = torch.randn(32, 16, 7, generator=gen).to(dtype)
    mask = torch.ones(2, 5, dtype=dtype)
    mask[1, 3:] = 0
    return x, w, mask


def compiled_forward(x, w, mask, sequence_ids=None):
    return torch.ops.groupbert.grouped_conv1d(x, w, mask, sequence_ids)


def compiled_backward(x, w, mask, sequence_ids=None):
    return torch.ops.groupbert.grouped_conv1d_backward(torch.ones_like(x), x, w, mask, [True, True], sequence_ids)


CONV_PATHS = [
    pytest.param(compiled_forward, id="compiled-forward", marks=requires_ops),
    pytest.param(compiled_backward, id="compiled-backward", marks=requires_ops),
    pytest.param("fallback", id="fallback"),
]


def conv_path(path, monkeypatch):
    """The callable for a path; "fallback" is the wrapper with the library hidden."""
    if path == "fallback":
        monkeypatch.setattr(sys.modules["custom_ops.grouped_conv1d"], "compiled_available", lambda: False)
        return sys.modules["custom_ops.grouped_conv1d"].grouped_conv1d
    return path


@pytest.mark.parametrize("path", CONV_PATHS)
@pytest.mark.parametrize("value", [0.5, 2.0, -1.0])
def test_conv_mask_other_than_0_or_1_is_an_error(path, value, monkeypatch):
    # The kernels skip masked rows; they used to read 0.5 as 1 while the fallback
    # multiplied by it. Now every path refuses, naming the value and where it is.
    fn = conv_path(path, monkeypatch)
    x, w, mask = conv_inputs()
    mask[1, 2] = value
    with pytest.raises(ValueError, match=rf"mask must hold only 0 and 1.*found {value:g} at \(b, s\) = \(1, 2\)"):
        fn(x, w, mask)


@requires_ops
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_conv_mask_check_at_wide_bf16_groups(backward):
    # bf16 with 64 channels per group and K = 7 (a shape the kernel policy sends to
    # torch's convolution on some CPUs, session/kernels.py): the compiled op checks alike.
    x = torch.randn(2, 5, 128).bfloat16()
    w = torch.randn(128, 64, 7).bfloat16()
    mask = torch.ones(2, 5, dtype=torch.bfloat16)
    mask[0, 4] = 0.5
    fn = compiled_backward if backward else compiled_forward
    with pytest.raises(ValueError, match=r"found 0.5 at \(b, s\) = \(0, 4\)"):
        fn(x, w, mask)


@pytest.mark.parametrize("path", CONV_PATHS)
def test_conv_mask_of_0_and_1_in_x_dtype_is_accepted(path, monkeypatch):
    # The other side of the check: the graph passes its 0/1 mask in x's dtype.
    fn = conv_path(path, monkeypatch)
    x, w, mask = conv_inputs()
    fn(x, w, mask)


@pytest.mark.parametrize("path", CONV_PATHS)
@pytest.mark.parametrize("case, weight_shape, pattern", [
    ("even-K", (32, 16, 6), r"32, 16, 6.*odd|odd.*32, 16, 6"),
    ("H-mismatch", (48, 16, 7), r"\(?48, 16, 7.*\(?2, 5, 32"),
    ("C-not-dividing-H", (32, 5, 7), r"\(?32, 5, 7"),
    ("C-zero", (32, 0, 7), r"\(?32, 0, 7"),  # the wrapper divided by it (ZeroDivisionError)
    ("weight-not-3d", (32, 16), r"weight.*\(?32, 16\)?"),
], ids=lambda v: v if isinstance(v, str) and "-" in v else None)
def test_conv_bad_weight_names_both_shapes(path, case, weight_shape, pattern, monkeypatch):
    fn = conv_path(path, monkeypatch)
    x, _, mask = conv_inputs()
    with pytest.raises(ValueError, match=pattern):
        fn(x, torch.randn(*weight_shape), mask)


@pytest.mark.parametrize("compiled", [pytest.param(True, id="compiled", marks=requires_ops),
                                      pytest.param(False, id="fallback")])
@pytest.mark.parametrize("rows", ["mask", "sequence_ids", "none"])
@pytest.mark.parametrize("b, s, h, c", [(2, 5, 0, 4), (2, 0, 32, 16), (0, 5, 32, 16)],
                         ids=["0-channels", "0-positions", "0-rows"])
def test_conv_with_nothing_to_convolve_is_empty_alike_on_every_path(b, s, h, c, rows, compiled):
    """The compiled op returns an empty output (and zero gradients) for 0 channels, positions or
    rows; torch's convolution refused them ("non-positive groups is not supported", a kernel
    longer than the input): the fallback answers as the compiled op does."""
    x = torch.randn(b, s, h, requires_grad=True)
    w = torch.randn(h, c, 7, requires_grad=True)
    extra = {"mask": (torch.ones(b, s), None), "sequence_ids": (None, torch.ones(b, s, dtype=torch.int64)),
             "none": (None, None)}[rows]
    y = grouped_conv1d(x, w, *extra, implementation="compiled" if compiled else "torch")
    assert y.shape == x.shape and y.dtype == x.dtype
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("path", CONV_PATHS)
def test_conv_x_not_3d(path, monkeypatch):
    fn = conv_path(path, monkeypatch)
    _, w, _ = conv_inputs()
    with pytest.raises(ValueError, match=r"x must be \(B, S, H\).*\(?10, 32"):
        fn(torch.randn(10, 32), w, None)


@pytest.mark.parametrize("path", CONV_PATHS)
def test_conv_mask_shape_names_both_shapes(path, monkeypatch):
    fn = conv_path(path, monkeypatch)
    x, w, _ = conv_inputs()
    with pytest.raises(ValueError, match=r"mask must be \(B, S\) = \(2, 5\).*\(?2, 4"):
        fn(x, w, torch.ones(2, 4, dtype=torch.bool))


@pytest.mark.parametrize("path", CONV_PATHS)
def test_conv_integer_mask_names_its_dtype(path, monkeypatch):
    fn = conv_path(path, monkeypatch)
    x, w, _ = conv_inputs()
    with pytest.raises(ValueError, match=r"mask must be bool or .*(Long|int64)"):
        fn(x, w, torch.ones(2, 5, dtype=torch.int64))


@pytest.mark.parametrize("path", CONV_PATHS)
def test_conv_weight_dtype_differs_from_x(path, monkeypatch):
    fn = conv_path(path, monkeypatch)
    x, w, _ = conv_inputs()
    with pytest.raises(ValueError, match=r"weight dtype .*(Double|float64).* differs from x dtype"):
        fn(x, w.double(), None)


@pytest.mark.parametrize("path", CONV_PATHS)
def test_conv_integer_x_names_its_dtype(path, monkeypatch):
    fn = conv_path(path, monkeypatch)
    _, w, _ = conv_inputs()
    x = torch.ones(*X_SHAPE, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"x must be float32, float64, bfloat16 or float16, got .*(Int|int32)"):
        fn(x, w.to(torch.int32), None)


@requires_ops
def test_conv_too_many_channels_per_group_names_the_limit():
    # The kernels hold a group's channels in registers: C > 64 is refused, not mis-run.
    from custom_ops.grouped_conv1d import MAX_CHANNELS_PER_GROUP

    x = torch.randn(1, 3, 130)
    with pytest.raises(ValueError, match=rf"at most {MAX_CHANNELS_PER_GROUP} channels per group.*\[130, 65, 3\]"):
        torch.ops.groupbert.grouped_conv1d(x, torch.randn(130, 65, 3), None)


@pytest.mark.parametrize("path", CONV_PATHS)
def test_conv_sequence_ids_are_checked(path, monkeypatch):
    # Packed sequence ids: int64 (B, S), and never together with a mask (which would say
    # twice, perhaps differently, where the padding is).
    fn = conv_path(path, monkeypatch)
    x, w, mask = conv_inputs()
    ids = torch.ones(2, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match="either mask or sequence_ids, not both"):
        fn(x, w, mask, ids)
    with pytest.raises(ValueError, match=r"sequence_ids must be int64, got .*[Ii]nt.*; pass sequence_ids.long\(\)"):
        fn(x, w, None, ids.int())
    with pytest.raises(ValueError, match=r"sequence_ids must be \(B, S\) = \(?2, 5\)?, got .*3"):
        fn(x, w, None, torch.ones(2, 3, dtype=torch.int64))


@requires_ops
def test_conv_backward_grad_out_must_match_x():
    x, w, mask = conv_inputs()
    with pytest.raises(ValueError, match=r"grad_out \[2, 5, 31\].*must match x \[2, 5, 32\]"):
        torch.ops.groupbert.grouped_conv1d_backward(torch.ones(2, 5, 31), x, w, mask, [True, True])


@requires_ops
def test_unknown_cpu_capability_names_the_variable(monkeypatch):
    monkeypatch.setenv("GROUPBERT_CPU_CAPABILITY", "avx3")
    x, w, mask = conv_inputs()
    with pytest.raises(ValueError, match=r"GROUPBERT_CPU_CAPABILITY=avx3 is not a kernel level: use generic, avx2 or"):
        torch.ops.groupbert.grouped_conv1d(x, w, mask)
    with pytest.raises(ValueError, match="GROUPBERT_CPU_CAPABILITY=avx3"):
        torch.ops.groupbert.cpu_capability()


@pytest.mark.parametrize("path", [pytest.param("compiled", marks=requires_ops), "fallback"])
def test_conv_runs_fp16(path, monkeypatch):
    # fp16 used to be refused by the compiled op ("x must be float32, float64 or bfloat16").
    if path == "fallback":
        monkeypatch.setattr(sys.modules["custom_ops.grouped_conv1d"], "compiled_available", lambda: False)
    x, w, mask = conv_inputs(torch.float16)
    x.requires_grad_()
    out = grouped_conv1d(x, w, mask)
    out.float().sum().backward()
    expected = torch.nn.functional.conv1d((x * mask[..., None]).double().transpose(1, 2), w.double(), padding=3,
                                          groups=2).transpose(1, 2)
    assert out.dtype == torch.float16 and x.grad.dtype == torch.float16
    assert (out.double() - expected).abs().max() <= 2e-3 * expected.abs().max()


def test_groupbert_trains_in_fp16():
    # Issue 10: `precision.dtype: fp16` failed inside the compiled conv. A tiny
    # GroupBERT now trains in fp16 with dynamic loss scaling, close to its fp32 run.
    from bert import build_model
    from session import SessionOptions
    from session.schedules import Schedule
    from session.training import OptimizerSpec, TrainingSession
    from tests.helpers import random_batch, tiny_config

    cfg = tiny_config("groupbert")
    batch = random_batch(cfg, 8, pad_from=3)

    def losses(**options):
        spec = OptimizerSpec(kind="lamb", schedule=Schedule(0.03, 0, 10, decay="constant"))
        session = TrainingSession(build_model(cfg).builder.model_proto(), optimizer=spec,
                                  options=SessionOptions(**options))
        return [session.run(batch)["loss"] for _ in range(15)]

    fp32, fp16 = losses(), losses(precision="fp16", loss_scaling="dynamic")
    assert all(torch.isfinite(torch.tensor(fp16))), fp16
    assert fp16[-1] < 0.8 * fp16[0], f"fp16 GroupBERT did not learn: {fp16}"
    assert abs(fp16[-1] - fp32[-1]) < 0.05 * fp32[-1], f"fp16 {fp16[-1]:.4f} vs fp32 {fp32[-1]:.4f}"


# --- fused LAMB -------------------------------------------------------------------------------
# The compiled ops and the pure-torch fallbacks check the same conditions in the same
# order (csrc/fused_lamb.cpp, custom_ops/lamb.py): each bad input is a ValueError naming
# the culprit on both paths.

LAMB_PATHS = [pytest.param("compiled", marks=requires_ops), "fallback"]
LENGTHS = [5, 3]
TOTAL = sum(LENGTHS)


def lamb_ops(path):
    if path == "compiled":
        return torch.ops.groupbert.lamb_sq_norms, torch.ops.groupbert.lamb_stage1, torch.ops.groupbert.lamb_stage2
    return lamb.lamb_sq_norms_fallback, lamb.lamb_stage1_fallback, lamb.lamb_stage2_fallback


def good_stage1_args():
    return dict(param=torch.randn(TOTAL), grad=torch.randn(TOTAL), exp_avg=torch.zeros(TOTAL),
                exp_avg_sq=torch.zeros(TOTAL), segments=torch.tensor([0, 5, 8]),
                weight_decay=torch.tensor([0.01, 0.0]), beta1=0.9, beta2=0.999, eps=1e-6, step=1, grad_scale=1.0)


def good_stage2_args():
    return dict(param=torch.randn(TOTAL), update=torch.randn(TOTAL), segments=torch.tensor([0, 5, 8]),
                norms=torch.ones(2, 2), use_trust_ratio=torch.tensor([True, False]), lr=0.01, max_trust_ratio=0.0,
                seed=0)


BAD_SEGMENTS = [
    ("first-offset-not-0", torch.tensor([1, 5, 8]), r"`segments\[0\]` must be 0, got 1"),
    ("decreasing", torch.tensor([0, 6, 5, 8]), r"non-decreasing, but segments\[2\] = 5 < segments\[1\] = 6"),
    ("end-short-of-buffer", torch.tensor([0, 5, 7]), r"segment table covers 7 elements but the buffers hold 8"),
    ("end-past-buffer", torch.tensor([0, 5, 9]), r"segment table covers 9 elements but the buffers hold 8"),
    ("int32", torch.tensor([0, 5, 8], dtype=torch.int32), r"`segments` must be a contiguous int64 1-D tensor"),
    ("2-d", torch.tensor([[0, 5, 8]]), r"`segments` must be a contiguous int64 1-D tensor"),
    ("empty", torch.zeros(0, dtype=torch.int64), r"`segments` must be a contiguous int64 1-D tensor"),
]


@pytest.mark.parametrize("path", LAMB_PATHS)
@pytest.mark.parametrize("segments, pattern", [pytest.param(s, p, id=i) for i, s, p in BAD_SEGMENTS])
def test_lamb_bad_segment_table_in_stage1(path, segments, pattern):
    # Without the check a bad table reads or writes past a segment (compiled) or fails in
    # torch.split with no word about the table (fallback), or splits the wrong tensors.
    _, stage1, _ = lamb_ops(path)
    args = good_stage1_args()
    args["segments"] = segments
    before = args["param"].clone()
    with pytest.raises(ValueError, match=pattern):
        stage1(*args.values())
    assert torch.equal(args["param"], before)


@pytest.mark.parametrize("path", LAMB_PATHS)
@pytest.mark.parametrize("segments, pattern", [pytest.param(s, p, id=i) for i, s, p in BAD_SEGMENTS[:4]])
def test_lamb_bad_segment_table_in_stage2_leaves_params(path, segments, pattern):
    _, _, stage2 = lamb_ops(path)
    args = good_stage2_args()
    args["segments"] = segments
    args["norms"] = torch.ones(len(segments) - 1, 2)
    args["use_trust_ratio"] = torch.ones(len(segments) - 1, dtype=torch.bool)
    before = args["param"].clone()
    with pytest.raises(ValueError, match=pattern):
        stage2(*args.values())
    assert torch.equal(args["param"], before), "parameters changed by a refused step"


@pytest.mark.parametrize("path", LAMB_PATHS)
def test_lamb_sq_norms_bad_table(path):
    sq_norms, _, _ = lamb_ops(path)
    with pytest.raises(ValueError, match="segment table covers 8 elements but the buffers hold 7"):
        sq_norms(torch.zeros(7), torch.tensor([0, 5, 8]))


@pytest.mark.parametrize("path", LAMB_PATHS)
@pytest.mark.parametrize("weight_decay, pattern", [
    pytest.param(torch.tensor([0.01]), r"`weight_decay` must be a contiguous .*\(2,?\), got .* [\[(]1,?[\])]",
                 id="short"),
    pytest.param(torch.tensor([0.01, 0.0, 0.0]), r"`weight_decay` must be .*\(2,?\)", id="long"),
    pytest.param(torch.tensor([0.01, 0.0], dtype=torch.float64), r"`weight_decay` must be a contiguous "
                 r"(Float|torch.float32)", id="float64"),
])
def test_lamb_weight_decay_length_and_dtype(path, weight_decay, pattern):
    _, stage1, _ = lamb_ops(path)
    args = good_stage1_args()
    args["weight_decay"] = weight_decay
    with pytest.raises(ValueError, match=pattern):
        stage1(*args.values())


@pytest.mark.parametrize("path", LAMB_PATHS)
@pytest.mark.parametrize("use_trust_ratio, pattern", [
    pytest.param(torch.tensor([True]), r"`use_trust_ratio` must be a contiguous .*\(2,?\)", id="short"),
    pytest.param(torch.tensor([1.0, 0.0]), r"`use_trust_ratio` must be bool or uint8", id="float"),
])
def test_lamb_use_trust_ratio_length_and_dtype(path, use_trust_ratio, pattern):
    _, _, stage2 = lamb_ops(path)
    args = good_stage2_args()
    args["use_trust_ratio"] = use_trust_ratio
    with pytest.raises(ValueError, match=pattern):
        stage2(*args.values())


@pytest.mark.parametrize("path", LAMB_PATHS)
def test_lamb_norms_shape(path):
    _, _, stage2 = lamb_ops(path)
    args = good_stage2_args()
    args["norms"] = torch.ones(3, 2)
    with pytest.raises(ValueError, match=r"`norms` must be the contiguous fp32 \(2, 2\) output of lamb_stage1"):
        stage2(*args.values())


@pytest.mark.parametrize("path", LAMB_PATHS)
def test_lamb_step_counts_from_1(path):
    _, stage1, _ = lamb_ops(path)
    args = good_stage1_args()
    args["step"] = 0
    with pytest.raises(ValueError, match=r"`step` counts from 1 \(bias correction\), got 0"):
        stage1(*args.values())


@pytest.mark.parametrize("path", LAMB_PATHS)
@pytest.mark.parametrize("name, bad, pattern", [
    pytest.param("grad", torch.randn(TOTAL).bfloat16(), r"`grad` has dtype .*(BFloat16|bfloat16)", id="grad-bf16"),
    pytest.param("param", torch.randn(TOTAL).double(), r"`param` has dtype .*(Double|float64)", id="param-float64"),
    pytest.param("exp_avg", torch.zeros(TOTAL + 1), r"`exp_avg` has 9 elements but the segment table covers 8",
                 id="exp_avg-length"),
    pytest.param("exp_avg_sq", torch.zeros(2 * TOTAL)[::2], r"`exp_avg_sq` must be a contiguous 1-D buffer",
                 id="exp_avg_sq-strided"),
])
def test_lamb_stage1_bad_buffer_named(path, name, bad, pattern):
    _, stage1, _ = lamb_ops(path)
    args = good_stage1_args()
    args[name] = bad
    with pytest.raises(ValueError, match=pattern):
        stage1(*args.values())


@pytest.mark.parametrize("path", LAMB_PATHS)
def test_lamb_stage2_update_length(path):
    _, _, stage2 = lamb_ops(path)
    args = good_stage2_args()
    args["update"] = torch.randn(TOTAL - 1)
    with pytest.raises(ValueError, match=r"`update` has 7 elements but the segment table covers 8"):
        stage2(*args.values())


def test_lamb_public_wrapper_refuses_a_bad_table():
    # custom_ops.lamb.lamb_stage1 (compiled when built, the fallback otherwise) refuses it too.
    args = good_stage1_args()
    args["segments"] = torch.tensor([0, 6, 5, 8])
    with pytest.raises(ValueError, match="non-decreasing"):
        lamb.lamb_stage1(*args.values())
