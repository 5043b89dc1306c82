"""Lion (session.optimizers.Lion) against the paper's algorithm one tensor at a time in float64;
in a training session: it learns, resumes bit for bit and refuses another optimizer's state.
Sharded under RTS it is checked in tests/test_distributed.py."""
from __future__ import annotations

import pytest
import torch

from bert import build_model
from bert.model import no_weight_decay
from session import SessionOptions
from session.optimizers import OPTIMIZERS, Lamb, Lion
from session.schedules import Schedule
from session.training import OptimizerSpec, TrainingSession
from tests.helpers import assert_close, random_batch, tiny_config
from tests.test_optimizers import FUSED, SHAPES, make_grads, make_params, unscaled_and_clipped


class ReferenceLion:
    """Chen et al. 2023, Algorithm 2, per tensor in float64; biases and LayerNorm take no
    weight decay; `loss_scale` divides the gradients, clipping scales the global norm."""

    def __init__(self, params, lr, beta1=0.9, beta2=0.99, weight_decay=0.0, max_grad_norm=None):
        self.p = {n: p.detach().double().clone() for n, p in params.items()}
        self.m = {n: torch.zeros_like(p) for n, p in self.p.items()}
        self.lr, self.betas, self.wd, self.max_grad_norm = lr, (beta1, beta2), weight_decay, max_grad_norm

    def step(self, grads, loss_scale=1.0):
        g = unscaled_and_clipped(grads, loss_scale, self.max_grad_norm)
        b1, b2 = self.betas
        for n, p in self.p.items():
            c = b1 * self.m[n] + (1 - b1) * g[n]
            wd = 0.0 if no_weight_decay(n) else self.wd
            self.p[n] = p - self.lr * (torch.sign(c) + wd * p)
            self.m[n] = b2 * self.m[n] + (1 - b2) * g[n]


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("loss_scale, max_grad_norm", [(1.0, None), (256.0, 2.0)])
def test_lion_matches_the_papers_algorithm(fused, loss_scale, max_grad_norm):
    params = make_params()
    hyper = dict(lr=3e-3, beta1=0.8, beta2=0.99, weight_decay=0.1, max_grad_norm=max_grad_norm)
    reference = ReferenceLion(params, **hyper)
    opt = Lion(params.items(), fused=fused, no_decay=no_weight_decay, **hyper)
    for step in range(6):
        grads = make_grads(step, scale=0.5)
        opt.zero_grad()
        for n, p in params.items():
            p.grad.copy_(grads[n] * loss_scale)
        opt.step(loss_scale=loss_scale)
        reference.step(grads)
        for n in SHAPES:
            assert_close(params[n], reference.p[n].float(), 1e-6, f"step {step + 1} {n}")
    offsets = opt.layout.starts
    for i, n in enumerate(SHAPES):
        assert_close(opt.flat_state["exp_avg"][offsets[i] : offsets[i] + params[n].numel()],
                     reference.m[n].flatten().float(), 1e-6, f"momentum {n}")
    assert opt.state_kinds == ("exp_avg",) and opt.state_bytes() == 4 * opt.layout.total
    assert max_grad_norm is None or opt.grad_norm > max_grad_norm, "the clip was active"


def test_lion_steps_bf16_parameters_by_unbiased_rounding():
    """bf16 parameters: each element moves by ±lr from fp32's, rounded stochastically, so the
    mean over many elements follows the fp32 run although lr is below bf16's resolution."""
    shapes = {"w": (256, 256)}
    start = torch.full(shapes["w"], 1.0)
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        param = torch.nn.Parameter(start.clone().to(dtype))
        opt = Lion([("w", param)], lr=1e-3, fused=False, seed=5)
        for step in range(4):
            opt.zero_grad()
            param.grad.copy_(torch.ones(shapes["w"]))  # every sign +1: each step subtracts lr
            opt.step()
        runs[dtype] = param.detach().float()
    assert torch.allclose(runs[torch.float32], torch.full(shapes["w"], 1.0 - 4e-3))
    assert abs(runs[torch.bfloat16].mean().item() - (1.0 - 4e-3)) < 2e-4  # 1 ulp of bf16 at 1 is 7.8e-3
    assert runs[torch.bfloat16].unique().numel() > 1, "rounded stochastically, not to nearest"


