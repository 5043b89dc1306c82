"""session.optimizers.Lamb (fused and pure torch) against a plain per-tensor LAMB; AdamW groups; schedules."""
from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from custom_ops import load_library
from bert.model import no_weight_decay
from session.optimizers import AdamW, FlatLayout, Lamb, fewer_than_two_dims, select_state
from session.schedules import Schedule, set_lr
from tests.helpers import assert_close

# Oddly sized tensors with HuggingFace-style names; the two large ones straddle the
# kernels' 16384-element chunks, "pooler.zero.weight" starts at 0 (trust ratio 1).
SHAPES = {
    "embeddings.word_embeddings.weight": (37, 11),
    "embeddings.LayerNorm.weight": (11,),
    "embeddings.LayerNorm.bias": (11,),
    "encoder.layer.0.intermediate.dense.weight": (129, 257),
    "encoder.layer.0.intermediate.dense.bias": (129,),
    "encoder.layer.0.output.dense.weight": (3, 7001),
    "encoder.layer.0.output.LayerNorm.weight": (3,),
    "pooler.zero.weight": (6, 5),
    "cls.gain": (1,),
}

FUSED = [
    pytest.param(False, id="torch"),
    pytest.param(True, id="fused",
                 marks=pytest.mark.skipif(not load_library(), reason="libgroupbert_ops.so not built: run `make`")),
]



def make_params(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in SHAPES.items():
        value = torch.randn(shape, generator=gen, dtype=torch.float64) * 0.5
        if "zero" in name:
            value.zero_()
        params[name] = torch.nn.Parameter(value.to(dtype))
    return params


def make_grads(step: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(s, generator=gen, dtype=torch.float64) * scale for n, s in SHAPES.items()}


def unscaled_and_clipped(grads, loss_scale, max_grad_norm):
    """The gradients in float64 divided by the loss scale, their global norm clipped to `max_grad_norm`."""
    g = {n: x.double() / loss_scale for n, x in grads.items()}
    if max_grad_norm is not None:
        norm = math.sqrt(sum((x * x).sum().item() for x in g.values()))
        if norm > max_grad_norm:
            g = {n: x * (max_grad_norm / norm) for n, x in g.items()}
    return g


class ReferenceLamb:
    """LAMB as You et al. 2020, Algorithm 2, one tensor at a time in float64.

    Biases and LayerNorm tensors take a plain Adam step (no decay, no trust ratio),
    as PopART's LambNoBias. Clipping scales the global gradient norm down to
    `max_grad_norm`; `loss_scale` divides the gradients first.
    """

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 max_grad_norm=None, max_trust_ratio=None):
        self.p = {n: p.detach().double().clone() for n, p in params.items()}
        self.m = {n: torch.zeros_like(p) for n, p in self.p.items()}
        self.v = {n: torch.zeros_like(p) for n, p in self.p.items()}
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.max_grad_norm, self.max_trust_ratio = max_grad_norm, max_trust_ratio
        self.t = 0

    def step(self, grads, loss_scale=1.0):
        g = unscaled_and_clipped(grads, loss_scale, self.max_grad_norm)
        self.t += 1
        b1, b2 = self.betas
        for n, p in self.p.items():
            self.m[n] = b1 * self.m[n] + (1 - b1) * g[n]
            self.v[n] = b2 * self.v[n] + (1 - b2) * g[n] ** 2
            m_hat = self.m[n] / (1 - b1**self.t)
            v_hat = self.v[n] / (1 - b2**self.t)
            update = m_hat / (v_hat.sqrt() + self.eps)
            trust = 1.0
            excluded = n.endswith(".bias") or "LayerNorm" in n
            if not excluded:
                update = update + self.wd * p
                p_norm, u_norm = p.norm().item(), update.norm().item()
                if p_norm > 0 and u_norm > 0:
                    trust = p_norm / u_norm
                    if self.max_trust_ratio is not None:
                        trust = min(trust, self.max_trust_ratio)
            self.p[n] = p - self.lr * trust * update


