"""The portable export: standard ONNX, dynamic batch and sequence, equal to the project's session.

Reference: the project's own graph built at each tested sequence length (its positions
a constant of that length), run by the session with the same weights; the export was
written once, at the training length, and onnxruntime runs it with default options.
"""
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import session.model_io
from bert import build_model
from custom_ops import DOMAIN
from session import InferenceSession, LoweredGraph
from bert.io.export import ENCODER, SEQUENCE_OUTPUT, export_serving
from session.export import export_model, metadata
from session.training import TrainingSession
from tests.helpers import assert_close, inference_feeds, random_batch, tiny_config

SHAPES = [(1, 19), (3, 7), (2, 33), (4, 1 + 19)]  # (batch, sequence); 19 is the training length


def _reference(cfg, weights, batch, seq):
    """The project's session on a graph built for `seq`, with the exported weights."""
    graph = LoweredGraph(build_model(cfg.model_copy(update={"sequence_length": seq}), with_loss=False).builder.model_proto())
    graph.load_weights(weights)
    with torch.no_grad():
        return {k: v.numpy() for k, v in graph({n: torch.from_numpy(batch[n]) for n in graph.input_names}).items()}


@pytest.mark.parametrize("architecture", ["groupbert", "bert"])
@pytest.mark.parametrize("task", ["pretraining", "squad"])
def test_onnxruntime_on_the_export_equals_the_session(tmp_path, architecture, task):
    cfg = tiny_config(architecture, task=task, layers_per_stage=(1, 1), max_positions=40)
    model = build_model(cfg, seed=3).builder.model_proto()  # the training graph, losses and all
    weights = LoweredGraph(model).weights_state_dict()
    path = export_serving(model, tmp_path / "model.onnx")

    exported = onnx.load(str(path))
    assert not [n for n in exported.graph.node if n.domain == DOMAIN], "custom nodes left in the export"
    assert not [a for n in exported.graph.node for a in n.attribute if a.name.startswith("__")]
    placement = json.loads(metadata(exported)["placement"])
    conv_nodes = [n for n in model.graph.node if n.domain == DOMAIN]
    assert len(conv_nodes) == (2 if architecture == "groupbert" else 0)
    layer_one = [name for name in placement if "/layer/1/" in name]
    assert layer_one and all(placement[n][:2] == [1, 1] for n in layer_one), "placement not recorded per node"
    heads = [name for name in placement if not name.startswith("bert/")]  # cls/..., the span head
    assert heads and all(placement[n][:2] == [0, 2] for n in heads), "heads: virtual graph 0, the stage after the layers"
    assert {i.name for i in exported.graph.input} == (
        {"input_ids", "segment_ids", "input_mask"} | ({"masked_lm_positions"} if task == "pretraining" else set()))

    runtime = ort.InferenceSession(str(path))  # default options: every graph optimization on
    for batch_size, seq in SHAPES:
        batch = random_batch(cfg.model_copy(update={"sequence_length": seq, "max_predictions": min(5, seq - 2)}),
                             batch_size, seed=seq, pad_from=2)
        feeds = {i.name: batch[i.name] for i in runtime.get_inputs()}
        got = dict(zip([o.name for o in runtime.get_outputs()], runtime.run(None, feeds)))
        want = _reference(cfg, weights, batch, seq)
        assert set(got) == ({"mlm_logits", "nsp_logits"} if task == "pretraining" else {"start_logits", "end_logits"})
        for name, value in got.items():
            assert_close(value, want[name], 1e-5, f"{architecture} {task} {name} batch {batch_size} seq {seq}")


def test_encoder_only_export_gives_the_sequence_the_heads_read(tmp_path):
    cfg = tiny_config("groupbert", task="squad")
    model = build_model(cfg, seed=5).builder.model_proto()
    weights = LoweredGraph(model).weights_state_dict()
    encoder = ort.InferenceSession(str(export_serving(model, tmp_path / "encoder.onnx", outputs=ENCODER)))
    assert [o.name for o in encoder.get_outputs()] == [SEQUENCE_OUTPUT]
    batch = random_batch(cfg.model_copy(update={"sequence_length": 11}), 3, pad_from=1)
    (sequence,) = encoder.run(None, {i.name: batch[i.name] for i in encoder.get_inputs()})
    assert sequence.shape == (3, 11, 48)
    # The span head applied by hand to the exported sequence output gives the session's logits.
    w, b = weights["qa_outputs.weight"].numpy(), weights["qa_outputs.bias"].numpy()
    logits = sequence @ w.T + b
    want = _reference(cfg, weights, batch, 11)
    assert_close(logits[..., 0], want["start_logits"], 1e-5, "start from sequence_output")
    assert_close(logits[..., 1], want["end_logits"], 1e-5, "end from sequence_output")


