"""The softmax cross-entropy ops (torch.ops.groupbert.softmax_xent_*, custom_ops/softmax_xent.py)
against float64 references, at every CPU kernel level this machine supports (`cpu_level`),
and the kernel policy's cross_entropy choice in a training session."""
from __future__ import annotations

import pytest
import torch

from bert import build_model
from custom_ops import library_status, load_library
from custom_ops.softmax_xent import (softmax_xent_grad, softmax_xent_grad_fallback, softmax_xent_stats,
                                     softmax_xent_stats_fallback)
from session import SessionOptions
from session.kernels import choose_kernels
from session.training import TrainingSession
from tests.helpers import assert_close, random_batch, tiny_config

requires_ops = pytest.mark.skipif(not load_library(), reason=f"compiled ops unavailable: {library_status()}")

# rows × columns: BERT's vocabulary (a tail of 10 after 16-lane vectors), a tail of 1, full
# vectors only, the NSP head's 2 columns.
SHAPES = [(3, 30522), (40, 1009), (5, 48), (7, 2)]


def scores_of(rows: int, columns: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, columns, generator=g, dtype=torch.float64) * 4).to(dtype)


def reference(scores: torch.Tensor, target: torch.Tensor, scale: torch.Tensor):
    """(log-probabilities, gradient) in float64 from the scores as given."""
    logp = torch.log_softmax(scores.double(), dim=-1)
    grad = logp.exp() * scale.double()[:, None]
    rows = (target >= 0).nonzero().squeeze(1)
    grad[rows, target[rows]] -= scale.double()[rows]
    return logp, grad


def targets(rows: int, columns: int) -> torch.Tensor:
    target = torch.arange(rows) * 7 % columns
    target[1::3] = -1  # ignored rows
    return target


@requires_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, columns", SHAPES)
def test_stats_and_gradient_equal_float64_at_every_level(cpu_level, dtype, rows, columns):
    scores = scores_of(rows, columns, dtype)
    target, scale = targets(rows, columns), torch.linspace(-2.0, 3.0, rows)
    scale[1::3] = 0.0  # the ignored rows' (the loss's backward gives them 0)
    logp_ref, grad_ref = reference(scores, target, scale)
    stats = softmax_xent_stats(scores)
    assert stats.dtype == torch.float32 and stats.shape == (rows, 2)
    assert torch.equal(stats[:, 0], scores.float().amax(-1)), "the first statistic is the row's maximum"
    logp = (scores.float() - stats[:, :1]) - stats[:, 1:]
    assert_close(logp, logp_ref, 1e-6, "log-probabilities", atol=1e-6)
    grad = softmax_xent_grad(scores, stats, target, scale)
    assert grad.dtype == dtype and grad.shape == scores.shape
    if dtype == torch.float32:
        assert_close(grad, grad_ref, 1e-6, "gradient", atol=1e-7)
    else:  # rounded once: within half a bf16 step of each element, plus fp32's error
        worst = ((grad.double() - grad_ref).abs() - grad_ref.abs() * 2**-8).max().item()
        assert worst <= 1e-6, f"a bf16 gradient element is off by more than its rounding ({worst})"
    assert not grad[1::3].any(), "an ignored row (scale 0) has a gradient"


@requires_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fallbacks_compute_what_the_compiled_ops_compute(dtype):
    scores = scores_of(9, 517, dtype, seed=3)
    target, scale = targets(9, 517), torch.rand(9, generator=torch.Generator().manual_seed(1))
    stats, stats_fb = softmax_xent_stats(scores), softmax_xent_stats_fallback(scores)
    assert_close(stats, stats_fb, 1e-6, "stats")
    grad, grad_fb = softmax_xent_grad(scores, stats, target, scale), softmax_xent_grad_fallback(scores, stats,
                                                                                               target, scale)
    assert_close(grad, grad_fb, 1e-6 if dtype == torch.float32 else 2**-8, "gradient")


@requires_ops
def test_extreme_rows_as_float64(cpu_level):
    """One dominant score (softmax ≈ 1 at the target: its gradient is a small difference),
    scores of -inf (a masked vocabulary), equal scores, NaN kept NaN; a row of -inf only has
    no probabilities: NaN, as F.cross_entropy gives."""
    scores = torch.randn(5, 37, generator=torch.Generator().manual_seed(2))
    scores[0, 5] = 40.0
    scores[1, 20:] = -torch.inf
    scores[2] = 1.5
    scores[3, 7] = torch.nan
    scores[4] = -torch.inf
    target, scale = torch.tensor([5, 3, 0, 1, 2]), torch.full((5,), 0.25)
    stats = softmax_xent_stats(scores)
    logp = (scores.gather(1, target[:, None]).squeeze(1) - stats[:, 0]) - stats[:, 1]
    logp_ref = torch.log_softmax(scores.double(), -1).gather(1, target[:, None]).squeeze(1)
    assert_close(logp[:3], logp_ref[:3], 1e-6, "finite rows", atol=1e-7)
    assert logp[3:].isnan().all() and logp_ref[3:].isnan().all()
    grad = softmax_xent_grad(scores, stats, target, scale)
    _, grad_ref = reference(scores[:3], target[:3], scale[:3])
    assert_close(grad[:3], grad_ref, 1e-6, "finite rows' gradient", atol=1e-9)
    assert torch.equal(grad[1, 20:], torch.zeros(17)), "a masked score has a gradient"
    assert grad[3].isnan().all()


