"""Open Inference Protocol v2 tensors: JSON and the binary-data extension, to and from numpy.

Binary extension (as Triton serves it, and as `tritonclient` sends by default): the body is
a JSON header of `Inference-Header-Content-Length` bytes followed by raw tensor bytes; a
tensor whose `parameters.binary_data_size` is set takes its bytes from there, in order.
BYTES elements in binary form are each prefixed by a 4-byte little-endian length.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

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


def parse_infer_request(body: bytes, header_length: int | None) -> InferRequestBody:
    """Parse a request body (JSON, or JSON + binary tensors)."""
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
    parameters = doc.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInput("field 'parameters' must be an object")

    offset = 0
    inputs: list[DecodedTensor] = []
    for index, raw in enumerate(raw_inputs):
        tensor, used = _decode_input(raw, index, binary[offset:])
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
        for raw in raw_outputs:
            if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
                raise InvalidInput("each requested output needs a 'name'")
            requested.append(raw["name"])
            if (raw.get("parameters") or {}).get("binary_data"):
                binary_outputs.add(raw["name"])
    request_id = doc.get("id")
    return InferRequestBody(
        str(request_id) if request_id is not None else None,
        parameters,
        inputs,
        requested,
        binary_outputs,
        bool(parameters.get("binary_data_output")),
    )


def _decode_input(raw: Any, index: int, binary: memoryview) -> tuple[DecodedTensor, int]:
    if not isinstance(raw, dict):
        raise InvalidInput(f"inputs[{index}] must be an object")
    name = raw.get("name")
    if not isinstance(name, str):
        raise InvalidInput(f"inputs[{index}] needs a string 'name'")
    datatype = raw.get("datatype")
    if datatype not in OIP_TO_NUMPY:
        raise InvalidInput(f"input '{name}': datatype {datatype!r} is not one of {sorted(OIP_TO_NUMPY)}")
    shape = raw.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise InvalidInput(f"input '{name}': 'shape' must be a list of non-negative integers")
    count = int(np.prod(shape)) if shape else 1
    params = raw.get("parameters") or {}
    size = params.get("binary_data_size") if isinstance(params, dict) else None
    if size is not None:
        if not isinstance(size, int) or size < 0 or size > len(binary):
            raise BadRequest(f"input '{name}': binary_data_size {size} exceeds the binary data left "
                             f"({len(binary)} bytes)")
        return DecodedTensor(name, datatype, _from_binary(name, datatype, shape, count, binary[:size]), True), size
    if "data" not in raw:
        raise InvalidInput(f"input '{name}' has neither 'data' nor parameters.binary_data_size")
    return DecodedTensor(name, datatype, _from_json(name, datatype, shape, count, raw["data"])), 0


def _from_binary(name: str, datatype: str, shape: list[int], count: int, data: memoryview) -> np.ndarray:
    if datatype == "BYTES":
        items: list[bytes] = []
        pos = 0
        while pos < len(data):
            if pos + 4 > len(data):
                raise BadRequest(f"input '{name}': truncated BYTES element length")
            (length,) = struct.unpack_from("<I", data, pos)
            pos += 4
            if pos + length > len(data):
                raise BadRequest(f"input '{name}': BYTES element overruns the binary data")
            items.append(bytes(data[pos : pos + length]))
            pos += length
        array = np.empty(len(items), dtype=object)
        array[:] = items
    else:
        dtype = np.dtype(OIP_TO_NUMPY[datatype])
        if len(data) != count * dtype.itemsize:
            raise InvalidInput(
                f"input '{name}': {len(data)} bytes of binary data do not hold shape {shape} of {datatype} "
                f"({count * dtype.itemsize} bytes)"
            )
        array = np.frombuffer(data, dtype=dtype.newbyteorder("<")).astype(dtype, copy=False)
    if array.size != count:
        raise InvalidInput(f"input '{name}': {array.size} elements do not fill shape {shape}")
    return array.reshape(shape)


def _from_json(name: str, datatype: str, shape: list[int], count: int, data: Any) -> np.ndarray:
    if datatype == "BYTES":
        flat = _flatten(data)
        array = np.empty(len(flat), dtype=object)
        array[:] = [s.encode("utf-8") if isinstance(s, str) else s for s in flat]
        if not all(isinstance(v, bytes) for v in array):
            raise InvalidInput(f"input '{name}': BYTES data must be strings")
    else:
        try:
            array = np.asarray(data, dtype=OIP_TO_NUMPY[datatype])
        except (ValueError, TypeError, OverflowError):
            raise InvalidInput(f"input '{name}': data is not a (nested) list of {datatype} values") from None
        if datatype == "BOOL" and array.size and not _all_bools(data):
            raise InvalidInput(f"input '{name}': BOOL data must be true/false")
        array = array.reshape(-1) if array.ndim != 1 else array
    if array.size != count:
        raise InvalidInput(f"input '{name}': {array.size} data elements do not fill shape {shape} ({count} elements)")
    return array.reshape(shape)


def _flatten(data: Any) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    out: list[Any] = []
    for item in data:
        out.extend(_flatten(item))
    return out


def _all_bools(data: Any) -> bool:
    return all(isinstance(v, bool) for v in _flatten(data))


def encode_infer_response(
    model_name: str,
    model_version: str,
    request_id: str | None,
    outputs: dict[str, np.ndarray],
    binary: set[str],
) -> tuple[bytes, int | None]:
    """Render the response; returns (body, json_header_length or None when all-JSON)."""
    tensors: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, array in outputs.items():
        datatype = NUMPY_TO_OIP.get(array.dtype.name, "BYTES" if array.dtype == object else None)
        if datatype is None:
            raise InvalidInput(f"output '{name}' has dtype {array.dtype}, which the protocol cannot carry")
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if name in binary:
            blob = _to_binary(array, datatype)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif datatype == "BYTES":
            entry["data"] = [bytes(v).decode("utf-8", "replace") for v in array.reshape(-1)]
        elif datatype == "FP16":
            entry["data"] = array.astype(np.float32).reshape(-1)
        else:
            entry["data"] = np.ascontiguousarray(array).reshape(-1)
        tensors.append(entry)
    doc: dict[str, Any] = {"model_name": model_name, "model_version": model_version, "outputs": tensors}
    if request_id is not None:
        doc["id"] = request_id
    header = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return header, None
    return header + b"".join(blobs), len(header)


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
    count = _element_count(name, shape)
    return _from_binary(name, datatype, shape, count, memoryview(data))


def tensor_from_values(name: str, datatype: str, shape: list[int], values: Any) -> np.ndarray:
    """One tensor from a flat sequence of typed values (gRPC's typed contents)."""
    if datatype not in OIP_TO_NUMPY:
        raise InvalidInput(f"input {quote(name)}: datatype {quote(datatype)} is not one of {sorted(OIP_TO_NUMPY)}")
    count = _element_count(name, shape)
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


#: Most dimensions a tensor may declare.
MAX_DIMS = 64


def _element_count(name: str, shape: Any) -> int:
    """Elements in `shape`, checked before anything is allocated (non-negative ints, bounded rank)."""
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise InvalidInput(f"input {quote(name)}: shape must be a list of at most {MAX_DIMS} non-negative integers")
    count = 1
    for dim in shape:
        count *= dim
    return count
