"""The fused LAMB ops (torch.ops.groupbert.lamb_*) against the pure-torch fallbacks and a float64 reference.

The compiled ops' numerics run at every CPU kernel level this machine supports
(`cpu_level`); bad inputs are in tests/test_faults_ops.py."""
from __future__ import annotations

import pytest
import torch

from custom_ops import lamb, library_status, load_library
from custom_ops.lamb import shard_segments
from session.optimizers import Lamb
from tests.helpers import assert_close

requires_ops = pytest.mark.skipif(not load_library(), reason=f"compiled ops unavailable: {library_status()}")

# Segment lengths: tiny, empty, one that spans several 16384-element chunks, pieces
# that straddle chunk boundaries, a single element; and which take decay / trust.
LENGTHS = [7, 0, 40001, 13, 16384, 1, 3000, 129]
DECAY = [0.01, 0.0, 0.01, 0.0, 0.05, 0.0, 0.01, 0.01]
TRUST = [True, False, True, False, True, False, True, False]
HYPER = dict(beta1=0.9, beta2=0.999, eps=1e-6)



def segments_of(lengths) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)


class Buffers:
    """Flat param / grad / moments with a fixed seed; `clone()` for side-by-side runs."""

    def __init__(self, seed=0, lengths=LENGTHS, param_dtype=torch.float32):
        gen = torch.Generator().manual_seed(seed)
        self.segments = segments_of(lengths)
        total = int(self.segments[-1])
        self.param = (torch.randn(total, generator=gen) * 0.3).to(param_dtype)
        self.exp_avg = torch.zeros(total)
        self.exp_avg_sq = torch.zeros(total)
        self.weight_decay = torch.tensor(DECAY[: len(lengths)])
        self.use_trust_ratio = torch.tensor(TRUST[: len(lengths)])

    def clone(self) -> Buffers:
        other = object.__new__(Buffers)
        other.__dict__ = {k: v.clone() for k, v in self.__dict__.items()}
        return other


