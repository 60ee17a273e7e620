"""The external-data files of an ONNX model, found by walking its protobuf without loading it:
every location (subgraphs included), never a byte of raw_data, bounded errors for bad files."""

from __future__ import annotations

import io
from pathlib import Path
from typing import BinaryIO, cast

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from servewell.engine.onnx_external_data import (
    MAX_GRAPH_DEPTH,
    OnnxFormatError,
    external_data_files,
    external_data_locations,
)


def model_with_a_subgraph(weights: np.ndarray) -> onnx.ModelProto:
    """y = x + w, or x + c where c is a Constant inside the `then` branch of an If."""
    constant = numpy_helper.from_array(np.full(weights.shape, 2.0, np.float32), "branch_c")
    then_graph = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=constant), helper.make_node("Add", ["x", "c"], ["t"])],
        "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, weights.shape)])
    else_graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["e"])], "else", [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, weights.shape)])
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], then_branch=then_graph, else_branch=else_graph)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, weights.shape),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, weights.shape)],
        initializer=[numpy_helper.from_array(weights, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_every_external_file_is_found_subgraphs_included(tmp_path: Path) -> None:
    weights = np.ones((4, 4), np.float32)
    onnx.save_model(model_with_a_subgraph(weights), tmp_path / "model.onnx", save_as_external_data=True,
                    all_tensors_to_one_file=False, convert_attribute=True, size_threshold=0)
    # onnx names each file after its tensor; "branch_c" lives in the If's then-branch.
    assert sorted(external_data_files(tmp_path / "model.onnx")) == ["branch_c", "w"]
    assert (tmp_path / "w").is_file() and (tmp_path / "branch_c").is_file()
    (tmp_path / "data").mkdir()
    onnx.save_model(model_with_a_subgraph(weights), tmp_path / "one.onnx", save_as_external_data=True,
                    location="data/weights.bin", size_threshold=0)
    assert external_data_files(tmp_path / "one.onnx") == ["data/weights.bin"]
    onnx.save_model(model_with_a_subgraph(weights), tmp_path / "inline.onnx")
    assert external_data_files(tmp_path / "inline.onnx") == []


class CountingFile(io.RawIOBase):
    """A file that counts the bytes read from it."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "rb", buffering=0)
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        n = self._file.readinto(buffer) or 0
        self.bytes_read += n
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._file.seek(offset, whence)

    def close(self) -> None:
        self._file.close()
        super().close()


def test_raw_data_is_skipped_not_read(tmp_path: Path) -> None:
    # 50 MB of weights stored inline (raw_data), then one small external tensor.
    inline = numpy_helper.from_array(np.zeros(50 * 1024 * 1024 // 4, np.float32), "inline")
    graph = helper.make_graph([], "g", [], [], initializer=[inline, external_tensor("ext.bin")])
    path = tmp_path / "big.onnx"
    path.write_bytes(helper.make_model(graph).SerializeToString())
    assert path.stat().st_size > 50_000_000
    counting = CountingFile(path)
    try:
        assert external_data_locations(cast(BinaryIO, counting), path.stat().st_size) == ["ext.bin"]
    finally:
        counting.close()
    assert counting.bytes_read < 1_000_000, counting.bytes_read


@pytest.mark.parametrize("data, match", [
    (b"garbage that is not protobuf at all", "wire type|runs past|truncated|field number 0"),
    (b"\x3a\xff\xff\xff\xff\x0f", "runs past"),  # graph (7) of 4 GiB in a 6-byte file
    (b"\x3a", "truncated"),
    (b"\xff" * 20, "varint"),
])
def test_a_truncated_or_garbage_file_is_a_clear_error(tmp_path: Path, data: bytes, match: str) -> None:
    path = tmp_path / "bad.onnx"
    path.write_bytes(data)
    with pytest.raises(OnnxFormatError, match=match):
        external_data_files(path)


def test_a_truncated_model_is_a_clear_error(tmp_path: Path) -> None:
    model = model_with_a_subgraph(np.ones((64, 4), np.float32))
    data = model.SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(OnnxFormatError):
        external_data_files(path)


def external_tensor(location: str) -> TensorProto:
    tensor = numpy_helper.from_array(np.ones(1, np.float32), "t")
    onnx.external_data_helper.set_external_data(tensor, location)
    tensor.ClearField("raw_data")
    return tensor


@pytest.mark.parametrize("location", ["/etc/passwd", "../outside.bin", "data/../../x", ""])
def test_a_location_outside_the_model_directory_is_refused(tmp_path: Path, location: str) -> None:
    graph = helper.make_graph([], "g", [], [], initializer=[external_tensor(location)])
    path = tmp_path / "m.onnx"
    path.write_bytes(helper.make_model(graph).SerializeToString())
    with pytest.raises(OnnxFormatError, match="not a path inside the model's directory|names no location"):
        external_data_files(path)


def test_subgraphs_nested_too_deep_are_refused(tmp_path: Path) -> None:
    graph = helper.make_graph([], "leaf", [], [], initializer=[external_tensor("deep.bin")])
    empty = helper.make_graph([], "empty", [], [])
    for _ in range(MAX_GRAPH_DEPTH + 1):
        graph = helper.make_graph([helper.make_node("If", ["c"], ["y"], then_branch=graph, else_branch=empty)],
                                  "g", [], [])
    path = tmp_path / "deep.onnx"
    path.write_bytes(helper.make_model(graph).SerializeToString())
    with pytest.raises(OnnxFormatError, match="nested deeper"):
        external_data_files(path)
