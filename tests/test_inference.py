"""InferenceSession and the unfused lowering, against the paths and references they must equal."""
import numpy as np
import onnxruntime as ort
import pytest
import torch

from bert import build_model
from session import InferenceSession, LoweredGraph
from session.schedules import Schedule
from session.training import OptimizerSpec, TrainingSession
from tests.helpers import assert_close, inference_feeds, random_batch, tiny_config
from tests.reference_groupbert import groupbert_pretraining


def _trained_checkpoint(cfg, directory, batch):
    """A checkpoint whose weights two LAMB steps moved away from their initial values."""
    spec = OptimizerSpec(schedule=Schedule(0.01, 0, 10, decay="constant"))
    session = TrainingSession(build_model(cfg).builder.model_proto(), optimizer=spec)
    for _ in range(2):
        session.run(batch)
    return session, session.save(directory)


def _torch(batch):
    return {k: torch.from_numpy(v) for k, v in batch.items()}


@pytest.mark.parametrize("architecture", ["bert", "groupbert"])
def test_inference_session_on_a_checkpoint_equals_the_training_graph_and_a_reference(tmp_path, architecture):
    cfg = tiny_config(architecture)
    batch = random_batch(cfg, 4, pad_from=3)
    training, checkpoint = _trained_checkpoint(cfg, tmp_path / "checkpoint", batch)
    out = InferenceSession(checkpoint / "model.onnx").run(batch)

    graph = training.executor.graphs[0].eval()
    with torch.no_grad():
        anchors = graph(_torch(batch))
    for name, value in anchors.items():  # the same lowering, the same weights: bit for bit
        assert torch.equal(out[name], value), f"{name}: inference {out[name]} vs training graph {value}"

    if architecture == "bert":  # standard ops only: onnxruntime is the reference
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        runtime = ort.InferenceSession(str(checkpoint / "model.onnx"), options)
        reference = dict(zip([o.name for o in runtime.get_outputs()], runtime.run(None, batch)))
    else:
        weights = graph.weights_state_dict()
        with torch.no_grad():
            reference = groupbert_pretraining(weights, cfg, _torch(batch))
    for name in ("mlm_logits", "nsp_logits", "loss"):
        assert_close(out[name], reference[name], 1e-5, name)


@pytest.mark.parametrize("architecture", ["bert", "groupbert"])
def test_unfused_lowering_equals_the_fused_one_forward_and_backward(architecture):
    cfg = tiny_config(architecture)
    proto = build_model(cfg).builder.model_proto()
    fused, plain = LoweredGraph(proto), LoweredGraph(proto, fuse=False)
    assert len(plain._steps) > len(fused._steps), "the fused graph must actually fuse (dense layers, attention)"
    batch = _torch(random_batch(cfg, 3, pad_from=4))
    a, b = fused(batch), plain(batch)
    for name in ("mlm_logits", "nsp_logits", "loss"):
        assert_close(b[name], a[name], 1e-5, name)
    a["loss"].backward()
    b["loss"].backward()
    noise = 1e-8 * max(p.grad.abs().max().item() for _, p in fused.named_weights())
    for (name, p), (_, q) in zip(fused.named_weights(), plain.named_weights()):
        assert_close(q.grad, p.grad, 1e-5, f"grad {name}", atol=noise)


def test_inputs_of_other_integer_types_give_the_same_outputs_and_stay_unchanged():
    cfg = tiny_config("groupbert")
    session = InferenceSession(build_model(cfg).builder.model_proto())
    batch = random_batch(cfg, 3, pad_from=2)
    expected = session.run(batch)
    narrow = {k: v.astype(np.int32) for k, v in batch.items()}
    narrow["input_mask"] = batch["input_mask"].astype(bool)
    narrow["input_ids"] = np.asfortranarray(narrow["input_ids"])  # not C-contiguous
    before = {k: v.copy() for k, v in narrow.items()}
    out = session.run(narrow)
    for name in expected:
        assert torch.equal(out[name], expected[name]), name
    for k, v in narrow.items():
        assert v.dtype == before[k].dtype and np.array_equal(v, before[k]), f"the caller's {k} changed"


def test_the_graph_holds_no_intermediate_value_past_its_last_reader():
    # Without this the interpreter kept every activation of the forward pass alive to
    # the end: GroupBERT-base inference at batch 32, seq 384 needed more than 24 GiB.
    cfg = tiny_config("groupbert")
    graph = LoweredGraph(build_model(cfg, with_loss=False).builder.model_proto())
    produced = {s for step in graph._steps for s in step.outputs}
    most_alive, run = [0], graph._run

    def watched(steps, env):
        for step in steps:  # one step at a time, counting the values alive after each
            run([step], env)
            most_alive[0] = max(most_alive[0], sum(env[s] is not None for s in produced))
        assert {s for s in produced if env[s] is not None} == set(graph._output_slots), "only the outputs outlive the run"

    graph._run = watched
    with torch.no_grad():
        graph({k: torch.from_numpy(v) for k, v in inference_feeds(random_batch(cfg, 2)).items()})
    assert most_alive[0] < len(produced) / 4, f"{most_alive[0]} of {len(produced)} values alive at once"
