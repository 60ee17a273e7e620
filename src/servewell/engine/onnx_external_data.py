"""The external-data files an ONNX model names, found without loading it.

A model over 2 GiB (the protobuf limit) keeps its weights in files beside the graph: a tensor
with `data_location: EXTERNAL` names its file in `external_data` (key `location`, relative to the
directory of the .onnx file). The snapshot copies exactly those files, so the frontend must find
them, but it must not import `onnx` (not a server dependency) nor read a model of gigabytes into
memory. This reader walks the protobuf wire format and descends only into the messages that can
hold a tensor; every other field, `raw_data` of any size included, is skipped with a seek.

Field numbers are those of onnx/onnx.proto (checked against onnx 1.23):

    ModelProto      graph = 7, functions = 25
    FunctionProto   node = 7
    GraphProto      node = 1, initializer = 5, sparse_initializer = 15
    NodeProto       attribute = 5
    AttributeProto  t = 5, g = 6, tensors = 10, graphs = 11, sparse_tensor = 22, sparse_tensors = 23
    SparseTensorProto values = 1, indices = 2
    TensorProto     external_data = 13 (StringStringEntryProto key = 1, value = 2), data_location = 14

A malformed or hostile file raises `OnnxFormatError`: nesting, entries and strings are bounded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import BinaryIO

#: Graphs nested in If/Loop/Scan bodies; protobuf's own parser stops at 100 message levels, and
#: each graph level is three (graph, node, attribute).
MAX_GRAPH_DEPTH = 32
#: Distinct external-data files one model may name.
MAX_EXTERNAL_FILES = 10_000
#: external_data entries of one tensor (onnx writes location, offset, length and checksum).
MAX_ENTRIES_PER_TENSOR = 16
#: Bytes of one external_data entry (key and value together), and so of a location (PATH_MAX).
MAX_ENTRY_BYTES = 4096
#: Bytes read from the file at a time; skipped fields beyond it are sought over, never read.
_WINDOW = 64 * 1024
_EXTERNAL = 1  # TensorProto.DataLocation.EXTERNAL


class OnnxFormatError(ValueError):
    """The file is not a protobuf ONNX model this reader can walk (truncated, garbage, too deep)."""


class _Cursor:
    """Reads varints and short byte strings through a small window; skips by seeking."""

    def __init__(self, stream: BinaryIO, size: int) -> None:
        self._stream = stream
        self.size = size
        self._window = b""
        self._start = 0  # file offset of _window[0]
        self.pos = 0

    def _fill(self) -> None:
        self._stream.seek(self.pos)
        self._window = self._stream.read(_WINDOW)
        self._start = self.pos
        if not self._window:
            raise OnnxFormatError(f"truncated at byte {self.pos}")

    def byte(self) -> int:
        index = self.pos - self._start
        if not 0 <= index < len(self._window):
            self._fill()
            index = 0
        self.pos += 1
        return self._window[index]

    def varint(self) -> int:
        value = shift = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
            if shift >= 70:
                raise OnnxFormatError(f"varint longer than 10 bytes at byte {self.pos}")

    def read(self, length: int) -> bytes:
        out = bytearray()
        while len(out) < length:
            index = self.pos - self._start
            if not 0 <= index < len(self._window):
                self._fill()
                index = 0
            piece = self._window[index:index + length - len(out)]
            out += piece
            self.pos += len(piece)
        return bytes(out)

    def skip_to(self, end: int) -> None:
        self.pos = end  # the next read past the window seeks there


Visit = Callable[[_Cursor, int, int], None]


def _fields(cur: _Cursor, end: int, wanted: dict[int, Visit], depth: int) -> None:
    """Walk the fields of one message that ends at `end`: the length-delimited ones in `wanted`
    are visited, every other field is skipped without being read."""
    while cur.pos < end:
        key = cur.varint()
        number, wire = key >> 3, key & 7
        if number == 0:
            raise OnnxFormatError(f"field number 0 at byte {cur.pos}")
        if wire != 2:
            _skip_value(cur, number, wire, end)
        else:
            length = cur.varint()
            field_end = cur.pos + length
            if field_end > end:
                raise OnnxFormatError(f"field {number} at byte {cur.pos} runs past its message "
                                      f"({length} bytes, {end - cur.pos} left)")
            visit = wanted.get(number)
            if visit is None:
                cur.skip_to(field_end)
            else:
                visit(cur, field_end, depth)
                if cur.pos != field_end:
                    raise OnnxFormatError(f"field {number} ends at byte {cur.pos}, not {field_end}")
    if cur.pos != end:
        raise OnnxFormatError(f"a field runs past its message at byte {end}")


class _Walk:
    """One walk over a model, collecting the external-data locations."""

    def __init__(self) -> None:
        self.locations: dict[str, None] = {}  # ordered, unique

    def model(self, cur: _Cursor) -> None:
        _fields(cur, cur.size, {7: self.graph, 25: self.function}, 0)

    def function(self, cur: _Cursor, end: int, depth: int) -> None:
        _fields(cur, end, {7: self.node}, depth)

    def graph(self, cur: _Cursor, end: int, depth: int) -> None:
        if depth >= MAX_GRAPH_DEPTH:
            raise OnnxFormatError(f"graphs nested deeper than {MAX_GRAPH_DEPTH}")
        _fields(cur, end, {1: self.node, 5: self.tensor, 15: self.sparse_tensor}, depth + 1)

    def node(self, cur: _Cursor, end: int, depth: int) -> None:
        _fields(cur, end, {5: self.attribute}, depth)

    def attribute(self, cur: _Cursor, end: int, depth: int) -> None:
        _fields(cur, end, {5: self.tensor, 10: self.tensor, 6: self.graph, 11: self.graph,
                           22: self.sparse_tensor, 23: self.sparse_tensor}, depth)

    def sparse_tensor(self, cur: _Cursor, end: int, depth: int) -> None:
        _fields(cur, end, {1: self.tensor, 2: self.tensor}, depth)

    def tensor(self, cur: _Cursor, end: int, depth: int) -> None:
        entries: list[tuple[str, str]] = []
        external = False
        while cur.pos < end:
            key = cur.varint()
            number, wire = key >> 3, key & 7
            if number == 14 and wire == 0:
                external = cur.varint() == _EXTERNAL
            elif number == 13 and wire == 2:
                length = cur.varint()
                if length > MAX_ENTRY_BYTES or cur.pos + length > end:
                    raise OnnxFormatError(f"external_data entry of {length} bytes at byte {cur.pos} (at most "
                                          f"{MAX_ENTRY_BYTES}, inside its tensor)")
                if len(entries) >= MAX_ENTRIES_PER_TENSOR:
                    raise OnnxFormatError(f"a tensor has more than {MAX_ENTRIES_PER_TENSOR} external_data entries")
                entries.append(_entry(cur.read(length)))
            else:
                _skip_value(cur, number, wire, end)
        if cur.pos != end:
            raise OnnxFormatError(f"a field runs past its tensor at byte {end}")
        if external:
            location = dict(entries).get("location")
            if location is None:
                raise OnnxFormatError("a tensor with external data names no location")
            self.locations[check_location(location)] = None
            if len(self.locations) > MAX_EXTERNAL_FILES:
                raise OnnxFormatError(f"the model names more than {MAX_EXTERNAL_FILES} external-data files")


def _skip_value(cur: _Cursor, number: int, wire: int, end: int) -> None:
    if wire == 0:
        cur.varint()
    elif wire in (1, 5):
        cur.skip_to(cur.pos + (8 if wire == 1 else 4))
        if cur.pos > end:
            raise OnnxFormatError(f"field {number} at byte {cur.pos} runs past its message")
    elif wire == 2:
        length = cur.varint()
        if cur.pos + length > end:
            raise OnnxFormatError(f"field {number} at byte {cur.pos} runs past its message")
        cur.skip_to(cur.pos + length)
    else:
        raise OnnxFormatError(f"wire type {wire} of field {number} at byte {cur.pos} is not used by ONNX")


def _entry(data: bytes) -> tuple[str, str]:
    """A StringStringEntryProto: (key, value)."""
    cur = _BytesCursor(data)
    key = value = ""
    while cur.pos < len(data):
        tag = cur.varint()
        number, wire = tag >> 3, tag & 7
        if wire != 2:
            raise OnnxFormatError(f"external_data entry has a field {number} of wire type {wire}")
        length = cur.varint()
        if cur.pos + length > len(data):
            raise OnnxFormatError("external_data entry is cut short")
        try:
            text = data[cur.pos:cur.pos + length].decode("utf-8")
        except UnicodeDecodeError:
            raise OnnxFormatError("external_data entry is not UTF-8") from None
        cur.pos += length
        if number == 1:
            key = text
        elif number == 2:
            value = text
    return key, value


class _BytesCursor:
    def __init__(self, data: bytes) -> None:
        self._data = data
        self.pos = 0

    def varint(self) -> int:
        value = shift = 0
        while True:
            if self.pos >= len(self._data) or shift >= 70:
                raise OnnxFormatError("external_data entry holds a bad varint")
            b = self._data[self.pos]
            self.pos += 1
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7


def check_location(location: str) -> str:
    """`location` as a relative POSIX path inside the model's directory; `OnnxFormatError` for an
    absolute path or one with '..' (onnxruntime refuses them too)."""
    path = PurePosixPath(location.replace("\\", "/"))
    if not location or "\x00" in location or path.is_absolute() or ".." in path.parts or ":" in path.parts[0]:
        raise OnnxFormatError(f"external data location {location[:200]!r} is not a path inside the model's "
                              "directory (absolute or with '..')")
    return str(path)


def external_data_locations(stream: BinaryIO, size: int) -> list[str]:
    """The external-data locations named by the ONNX model in `stream` (`size` bytes), relative to
    the model file's directory, in the order they first appear. Reads only the messages that can
    hold tensors; `OnnxFormatError` when the file cannot be walked."""
    walk = _Walk()
    walk.model(_Cursor(stream, size))
    return list(walk.locations)


def external_data_files(path: Path) -> list[str]:
    """`external_data_locations` of the ONNX file at `path`."""
    with open(path, "rb", buffering=0) as f:
        return external_data_locations(f, f.seek(0, 2))