def test_inference_session_runs_the_export_and_the_custom_op_graph(tmp_path):
    cfg = tiny_config("groupbert")
    model = build_model(cfg, with_loss=False, seed=1).builder.model_proto()
    portable = export_serving(model, tmp_path / "portable.onnx")
    custom = export_serving(model, tmp_path / "custom.onnx", portable=False)
    assert [n for n in onnx.load(str(custom)).graph.node if n.domain == DOMAIN], "portable=False keeps the custom op"
    batch = inference_feeds(random_batch(cfg, 2, pad_from=2))
    a = InferenceSession(portable).run(batch)
    b = InferenceSession(custom).run(batch)
    for name in ("mlm_logits", "nsp_logits"):
        assert_close(a[name], b[name], 1e-5, name)
    # Other sequence lengths in the session too (positions follow the input's shape).
    short = inference_feeds(random_batch(cfg.model_copy(update={"sequence_length": 9}), 2, pad_from=1))
    assert InferenceSession(portable).run(short)["mlm_logits"].shape == (2, 5, 101)


def test_sessions_export_their_current_weights(tmp_path):
    cfg = tiny_config("bert", task="squad")
    training = TrainingSession(build_model(cfg).builder.model_proto())
    with torch.no_grad():
        next(p for n, p in training.named_weights() if n == "qa_outputs.bias").add_(1.5)
    path = export_serving(training.model_proto(), tmp_path / "trained.onnx", extra_metadata={"task": "squad"})
    assert metadata(path)["task"] == "squad"
    bias = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}["qa_outputs.bias"]
    assert np.allclose(bias, 1.5)
    again = export_serving(path, tmp_path / "again.onnx")
    batch = random_batch(cfg, 2)
    runs = [ort.InferenceSession(str(p)).run(None, {k: batch[k] for k in ("input_ids", "segment_ids", "input_mask")})
            for p in (path, again)]
    assert all(np.array_equal(x, y) for x, y in zip(*runs))


def test_large_weights_go_to_external_data(tmp_path, monkeypatch):
    # The rule is "external past 1 GiB"; lowered here so a tiny model exercises the same path.
    monkeypatch.setattr(session.model_io, "_EXTERNAL_DATA_THRESHOLD", 1000)
    cfg = tiny_config("groupbert")
    model = build_model(cfg, with_loss=False).builder.model_proto()
    path = export_serving(model, tmp_path / "big" / "model.onnx")
    assert (tmp_path / "big" / "model.onnx.data").stat().st_size > 100_000
    assert sorted(p.name for p in (tmp_path / "big").iterdir()) == ["model.onnx", "model.onnx.data"]
    batch = inference_feeds(random_batch(cfg, 2))
    got = ort.InferenceSession(str(path)).run(["mlm_logits"], batch)
    assert_close(got[0], InferenceSession(path).run(batch)["mlm_logits"], 1e-5, "external data")


def test_bad_exports_are_value_errors(tmp_path):
    model = build_model(tiny_config("bert")).builder.model_proto()
    with pytest.raises(ValueError, match="must end in .onnx"):
        export_serving(model, tmp_path / "model.bin")
    with pytest.raises(ValueError, match="outputs must be"):
        export_serving(model, tmp_path / "m.onnx", outputs="logits")
    with pytest.raises(ValueError, match="does not exist"):
        export_serving(tmp_path / "missing.onnx", tmp_path / "m.onnx")
    with pytest.raises(ValueError, match=r"\['logits'\] are not outputs of the graph"):
        export_model(model, tmp_path / "m.onnx", outputs=["logits"])
    with pytest.raises(ValueError, match="dynamic_axes gives 1 axes for 'input_ids'"):
        export_model(model, tmp_path / "m.onnx", outputs=["mlm_logits"], dynamic_axes={"input_ids": ["batch"]})
    assert not (tmp_path / "m.onnx").exists()
