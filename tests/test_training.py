"""TrainingSession and the bert.py run: resume, phases, accumulation, recompute, precision."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bert import build_model, config_from_dict
from bert.train import train
from session import SessionOptions
from session.schedules import Schedule
from session.training import OptimizerSpec, TrainingSession, _LossScaler
from tests.helpers import assert_close, random_batch, tiny_config

ROOT = Path(__file__).resolve().parents[1]


def run_config(tmp_path, **sections):
    model = dict(architecture="groupbert", hidden_size=48, num_layers=2, num_heads=3, vocab_size=101,
                 sequence_length=24, max_predictions=4, max_positions=64)
    model.update(sections.pop("model", {}))
    training = dict(steps=6, micro_batch_size=4, learning_rate=0.01, warmup_steps=2, output_dir=str(tmp_path / "run"),
                    log_every=1)
    training.update(sections.pop("training", {}))
    data = dict(source="synthetic")
    data.update(sections.pop("data", {}))
    return config_from_dict({"name": "t", "model": model, "training": training, "data": data})


def test_resume_continues_bit_for_bit(tmp_path):
    # Dropout on, so the restored RNG state matters too.
    cfg = run_config(tmp_path, model=dict(hidden_dropout=0.1, attention_dropout=0.1),
                     training=dict(checkpoint_every=3))
    full = train(cfg, progress=False)
    assert (full.output_dir / "checkpoint-3").is_dir()
    # As if the run had crashed after step 6, before writing its final checkpoint.
    shutil.rmtree(full.output_dir / "checkpoint-final")
    resumed = train(cfg, checkpoint_input=str(full.output_dir / "checkpoint-3"), progress=False)
    assert resumed.output_dir == full.output_dir, "a resume that continues the run writes into it"
    assert [m["step"] for m in resumed.metrics] == [4, 5, 6]
    for a, b in zip(full.metrics[3:], resumed.metrics):
        for key in ("loss", "mlm_loss", "nsp_loss", "learning_rate"):
            assert a[key] == b[key], f"step {a['step']} {key}: {a[key]!r} uninterrupted vs {b[key]!r} resumed"
    # metrics.jsonl holds each step once after the resume; the old file is kept beside it.
    lines = [json.loads(x) for x in (full.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]
    assert (full.output_dir / "metrics.before-resume-3.jsonl").exists()


def test_phase2_starts_from_phase1_weights_at_another_length(tmp_path):
    phase1 = train(run_config(tmp_path, training=dict(steps=2)), progress=False)
    cfg2 = run_config(tmp_path, model=dict(sequence_length=48, max_predictions=8),
                      training=dict(steps=2, init_from=str(phase1.checkpoint), output_dir=str(tmp_path / "p2")))
    from bert.train import make_session

    session = make_session(cfg2)
    session.load_weights(phase1.checkpoint)
    saved = TrainingSession(phase1.checkpoint / "model.onnx").graph.weights_state_dict()
    for name, p in session.graph.named_weights():
        assert torch.equal(p.detach(), saved[name]), name
    phase2 = train(cfg2, progress=False)
    assert [m["step"] for m in phase2.metrics] == [1, 2]
    assert phase2.output_dir == tmp_path / "p2"


def _session(cfg, **options):
    model = build_model(cfg).builder.model_proto()
    lr = options.pop("lr", 0.01)
    spec = OptimizerSpec(kind=options.pop("kind", "lamb"), schedule=Schedule(lr, 0, 10, decay="constant"))
    return TrainingSession(model, optimizer=spec, options=SessionOptions(**options))


def test_gradient_accumulation_equals_one_big_batch():
    cfg = tiny_config("groupbert")
    batch = random_batch(cfg, 8)
    batch["masked_lm_positions"][:, -1] = batch["masked_lm_positions"][:, 0] + 1  # every slot used
    batch["masked_lm_positions"].sort(axis=1)
    grads = []
    for accumulation in (1, 2):
        session = _session(cfg, gradient_accumulation=accumulation)
        # Capture the gradient the optimizer receives (its buffer holds the update afterwards).
        session.optimizer.step = lambda loss_scale, s=session: grads.append(s.optimizer.flat_grads.clone())
        session.run(batch)
    assert_close(grads[1], grads[0], 1e-5, "accumulated gradient")


def test_recompute_gives_the_same_gradients():
    cfg = tiny_config("groupbert")
    batch = {k: torch.from_numpy(v) for k, v in random_batch(cfg, 3, pad_from=3).items()}
    plain, again = _session(cfg), _session(cfg, recompute=True)
    assert any(seg[1] is not None for seg in again.graph._segments), "the graph has recompute segments"
    for s in (plain, again):
        s.graph(batch)["loss"].backward()
    for (name, a), (_, b) in zip(plain.graph.named_weights(), again.graph.named_weights()):
        assert_close(a.grad, b.grad, 1e-6, name)


@pytest.mark.parametrize("precision, loss_scaling", [("bf16", None), ("fp16", "dynamic"), ("fp16", 1024.0)])
def test_mixed_precision_training_learns_a_fixed_batch(precision, loss_scaling):
    cfg = tiny_config("bert")
    batch = random_batch(cfg, 8)
    reference = _session(cfg, lr=0.03)
    fp32 = [reference.run(batch)["loss"] for _ in range(15)]
    session = _session(cfg, lr=0.03, precision=precision, loss_scaling=loss_scaling)
    losses = [session.run(batch)["loss"] for _ in range(15)]
    assert losses[-1] < 0.8 * losses[0], f"{precision}: {losses}"
    assert abs(losses[-1] - fp32[-1]) < 0.05 * fp32[-1], f"{precision} {losses[-1]:.4f} vs fp32 {fp32[-1]:.4f}"
    assert all(p.dtype == torch.float32 for _, p in session.graph.named_weights()), "master weights stay fp32"


def test_dynamic_loss_scale_halves_on_overflow_and_skips_the_step():
    cfg = tiny_config("bert")
    session = _session(cfg, precision="fp16", loss_scaling="dynamic")
    before = {n: p.detach().clone() for n, p in session.graph.named_weights()}
    session.scaler.scale = 1e30  # certain overflow in fp16
    out = session.run(random_batch(cfg, 4))
    assert out["skipped"] == 1.0 and session.step == 0
    assert session.scaler.scale == 5e29
    for n, p in session.graph.named_weights():
        assert torch.equal(p, before[n]), f"{n} changed on a skipped step"
    scaler = _LossScaler("dynamic", growth_interval=2)
    scaler.update(False), scaler.update(False)
    assert scaler.scale == 2.0**16


def test_adamw_session_trains():
    cfg = tiny_config("bert")
    session = _session(cfg, kind="adamw")
    batch = random_batch(cfg, 8)
    losses = [session.run(batch)["loss"] for _ in range(10)]
    assert losses[-1] < 0.8 * losses[0], losses


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    cfg = tiny_config("bert")
    session = _session(cfg)
    target = tmp_path / "checkpoint"
    session.save(target, {"mark": 1})
    before = sorted(p.name for p in target.iterdir())

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("session.training.torch.save", broken)
    with pytest.raises(OSError, match="disk full"):
        session.save(target, {"mark": 2})
    assert sorted(p.name for p in target.iterdir()) == before
    assert json.loads((target / "session.json").read_text())["extra"] == {"mark": 1}


def test_a_fresh_run_never_writes_into_another_runs_directory(tmp_path):
    cfg = run_config(tmp_path, training=dict(steps=1, warmup_steps=0))
    first = train(cfg, progress=False)
    second = train(cfg, progress=False)
    assert first.output_dir != second.output_dir and second.output_dir.name == "run.1"
    assert len((first.output_dir / "metrics.jsonl").read_text().splitlines()) == 1


def test_cli_rejects_unknown_override_with_a_clear_message():
    result = subprocess.run(
        [sys.executable, "bert.py", "--config", "configs/groupbert_tiny.json", "--training.stepz", "3", "--summary"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert result.returncode == 2
    assert "unknown key 'training.stepz' (value 3)" in result.stderr


def test_cli_summary_ends_with_the_parameter_count():
    result = subprocess.run(
        [sys.executable, "bert.py", "--config", "configs/groupbert_base.json", "--summary"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )
    assert result.stdout.strip().splitlines()[-1] == "parameters: 160842044"
    assert "forward FLOPs per token" in result.stdout


@pytest.mark.slow
def test_compiled_session_matches_eager_through_the_custom_conv():
    """torch.compile traces the lowered GroupBERT graph, the custom op included."""
    cfg = tiny_config("groupbert")
    batch = random_batch(cfg, 4, pad_from=2)
    eager, compiled = _session(cfg), _session(cfg, compile=True)
    for step in range(2):
        a, b = eager.run(batch)["loss"], compiled.run(batch)["loss"]
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: eager {a} vs compiled {b}"


def test_wandb_logs_offline_without_credentials(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    result = train(run_config(tmp_path, training=dict(steps=2, warmup_steps=0)), use_wandb=True, progress=False)
    runs = list((result.output_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, f"expected one offline wandb run, found {runs}"
    assert list(runs[0].glob("*.wandb")), "the offline run holds no logged data"


def test_checkpoint_graph_of_an_untrained_session_equals_its_input_byte_for_byte():
    proto = build_model(tiny_config("groupbert")).builder.model_proto()
    session = TrainingSession(proto)
    assert len(proto.graph.initializer) > 0, "the input keeps its weights"
    assert session.model_proto().SerializeToString() == proto.SerializeToString()


# ------------------------------------------------------------------ oneDNN linear
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_equals_float64_forward_and_backward(bias):
    from session.lowering import _OneDnnLinear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 24, generator=g, dtype=torch.float64)
    w = torch.randn(40, 24, generator=g, dtype=torch.float64)
    b = torch.randn(40, generator=g, dtype=torch.float64) if bias else None
    dy = torch.randn(3, 5, 40, generator=g, dtype=torch.float64)
    ref = [t.clone().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
    torch.nn.functional.linear(*ref).backward(dy)
    ours = [t.float().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
    y = _OneDnnLinear.apply(*ours, *(() if bias else (None,)))
    y.backward(dy.float())
    assert_close(y.double(), torch.nn.functional.linear(x, w, b), 1e-5, "y")
    for name, r, o in zip(("dx", "dw", "db"), ref, ours):
        assert_close(o.grad.double(), r.grad, 1e-5, name)


def test_sessions_train_alike_through_onednn_and_torch_linear(monkeypatch):
    import session.lowering as lowering

    cfg = tiny_config("bert")
    batches = [random_batch(cfg, 4, seed=s) for s in range(3)]
    runs, calls, apply = {}, [], lowering._OneDnnLinear.apply
    monkeypatch.setattr(lowering._OneDnnLinear, "apply", lambda *a: calls.append(1) or apply(*a))
    for onednn in (False, True):
        monkeypatch.setattr(lowering, "_ONEDNN_LINEAR", onednn)
        calls.clear()
        session = TrainingSession(build_model(cfg, seed=3).builder.model_proto())
        runs[onednn] = [session.run(b)["loss"] for b in batches]
        assert bool(calls) == onednn, "the fused linear layers take the chosen path"
        calls.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast keeps torch's bf16 GEMM
            session.graph({k: torch.from_numpy(v) for k, v in batches[0].items()})
        assert not calls
    assert_close(torch.tensor(runs[True]), torch.tensor(runs[False]), 1e-5, "losses over 3 steps")


def test_linear_choice_is_checked(monkeypatch):
    from session.lowering import _onednn_by_default

    for value, expected in (("torch", False), ("onednn", True)):
        monkeypatch.setenv("GROUPBERT_LINEAR", value)
        assert _onednn_by_default() is expected
    monkeypatch.setenv("GROUPBERT_LINEAR", "mkl")
    with pytest.raises(ValueError, match="GROUPBERT_LINEAR='mkl': use auto, torch or onednn"):
        _onednn_by_default()