@requires_ops
def test_results_do_not_depend_on_the_thread_count():
    scores = scores_of(64, 3001, torch.bfloat16, seed=5)
    target, scale = targets(64, 3001), torch.rand(64, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            stats = softmax_xent_stats(scores)
            runs.append((stats, softmax_xent_grad(scores, stats, target, scale)))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@requires_ops
@pytest.mark.parametrize("call, message", [
    (lambda: softmax_xent_stats(torch.zeros(4, 6).t()), "must be a contiguous \\(N, C\\) array"),
    (lambda: softmax_xent_stats(torch.zeros(4, 6, dtype=torch.float16)), "does not take"),
    (lambda: softmax_xent_grad(torch.zeros(4, 6), torch.zeros(4), torch.zeros(4, dtype=torch.int64), torch.zeros(4)),
     "`stats` must be a contiguous Float CPU tensor of shape \\(4, 2\\), got Float \\[4\\]"),
    (lambda: softmax_xent_grad(torch.zeros(4, 6), torch.zeros(4, 2), torch.zeros(4, dtype=torch.int32), torch.zeros(4)),
     "`target` must be a contiguous Long CPU tensor of shape \\(4\\), got Int"),
])
def test_bad_inputs_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@requires_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    """The schemas, fake kernels and dispatch (torch.library.opcheck: what torch.compile and
    the meta device rely on)."""
    scores = scores_of(6, 50, dtype)
    stats = softmax_xent_stats(scores)
    torch.library.opcheck(torch.ops.groupbert.softmax_xent_stats.default, (scores,))
    torch.library.opcheck(torch.ops.groupbert.softmax_xent_grad.default,
                          (scores, stats, targets(6, 50), torch.linspace(0.0, 1.0, 6)))


# ------------------------------------------------------------- the kernel policy
def test_the_policy_takes_the_compiled_ops_on_the_cpu_only():
    cpu = choose_kernels("cpu", "bf16")
    assert cpu.cross_entropy == ("compiled" if load_library() else "torch")
    assert choose_kernels("cpu", "fp32", overrides={"cross_entropy": "torch"}).cross_entropy == "torch"
    if load_library():
        with pytest.raises(ValueError, match="cross_entropy=compiled runs on the CPU, not cuda"):
            choose_kernels("cuda", "bf16", overrides={"cross_entropy": "compiled"})


@requires_ops
def test_the_lowering_takes_the_ops_for_a_vocabulary_and_torch_for_narrower_heads(monkeypatch):
    from session.kernels import KernelPolicy
    from session.dense import COMPILED_CROSS_ENTROPY_MIN_COLUMNS
    from session.lowering import _OPS

    calls = []
    monkeypatch.setattr("session.dense.softmax_xent_stats", lambda s: calls.append(s.shape[1]) or
                        softmax_xent_stats_fallback(s))
    factory = _OPS[("", "SoftmaxCrossEntropyLoss")]
    for columns in (2, COMPILED_CROSS_ENTROPY_MIN_COLUMNS - 1, COMPILED_CROSS_ENTROPY_MIN_COLUMNS):
        for impl in ("compiled", "torch"):
            loss = factory({"_policy": KernelPolicy(cross_entropy=impl), "ignore_index": -100}, [None, None])
            scores, labels = scores_of(3, columns, torch.bfloat16), torch.tensor([1, -100, 0])
            assert_close(loss(None, scores, labels), torch.nn.functional.cross_entropy(
                scores.double(), labels, ignore_index=-100), 1e-6, f"{impl} loss at {columns} columns")
    assert calls == [COMPILED_CROSS_ENTROPY_MIN_COLUMNS]


@requires_ops
@pytest.mark.parametrize("precision, rtol", [("fp32", 1e-5), ("bf16", 2e-2)])
def test_a_session_trains_alike_through_either_cross_entropy_and_runs_the_chosen_one(monkeypatch, precision, rtol):
    """Three steps of a tiny BERT with BERT's vocabulary (MLM and NSP losses) with
    cross_entropy=compiled and =torch: the same losses to the precision's tolerance, and only
    the chosen path runs, for the vocabulary's scores and not the NSP head's two columns."""
    import custom_ops.softmax_xent as ops

    calls = []
    stats = ops.softmax_xent_stats
    monkeypatch.setattr("session.dense.softmax_xent_stats", lambda s: calls.append(s.shape) or stats(s))
    cfg = tiny_config("bert", vocab_size=30522)
    batches = [random_batch(cfg, 4, seed=s) for s in range(3)]
    losses = {}
    for impl in ("compiled", "torch"):
        calls.clear()
        session = TrainingSession(build_model(cfg, seed=3).builder.model_proto(),
                                  options=SessionOptions(precision=precision, kernels={"cross_entropy": impl}))
        losses[impl] = [session.run(b)["loss"] for b in batches]
        assert calls == ([(4 * cfg.max_predictions, cfg.vocab_size)] * 3 if impl == "compiled" else []), calls
    assert_close(torch.tensor(losses["compiled"]), torch.tensor(losses["torch"]), rtol, "losses over 3 steps")
