"""SGD with momentum and Nesterov's variant (session.optimizers.SGD): the rule added beside LAMB,
AdamW and Lion to show what a rule with hyperparameters of its own names costs (issue 52, step
3): its declaration (session/hyperparameters.py) and its class (session/optimizers.py), and
nothing else. Against a per-tensor float64 reference and torch.optim.SGD; in a training session:
it learns, resumes bit for bit and refuses another rule's state; from a config: its keys are
`momentum` and `nesterov`, another rule's are refused. Sharded under RTS at 2 replicas it is
checked in tests/test_distributed.py."""
from __future__ import annotations

import json

import pytest
import torch

from bert import build_model, config_from_dict
from bert.model import no_weight_decay
from session import SessionOptions
from session.optimizers import OPTIMIZERS, SGD, Lamb
from session.schedules import Schedule
from session.training import OptimizerSpec, TrainingSession
from tests.helpers import assert_close, random_batch, tiny_config
from tests.test_optimizers import FUSED, SHAPES, make_grads, make_params, unscaled_and_clipped


class ReferenceSGD:
    """SGDW (Loshchilov & Hutter 2019, Algorithm 1) with torch's momentum form, per tensor in
    float64: v ← μv + g; d = g + μv (Nesterov) or v; p ← p − lr·(d + wd·p); biases and
    LayerNorm take no weight decay."""

    def __init__(self, params, lr, momentum=0.9, nesterov=False, weight_decay=0.0, max_grad_norm=None):
        self.p = {n: p.detach().double().clone() for n, p in params.items()}
        self.v = {n: torch.zeros_like(p) for n, p in self.p.items()}
        self.lr, self.mu, self.nesterov, self.wd, self.max_grad_norm = lr, momentum, nesterov, weight_decay, max_grad_norm

    def step(self, grads, loss_scale=1.0):
        g = unscaled_and_clipped(grads, loss_scale, self.max_grad_norm)
        for n, p in self.p.items():
            self.v[n] = self.mu * self.v[n] + g[n]
            d = g[n] + self.mu * self.v[n] if self.nesterov else self.v[n]
            wd = 0.0 if no_weight_decay(n) else self.wd
            self.p[n] = p - self.lr * (d + wd * p)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
@pytest.mark.parametrize("loss_scale, max_grad_norm", [(1.0, None), (256.0, 2.0)])
def test_sgd_matches_the_reference(fused, nesterov, loss_scale, max_grad_norm):
    params = make_params()
    hyper = dict(lr=0.05, momentum=0.8, nesterov=nesterov, weight_decay=0.1, max_grad_norm=max_grad_norm)
    reference = ReferenceSGD(params, **hyper)
    opt = SGD(params.items(), fused=fused, no_decay=no_weight_decay, **hyper)
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
        assert_close(opt.flat_state["momentum_buffer"][offsets[i] : offsets[i] + params[n].numel()],
                     reference.v[n].flatten().float(), 1e-6, f"velocity {n}")
    assert opt.state_kinds == ("momentum_buffer",) and opt.state_bytes() == 4 * opt.layout.total
    assert max_grad_norm is None or opt.grad_norm > max_grad_norm, "the clip was active"


@pytest.mark.parametrize("nesterov", [False, True], ids=["momentum", "nesterov"])
def test_sgd_without_weight_decay_is_torch_sgd(nesterov):
    params, theirs = make_params(), make_params()
    opt = SGD(params.items(), lr=0.05, momentum=0.8, nesterov=nesterov, fused=False)
    torch_opt = torch.optim.SGD(theirs.values(), lr=0.05, momentum=0.8, nesterov=nesterov)
    for step in range(5):
        grads = make_grads(step)
        opt.zero_grad()
        for n, p in params.items():
            p.grad.copy_(grads[n])
            theirs[n].grad = grads[n].float()
        opt.step()
        torch_opt.step()
        for n in SHAPES:
            assert_close(params[n], theirs[n], 1e-6, f"step {step + 1} {n}")


def test_sgd_takes_its_own_hyperparameters_by_name():
    group = SGD(make_params().items()).param_groups[0]
    assert (group["momentum"], group["nesterov"]) == (0.9, False)
    with pytest.raises(ValueError, match=r"SGD takes no 'betas'; its own hyperparameters are momentum, nesterov"):
        SGD(make_params().items(), betas=(0.9, 0.99))
    with pytest.raises(ValueError, match=r"SGD: momentum = 1\.5: Input should be less than 1"):
        SGD(make_params().items(), momentum=1.5)