def run_both(fused: bool, steps: int = 6, loss_scale: float = 1.0, grad_scale: float = 1.0, **hyper):
    params = make_params()
    reference = ReferenceLamb(params, **hyper)
    opt = Lamb(params.items(), fused=fused, no_decay=no_weight_decay, **hyper)
    for step in range(steps):
        grads = make_grads(step, grad_scale)
        opt.zero_grad()
        for n, p in params.items():
            p.grad.copy_(grads[n] * loss_scale)
        opt.step(loss_scale=loss_scale)
        reference.step({n: g * loss_scale for n, g in grads.items()}, loss_scale=loss_scale)
        for n, p in params.items():
            assert_close(p, reference.p[n], 1e-6, f"step {step + 1} {n}")
    return params, reference, opt


@pytest.mark.parametrize("fused", FUSED)
def test_lamb_matches_reference(fused):
    run_both(fused, lr=0.01, weight_decay=0.01)


@pytest.mark.parametrize("fused", FUSED)
def test_lamb_clipping_loss_scale_and_max_trust(fused):
    # Gradient norm ≈ 290 ≫ 1: the clip is active every step; the trust bound bites too.
    _, _, opt = run_both(fused, loss_scale=1024.0, lr=0.02, weight_decay=0.1, max_grad_norm=1.0, max_trust_ratio=0.5)
    assert opt.grad_norm > 100.0


def test_lamb_fused_and_torch_paths_agree():
    if not load_library():
        pytest.skip("libgroupbert_ops.so not built: run `make`")
    a, _, opt_a = run_both(True, lr=0.01, max_grad_norm=5.0)
    b, _, opt_b = run_both(False, lr=0.01, max_grad_norm=5.0)
    for n in SHAPES:
        assert_close(a[n], b[n], 1e-6, f"fused vs torch {n}")
    assert_close(opt_a.exp_avg_sq, opt_b.exp_avg_sq, 1e-6, "exp_avg_sq")


def test_lamb_moments_match_reference():
    params, reference, opt = run_both(False, steps=5, lr=0.01)
    offsets = opt.segments.tolist()
    for i, n in enumerate(SHAPES):
        assert_close(opt.exp_avg[offsets[i]:offsets[i + 1]], reference.m[n].flatten(), 1e-6, f"exp_avg {n}")
        assert_close(opt.exp_avg_sq[offsets[i]:offsets[i + 1]], reference.v[n].flatten(), 1e-6, f"exp_avg_sq {n}")


def test_params_and_grads_are_views_autograd_fills():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 3))
    expected = copy.deepcopy(model)
    opt = Lamb(model.named_parameters(), lr=0.01)
    x = torch.randn(4, 5)
    for _ in range(2):  # second backward accumulates into the zeroed views
        opt.zero_grad()
        model(x).square().sum().backward()
    expected(x).square().sum().backward()
    for (n, p), q in zip(model.named_parameters(), expected.parameters()):
        assert p.grad.untyped_storage().data_ptr() == opt.flat_grads.untyped_storage().data_ptr(), n
        assert_close(p.grad, q.grad, 1e-6, f"grad {n}")
    before = opt.flat_params.clone()
    opt.step()
    assert not torch.equal(before, opt.flat_params)
    assert model[0].weight.untyped_storage().data_ptr() == opt.flat_params.untyped_storage().data_ptr()
    opt.zero_grad(set_to_none=True)  # ignored: the views stay
    assert model[0].weight.grad is not None and not opt.flat_grads.any()


