"""The one ONNX external-data writer: aligned offsets, zero padding, location entries that onnx reads back."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dsconv.io.onnx_data import ExternalDataWriter, external_location

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("align", [1, 4096])
def test_writer_places_tensors_onnx_can_load(tmp_path, align):
    a = np.arange(300, dtype=np.float32).reshape(10, 30)
    b = np.linspace(-1, 1, 77, dtype=np.float32)
    inits = [numpy_helper.from_array(np.zeros_like(a), "a"), numpy_helper.from_array(np.zeros_like(b), "b")]
    with ExternalDataWriter(tmp_path / "m.onnx.data", align=align) as w:
        w.write(inits[0], [a[:4].reshape(-1).view(np.uint8), a[4:].reshape(-1).view(np.uint8)])  # in chunks
        w.write(inits[1], [b.tobytes()])
    locs = [external_location(t) for t in inits]
    assert locs[0] == ("m.onnx.data", 0, a.nbytes)
    assert locs[1] == ("m.onnx.data", -(-a.nbytes // align) * align, b.nbytes)
    raw = (tmp_path / "m.onnx.data").read_bytes()
    assert raw[a.nbytes:locs[1][1]] == b"\0" * (locs[1][1] - a.nbytes)
    graph = helper.make_graph([helper.make_node("Add", ["a", "a"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [10, 30])], initializer=inits)
    onnx.save_model(helper.make_model(graph), str(tmp_path / "m.onnx"))
    m = onnx.load(str(tmp_path / "m.onnx"))
    got = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    np.testing.assert_array_equal(got["a"], a)
    np.testing.assert_array_equal(got["b"], b)


def test_inline_tensor_has_no_location():
    assert external_location(numpy_helper.from_array(np.ones(3, np.float32), "x")) is None
