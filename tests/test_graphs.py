"""The built ONNX graphs: sizes, placement attributes, validity, round trip, build time."""
import copy
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from bert import build_model, load_config
from builder import IPU_NUMBER, PIPELINE_STAGE, RECOMPUTE, RecomputeType
from session import LoweredGraph, save_model
from tests.helpers import assert_close, random_batch, tiny_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize(
    "name, expected",
    [("groupbert_base", 160.8e6), ("groupbert_large", 515.5e6), ("bert_base", 110.1e6), ("bert_large", 336.2e6)],
)
def test_parameter_counts(name, expected):
    model = build_model(load_config(CONFIGS / f"{name}.json").model)
    count = model.builder.parameter_count()
    assert abs(count - expected) <= 0.005 * expected, f"{name}: {count:,} parameters, expected {expected:,.0f} ± 0.5%"


def _attrs(node):
    return {a.name: a.i for a in node.attribute if a.name.startswith("__")}


@pytest.mark.parametrize("architecture", ["bert", "groupbert"])
def test_every_layer_node_carries_the_configured_placement(architecture):
    cfg = tiny_config(architecture, num_layers=5, layers_per_stage=(2, 0, 3))
    proto = build_model(cfg).builder.model_proto(with_weights=False)
    stage_of_layer = [0, 0, 2, 2, 2]
    seen_layers = set()
    for node in proto.graph.node:
        if node.op_type == "Constant":
            continue  # shared constants carry no placement
        attrs = _attrs(node)
        parts = node.name.split("/")
        if "layer" in parts:
            i = int(parts[parts.index("layer") + 1])
            seen_layers.add(i)
            want = stage_of_layer[i]
            assert attrs[IPU_NUMBER] == want and attrs[PIPELINE_STAGE] == want, (node.name, attrs)
            assert attrs[RECOMPUTE] in (RecomputeType.RECOMPUTE, RecomputeType.CHECKPOINT), node.name
        elif parts[0] == "bert" and parts[1] == "embeddings":
            assert (attrs[IPU_NUMBER], attrs[PIPELINE_STAGE]) == (0, 0), node.name
        elif parts[0] == "cls":
            # Heads sit on virtual graph 0, in the stage after the last layer group.
            assert (attrs[IPU_NUMBER], attrs[PIPELINE_STAGE]) == (0, 3), node.name
    assert seen_layers == set(range(5))
    checkpoints = [n for n in proto.graph.node if _attrs(n).get(RECOMPUTE) == RecomputeType.CHECKPOINT]
    assert len(checkpoints) == 5, "one checkpoint per layer output"


@pytest.mark.parametrize("architecture", ["bert", "groupbert"])
@pytest.mark.parametrize("task", ["pretraining", "squad"])
def test_graph_passes_full_checker_and_onnx_infers_the_same_shapes(architecture, task):
    proto = build_model(tiny_config(architecture, task=task)).builder.model_proto()
    onnx.checker.check_model(proto, full_check=True)
    ours = {v.name: v.type for v in proto.graph.value_info}
    bare = copy.deepcopy(proto)
    # ONNX has no shape function for custom-domain nodes: keep the builder's word for their
    # outputs only, and let ONNX infer everything else from scratch.
    custom_outputs = {o for n in proto.graph.node if n.domain for o in n.output}
    keep = [v for v in bare.graph.value_info if v.name in custom_outputs]
    del bare.graph.value_info[:]
    bare.graph.value_info.extend(keep)
    inferred = onnx.shape_inference.infer_shapes(bare, strict_mode=True)
    for v in inferred.graph.value_info:
        assert v.name in ours, f"ONNX inferred {v.name}, which the builder did not record"
        mine, theirs = ours[v.name].tensor_type, v.type.tensor_type
        assert mine.elem_type == theirs.elem_type, f"{v.name}: element type {mine.elem_type} != {theirs.elem_type}"
        assert len(mine.shape.dim) == len(theirs.shape.dim), f"{v.name}: rank differs"
        for a, b in zip(mine.shape.dim, theirs.shape.dim):
            if b.dim_param.startswith("unk__"):
                # ONNX names a product of symbols afresh; the builder knows it, e.g. "batch*5".
                assert a.dim_param, f"{v.name}: builder has {a.dim_value} where ONNX has a symbol"
            else:
                assert (a.dim_value, a.dim_param) == (b.dim_value, b.dim_param), f"{v.name}: {mine} != {theirs}"


def test_saved_graph_loads_back_identical(tmp_path):
    proto = build_model(tiny_config("groupbert")).builder.model_proto()
    path = tmp_path / "model.onnx"
    save_model(proto, path)
    assert onnx.load(str(path)).SerializeToString() == proto.SerializeToString()


@pytest.mark.slow
def test_groupbert_large_builds_and_checks(tmp_path):
    # How long the build takes is a benchmark figure (bench/README.md), not a test bound.
    cfg = load_config(CONFIGS / "groupbert_large.json").model
    proto = build_model(cfg).builder.model_proto()
    path = tmp_path / "large.onnx"
    save_model(proto, path)  # > 2 GiB of weights: external data
    assert (tmp_path / "large.onnx.data").exists()
    onnx.checker.check_model(str(path), full_check=True)
    loaded = onnx.load(str(path), load_external_data=False)
    assert [n.name for n in loaded.graph.node] == [n.name for n in proto.graph.node]
    assert [t.name for t in loaded.graph.initializer] == [t.name for t in proto.graph.initializer]


def test_onnxruntime_runs_the_bert_graph_like_the_session():
    cfg = tiny_config("bert")
    proto = build_model(cfg).builder.model_proto()
    batch = random_batch(cfg, 3, pad_from=2)
    options = ort.SessionOptions()
    # Extended fusions (FusedGemm) copy node attributes under new names and then reject
    # them; the placement attributes are fine at the basic level. The portable export
    # strips them (docs/design.md).
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    ort_out = ort.InferenceSession(proto.SerializeToString(), options).run(None, batch)
    ours = LoweredGraph(proto).eval()
    with torch.no_grad():
        out = ours({k: torch.from_numpy(v) for k, v in batch.items()})
    for name, value in zip([o.name for o in proto.graph.output], ort_out):
        assert_close(out[name], value, 1e-5, name)


def test_weights_are_deterministic_by_name():
    a = build_model(tiny_config("groupbert")).builder
    b = build_model(tiny_config("groupbert", num_layers=3)).builder  # more layers built after
    for name in a.weight_specs:
        np.testing.assert_array_equal(a.initial_value(name), b.initial_value(name), err_msg=name)


def test_config_errors_name_key_value_and_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"model": {"architecture": "groupbert", "hidden_size": 64, "num_layers": 2,
                                          "num_heads": 4, "hiden_size": 3}}))
    with pytest.raises(ValueError, match=r"bad\.json[\s\S]*unknown key 'model\.hiden_size' \(value 3\)"):
        load_config(path)
    path.write_text(json.dumps({"model": {"architecture": "groupbert", "hidden_size": -1, "num_layers": 2, "num_heads": 4}}))
    with pytest.raises(ValueError, match=r"bad\.json[\s\S]*model\.hidden_size = -1"):
        load_config(path)
    path.write_text(json.dumps({"model": {"architecture": "albert", "hidden_size": 64, "num_layers": 2, "num_heads": 4}}))
    with pytest.raises(ValueError, match=r"model\.architecture = 'albert'"):
        load_config(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.json")