@pytest.mark.parametrize("fused", FUSED)
def test_state_dict_round_trip_is_bit_identical(fused):
    def train(params, opt, steps):
        for step in steps:
            opt.zero_grad()
            for n, p in params.items():
                p.grad.copy_(make_grads(step)[n])
            opt.step()

    hyper = dict(lr=0.01, max_grad_norm=2.0, fused=fused)
    params = make_params()
    opt = Lamb(params.items(), **hyper)
    train(params, opt, range(3))
    buffer = io.BytesIO()
    torch.save({"params": {n: p.detach().clone() for n, p in params.items()}, "opt": opt.state_dict()}, buffer)
    train(params, opt, range(3, 6))

    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = {n: torch.nn.Parameter(t) for n, t in saved["params"].items()}
    opt2 = Lamb(resumed.items(), lr=123.0, fused=fused)  # lr comes back from the state
    opt2.load_state_dict(saved["opt"])
    assert opt2.step_count == 3 and opt2.param_groups[0]["lr"] == 0.01
    train(resumed, opt2, range(3, 6))
    for n in SHAPES:
        assert torch.equal(params[n], resumed[n]), f"{n} differs after resume"
    assert torch.equal(opt.exp_avg, opt2.exp_avg) and torch.equal(opt.exp_avg_sq, opt2.exp_avg_sq)


def test_load_state_dict_refuses_other_parameters():
    opt = Lamb(make_params().items(), lr=0.01)
    other = dict(list(make_params().items())[:-1])
    with pytest.raises(ValueError, match="first difference"):
        Lamb(other.items(), lr=0.01).load_state_dict(opt.state_dict())


def test_a_refused_state_dict_changes_nothing():
    """A state whose buffers do not fit (here: a moment cut short) is refused before its step,
    hyperparameters or any buffer are loaded; a state of another optimizer is refused by name."""
    saved = Lamb(make_params().items(), lr=0.5)
    saved._step = 7
    state = saved.state_dict()
    state["state"]["exp_avg_sq"] = state["state"]["exp_avg_sq"][:-1]
    opt = Lamb(make_params().items(), lr=0.01)
    with pytest.raises(ValueError, match=r"saved exp_avg_sq has shape \(\d+,\), expected \(\d+,\)"):
        opt.load_state_dict(state)
    assert opt.step_count == 0 and opt.param_groups[0]["lr"] == 0.01
    with pytest.raises(ValueError, match="optimizer state was saved by lamb, this optimizer is adamw"):
        AdamW(make_params().items(), lr=0.01).load_state_dict(saved.state_dict())


def test_non_finite_gradients_skip_the_step():
    params = make_params()
    opt = Lamb(params.items(), lr=0.01, fused=False)
    before = opt.flat_params.clone()
    next(iter(params.values())).grad[0, 0] = float("inf")
    opt.step(loss_scale=512.0)
    assert opt.skipped and opt.step_count == 0 and torch.equal(before, opt.flat_params)


def test_bf16_parameters_are_views_of_a_bf16_buffer():
    params = make_params()
    opt = Lamb(params.items(), lr=0.01, param_dtype=torch.bfloat16, fused=False)
    assert all(p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16 for p in params.values())
    for n, p in params.items():
        p.grad.copy_(make_grads(0)[n])
    opt.step()
    assert torch.isfinite(opt.flat_params.float()).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr=-1.0), "lr"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(max_grad_norm=0.0), "max_grad_norm"),
        (dict(max_trust_ratio=-2.0), "max_trust_ratio"),
        (dict(param_dtype=torch.float16), "float32 or bfloat16"),
    ],
)
def test_lamb_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Lamb(make_params().items(), **kwargs)