def _session(kind="sgd", steps=10, **options):
    cfg = tiny_config("groupbert")
    own = {"sgd": {"momentum": 0.8, "nesterov": True}}.get(kind, {})
    spec = OptimizerSpec(kind=kind, schedule=Schedule(0.05, 2, steps), weight_decay=0.01, hyperparameters=own)
    return cfg, TrainingSession(build_model(cfg, seed=1).builder.model_proto(), optimizer=spec,
                                options=SessionOptions(**options), seed=1)


def test_sgd_is_an_optimizer_a_session_trains_with():
    assert OPTIMIZERS["sgd"] is SGD
    cfg, session = _session()
    assert isinstance(session.optimizer, SGD) and session.optimizer.param_groups[0]["nesterov"] is True
    batch = random_batch(cfg, 8, seed=2)
    losses = [session.run(batch)["loss"] for _ in range(10)]
    assert losses[-1] < 0.8 * losses[0], losses


def test_sgd_resumes_bit_for_bit_and_refuses_another_optimizers_state(tmp_path):
    cfg, full = _session()
    batches = [random_batch(cfg, 8, seed=10 + s) for s in range(5)]
    expected = [full.run(b)["loss"] for b in batches]
    _, first = _session()
    for b in batches[:3]:
        first.run(b)
    first.save(tmp_path / "checkpoint-3")
    group = json.loads((tmp_path / "checkpoint-3" / "session.json").read_text())["optimizer"]["param_groups"][0]
    assert (group["momentum"], group["nesterov"]) == (0.8, True), "recorded by its own names"
    _, resumed = _session()
    resumed.load(tmp_path / "checkpoint-3")
    assert [resumed.run(b)["loss"] for b in batches[3:]] == expected[3:]
    for (name, a), (_, b) in zip(full.named_weights(), resumed.named_weights()):
        assert torch.equal(a, b), name
    assert torch.equal(full.optimizer.flat_state["momentum_buffer"], resumed.optimizer.flat_state["momentum_buffer"])
    _, lamb = _session("lamb")
    with pytest.raises(ValueError, match=r"optimizer state was saved by sgd, this optimizer is lamb"):
        lamb.load(tmp_path / "checkpoint-3")
    assert isinstance(lamb.optimizer, Lamb)


def test_sgd_is_a_config_rule_with_its_own_keys(tmp_path):
    from bert.tasks.pretraining import train

    model = {"architecture": "groupbert", "hidden_size": 48, "num_layers": 2, "num_heads": 3, "vocab_size": 101,
             "sequence_length": 24, "max_predictions": 4, "max_positions": 64}
    raw = {"version": 3, "name": "sgd", "model": model, "data": {"source": "synthetic"},
           "training": {"steps": 3, "output_dir": str(tmp_path / "run"), "log_every": 1},
           "batch": {"micro_batch_size": 4},
           "optimizer": {"name": "sgd", "learning_rate": 0.05, "momentum": 0.8, "nesterov": True}}
    cfg = config_from_dict(raw)
    assert cfg.optimizer.hyperparameters == {"momentum": 0.8, "nesterov": True}
    state = json.loads((train(cfg, progress=False).checkpoint / "session.json").read_text())["optimizer"]
    assert state["optimizer"] == "sgd" and state["state_kinds"] == ["momentum_buffer"]
    assert (state["param_groups"][0]["momentum"], state["param_groups"][0]["nesterov"]) == (0.8, True)
    with pytest.raises(ValueError, match=r"unknown key 'optimizer\.betas' \(value \[0\.9, 0\.99\]\) for optimizer\.name "
                                         r"'sgd': sgd takes name, learning_rate, weight_decay, max_grad_norm, "
                                         r"momentum, nesterov \(betas is lamb's and adamw's\)"):
        config_from_dict({**raw, "optimizer": {"name": "sgd", "betas": [0.9, 0.99]}})
    with pytest.raises(ValueError, match=r"optimizer\.nesterov = 1: Input should be a valid boolean"):
        config_from_dict({**raw, "optimizer": {"name": "sgd", "nesterov": 1}})
