"""Property tests of the OIP tensor codec: tensors round-trip through JSON and the binary extension,
and no body whatever (any JSON, any bytes) raises anything but a ServeError."""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import fuzzing  # noqa: F401 - loads the hypothesis profile
from servewell.api.codecs.tensors import encode_infer_response, parse_infer_request
from servewell.config.model import NUMPY_TO_OIP
from servewell.errors import ServeError

NUMERIC = [
    np.dtype(n)
    for n in (
        "bool",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
    )
]
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)


def finite_arrays() -> st.SearchStrategy[np.ndarray]:
    return st.sampled_from(NUMERIC).flatmap(
        lambda dtype: hnp.arrays(
            dtype, SHAPES, elements={"allow_nan": False, "allow_infinity": False} if dtype.kind == "f" else None
        )
    )


def any_arrays() -> st.SearchStrategy[np.ndarray]:
    return st.sampled_from(NUMERIC).flatmap(lambda dtype: hnp.arrays(dtype, SHAPES))


def request_json(array: np.ndarray) -> bytes:
    return orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": list(array.shape),
                    "datatype": NUMPY_TO_OIP[array.dtype.name],
                    "data": array.reshape(-1).tolist(),
                }
            ]
        }
    )


def request_binary(array: np.ndarray) -> tuple[bytes, int]:
    blob = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": list(array.shape),
                    "datatype": NUMPY_TO_OIP[array.dtype.name],
                    "parameters": {"binary_data_size": len(blob)},
                }
            ]
        }
    )
    return header + blob, len(header)


@given(finite_arrays())
def test_json_tensors_round_trip(array):
    parsed = parse_infer_request(request_json(array), None).inputs[0].array
    assert parsed.dtype == array.dtype and parsed.shape == array.shape
    np.testing.assert_array_equal(parsed, array)


@given(any_arrays())
def test_binary_tensors_round_trip_bit_for_bit(array):
    raw, length = request_binary(array)
    parsed = parse_infer_request(raw, length).inputs[0].array
    assert parsed.dtype == array.dtype and parsed.shape == array.shape
    assert parsed.tobytes() == array.tobytes()


@given(st.lists(st.binary(max_size=20), max_size=6))
def test_bytes_tensors_round_trip_in_binary(items):
    blob = b"".join(struct.pack("<I", len(b)) + b for b in items)
    header = orjson.dumps(
        {
            "inputs": [
                {"name": "s", "shape": [len(items)], "datatype": "BYTES", "parameters": {"binary_data_size": len(blob)}}
            ]
        }
    )
    assert list(parse_infer_request(header + blob, len(header)).inputs[0].array) == items


@given(any_arrays())
def test_responses_carry_every_value(array):
    raw, length = encode_infer_response("m", "1", "id", {"y": array}, set())
    out = orjson.loads(raw)["outputs"][0]
    assert length is None and out["shape"] == list(array.shape)
    expected = array.astype(np.float32) if array.dtype == np.float16 else array
    # JSON has no NaN or infinity: non-finite values come back as null (README, "NaN and infinity").
    wanted = [None if isinstance(v, float) and not np.isfinite(v) else v for v in expected.reshape(-1).tolist()]
    assert out["data"] == pytest.approx(wanted) if array.dtype.kind == "f" else out["data"] == wanted
    raw, length = encode_infer_response("m", "1", "id", {"y": array}, {"y"})
    assert np.frombuffer(raw[length:], dtype=array.dtype.newbyteorder("<")).tobytes() == array.reshape(-1).tobytes()


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=30,
)
DATATYPES = st.sampled_from(["BOOL", "UINT8", "INT8", "INT64", "UINT64", "FP16", "FP32", "FP64", "BYTES"]) | JSON_VALUES
TENSORS = st.fixed_dictionaries(
    {"name": st.text(max_size=4) | JSON_VALUES, "datatype": DATATYPES},
    optional={
        "shape": st.lists(st.integers(min_value=-2, max_value=2**40) | JSON_VALUES, max_size=6) | JSON_VALUES,
        "data": JSON_VALUES,
        "parameters": st.fixed_dictionaries({}, optional={"binary_data_size": st.integers(-2, 64) | JSON_VALUES})
        | JSON_VALUES,
    },
)
REQUESTS = st.fixed_dictionaries(
    {"inputs": st.lists(TENSORS, max_size=3) | JSON_VALUES},
    optional={
        "id": JSON_VALUES,
        "parameters": JSON_VALUES,
        "outputs": st.lists(
            st.fixed_dictionaries({"name": st.text(max_size=4) | JSON_VALUES}, optional={"parameters": JSON_VALUES}),
            max_size=3,
        )
        | JSON_VALUES,
    },
)


def only_serve_errors(raw: bytes, length: int | None) -> None:
    try:
        parse_infer_request(raw, length)
    except ServeError as exc:
        assert 400 <= exc.status < 500, exc


@given(REQUESTS)
def test_any_json_request_is_parsed_or_refused_with_a_client_error(doc):
    only_serve_errors(orjson.dumps(doc), None)


@given(JSON_VALUES)
def test_any_json_document_is_parsed_or_refused_with_a_client_error(doc):
    only_serve_errors(orjson.dumps(doc), None)


@given(REQUESTS, st.binary(max_size=64), st.integers(min_value=-4, max_value=400))
def test_any_binary_request_is_parsed_or_refused_with_a_client_error(doc, tail, shift):
    header = orjson.dumps(doc)
    only_serve_errors(header + tail, max(0, len(header) + shift) if shift != 0 else len(header))


@given(st.binary(max_size=256), st.none() | st.integers(min_value=0, max_value=300))
def test_any_bytes_are_parsed_or_refused_with_a_client_error(raw, length):
    only_serve_errors(raw, length)


def test_long_strings_in_numeric_data_cost_no_more_memory_than_the_body():
    # numpy would size a string array by the longest string times the element count (500 GB here).
    raw = orjson.dumps(
        {"inputs": [{"name": "x", "shape": [250_001], "datatype": "FP32", "data": ["a" * 500_000] + ["b"] * 250_000}]}
    )
    tracemalloc.start()
    try:
        only_serve_errors(raw, None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100_000_000  # the parsed document itself is about 30 MB of Python objects