def test_no_decay_rules():
    # The session's default is by shape (vectors: biases, norm scales); BERT's is by name.
    assert fewer_than_two_dims("cls.gain", (1,)) and not fewer_than_two_dims("w", (3, 2))
    params = make_params()
    by_shape, by_name = Lamb(params.items(), lr=0.01), Lamb(make_params().items(), lr=0.01, no_decay=no_weight_decay)
    decayed = lambda opt: dict(zip(opt.layout.names, opt.decay.tolist()))  # noqa: E731
    assert decayed(by_shape)["cls.gain"] is False and decayed(by_name)["cls.gain"] is True
    assert no_weight_decay("encoder.layer.3.attention.self.query.bias")
    assert no_weight_decay("encoder.layer.3.output.LayerNorm.weight")
    assert no_weight_decay("encoder.layer.3.conv_LayerNorm.weight")
    assert not no_weight_decay("encoder.layer.3.attention.self.query.weight")
    assert not no_weight_decay("embeddings.word_embeddings.weight")


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("loss_scale, max_grad_norm", [(1.0, None), (512.0, 3.0)])
def test_adamw_matches_torch_adamw_with_decay_groups(fused, loss_scale, max_grad_norm):
    """Flat AdamW (the LAMB step without trust ratio) against torch.optim.AdamW, with loss
    scaling undone and the global norm clipped before the torch step."""
    params, reference = make_params(), make_params()
    hyper = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-6)
    opt = AdamW(params.items(), weight_decay=0.05, max_grad_norm=max_grad_norm, fused=fused,
                no_decay=no_weight_decay, **hyper)
    decay = [p for n, p in reference.items() if not no_weight_decay(n)]
    no_decay = [p for n, p in reference.items() if no_weight_decay(n)]
    torch_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                                  **hyper)
    for step in range(5):
        grads = make_grads(step, scale=0.5)
        opt.zero_grad()
        for n, p in params.items():
            p.grad.copy_(grads[n] * loss_scale)
            reference[n].grad = grads[n].float()
        opt.step(loss_scale=loss_scale)
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(reference.values()), max_grad_norm)
        torch_opt.step()
        for n in SHAPES:
            assert_close(params[n], reference[n], 1e-6, f"step {step + 1} {n}")
    assert max_grad_norm is None or opt.grad_norm > max_grad_norm, "the clip was active"


def test_layout_pads_buckets_to_whole_chunks():
    names, shapes = ["a", "b", "c", "d"], [(5,), (3, 2), (7,), (1,)]
    layout = FlatLayout.build(names, shapes, bucket_numel=10, replicas=4)
    # a+b = 11 > 10 closes the first bucket after a (5 → 8); b+c = 13 > 10 after b (6 → 8); c+d = 8.
    assert layout.buckets == ((0, 8), (8, 16), (16, 24)) and layout.starts == (0, 8, 16, 23)
    assert layout.chunks(1) == [(2, 4), (10, 12), (18, 20)] and layout.shard_numel == 6
    flat = torch.arange(layout.total, dtype=torch.float32)
    assert torch.equal(layout.pad(layout.unpad(flat)), torch.where(_padding_mask(layout), 0.0, flat))
    assert FlatLayout.build(names, shapes).buckets == ((0, 19),) and not FlatLayout.build(names, shapes).padded


def test_layout_cuts_a_tensor_larger_than_a_bucket_at_whole_chunks():
    layout = FlatLayout.build(["a", "big", "c"], [(5,), (5, 6), (3,)], bucket_numel=10, replicas=4)
    # a closes at 8; big (30) spans buckets of 8 (10 rounded down to whole chunks) from 8
    # to 32, unpadded, and its last 6 are a bucket of its own (padded to 8): every bucket
    # of a large tensor lies inside it. c starts a bucket at 40 (3, padded to 4).
    assert layout.starts == (0, 8, 40)
    assert layout.buckets == ((0, 8), (8, 16), (16, 24), (24, 32), (32, 40), (40, 44))
    assert layout.chunks(1) == [(2, 4), (10, 12), (18, 20), (26, 28), (34, 36), (41, 42)]
    flat = torch.arange(layout.total, dtype=torch.float32)
    assert torch.equal(layout.pad(layout.unpad(flat)), torch.where(_padding_mask(layout), 0.0, flat))
    # Buckets smaller than the replica count still split into whole chunks.
    assert FlatLayout.build(["x"], [(9,)], bucket_numel=2, replicas=4).buckets == ((0, 4), (4, 8), (8, 12))


