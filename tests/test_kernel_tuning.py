"""Kernel choices timed on the device (session/kernel_tuning.py): the graph's convolution shape,
a real measurement of the compiled kernels against torch's convolution, its cache per device
model, torch version, precision and shape, and the policy that takes it (on CUDA by default,
anywhere with conv=measure), while an explicit choice is never measured over."""
import json

import pytest
import torch

from bert import build_model
from custom_ops import load_library
from session.kernel_choices import check_overrides
from session.kernel_tuning import ConvShape, Measurement, cache_path, conv_shape, measure_conv
from session.kernels import choose_kernels
from tests.helpers import tiny_config

pytestmark = pytest.mark.skipif(not load_library(), reason="the compiled ops are not built (make)")
SHAPE = ConvShape(sequence=32, hidden=64, per_group=16, width=7)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GROUPBERT_KERNEL_CACHE", str(tmp_path / "choices.json"))
    return tmp_path / "choices.json"


def test_the_convolution_measured_is_the_graphs_own():
    cfg = tiny_config("groupbert", sequence_length=24, conv_group_size=8)
    proto = build_model(cfg).builder.model_proto()
    assert conv_shape(proto) == ConvShape(24, cfg.hidden_size, 8, cfg.conv_kernel)
    assert conv_shape(build_model(tiny_config("bert")).builder.model_proto()) is None


def test_a_measurement_times_both_and_is_cached_for_this_machine(cache):
    first = measure_conv(torch.device("cpu"), "fp32", SHAPE)
    assert not first.cached and set(first.times_ms) == {"compiled", "torch"} and all(t > 0 for t in
                                                                                     first.times_ms.values())
    assert first.winner == min(first.times_ms, key=first.times_ms.get) and first.ratio >= 1
    (key, entry), = json.loads(cache.read_text()).items()
    assert f"torch {torch.__version__}" in key and "fp32" in key and SHAPE.text() in key
    again = measure_conv(torch.device("cpu"), "fp32", SHAPE)
    assert again.cached and again.winner == first.winner and again.times_ms == entry["times_ms"]
    assert not measure_conv(torch.device("cpu"), "bf16", SHAPE).cached, "another precision is measured anew"
    cache.write_text("{not json")
    assert not measure_conv(torch.device("cpu"), "fp32", SHAPE).cached and json.loads(cache.read_text())


def test_three_candidates_are_named_by_their_ratio_to_the_winner_and_cached_apart(cache):
    # On a GPU with Triton three convolutions are timed: the runner-up decides the headline ratio.
    measured = Measurement("conv", "triton", {"compiled": 2.0, "torch": 1.5, "triton": 1.0}, "NVIDIA H200, bf16", False)
    assert measured.runner_up == "torch" and measured.ratio == 1.5
    assert measured.text() == "conv=triton measured 1.50× faster than torch, 2.00× than compiled on NVIDIA H200, bf16"
    two = measure_conv(torch.device("cpu"), "fp32", SHAPE, ("compiled", "torch"))
    one_more = measure_conv(torch.device("cpu"), "fp32", SHAPE, ("torch", "compiled"))
    assert not two.cached and not one_more.cached, "the candidates are part of the key: a new one is timed"
    assert len(json.loads(cache.read_text())) == 2


@pytest.mark.parametrize("fault", ["raises", "wrong"])
def test_a_candidate_that_fails_or_disagrees_here_is_left_out_and_named(cache, monkeypatch, fault):
    """A kernel not yet run on this device (Triton's on a new GPU) must not end the run by
    failing, nor win by being fast and wrong: the measurement leaves it out, says why in the
    policy line, and caches nothing, so it is tried again next time."""
    import custom_ops.grouped_conv1d as conv

    real = conv.grouped_conv1d

    def faulty(x, w, mask=None, ids=None, *, implementation="compiled"):
        if implementation == "torch" and fault == "raises":
            raise RuntimeError("no kernel image is available for execution on the device")
        out = real(x, w, mask, ids, implementation=implementation)
        return out * 1.5 if implementation == "torch" else out

    monkeypatch.setattr(conv, "grouped_conv1d", faulty)
    measured = measure_conv(torch.device("cpu"), "fp32", SHAPE)
    assert measured.winner == "compiled" and set(measured.times_ms) == {"compiled"} and not cache.exists()
    why = "failed here (RuntimeError: no kernel image" if fault == "raises" else "disagreed with compiled here"
    assert measured.text().startswith("conv=compiled, the only one that ran on ") and f"torch {why}" in measured.text()


def test_the_policy_takes_the_measured_winner_and_says_so(cache):
    measured = measure_conv(torch.device("cpu"), "fp32", SHAPE)
    policy = choose_kernels("cpu", "fp32", overrides={"conv": "measure"}, conv=SHAPE)
    assert policy.conv == measured.winner and policy.measured == measured.text() + " (cached)"
    assert f"conv={measured.winner} measured {measured.ratio:.2f}× faster than" in policy.describe()
    # A recorded choice decides the next run: here the cache says torch's convolution wins.
    entries = json.loads(cache.read_text())
    for entry in entries.values():
        entry.update(winner="torch", times_ms={"compiled": 2.0, "torch": 1.0})
    cache.write_text(json.dumps(entries))
    policy = choose_kernels("cpu", "fp32", overrides={"conv": "measure"}, conv=SHAPE)
    assert policy.conv == "torch" and "conv=torch measured 2.00× faster than compiled" in policy.describe()


def test_an_explicit_choice_or_the_cpu_default_is_not_measured(cache):
    assert choose_kernels("cpu", "fp32", overrides={"conv": "torch"}, conv=SHAPE).conv == "torch"
    assert choose_kernels("cpu", "fp32", conv=SHAPE).conv == "compiled"
    assert not cache.exists(), "nothing was timed"
    assert check_overrides({"conv": "measure"}) == {"conv": "measure"}
    with pytest.raises(ValueError, match="gemm cannot be 'measure'"):
        check_overrides({"gemm": "measure"})


def test_a_training_session_asked_to_measure_runs_the_winner(cache):
    from session import SessionOptions
    from session.training import OptimizerSpec, TrainingSession

    cfg = tiny_config("groupbert", sequence_length=24)
    session = TrainingSession(build_model(cfg, with_loss=True).builder.model_proto(), "loss", OptimizerSpec(),
                              SessionOptions(kernels={"conv": "measure"}))
    assert session.policy.measured.startswith(f"conv={session.policy.conv} measured")
    assert cache_path() == cache and cache.exists()
