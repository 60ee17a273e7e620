"""Open Inference Protocol v2 tensors: JSON and the binary-data extension, to and from numpy.

Binary extension (as Triton serves it, and as `tritonclient` sends by default): the body is
a JSON header of `Inference-Header-Content-Length` bytes followed by raw tensor bytes; a
tensor whose `parameters.binary_data_size` is set takes its bytes from there, in order.
BYTES elements in binary form are each prefixed by a 4-byte little-endian length.
"""

from __future__ import annotations

import struct
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import orjson

from servewell.config.model import NUMPY_TO_OIP, OIP_TO_NUMPY
from servewell.errors import BadRequest, InvalidInput, quote


@dataclass(slots=True)
class DecodedTensor:
    """One input tensor of a request."""

    name: str
    datatype: str
    array: np.ndarray
    from_binary: bool = False


@dataclass(slots=True)
class InferRequestBody:
    """A parsed OIP inference request."""

    id: str | None
    parameters: dict[str, Any]
    inputs: list[DecodedTensor]
    requested_outputs: list[str] | None
    binary_outputs: set[str] = field(default_factory=set)
    all_binary: bool = False


#: Most dimensions a tensor may have (numpy's own limit, and Triton's).
MAX_DIMS = 64
#: Largest product of a shape's non-zero dimensions (numpy cannot shape even an empty array past 2**63 bytes).
MAX_SPAN = 2**40
#: Deepest nesting of a tensor's JSON `data` (one level per dimension, plus the list itself).
MAX_NESTING = MAX_DIMS + 1
#: Python types of JSON values each kind of numpy datatype accepts (bool is not a number here).
_JSON_TYPES: dict[str, set[type]] = {"f": {float, int}, "i": {int}, "u": {int}, "b": {bool}}


def parse_infer_request(body: bytes, header_length: int | None) -> InferRequestBody:
    """Parse a request body (JSON, or JSON + binary tensors).

    Raises only `ServeError` subclasses (400 `BadRequest` for framing, 422 `InvalidInput` for
    tensors), and checks every shape against the body before allocating: a tensor can never
    claim more elements than its bytes could hold."""
    if header_length is not None:
        if header_length < 0 or header_length > len(body):
            raise BadRequest(f"Inference-Header-Content-Length {header_length} exceeds the body of {len(body)} bytes")
        header, binary = body[:header_length], memoryview(body)[header_length:]
    else:
        header, binary = body, memoryview(b"")
    try:
        doc = orjson.loads(header)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidInput("request body must be a JSON object")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidInput("field 'inputs' must be a non-empty list of tensors")
    parameters = _object(doc.get("parameters"), "field 'parameters'")
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInput("field 'id' must be a string")

    offset = 0
    inputs: list[DecodedTensor] = []
    for index, raw in enumerate(raw_inputs):
        tensor, used = _decode_input(raw, index, binary[offset:], len(body))
        offset += used
        inputs.append(tensor)
    if offset != len(binary):
        raise BadRequest(f"{len(binary) - offset} bytes of binary data are not claimed by any input")

    requested: list[str] | None = None
    binary_outputs: set[str] = set()
    raw_outputs = doc.get("outputs")
    if raw_outputs is not None:
        if not isinstance(raw_outputs, list):
            raise InvalidInput("field 'outputs' must be a list")
        requested = []
        for index, raw in enumerate(raw_outputs):
            if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
                raise InvalidInput(f"outputs[{index}] needs a string 'name'")
            requested.append(raw["name"])
            if _flag(_object(raw.get("parameters"), f"outputs[{index}].parameters"), "binary_data"):
                binary_outputs.add(raw["name"])
    return InferRequestBody(request_id, parameters, inputs, requested, binary_outputs,
                            _flag(parameters, "binary_data_output"))


def _flag(parameters: dict[str, Any], key: str) -> bool:
    """A boolean parameter (absent: false); `InvalidInput` for anything but true/false."""
    value = parameters.get(key, False)
    if not isinstance(value, bool):
        raise InvalidInput(f"parameter {key!r} must be true or false")
    return value