def _session(kind="lion", steps=10, hyperparameters=None, **options):
    cfg = tiny_config("groupbert")
    own = {"lion": {"beta1": 0.9, "beta2": 0.99}}.get(kind, {}) if hyperparameters is None else hyperparameters
    spec = OptimizerSpec(kind=kind, schedule=Schedule(2e-3, 2, steps), weight_decay=0.1, hyperparameters=own)
    return cfg, TrainingSession(build_model(cfg, seed=1).builder.model_proto(), optimizer=spec,
                                options=SessionOptions(**options), seed=1)


def test_lion_is_a_configured_optimizer_that_learns():
    assert OPTIMIZERS["lion"] is Lion
    cfg, session = _session()
    assert isinstance(session.optimizer, Lion)
    batch = random_batch(cfg, 8, seed=2)
    losses = [session.run(batch)["loss"] for _ in range(10)]
    assert losses[-1] < 0.8 * losses[0], losses


def test_lion_resumes_bit_for_bit_and_refuses_another_optimizers_state(tmp_path):
    cfg, full = _session()
    batches = [random_batch(cfg, 8, seed=10 + s) for s in range(5)]
    expected = [full.run(b)["loss"] for b in batches]
    _, first = _session()
    for b in batches[:3]:
        first.run(b)
    first.save(tmp_path / "checkpoint-3")
    _, resumed = _session()
    resumed.load(tmp_path / "checkpoint-3")
    assert [resumed.run(b)["loss"] for b in batches[3:]] == expected[3:]
    for (name, a), (_, b) in zip(full.named_weights(), resumed.named_weights()):
        assert torch.equal(a, b), name
    assert torch.equal(full.optimizer.flat_state["exp_avg"], resumed.optimizer.flat_state["exp_avg"])
    _, lamb = _session("lamb")
    with pytest.raises(ValueError, match=r"optimizer state was saved by lion, this optimizer is lamb; resume with "
                                         r"optimizer 'lion'"):
        lamb.load(tmp_path / "checkpoint-3")
    assert isinstance(lamb.optimizer, Lamb)


def test_a_run_configured_with_lion_trains_and_records_it(tmp_path):
    import json

    from bert.tasks.pretraining import train
    from tests.test_training import run_config

    cfg = run_config(tmp_path, training=dict(optimizer="lion", learning_rate=1e-3, beta2=0.99, steps=3))
    result = train(cfg, progress=False)
    state = json.loads((result.checkpoint / "session.json").read_text())["optimizer"]
    assert state["optimizer"] == "lion" and state["state_kinds"] == ["exp_avg"]
    assert (state["param_groups"][0]["beta1"], state["param_groups"][0]["beta2"]) == (0.9, 0.99)
    assert "betas" not in state["param_groups"][0], "Lion's decays by its own names"


def test_lion_takes_its_own_hyperparameters_by_name_and_refuses_others():
    """Lion's are beta1 and beta2 (LionHyperparameters), not LAMB's betas or eps."""
    assert Lion(make_params().items()).param_groups[0]["beta2"] == 0.99, "the paper's default"
    with pytest.raises(ValueError, match=r"Lion takes no 'eps'; its own hyperparameters are beta1, beta2, besides lr "
                                         r"and weight_decay \(LionHyperparameters, session/hyperparameters\.py\)"):
        Lion(make_params().items(), eps=1e-8)
    with pytest.raises(ValueError, match=r"Lion: beta2 = 1\.0: Input should be less than 1"):
        Lion(make_params().items(), beta2=1.0)
    with pytest.raises(ValueError, match=r"optimizer 'lion': Lion takes no 'betas'"):
        _session(hyperparameters={"betas": (0.9, 0.99)})