def grad_of(step: int, total: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(total, generator=torch.Generator().manual_seed(100 + step)) * scale


def step_with(ops, b: Buffers, grad: torch.Tensor, step: int, lr: float, grad_scale=1.0, max_trust=0.0, seed=0):
    """One LAMB step through (sq_norms, stage1, stage2); returns the stage-1 norms."""
    _, stage1, stage2 = ops
    norms = stage1(b.param, grad, b.exp_avg, b.exp_avg_sq, b.segments, b.weight_decay, HYPER["beta1"],
                   HYPER["beta2"], HYPER["eps"], step, grad_scale)
    stage2(b.param, grad, b.segments, norms, b.use_trust_ratio, lr, max_trust, seed)
    return norms


COMPILED = (
    lambda *a: torch.ops.groupbert.lamb_sq_norms(*a),
    lambda *a: torch.ops.groupbert.lamb_stage1(*a),
    lambda *a: torch.ops.groupbert.lamb_stage2(*a),
)
FALLBACK = (lamb.lamb_sq_norms_fallback, lamb.lamb_stage1_fallback, lamb.lamb_stage2_fallback)


def reference_step(b: Buffers, grad: torch.Tensor, step: int, lr: float, grad_scale=1.0, max_trust=0.0):
    """The ops' semantics segment by segment in float64 (You et al. 2020, Algorithm 2)."""
    beta1, beta2, eps = HYPER["beta1"], HYPER["beta2"], HYPER["eps"]
    p, m, v = b.param.double(), b.exp_avg.double(), b.exp_avg_sq.double()
    g = grad.double() * grad_scale
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    u = (m / (1 - beta1**step)) / ((v / (1 - beta2**step)).sqrt() + eps)
    bounds = b.segments.tolist()
    for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        u[lo:hi] += b.weight_decay[s].item() * p[lo:hi]
        trust = 1.0
        p_norm, u_norm = p[lo:hi].norm().item(), u[lo:hi].norm().item()
        if b.use_trust_ratio[s] and p_norm > 0 and u_norm > 0:
            trust = min(p_norm / u_norm, max_trust) if max_trust > 0 else p_norm / u_norm
        p[lo:hi] -= lr * trust * u[lo:hi]
    b.param, b.exp_avg, b.exp_avg_sq = p, m, v


def test_fallback_matches_float64_reference():
    check_against_float64_reference(FALLBACK)


@requires_ops
def test_compiled_matches_float64_reference(cpu_level):
    check_against_float64_reference(COMPILED)


def check_against_float64_reference(ops):
    b, ref = Buffers(), Buffers().clone()
    ref.param = ref.param.double()
    for step in range(1, 7):
        grad = grad_of(step, b.param.numel(), 64.0)  # scaled as by a loss scale, undone by grad_scale
        step_with(ops, b, grad.clone(), step, lr=0.01, grad_scale=1 / 64.0, max_trust=1.5)  # grad ← update
        reference_step(ref, grad, step, lr=0.01, grad_scale=1 / 64.0, max_trust=1.5)
        for name in ("param", "exp_avg", "exp_avg_sq"):
            bounds = b.segments.tolist()
            for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
                assert_close(getattr(b, name)[lo:hi], getattr(ref, name)[lo:hi], 1e-6, f"step {step} {name} seg {s}")


@requires_ops
def test_compiled_matches_fallback_norms_and_update(cpu_level):
    b, f = Buffers(), Buffers()
    for step in range(1, 6):
        grad_b = grad_of(step, b.param.numel())
        grad_f = grad_b.clone()
        norms_b = step_with(COMPILED, b, grad_b, step, lr=0.02, grad_scale=0.5)
        norms_f = step_with(FALLBACK, f, grad_f, step, lr=0.02, grad_scale=0.5)
        assert_close(norms_b, norms_f, 1e-6, f"step {step} norms")
        assert_close(grad_b, grad_f, 1e-6, f"step {step} update")
        assert_close(b.param, f.param, 1e-6, f"step {step} param")
    grad = grad_of(0, b.param.numel())
    assert_close(torch.ops.groupbert.lamb_sq_norms(grad, b.segments),
                 lamb.lamb_sq_norms_fallback(grad, b.segments), 1e-6, "sq_norms")
    assert torch.ops.groupbert.lamb_sq_norms(grad, b.segments)[1] == 0.0  # the empty segment


@pytest.mark.parametrize("ops", [pytest.param(COMPILED, id="compiled", marks=requires_ops),
                                 pytest.param(FALLBACK, id="fallback")])
def test_shards_add_up_to_the_whole(ops):
    """Replicated tensor sharding: per-shard partial norms summed = whole norms; same step."""
    whole, sharded = Buffers(), Buffers()
    total = whole.param.numel()
    cuts = [0, 20000, 41000, total]  # cut inside segments 2 and 4
    for step in (1, 2):
        grad = grad_of(step, total)
        norms = step_with(ops, whole, grad.clone(), step, lr=0.01)
        shard_grads = grad.clone()
        partial = []
        for lo, hi in zip(cuts, cuts[1:]):
            seg = shard_segments(sharded.segments, lo, hi)
            partial.append(ops[1](sharded.param[lo:hi], shard_grads[lo:hi], sharded.exp_avg[lo:hi],
                                  sharded.exp_avg_sq[lo:hi], seg, sharded.weight_decay, 0.9, 0.999, 1e-6, step, 1.0))
        reduced = sum(partial)  # what the all-reduce computes
        assert_close(reduced, norms, 1e-6, f"step {step} summed shard norms")
        for lo, hi in zip(cuts, cuts[1:]):
            seg = shard_segments(sharded.segments, lo, hi)
            ops[2](sharded.param[lo:hi], shard_grads[lo:hi], seg, reduced, sharded.use_trust_ratio, 0.01, 0.0, 0)
        assert_close(sharded.param, whole.param, 1e-6, f"step {step} sharded params")
    with pytest.raises(ValueError, match="not inside"):
        shard_segments(whole.segments, 10, total + 1)


@requires_ops
def test_norms_are_deterministic_across_runs_and_thread_counts(cpu_level):
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (threads, 1, threads):
            torch.set_num_threads(n)
            b = Buffers(lengths=[300001, 5, 77777])
            grad = grad_of(1, b.param.numel())
            norms = step_with(COMPILED, b, grad, 1, lr=0.01)
            results.append((norms, b.param, torch.ops.groupbert.lamb_sq_norms(grad, b.segments)))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for x, y in zip(results[0], other):
            assert torch.equal(x, y), "results differ between runs / thread counts"


@pytest.mark.parametrize("ops", [pytest.param(COMPILED, id="compiled", marks=requires_ops),
                                 pytest.param(FALLBACK, id="fallback")])
def test_stochastic_rounding_is_unbiased(ops):
    # p - lr·u lands 30% of a bf16 spacing above a bf16 value: round-to-nearest
    # would always round down (bias −0.3 ulp); stochastic rounding averages to it.
    n, trials = 1 << 16, 8
    ulp = 2.0**-7  # bf16 spacing in [1, 2)
    target = 1.0 + 5 * ulp + 0.3 * ulp
    segments = torch.tensor([0, n])
    norms = torch.ones(1, 2)
    errors = []
    for seed in range(trials):
        param = torch.full((n,), 1.0 + 5 * ulp, dtype=torch.bfloat16)
        update = torch.full((n,), -0.3 * ulp)
        ops[2](param, update, segments, norms, torch.tensor([False]), 1.0, 0.0, seed)
        values = param.double()
        assert set(values.unique().tolist()) <= {1.0 + 5 * ulp, 1.0 + 6 * ulp}
        errors.append(values.mean().item() - target)
    sigma = ulp * (0.3 * 0.7) ** 0.5 / (n * trials) ** 0.5  # std of the mean of Bernoulli roundings
    mean_error = sum(errors) / trials
    assert abs(mean_error) < 4 * sigma, f"mean rounding error {mean_error:.3e} vs 4σ = {4 * sigma:.3e}"
    assert len(set(errors)) > 1, "every seed gave the same rounding"


@requires_ops
def test_stochastic_rounding_matches_fallback_bits(cpu_level):
    b = Buffers(param_dtype=torch.bfloat16)
    f = b.clone()
    grad = grad_of(1, b.param.numel())
    norms = torch.ops.groupbert.lamb_stage1(b.param, grad, b.exp_avg, b.exp_avg_sq, b.segments, b.weight_decay,
                                            0.9, 0.999, 1e-6, 1, 1.0)
    torch.ops.groupbert.lamb_stage2(b.param, grad, b.segments, norms, b.use_trust_ratio, 0.01, 0.0, 1234)
    lamb.lamb_stage2_fallback(f.param, grad, f.segments, norms, f.use_trust_ratio, 0.01, 0.0, 1234)
    # The kernel may fuse p − a·u into one FMA; a last-bit difference can flip a rounding.
    differ = (b.param.view(torch.int16) != f.param.view(torch.int16)).sum().item()
    assert differ <= b.param.numel() // 10000, f"{differ} of {b.param.numel()} bf16 values differ"


@pytest.mark.parametrize("fused", [pytest.param(True, marks=requires_ops), False])
def test_bf16_lamb_converges_on_least_squares(fused):
    torch.manual_seed(0)
    x = torch.randn(256, 48)
    target = x @ torch.randn(48, 20) * 0.2
    model = torch.nn.Linear(48, 20)

    def loss_of():
        return (model(x.bfloat16()).float() - target).square().mean()

    opt = Lamb(model.named_parameters(), lr=0.02, param_dtype=torch.bfloat16, fused=fused, seed=3)
    with torch.no_grad():
        start = loss_of().item()
    for _ in range(150):
        opt.zero_grad()
        loss = loss_of()
        loss.backward()
        opt.step()
    assert loss.item() < start / 20, f"loss {start:.4f} -> {loss.item():.4f}"


@requires_ops
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_opcheck(param_dtype):
    b = Buffers(lengths=[5, 0, 17, 3], param_dtype=param_dtype)
    grad = grad_of(0, b.param.numel())
    torch.library.opcheck(torch.ops.groupbert.lamb_sq_norms.default, (grad, b.segments))
    torch.library.opcheck(
        torch.ops.groupbert.lamb_stage1.default,
        (b.param, grad, b.exp_avg, b.exp_avg_sq, b.segments, b.weight_decay, 0.9, 0.999, 1e-6, 2, 0.5),
    )
    norms = torch.rand(4, 2) + 0.1
    torch.library.opcheck(
        torch.ops.groupbert.lamb_stage2.default,
        (b.param, grad, b.segments, norms, b.use_trust_ratio, 0.01, 2.0, 7),
    )


@pytest.mark.gpu
@requires_ops
def test_cuda_matches_cpu():
    if not hasattr(torch.ops.groupbert.lamb_stage1, "default") or not torch._C._dispatch_has_kernel_for_dispatch_key(
        "groupbert::lamb_stage1", "CUDA"
    ):
        pytest.skip("libgroupbert_ops.so was built without CUDA kernels")
    for param_dtype in (torch.float32, torch.bfloat16):
        cpu = Buffers(param_dtype=param_dtype)
        gpu = cpu.clone()
        gpu.__dict__ = {k: v.cuda() for k, v in gpu.__dict__.items()}
        for step in range(1, 6):
            grad = grad_of(step, cpu.param.numel())
            grad_gpu = grad.cuda()
            norms = step_with(COMPILED, cpu, grad, step, lr=0.01, max_trust=2.0, seed=step)
            norms_gpu = step_with(COMPILED, gpu, grad_gpu, step, lr=0.01, max_trust=2.0, seed=step)
            assert_close(norms_gpu.cpu(), norms, 1e-6, f"{param_dtype} step {step} norms")
            assert_close(gpu.param.cpu().float(), cpu.param.float(), 1e-6 if param_dtype == torch.float32 else 1e-2,
                         f"{param_dtype} step {step} param")
        assert_close(torch.ops.groupbert.lamb_sq_norms(grad_gpu, gpu.segments).cpu(),
                     torch.ops.groupbert.lamb_sq_norms(grad, cpu.segments), 1e-6, "sq_norms")