def _object(value: Any, what: str) -> dict[str, Any]:
    """`value` when it is a JSON object, {} when absent; `InvalidInput` otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"{what} must be an object")
    return value


def _element_count(name: str, shape: Any, limit: int) -> tuple[list[int], int]:
    """The shape as a list and its element count, refused before anything is allocated when it is
    malformed or holds more than `limit` elements (a request of `limit` bytes cannot carry more).
    Zero-size dimensions do not excuse huge others: numpy could not shape the (empty) array."""
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise InvalidInput(f"input {quote(name)}: 'shape' must be a list of at most {MAX_DIMS} non-negative integers")
    empty = 0 in shape
    span = 1
    for dim in shape:
        span *= max(dim, 1)  # stops growing past the caps: a client's 64 huge dimensions cost nothing
        if span > MAX_SPAN or (span > limit and not empty):
            raise InvalidInput(f"input {quote(name)}: shape {quote(shape)} holds more elements than a request of "
                               f"{limit} bytes can carry")
    return shape, 0 if empty else span


def _decode_input(raw: Any, index: int, binary: memoryview, limit: int) -> tuple[DecodedTensor, int]:
    if not isinstance(raw, dict):
        raise InvalidInput(f"inputs[{index}] must be an object")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"inputs[{index}] needs a non-empty string 'name'")
    datatype = raw.get("datatype")
    if not isinstance(datatype, str) or datatype not in OIP_TO_NUMPY:
        raise InvalidInput(f"input {quote(name)}: datatype {quote(datatype)} is not one of {sorted(OIP_TO_NUMPY)}")
    shape, count = _element_count(name, raw.get("shape"), limit)
    params = _object(raw.get("parameters"), f"inputs[{index}].parameters")
    size = params.get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or size > len(binary):
            raise BadRequest(f"input {quote(name)}: binary_data_size {quote(size)} exceeds the binary data left "
                             f"({len(binary)} bytes)")
        return DecodedTensor(name, datatype, _from_binary(name, datatype, shape, count, binary[:size]), True), size
    if "data" not in raw:
        raise InvalidInput(f"input {quote(name)} has neither 'data' nor parameters.binary_data_size")
    return DecodedTensor(name, datatype, _from_json(name, datatype, shape, count, raw["data"])), 0


def _from_binary(name: str, datatype: str, shape: list[int], count: int, data: memoryview) -> np.ndarray:
    if datatype == "BYTES":
        items: list[bytes] = []
        pos = 0
        while pos < len(data):
            if len(items) == count:
                raise InvalidInput(f"input {quote(name)}: more BYTES elements than shape {shape} holds")
            if pos + 4 > len(data):
                raise BadRequest(f"input {quote(name)}: truncated BYTES element length")
            (length,) = struct.unpack_from("<I", data, pos)
            pos += 4
            if pos + length > len(data):
                raise BadRequest(f"input {quote(name)}: BYTES element overruns the binary data")
            items.append(bytes(data[pos : pos + length]))
            pos += length
        array = np.empty(len(items), dtype=object)
        array[:] = items
    else:
        dtype = np.dtype(OIP_TO_NUMPY[datatype])
        if len(data) != count * dtype.itemsize:
            raise InvalidInput(
                f"input {quote(name)}: {len(data)} bytes of binary data do not hold shape {shape} of {datatype} "
                f"({count * dtype.itemsize} bytes)"
            )
        array = np.frombuffer(data, dtype=dtype.newbyteorder("<")).astype(dtype, copy=False)
    if array.size != count:
        raise InvalidInput(f"input {quote(name)}: {array.size} elements do not fill shape {shape}")
    return array.reshape(shape)


def _from_json(name: str, datatype: str, shape: list[int], count: int, data: Any) -> np.ndarray:
    if not isinstance(data, list):
        raise InvalidInput(f"input {quote(name)}: 'data' must be a (nested) list")
    if datatype == "BYTES":
        flat = _flatten(name, data)
        if not all(isinstance(s, str) for s in flat):
            raise InvalidInput(f"input {quote(name)}: BYTES data must be strings")
        array = np.empty(len(flat), dtype=object)
        array[:] = [s.encode("utf-8") for s in flat]
    else:
        array = _numbers(name, datatype, data)
    if array.size != count:
        raise InvalidInput(f"input {quote(name)}: {array.size} data elements do not fill shape {shape} "
                           f"({count} elements)")
    return array.reshape(shape)


def _numbers(name: str, datatype: str, data: list[Any]) -> np.ndarray:
    """JSON numbers as a flat array of `datatype`.

    Parsed as an object array first (8 bytes per element whatever the client sent: a plain
    `np.asarray` would size a string array by its longest string, times every element) whose
    element types are then checked in C: a `null`, a string, an object, a nested ragged list or
    (in a numeric tensor) a boolean is refused, so JSON `null` never becomes NaN. About 2x the
    cost of a bare `np.asarray` (13 ms against 7 ms for 150,528 floats), paid only by JSON tensors.
    """
    dtype = np.dtype(OIP_TO_NUMPY[datatype])
    if dtype.kind == "f" and data and not isinstance(data[0], list) and set(map(type, data)) <= _JSON_TYPES["f"]:
        # The usual case, a flat list of numbers (OIP's row-major `data`): checked and converted
        # straight from the list, half the cost of the object array below (24 against 54 µs
        # for 512 floats; the tiny MLP's JSON requests spent ~10% of the frontend's CPU here).
        try:
            with np.errstate(over="ignore"):
                flat = np.array(data, dtype=dtype)
        except OverflowError:  # an integer too large for a float
            raise InvalidInput(f"input {quote(name)}: a value lies outside the range of {datatype}") from None
        if not np.isfinite(flat).all():
            raise InvalidInput(f"input {quote(name)}: a value lies outside the range of {datatype}")
        return flat
    try:
        parsed = np.asarray(data, dtype=object).reshape(-1)
    except (ValueError, TypeError, RecursionError):
        raise InvalidInput(f"input {quote(name)}: data is not a regular (nested) list of {datatype} values") from None
    if parsed.size == 0:
        return np.empty(0, dtype=dtype)
    allowed = _JSON_TYPES[dtype.kind]
    if not set(map(type, parsed)) <= allowed:
        what = "true/false" if dtype.kind == "b" else "integers" if dtype.kind in "iu" else "numbers"
        raise InvalidInput(f"input {quote(name)}: {datatype} data must be a regular (nested) list of {what} "
                           "(no null, strings, objects or ragged lists)")
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if parsed.min() < info.min or parsed.max() > info.max:
            raise InvalidInput(f"input {quote(name)}: a value lies outside the range of {datatype}")
    with np.errstate(over="ignore"):  # an overflow becomes inf, refused just below
        array = parsed.astype(dtype)
    if dtype.kind == "f" and not np.isfinite(array).all():
        raise InvalidInput(f"input {quote(name)}: a value lies outside the range of {datatype}")
    return array


def _flatten(name: str, data: list[Any]) -> list[Any]:
    """The leaves of nested lists, in order, without recursion (deep nesting is a client's choice)."""
    out: list[Any] = []
    stack: list[Iterator[Any]] = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                if len(stack) >= MAX_NESTING:
                    raise InvalidInput(f"input {quote(name)}: data is nested deeper than {MAX_DIMS} dimensions")
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


#: Values one step of an answer's JSON encoding turns into text (about 2-3 ms here): the event
#: loop gets a turn between steps (`run_steps`, or `InferenceCall.encode` on the loop).
STEP_VALUES = 1 << 15

#: Text of a JSON body is gathered into parts of about this size: one socket write each.
PART_BYTES = 1 << 20
#: The parts a body is sent as, in order (a large binary tensor stays a view: never joined into a copy).
BodyPart = bytes | memoryview


@dataclass(slots=True)
class EncodedBody:
    """An answer's body as parts, and the length of its JSON header when binary tensors follow it."""

    parts: list[BodyPart]
    json_length: int | None  # None: the whole body is JSON

    @property
    def size(self) -> int:
        """Bytes of the whole body."""
        return sum(memoryview(part).nbytes for part in self.parts)

    def joined(self) -> bytes:
        """The body as one bytes object (a copy of every part)."""
        return self.parts[0] if len(self.parts) == 1 and isinstance(self.parts[0], bytes) else b"".join(self.parts)


Steps = Generator[None, None, EncodedBody]
T = TypeVar("T")


def run_steps(steps: Generator[None, None, T]) -> T:
    """Every step of an encoding at once; what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: T = done.value
            return result


def encode_infer_response(
    model_name: str,
    model_version: str,
    request_id: str | None,
    outputs: dict[str, np.ndarray],
    binary: set[str],
) -> tuple[bytes, int | None]:
    """Render the response; returns (body, json_header_length or None when all-JSON)."""
    body = run_steps(infer_response_steps(model_name, model_version, request_id, outputs, binary))
    return body.joined(), body.json_length


def infer_response_steps(model_name: str, model_version: str, request_id: str | None, outputs: dict[str, np.ndarray],
                         binary: set[str]) -> Steps:
    """The response's encoding as steps of at most `STEP_VALUES` values each (the generator yields
    between them and returns the body): a 60 MB tensor as JSON is about a second of encoding,
    which must not run in one piece on an event loop other requests wait for (issue 45 H1).
    Every output's datatype is checked before the first step (`InvalidInput`)."""
    datatypes = {}
    for name, array in outputs.items():
        datatype = NUMPY_TO_OIP.get(array.dtype.name, "BYTES" if array.dtype == object else None)
        if datatype is None:
            raise InvalidInput(f"output {quote(name)} has dtype {array.dtype}, which the protocol cannot carry")
        datatypes[name] = datatype
    return _steps(model_name, model_version, request_id, outputs, binary, datatypes)


