"""TrainingSession and the bert.py run: resume, phases, accumulation, recompute, precision."""
import errno
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bert import build_model, config_from_dict
from bert.tasks.pretraining import train
from session import SessionOptions
from session.schedules import Schedule
from session import checkpoint
from session.state import LossScaler
from session.training import OptimizerSpec, TrainingSession
from tests.helpers import assert_close, random_batch, sections, tiny_config

ROOT = Path(__file__).resolve().parents[1]


def run_config(tmp_path, **given):
    """A tiny synthetic run; `training` takes its settings flat, by their version-1 names (tests.helpers.sections)."""
    model = dict(architecture="groupbert", hidden_size=48, num_layers=2, num_heads=3, vocab_size=101,
                 sequence_length=24, max_predictions=4, max_positions=64)
    model.update(given.pop("model", {}))
    training = dict(steps=6, micro_batch_size=4, learning_rate=0.01, warmup_steps=2, output_dir=str(tmp_path / "run"),
                    log_every=1)
    training.update(given.pop("training", {}))
    data = dict(source="synthetic")
    data.update(given.pop("data", {}))
    return config_from_dict({"name": "t", "model": model, **sections(**training), "data": data})


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
    from bert.tasks.pretraining import make_session

    session = make_session(cfg2)
    session.load_weights(phase1.checkpoint)
    saved = dict(TrainingSession(phase1.checkpoint / "model.onnx").named_weights())
    for name, p in session.named_weights():
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


class RecordingHooks:
    """GradientHooks that write down what an executor tells them, in order."""

    def __init__(self):
        self.events = []

    def forward_of(self, microbatch, stage):
        self.events.append(("forward_of", microbatch, stage, torch.is_grad_enabled()))

    def forward_done(self, microbatch, stage):
        self.events.append(("forward_done", microbatch, stage))

    def backward_of(self, microbatch, roots):
        self.events.append(("backward_of", microbatch, all(r.grad_fn is not None for r in roots)))

    def end_microbatch(self, microbatch):
        self.events.append(("end_microbatch", microbatch))


def test_gradient_hooks_frame_each_forward_and_backward_in_order():
    """The forward half of GradientHooks (what weight sharding needs: gather before a
    stage's forward, free after it) and the backward half, per micro-batch, in order."""
    session = _session(tiny_config("groupbert"), gradient_accumulation=3)
    hooks = RecordingHooks()
    feeds = session._feeds(random_batch(tiny_config("groupbert"), 6), session.input_names)
    session.executor.train_step(feeds, 1.0, hooks)
    assert hooks.events == [event for m in range(3) for event in (
        ("forward_of", m, 0, True), ("forward_done", m, 0), ("backward_of", m, True), ("end_microbatch", m))]


def test_recompute_gives_the_same_gradients():
    cfg = tiny_config("groupbert")
    batch = {k: torch.from_numpy(v) for k, v in random_batch(cfg, 3, pad_from=3).items()}
    plain, again = _session(cfg), _session(cfg, recompute=True)
    assert any(seg[1] is not None for seg in again.executor.graphs[0]._segments), "the graph has recompute segments"
    for s in (plain, again):
        s.executor.graphs[0](batch)["loss"].backward()
    for (name, a), (_, b) in zip(plain.named_weights(), again.named_weights()):
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
    assert all(p.dtype == torch.float32 for _, p in session.named_weights()), "master weights stay fp32"


def test_dynamic_loss_scale_halves_on_overflow_and_skips_the_step():
    cfg = tiny_config("bert")
    session = _session(cfg, precision="fp16", loss_scaling="dynamic")
    before = {n: p.detach().clone() for n, p in session.named_weights()}
    session.scaler.scale = 1e30  # certain overflow in fp16
    out = session.run(random_batch(cfg, 4))
    assert out["skipped"] == 1.0 and session.step == 0
    assert session.scaler.scale == 5e29
    for n, p in session.named_weights():
        assert torch.equal(p, before[n]), f"{n} changed on a skipped step"
    scaler = LossScaler("dynamic", growth_interval=2)
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

    def broken(path, params, names):
        path.write_bytes(b"part of the weights")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint, "_write_weights", broken)
    with pytest.raises(ValueError, match="the disk is full: cannot write checkpoint .*checkpoint.*previous checkpoint"):
        session.save(target, {"mark": 2})
    assert sorted(p.name for p in target.iterdir()) == before
    assert json.loads((target / "session.json").read_text())["per_rank"][0]["extra"] == {"mark": 1}
    assert not list(tmp_path.glob(".checkpoint.tmp-*")), "the unfinished checkpoint is removed"


