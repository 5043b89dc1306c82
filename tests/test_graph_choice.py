"""graph=measure: a training session times its program eager and through torch.compile on its
first micro-batch and keeps the faster (session/kernel_tuning.py, issue 54 item 2). On a GPU
it is the default; here it is asked for, and the CPU's inductor compiles the tiny model."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from bert import build_model
from session import SessionOptions
from session.inference import InferenceSession
from session.kernel_tuning import measure_graph
from session.kernels import choose_kernels
from session.schedules import Schedule
from session.training import OptimizerSpec, TrainingSession
from tests.helpers import random_batch, tiny_config


def test_cuda_graphs_are_refused_off_cuda_in_one_line():
    with pytest.raises(ValueError, match="graph=cudagraphs replays .* needs a CUDA device, not cpu: use "
                                         "graph=compiled or graph=eager"):
        choose_kernels("cpu", "bf16", overrides={"graph": "cudagraphs"})


def _session(cfg, graph: str, steps: int = 10**6) -> TrainingSession:
    spec = OptimizerSpec(schedule=Schedule(0.01, 0, steps, decay="constant"))
    return TrainingSession(build_model(cfg, seed=3).builder.model_proto(), optimizer=spec,
                           options=SessionOptions(kernels={"graph": graph}), seed=3)


@pytest.mark.slow
def test_measured_graph_trains_as_the_chosen_one_and_the_next_run_reads_the_cache(tmp_path, monkeypatch):
    """The first step times both, names the winner and its ratio in a note, and trains as a
    session given the winner outright (the measurement's dropout draws are its own); the next
    session reads the choice from the cache."""
    monkeypatch.setenv("GROUPBERT_KERNEL_CACHE", str(tmp_path / "choices.json"))
    cfg = tiny_config("groupbert", hidden_dropout=0.1, attention_dropout=0.1)
    batch = random_batch(cfg, 4)
    measured = _session(cfg, "measure")
    assert measured.policy.graph == "measure" and "graph=measure" in measured.policy.describe()
    first = [measured.run(batch) for _ in range(2)]
    winner = measured.policy.graph
    assert winner in ("eager", "compiled"), winner
    (note,) = measured.notes
    loser = "compiled" if winner == "eager" else "eager"
    assert note.startswith(f"kernels: graph={winner} measured ") and f"faster than {loser} on " in note, note
    assert "graph=" + winner in measured.policy.describe() and "measured" in measured.policy.describe()
    times = json.loads((tmp_path / "choices.json").read_text())
    ((key, entry),) = times.items()
    assert entry["winner"] == winner and set(entry["times_ms"]) == {"eager", "compiled"}, entry

    given = _session(cfg, winner)
    second = [given.run(batch) for _ in range(2)]
    # The same dropout draws. Inductor's CPU kernels are not reproducible to the last bit: two
    # processes running the same compiled session differ by 1.2e-7 after 3 steps (2 threads,
    # Zen 4, 2026-11-30), where eager ones are equal.
    for a, b in zip(first, second):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (a, b)
    for (name, p), (_, q) in zip(measured.named_weights(), given.named_weights()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)

    # The next session on this machine reads the choice: no timing, and no compile to find out
    # (a short run would not pay a cached compile of 30 s back: eager, saying so).
    entry["first_s"] = 30.0
    (tmp_path / "choices.json").write_text(json.dumps({key: entry}))
    again = _session(cfg, "measure", steps=20)
    again.run(batch)
    (note,) = again.notes
    assert again.policy.graph == "eager", note
    if winner == "compiled":
        assert "(cached), but 20 passes save" in note and "against its 30 s of compiling" in note, note
    else:
        assert note.endswith("(cached)"), note


def test_a_run_too_short_to_pay_back_a_compile_is_not_compiled_to_find_out(tmp_path, monkeypatch):
    monkeypatch.setenv("GROUPBERT_KERNEL_CACHE", str(tmp_path / "choices.json"))
    cfg = tiny_config("bert")
    session = _session(cfg, "measure", steps=40)
    began = time.perf_counter()
    session.run(random_batch(cfg, 4))
    assert time.perf_counter() - began < 10, "compiled to find out"
    (note,) = session.notes
    assert session.policy.graph == "eager" and note.startswith("kernels: graph=eager: 40 passes of "), note
    assert "cannot pay back a compile" in note
    assert not (tmp_path / "choices.json").exists(), "a choice by the run's length is not the device's"


def test_a_compile_that_fails_or_disagrees_is_left_out_and_named(tmp_path, monkeypatch):
    """Never fatal, never cached: the eager program runs, and the line says why."""
    monkeypatch.setenv("GROUPBERT_KERNEL_CACHE", str(tmp_path / "choices.json"))
    x = torch.linspace(-1, 1, 64, requires_grad=True)

    def eager():
        loss = (x * x).sum()
        torch.autograd.grad(loss, [x])
        return (loss.detach(),)

    def broken():
        raise RuntimeError("inductor: no C++ compiler\nmore")

    def wrong():
        return (eager()[0] * 1.5,)

    for compiled, why in ((broken, "compiled failed here (RuntimeError: inductor: no C++ compiler)"),
                          (wrong, "compiled disagreed with eager here (relative error 5.0e-01)")):
        result = measure_graph(torch.device("cpu"), "fp32", "toy", {"eager": eager, "compiled": compiled}, 10**12)
        assert result.winner == "eager" and why in result.text(), result.text()
    assert not (tmp_path / "choices.json").exists()


def test_measure_is_a_graph_choice_that_a_resume_and_serving_read_as_pending():
    measure = choose_kernels("cpu", "fp32", overrides={"graph": "measure"})
    assert measure.graph == "measure"
    assert measure.changes_from({**measure.as_dict(), "graph": "compiled"}) == [], "decided again by the step"
    assert choose_kernels("cpu", "fp32").graph == "eager", "the CPU's default stays eager (compiled 0.94-0.99)"
    cfg = tiny_config("bert")
    proto = build_model(cfg).builder.model_proto()
    serving = InferenceSession(proto, SessionOptions(kernels={"graph": "measure"}))
    assert serving.policy.graph == "eager"
    batch = {k: v for k, v in random_batch(cfg, 2).items() if k in serving.input_names}
    assert all(np.isfinite(np.asarray(v)).all() for v in serving.run(batch).values())
