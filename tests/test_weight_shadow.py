"""The weights' low-precision copy made once per step (session/shadow.py, weight_cast=shadow):
training, evaluation and weights written between steps equal to a cast at each use
(weight_cast=autocast) to the bit, with no cast of a dense weight left in a step's forward."""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from onnx import numpy_helper

from bert import build_model
from session import SessionOptions
from session.kernels import choose_kernels
from session.schedules import Schedule
from session.shadow import WeightShadow, full_precision
from session.training import OptimizerSpec, TrainingSession
from tests.helpers import random_batch, tiny_config

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def session_for(cfg, weight_cast: str, device: str = "cpu", **options) -> TrainingSession:
    spec = OptimizerSpec(kind="lamb", schedule=Schedule(0.01, 1, 10), max_grad_norm=5.0)
    return TrainingSession(build_model(cfg, seed=3).builder.model_proto(), optimizer=spec, seed=3,
                           options=SessionOptions(precision="bf16", device=device,
                                                  kernels={"weight_cast": weight_cast}, **options))


def weights_of(session: TrainingSession) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().clone() for name, p in session.named_weights()}


def train(session: TrainingSession, cfg, steps: int = 3) -> list[float]:
    return [session.run(random_batch(cfg, 6, seed=10 + step, pad_from=3))["loss"] for step in range(steps)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("architecture", ["bert", "groupbert"])
def test_training_on_the_copy_equals_a_cast_at_each_use_to_the_bit(architecture, device):
    """Three steps of 3 micro-batches: the losses and every weight after them are the same bits
    whether the dense layers read the step's copy or cast their weights in each forward; the
    weights change between steps, so a copy not made again would show."""
    cfg = tiny_config(architecture)
    runs = {}
    for weight_cast in ("shadow", "autocast"):
        session = session_for(cfg, weight_cast, device, gradient_accumulation=3)
        assert session.policy.weight_cast == weight_cast
        runs[weight_cast] = (train(session, cfg), weights_of(session))
    (shadow_losses, shadow), (cast_losses, cast) = runs["shadow"], runs["autocast"]
    assert shadow_losses == cast_losses
    assert len(set(shadow_losses)) == 3
    assert shadow.keys() == cast.keys()
    changed = [n for n in shadow if not torch.equal(shadow[n], cast[n])]
    assert not changed, f"weights differ: {changed[:5]}"


def _forward_casts(session: TrainingSession, cfg) -> tuple[collections.Counter, int]:
    """A profiled step: the forward's casts of tensors shaped like a dense weight or bias (not
    under a backward node), and the multi-tensor copies made."""
    shapes = {tuple(p.shape) for name, p in session.named_weights() if p.dim() == 2 or name.endswith("bias")}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        session.run(random_batch(cfg, 6, seed=1, pad_from=3))

    def in_backward(event) -> bool:
        while event is not None:
            if "Backward" in event.name or "backward" in event.name:
                return True
            event = event.cpu_parent
        return False

    casts = collections.Counter(tuple(e.input_shapes[0]) for e in prof.events()
                                if e.name == "aten::_to_copy" and e.input_shapes and tuple(e.input_shapes[0]) in shapes
                                and not in_backward(e))
    copies = sum(e.name == "aten::_foreach_copy_" for e in prof.events())
    return casts, copies


def test_a_step_on_the_copy_casts_no_dense_weight_and_makes_the_copy_once():
    cfg = tiny_config("bert", hidden_size=40, num_heads=4)  # FFN 160: shapes no activation shares
    shadow = session_for(cfg, "shadow", gradient_accumulation=3)
    train(shadow, cfg, 1)
    casts, copies = _forward_casts(shadow, cfg)
    assert copies == 1, f"{copies} copies of the weights in a step of 3 micro-batches"
    dense = {(160, 40), (40, 160), (120, 40)}  # FFN in and out, query/key/value concatenated
    assert not dense & set(casts), casts
    # The same step casting at each use casts every dense weight in each micro-batch.
    cast = session_for(cfg, "autocast", gradient_accumulation=3)
    train(cast, cfg, 1)
    casts, copies = _forward_casts(cast, cfg)
    assert copies == 0 and casts[(160, 40)] == 3 * cfg.num_layers, casts


def test_weights_written_between_steps_and_evaluation_read_the_new_weights():
    """load_weights between steps, then a step and an evaluation: the copy is made again, as
    a cast at each use would read them; an evaluation outside a step makes it again too."""
    cfg = tiny_config("groupbert")
    results = {}
    for weight_cast in ("shadow", "autocast"):
        session = session_for(cfg, weight_cast)
        losses = train(session, cfg, 2)
        rng, proto = np.random.default_rng(5), session.model_proto()
        for t in proto.graph.initializer:
            scaled = numpy_helper.to_array(t) * rng.uniform(0.5, 1.5, tuple(t.dims))
            t.CopyFrom(numpy_helper.from_array(scaled.astype(np.float32), t.name))
        session.load_weights(proto)
        before = session.evaluate(random_batch(cfg, 4, seed=7), ["loss"])
        losses += train(session, cfg, 1)
        after = session.evaluate(random_batch(cfg, 4, seed=7), ["loss"])
        results[weight_cast] = (losses, before, after, weights_of(session))
    shadow, cast = results["shadow"], results["autocast"]
    assert shadow[0] == cast[0]
    for k in (1, 2):
        assert {n: np.asarray(v).tolist() for n, v in shadow[k].items()} == \
               {n: np.asarray(v).tolist() for n, v in cast[k].items()}
    assert np.asarray(shadow[1]["loss"]).tolist() != np.asarray(shadow[2]["loss"]).tolist(), "the step changed them"
    assert all(torch.equal(shadow[3][n], cast[3][n]) for n in cast[3])


def test_a_forward_without_autocast_reads_the_float32_weights():
    """The copy is read only under autocast to its dtype: the same graph run in fp32 computes
    with the float32 weights, concatenated where the layer takes them so."""
    cfg = tiny_config("bert")
    session = session_for(cfg, "shadow")
    graph = session.executor.graphs[0]
    feeds = {k: torch.as_tensor(v) for k, v in random_batch(cfg, 3, seed=2).items() if k in graph.input_names}
    with torch.no_grad():
        fp32 = graph(feeds)["loss"]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = graph(feeds)["loss"]
    plain = TrainingSession(build_model(cfg, seed=3).builder.model_proto(), seed=3,
                            optimizer=OptimizerSpec(kind="lamb", schedule=Schedule(0.01, 1, 10)),
                            options=SessionOptions(precision="fp32")).executor.graphs[0]
    with torch.no_grad():
        assert torch.equal(plain(feeds)["loss"], fp32)
    assert not torch.equal(fp32, bf16)


def test_the_copys_gradient_is_the_casts_split_by_rows():
    """WeightShadow alone: the copy of a group is its weights concatenated and rounded to bf16;
    the gradient each weight receives is the concatenation's, cast back and split; moved to
    another buffer (module.to), the views follow."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 5)), torch.nn.Parameter(torch.randn(2, 5)),
              torch.nn.Parameter(torch.randn(7))]
    groups = [(0, 1), (2,)]
    shadow = WeightShadow(groups, [p.shape for p in params], torch.bfloat16)
    shadow.refresh(params)
    copies = shadow.values(params)
    references = [t.to(torch.bfloat16) for t in full_precision(params, groups)]
    assert all(torch.equal(c, r) for c, r in zip(copies, references))
    upstream = [torch.randn(c.shape, dtype=torch.bfloat16) for c in copies]
    torch.autograd.backward(copies, upstream)
    expected = [upstream[0].float()[:3], upstream[0].float()[3:], upstream[1].float()]
    assert all(torch.equal(p.grad, e) for p, e in zip(params, expected))
    assert copies[1].grad_fn.name() == "_ShadowCastBackward"
    shadow.flat = shadow.flat.clone()  # as module.to(device) replaces a buffer
    with torch.no_grad():
        params[2].add_(1.0)
    shadow.refresh(params)
    assert torch.equal(shadow.values(params)[1], params[2].detach().to(torch.bfloat16))


def test_the_policy_keeps_casts_until_the_copy_has_run_on_a_gpu():
    """The default is a cast at each use everywhere: on this CPU the copy saved nothing
    measurable (the casts are a fraction of a percent of a step), and it has not run on a GPU,
    where the casts are many small kernels. `weight_cast=shadow` asks for it."""
    assert choose_kernels("cpu", "bf16").weight_cast == "autocast"
    assert choose_kernels("cpu", "bf16", overrides={"weight_cast": "shadow"}).weight_cast == "shadow"
    with pytest.raises(ValueError, match="weight_cast cannot be 'bf16'"):
        choose_kernels("cpu", "bf16", overrides={"weight_cast": "bf16"})


def test_the_replicas_take_a_weights_gradient_through_its_copy_as_through_a_cast():
    """session/replication.py gradient_edges(through_casts=True): a use through the copy of one
    weight is the node that hands the copy its bf16 gradient, as for autocast's cast; a copy
    of several weights (concatenated) is a use of each, at the copy's node."""
    from session.replication import gradient_edges

    w, v, u = (torch.nn.Parameter(torch.randn(4, 3)) for _ in range(3))
    shadow = WeightShadow([(0,), (1, 2)], [w.shape, v.shape, u.shape], torch.bfloat16)
    shadow.refresh([w, v, u])
    single, both = shadow.values([w, v, u])
    x = torch.randn(2, 3, dtype=torch.bfloat16)
    loss = (single @ x.t()).float().sum() + (both @ x.t()).float().sum()
    accumulators = {p.view_as(p).grad_fn.next_functions[0][0]: i for i, p in enumerate((w, v, u))}
    edges = gradient_edges([loss], accumulators, through_casts=True)
    assert [node.name() for node, _ in edges[0]] == ["MmBackward0"]
    assert [node.name() for node, _ in edges[1]] == [node.name() for node, _ in edges[2]] == ["_ShadowCastBackward"]
    plain = gradient_edges([loss], accumulators, through_casts=False)
    assert [node.name() for node, _ in plain[0]] == ["_ShadowCastBackward"]