def test_a_fresh_run_never_writes_into_another_runs_directory(tmp_path):
    cfg = run_config(tmp_path, training=dict(steps=1, warmup_steps=0))
    first = train(cfg, progress=False)
    second = train(cfg, progress=False)
    assert first.output_dir != second.output_dir and second.output_dir.name == "run.1"
    assert len((first.output_dir / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.slow
def test_cli_rejects_unknown_override_with_a_clear_message():
    result = subprocess.run(
        [sys.executable, "bert.py", "summary", "--config", "configs/groupbert_tiny.json", "--training.stepz", "3"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert result.returncode == 2
    assert "unknown key 'training.stepz' (value 3)" in result.stderr


@pytest.mark.slow
def test_cli_summary_ends_with_the_parameter_count():
    result = subprocess.run(
        [sys.executable, "bert.py", "summary", "--config", "configs/groupbert_base.json"],
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


# ------------------------------------------------------- no process-wide effects
def _dropout_session(architecture: str, seed: int) -> TrainingSession:
    cfg = tiny_config(architecture, hidden_dropout=0.2, attention_dropout=0.1)
    spec = OptimizerSpec(schedule=Schedule(0.01, 0, 10, decay="constant"))
    return TrainingSession(build_model(cfg, seed=seed).builder.model_proto(), optimizer=spec,
                           options=SessionOptions(recompute=True), seed=seed)


def test_two_sessions_in_one_process_train_as_each_alone():
    """Dropout (replayed by recompute too) draws from each session's own generator: run one
    after the other or interleaved, each session gives the losses it gives alone, and the
    process's global generator is left as it was."""
    batches = {a: [random_batch(tiny_config(a), 4, seed=s, pad_from=2) for s in range(3)] for a in ("bert", "groupbert")}
    alone = {}
    for architecture, seed in (("bert", 1), ("groupbert", 2)):
        with _dropout_session(architecture, seed) as session:
            alone[architecture] = [session.run(b)["loss"] for b in batches[architecture]]
    torch.manual_seed(123)
    global_state = torch.get_rng_state()
    side_by_side = {"bert": [], "groupbert": []}
    first, second = _dropout_session("bert", 1), _dropout_session("groupbert", 2)
    for step in range(3):
        torch.rand(7)  # the caller's own use of the global generator in between
        side_by_side["bert"].append(first.run(batches["bert"][step])["loss"])
        side_by_side["groupbert"].append(second.run(batches["groupbert"][step])["loss"])
    assert side_by_side == alone, "interleaved sessions disturbed each other's randomness"
    expected = torch.get_rng_state()
    torch.set_rng_state(global_state)
    torch.rand(7), torch.rand(7), torch.rand(7)
    assert torch.equal(torch.get_rng_state(), expected), "a session moved the global generator"
    assert len(set(alone["bert"])) == 3, "the batches and dropout make every loss differ"


def test_a_missing_data_file_is_reported_before_any_model_is_built(monkeypatch, tmp_path):
    import bert.tasks.pretraining
    from tests.tiny_runs import bert_cli

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the data was checked")

    monkeypatch.setattr(bert.tasks.pretraining, "build_model", no_model)
    missing = tmp_path / "none-*.hdf5"
    assert bert_cli()(["--config", str(ROOT / "configs" / "groupbert_large.json"),
                          "--data.files", json.dumps([str(missing)])]) == 2


def test_the_kernels_are_printed_once_and_recorded_in_every_checkpoint(tmp_path, capsys):
    cfg = run_config(tmp_path, training=dict(steps=2, checkpoint_every=1, kernels={"attention": "composed"}))
    result = train(cfg, progress=False)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("kernels (")]
    assert len(lines) == 1 and "attention=composed" in lines[0], lines
    for directory in (result.output_dir / "checkpoint-1", result.checkpoint):
        kernels = json.loads((directory / "session.json").read_text())["kernels"]
        assert kernels["attention"] == "composed" and kernels["precision"] == "fp32"
    # A resume that would run another implementation says so.
    resumed = cfg.model_copy(update={"training": cfg.training.model_copy(update={"steps": 3, "kernels": {}})})
    train(resumed, checkpoint_input=str(result.output_dir / "checkpoint-1"), progress=False)
    assert "note: this host runs other kernels than the run it resumes (attention composed → sdpa)" in \
        capsys.readouterr().out


def test_a_checkpoint_of_the_previous_format_still_resumes(tmp_path):
    """Checkpoints written before per-process files (weights inside model.onnx, one
    optimizer.pt) load: weights, moments, step and randomness."""
    import hashlib

    import onnx

    cfg = tiny_config("groupbert")
    batches = [random_batch(cfg, 4, seed=s) for s in range(4)]
    session = _session(cfg)
    for b in batches[:2]:
        session.run(b)
    old = tmp_path / "old"
    old.mkdir()
    onnx.save_model(session.model_proto(), str(old / "model.onnx"))
    torch.save({"optimizer": session.optimizer.state_dict()}, old / "optimizer.pt")
    rng = session._rng.cpu.tolist()
    (old / "session.json").write_text(json.dumps({
        "step": session.step, "loss_scale": 1.0, "loss_scale_clean_steps": 0, "torch_rng": rng, "extra": {"m": 1},
        "topology": {"replicas": 1, "virtual_graphs": 1}, "per_rank": [{"torch_rng": rng, "extra": {"m": 1}}]}))
    (old / "checksums.json").write_text(json.dumps(
        {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in old.iterdir()}))
    expected = [session.run(b)["loss"] for b in batches[2:]]
    resumed = _session(cfg)
    assert resumed.load(old) == {"m": 1} and resumed.step == 2
    assert [resumed.run(b)["loss"] for b in batches[2:]] == expected


def test_a_pipeline_stage_without_layers_is_refused():
    with pytest.raises(ValueError, match=r"layers_per_stage \[2, 0\] leaves pipeline stage\(s\) \[1\] without layers"):
        config_from_dict({"name": "t", "model": {"architecture": "bert", "hidden_size": 48, "num_layers": 2,
                                                 "num_heads": 3, "layers_per_stage": [2, 0]},
                          "parallel": {"pipeline": True}})