def _padding_mask(layout):
    mask = torch.ones(layout.total, dtype=torch.bool)
    for s, n in zip(layout.starts, layout.numels):
        mask[s : s + n] = False
    return mask


def test_select_state_takes_the_named_tensors_in_their_order():
    """A format-1 checkpoint's one state over every tensor, cut to a pipeline stage's (session/checkpoint.py)."""
    opt = Lamb(make_params().items(), lr=0.01)
    opt.exp_avg.copy_(torch.randn_like(opt.exp_avg))
    state = opt.state_dict()
    names = list(SHAPES)
    first, second = select_state(state, names[:4]), select_state(state, names[4:])
    split = opt.layout.starts[4]
    assert torch.equal(first["state"]["exp_avg"], state["state"]["exp_avg"][:split])
    assert torch.equal(second["state"]["exp_avg"], state["state"]["exp_avg"][split:])
    assert first["names"] == names[:4] and second["shapes"] == state["shapes"][4:]
    stage = Lamb({n: p for n, p in make_params().items() if n in names[4:]}.items(), lr=0.01)
    stage.load_state_dict(second)
    assert torch.equal(stage.exp_avg, opt.exp_avg[split:])
    with pytest.raises(ValueError, match="no entry"):
        select_state(state, ["nope"])


# ------------------------------------------------------------------ schedules


def test_groupbert_schedule_values():
    """GroupBERT's pre-training schedule (configs/groupbert_*.json): sqrt warm-up, polynomial decay."""
    s = Schedule(base_lr=0.012, warmup_steps=100, total_steps=1100, warmup="sqrt", decay="polynomial", power=2.0)
    assert s(0) == 0.0
    assert s(25) == pytest.approx(0.012 * 0.5)  # √(25/100)
    assert s(100) == pytest.approx(0.012)  # end of warm-up
    assert s(600) == pytest.approx(0.012 * 0.25)  # halfway through decay: (1 − 0.5)²
    assert s(1100) == 0.0 and s(5000) == 0.0


def test_linear_warmup_and_decay_values():
    s = Schedule(base_lr=0.006, warmup_steps=10, total_steps=110, warmup="linear", decay="linear")
    assert s(5) == pytest.approx(0.003)
    assert s(10) == pytest.approx(0.006)
    assert s(60) == pytest.approx(0.003)
    assert s(110) == 0.0


def test_polynomial_to_end_lr_and_constant():
    s = Schedule(0.01, 0, 100, warmup="linear", decay="polynomial", power=0.5, end_lr=0.001)
    assert s(0) == pytest.approx(0.01)
    assert s(75) == pytest.approx(0.001 + 0.009 * 0.5)  # √(1 − 0.75)
    assert s(100) == pytest.approx(0.001)
    assert Schedule(0.01, 4, 8, decay="constant")(7) == 0.01


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(base_lr=0.0, warmup_steps=1, total_steps=2), "base_lr"),
        (dict(base_lr=0.1, warmup_steps=5, total_steps=2), "exceeds total_steps"),
        (dict(base_lr=0.1, warmup_steps=1, total_steps=2, warmup="cosine"), "warmup"),
        (dict(base_lr=0.1, warmup_steps=1, total_steps=2, decay="exp"), "decay"),
        (dict(base_lr=0.1, warmup_steps=1, total_steps=2, decay="linear", power=2.0), "polynomial"),
        (dict(base_lr=0.1, warmup_steps=1, total_steps=2, end_lr=0.2), "end_lr"),
    ],
)
def test_schedule_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Schedule(**kwargs)


def test_set_lr_writes_every_group():
    opt = AdamW(make_params().items(), lr=1.0)
    set_lr(opt, Schedule(0.006, 10, 110, warmup="linear", decay="linear")(5))
    assert all(g["lr"] == pytest.approx(0.003) for g in opt.param_groups)
