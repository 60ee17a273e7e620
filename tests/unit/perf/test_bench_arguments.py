"""The bench command line: targets, load steps, headers."""

from __future__ import annotations

import pytest

from servewell.cli import build_parser
from servewell.perf.bench_command import check_local_flags, load_shapes, parse_headers
from servewell.perf.local_server import LocalServer
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


def test_the_server_bench_starts_takes_its_ports_and_load_timeout(tmp_path):
    args = build_parser().parse_args(["bench", str(tmp_path), "--port", "18123", "--grpc-port", "18124",
                                      "--load-timeout-s", "240"])
    check_local_flags(args, local=True)
    server = LocalServer(tmp_path, tmp_path / "log", port=args.port, grpc_port=args.grpc_port,
                         load_timeout_s=args.load_timeout_s)
    argv = server.argv()
    assert argv[argv.index("--port") + 1] == "18123" and argv[argv.index("--grpc-port") + 1] == "18124"
    assert argv[argv.index("--load-timeout-s") + 1] == "240"
    assert server.ready_timeout_s >= 240  # the start waits past the load timeout it gave
    default = LocalServer(tmp_path, tmp_path / "log")
    assert "--load-timeout-s" not in default.argv() and default.port > 0 and default.grpc_port == 0


def test_the_local_server_flags_are_refused_with_a_url_and_out_of_range():
    with pytest.raises(ValueError, match="--port, --load-timeout-s set the server bench starts"):
        check_local_flags(_args("--port", "9000", "--load-timeout-s", "60"), local=False)
    for flag, value in (("--port", "70000"), ("--grpc-port", "0"), ("--load-timeout-s", "0")):
        with pytest.raises(SystemExit):
            _args(flag, value)