def _steps(model_name: str, model_version: str, request_id: str | None, outputs: dict[str, np.ndarray],
           binary: set[str], datatypes: dict[str, str]) -> Steps:
    header = _Parts()
    header.add(orjson.dumps({"model_name": model_name, "model_version": model_version})[:-1])
    header.add(b',"outputs":[')
    blobs: list[BodyPart] = []
    for index, (name, array) in enumerate(outputs.items()):
        datatype = datatypes[name]
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if index:
            header.add(b",")
        if name in binary:
            blob = _binary_view(array, datatype)
            entry["parameters"] = {"binary_data_size": memoryview(blob).nbytes}
            blobs.append(blob)
            header.add(orjson.dumps(entry))
            continue
        header.add(orjson.dumps(entry)[:-1])
        header.add(b',"data":[')
        flat = array.reshape(-1)
        for start in range(0, flat.size, STEP_VALUES):
            if start:
                header.add(b",")
                yield  # a step's worth of values is written: the loop may take a turn
            header.add(_json_values(flat[start:start + STEP_VALUES], datatype))
        header.add(b"]}")
    header.add(b"]")
    if request_id is not None:
        header.add(b',"id":')
        header.add(orjson.dumps(request_id))
    header.add(b"}")
    parts = header.done()
    if not blobs:
        return EncodedBody(parts, None)
    return EncodedBody(parts + blobs, sum(len(part) for part in parts))


