"""The bench command line: targets, load steps, headers."""

from __future__ import annotations

import pytest

from servewell.cli import build_parser
from servewell.perf.bench_command import load_shapes, parse_headers
from servewell.perf.target import Endpoint, parse_endpoint


@pytest.mark.parametrize(("text", "protocol", "expected"), [
    ("http://127.0.0.1:8000", None, Endpoint("http", "127.0.0.1", 8000)),
    ("http://localhost:8000/", None, Endpoint("http", "localhost", 8000)),
    ("grpc://10.0.0.5:8001", None, Endpoint("grpc", "10.0.0.5", 8001)),
    ("127.0.0.1:9000", "grpc", Endpoint("grpc", "127.0.0.1", 9000)),
    ("127.0.0.1:9000", None, Endpoint("http", "127.0.0.1", 9000)),
])
def test_endpoints(text, protocol, expected):
    assert parse_endpoint(text, protocol) == expected


@pytest.mark.parametrize(("text", "protocol"), [
    ("https://host:443", None), ("http://host:8000/v2/models/x", None), ("grpc://host:1", "http"),
    ("http://:80", None), ("http://host:99999", None),
])
def test_unusable_endpoints_are_refused(text, protocol):
    with pytest.raises(ValueError):
        parse_endpoint(text, protocol)


def _args(*argv):
    return build_parser().parse_args(["bench", "http://127.0.0.1:1", *argv])


def test_default_sweep_is_closed_loop_concurrency():
    shapes = load_shapes(_args())
    assert [(s.mode, s.concurrency) for s in shapes] == [("closed", c) for c in (1, 2, 4, 8, 16)]
    assert shapes[0].duration_s == 10.0 and shapes[0].timeout_s == 10.0


def test_rates_make_an_open_loop_sweep_bounded_by_requests():
    shapes = load_shapes(_args("--rate", "50,100.5", "--requests", "500", "--timeout-ms", "250"))
    assert [(s.mode, s.rate, s.max_requests) for s in shapes] == [("open", 50.0, 500), ("open", 100.5, 500)]
    assert shapes[0].timeout_s == 0.25 and shapes[0].duration_s == 600.0


def test_concurrency_and_rate_exclude_each_other():
    with pytest.raises(SystemExit):
        _args("--concurrency", "1", "--rate", "5")


@pytest.mark.parametrize("text", ["0,1", "a,b", ""])
def test_bad_levels_are_refused(text):
    with pytest.raises(ValueError):
        load_shapes(_args("--concurrency", text))


def test_headers():
    headers = parse_headers(["Authorization: Bearer k", "X-Api-Key:abc"])
    assert headers == {"Authorization": "Bearer k", "X-Api-Key": "abc"}
    with pytest.raises(ValueError):
        parse_headers(["no colon"])
    with pytest.raises(ValueError):
        parse_headers(["Bad Name: x"])


def test_idle_steps_follow_the_ladder_as_one_thinking_client_each():
    shapes = load_shapes(_args("--concurrency", "1,8", "--idle-ms", "2,20"))
    assert [(s.concurrency, s.think_s) for s in shapes] == [(1, 0.0), (8, 0.0), (1, 0.002), (1, 0.02)]


@pytest.mark.parametrize(("argv", "problem"), [
    (("--rate", "5", "--idle-ms", "2"), "closed loop"),
    (("--idle-ms", "0"), "positive"),
    (("--idle-ms", "120000"), "at most"),
])
def test_bad_idle_steps_are_refused(argv, problem):
    with pytest.raises(ValueError, match=problem):
        load_shapes(_args(*argv))
