"""The generic builder: shapes checked at the offending line, scopes, names."""
import numpy as np
import onnx
import pytest

from builder import FLOAT, INT64, IPU_NUMBER, PIPELINE_STAGE, RECOMPUTE, Builder, RecomputeType, ShapeError, normal


def test_shape_mismatch_raises_with_both_shapes():
    b = Builder()
    x = b.input("x", ["batch", 7, 12])
    w = b.weight("w", (13, 5), normal(0.1))
    with pytest.raises(ShapeError, match=r"MatMul.*\('batch', 7, 12\).*\(13, 5\)"):
        b.onnx.MatMul(x, w)
    with pytest.raises(ShapeError, match=r"cannot broadcast \(batch, 7, 12\) and \(13, 5\)"):
        b.onnx.Add(x, w)
    with pytest.raises(ShapeError, match="one element type"):
        b.onnx.Add(x, b.input("i", ["batch", 7, 12], INT64))


def test_scopes_set_names_and_popart_attributes():
    b = Builder()
    x = b.input("x", [2, 3])
    with b.name_scope("enc", "layer", 4), b.virtual_graph(2), b.pipeline_stage(1), b.recompute():
        w = b.weight("dense.weight", (3, 3), normal(0.1))
        y = b.onnx.MatMul(x, w)
    z = b.onnx.Relu(y)
    b.output(z, "z")
    proto = b.model_proto()
    onnx.checker.check_model(proto, full_check=True)
    assert w.name == "enc.layer.4.dense.weight"
    node = next(n for n in proto.graph.node if n.op_type == "MatMul")
    assert node.name.startswith("enc/layer/4/MatMul")
    attrs = {a.name: a.i for a in node.attribute}
    assert attrs == {IPU_NUMBER: 2, PIPELINE_STAGE: 1, RECOMPUTE: RecomputeType.RECOMPUTE}
    relu = next(n for n in proto.graph.node if n.op_type == "Relu")
    assert not relu.attribute, "attributes end with their scope"


def test_reshape_tracks_symbolic_dims():
    b = Builder()
    x = b.input("x", ["batch", 6, 4], FLOAT)
    y = b.onnx.Reshape(x, b.constant(np.array([0, 0, 2, 2], np.int64)))
    assert y.shape == ("batch", 6, 2, 2)
    flat = b.onnx.Reshape(x, b.constant(np.array([-1, 4], np.int64)))
    assert flat.shape == ("batch*6", 4)
    with pytest.raises(ShapeError, match="cannot reshape"):
        b.onnx.Reshape(x, b.constant(np.array([0, 5, -1], np.int64)))


def test_duplicate_weight_names_are_refused():
    b = Builder()
    b.weight("w", (2,))
    with pytest.raises(ValueError, match="defined twice"):
        b.weight("w", (2,))