class _Parts:
    """Pieces of text gathered into parts of about `PART_BYTES` (one write each, not one per piece)."""

    __slots__ = ("_parts", "_pieces", "_size")

    def __init__(self) -> None:
        self._parts: list[BodyPart] = []
        self._pieces: list[bytes] = []
        self._size = 0

    def add(self, piece: bytes) -> None:
        self._pieces.append(piece)
        self._size += len(piece)
        if self._size >= PART_BYTES:
            self._parts.append(b"".join(self._pieces))
            self._pieces, self._size = [], 0

    def done(self) -> list[BodyPart]:
        if self._pieces or not self._parts:
            self._parts.append(b"".join(self._pieces))
        return self._parts


def _json_values(values: np.ndarray, datatype: str) -> bytes:
    """`values` (flat) as the text between a JSON list's brackets."""
    if datatype == "BYTES":
        return orjson.dumps([bytes(v).decode("utf-8", "replace") for v in values])[1:-1]
    if datatype == "FP16":
        values = values.astype(np.float32)
    return orjson.dumps(np.ascontiguousarray(values), option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]


def _binary_view(array: np.ndarray, datatype: str) -> bytes | memoryview:
    """An output's bytes for the binary extension, as a view of the array where it already is
    little-endian and contiguous (the body's join is then their only copy: a result read in place
    from the engine's shared memory goes from there into the body)."""
    if datatype == "BYTES" or array.size == 0:
        return _to_binary(array, datatype)
    contiguous = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return memoryview(contiguous.data).cast("B")


def _to_binary(array: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        parts = []
        for value in array.reshape(-1):
            raw = value if isinstance(value, bytes) else str(value).encode("utf-8")
            parts.append(struct.pack("<I", len(raw)) + raw)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def tensor_from_raw(name: str, datatype: str, shape: list[int], data: memoryview | bytes) -> np.ndarray:
    """One tensor from raw little-endian bytes (the binary extension's and gRPC's raw contents;
    BYTES elements each behind a 4-byte length)."""
    if datatype not in OIP_TO_NUMPY:
        raise InvalidInput(f"input {quote(name)}: datatype {quote(datatype)} is not one of {sorted(OIP_TO_NUMPY)}")
    view = memoryview(data)
    shape, count = _element_count(name, shape, max(len(view), 1))  # no element takes less than a byte
    return _from_binary(name, datatype, shape, count, view)


def tensor_from_values(name: str, datatype: str, shape: list[int], values: Any) -> np.ndarray:
    """One tensor from a flat sequence of typed values (gRPC's typed contents)."""
    if datatype not in OIP_TO_NUMPY:
        raise InvalidInput(f"input {quote(name)}: datatype {quote(datatype)} is not one of {sorted(OIP_TO_NUMPY)}")
    shape, count = _element_count(name, shape, max(len(values), 1))  # one value per element
    if datatype == "BYTES":
        array = np.empty(len(values), dtype=object)
        array[:] = [bytes(v) for v in values]
    else:
        try:
            array = np.asarray(values, dtype=OIP_TO_NUMPY[datatype])
        except (ValueError, TypeError, OverflowError):
            raise InvalidInput(f"input {quote(name)}: contents do not hold {datatype} values") from None
    if array.size != count:
        raise InvalidInput(f"input {quote(name)}: {array.size} values do not fill shape {shape} ({count} elements)")
    return array.reshape(shape)


def tensor_to_raw(name: str, array: np.ndarray) -> tuple[str, bytes]:
    """(OIP datatype, raw little-endian bytes) of an output tensor."""
    datatype = NUMPY_TO_OIP.get(array.dtype.name, "BYTES" if array.dtype == object else None)
    if datatype is None:
        raise InvalidInput(f"output '{name}' has dtype {array.dtype}, which the protocol cannot carry")
    return datatype, _to_binary(array, datatype)
