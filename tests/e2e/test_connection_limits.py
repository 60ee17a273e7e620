"""Connection and request limits against the real server: oversized and endless request heads,
slow clients, idle connections and connection floods get a JSON 4xx or a closed connection,
while health probes and /metrics keep answering.

The limits of the dedicated servers are set through `SERVEWELL_*` variables, so that the same
file runs against a build without the limits (which ignores unknown variables) and fails there
for the right reasons rather than for an unknown flag.
"""

from __future__ import annotations

import os
import resource
import select
import socket
import threading
import time

import httpx
import orjson
import pytest

from example_images import GOOD_IMAGE

SLOWLORIS_SOCKETS = 3000
MAX_CONNECTIONS = 256
RESERVED = 4
PARTIAL_HEAD = b"GET /healthz HTTP/1.1\r\nHost: attacker\r\nX-Slow: "


@pytest.fixture(scope="module")
def limits_server(start_module_server, servewell_cache):
    """Few connections, default timeouts (10 s head, 30 s body): floods meet the connection limit."""
    server = start_module_server(
        ["--cache-dir", str(servewell_cache)],
        env={"SERVEWELL_MAX_CONNECTIONS": str(MAX_CONNECTIONS), "SERVEWELL_RESERVED_CONNECTIONS": str(RESERVED)},
    )
    server.wait_ready()
    return server


@pytest.fixture(scope="module")
def timeouts_server(start_module_server, servewell_cache):
    """One-second timeouts for heads, bodies and idle keep-alive connections."""
    server = start_module_server(
        ["--cache-dir", str(servewell_cache)],
        env={"SERVEWELL_HEADER_TIMEOUT_S": "1", "SERVEWELL_BODY_TIMEOUT_S": "1", "SERVEWELL_KEEP_ALIVE_TIMEOUT_S": "1"},
    )
    server.wait_ready()
    return server


@pytest.fixture(scope="module", autouse=True)
def enough_file_descriptors():
    """The flood tests hold a few thousand sockets at once in this process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * SLOWLORIS_SOCKETS + 1024
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else min(hard, wanted), hard)
        )
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, bool]:
    """Everything the server sends until it closes (True) or `timeout_s` passes (False)."""
    data = b""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return data, False
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return data, False
        except ConnectionError:
            return data, True
        if not chunk:
            return data, True
        data += chunk


def json_error(raw: bytes) -> tuple[int, dict]:
    """Status and JSON error of a raw HTTP/1.1 response (fails if the body is not the JSON error shape)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), raw[:200]
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower(), head
    error = orjson.loads(body)["error"]
    assert set(error) == {"code", "message", "request_id"} and error["request_id"]
    return status, error


def refusal(port: int, request: bytes, timeout_s: float = 10) -> tuple[int, dict]:
    """Send `request`; the server must answer a JSON error and close."""
    with connect(port) as sock:
        sock.sendall(request)
        raw, closed = read_until_closed(sock, timeout_s)
    assert closed, f"connection still open after {timeout_s} s; got {raw[:200]!r}"
    return json_error(raw)


def proc_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# Request heads


def test_url_longer_than_the_limit_gets_414_json(digits_server):
    status, error = refusal(digits_server.port, b"GET /v2/models/" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, error["code"]) == (414, "uri_too_long")


def test_too_many_header_fields_get_431_json(digits_server):
    headers = b"".join(b"X-Field-%d: 1\r\n" % i for i in range(150))
    status, error = refusal(digits_server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
    assert (status, error["code"]) == (431, "too_many_headers")


def test_malformed_http_gets_400_json(digits_server):
    status, error = refusal(digits_server.port, b"NOT HTTP AT ALL\x00\r\n\r\n")
    assert (status, error["code"]) == (400, "bad_request")


def test_endless_header_is_cut_off_early_and_costs_the_server_little(digits_server):
    """A 200 MB header that never ends: the server stops reading after its limit (16 KiB); what
    the client manages to send is only what the socket buffers hold, and /healthz stays fast."""
    pid = digits_server.proc.pid
    cpu_before, rss_before = proc_cpu_s(pid), proc_rss_bytes(pid)
    probes: list[int | str] = []
    stop = threading.Event()

    def probe() -> None:  # a client timeout is a failed probe: /healthz must answer meanwhile
        with httpx.Client(timeout=2.0) as client:
            while not stop.is_set():
                try:
                    probes.append(client.get(digits_server.url + "/healthz").status_code)
                except httpx.HTTPError as exc:
                    probes.append(type(exc).__name__)
                time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    sent = 0
    chunk = b"a" * (1 << 20)
    try:
        with connect(digits_server.port) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Endless: ")
            deadline = time.monotonic() + 60
            try:
                while sent < 200 << 20 and time.monotonic() < deadline:
                    sock.sendall(chunk)
                    sent += len(chunk)
            except OSError:
                pass  # the server closed the connection: what this test wants
            time.sleep(0.5)  # let /healthz probes run after the attack too
    finally:
        stop.set()
        prober.join()
    assert sent < 32 << 20, f"the server kept reading: {sent >> 20} MB of one header accepted"
    assert proc_cpu_s(pid) - cpu_before < 5.0
    assert proc_rss_bytes(pid) - rss_before < 64 << 20
    assert probes and all(p == 200 for p in probes), probes


# Slow clients and idle connections


def test_slow_head_gets_408_json(timeouts_server):
    status, error = refusal(timeouts_server.port, b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Ty", timeout_s=8)
    assert (status, error["code"]) == (408, "request_timeout")


def test_connection_that_sends_nothing_is_closed(timeouts_server):
    with connect(timeouts_server.port) as sock:
        raw, closed = read_until_closed(sock, 8)
    assert closed and raw == b""


def test_slow_body_gets_408_or_is_closed(timeouts_server):
    head = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    with connect(timeouts_server.port) as sock:
        sock.sendall(head + b'{"image_base64": "')
        raw, closed = read_until_closed(sock, 8)
    assert closed, f"a body 982 bytes short was still awaited after 8 s; got {raw[:200]!r}"
    if raw:
        status, error = json_error(raw)
        assert (status, error["code"]) == (408, "request_timeout")


def test_idle_keep_alive_connection_is_closed_after_the_timeout(timeouts_server):
    with connect(timeouts_server.port) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(5)
        first = b""
        while not first.endswith(b'{"live":true}'):
            chunk = sock.recv(65536)
            assert chunk, f"closed before the whole response: {first!r}"
            first += chunk
        assert first.startswith(b"HTTP/1.1 200 "), first[:100]
        raw, closed = read_until_closed(sock, 3.5)  # the keep-alive timeout is 1 s (uvicorn's default: 5 s)
    assert closed and raw == b""


# Connection floods


def open_slowloris(port: int, count: int) -> list[socket.socket]:
    sockets = []
    for _ in range(count):
        sock = connect(port)
        try:
            sock.sendall(PARTIAL_HEAD)
        except OSError:
            pass  # already evicted by the time it sent: counted as closed below
        sockets.append(sock)
    return sockets


def closed_by_server(sockets: list[socket.socket], at_least: int, timeout_s: float) -> set[socket.socket]:
    """Sockets the server has closed (EOF or reset, after any answer), waiting until `at_least` or the timeout."""
    closed: set[socket.socket] = set()
    by_fd = {sock.fileno(): sock for sock in sockets}
    poller = select.poll()  # select() cannot watch descriptors numbered past 1024
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout_s
    while len(closed) < at_least and time.monotonic() < deadline:
        for fd, _ in poller.poll(50):
            sock = by_fd[fd]
            try:
                if sock.recv(65536, socket.MSG_DONTWAIT) != b"":
                    continue  # an answer (a 503) before the close
            except BlockingIOError:
                continue
            except ConnectionError:
                pass
            closed.add(sock)
            poller.unregister(fd)
    return closed


def test_slowloris_flood_is_bounded_and_probes_still_answer(limits_server):
    """Thousands of connections that never finish their head: the server keeps at most its
    limit open (evicting the longest-waiting), its descriptors stay bounded, probes answer."""
    pid = limits_server.proc.pid
    sockets = open_slowloris(limits_server.port, SLOWLORIS_SOCKETS)
    try:
        beyond = SLOWLORIS_SOCKETS - (MAX_CONNECTIONS + RESERVED)
        closed = closed_by_server(sockets, beyond, timeout_s=8)  # well before the 10 s head timeout
        assert len(closed) >= beyond, f"only {len(closed)} of {SLOWLORIS_SOCKETS} flood connections were closed"
        assert open_fds(pid) < MAX_CONNECTIONS + RESERVED + 200
        with httpx.Client(timeout=5.0) as client:
            assert client.get(limits_server.url + "/healthz").status_code == 200
            assert client.get(limits_server.url + "/metrics").status_code == 200
    finally:
        for sock in sockets:
            sock.close()
    deadline = time.monotonic() + 10
    while "HTTP limits enforced" not in limits_server.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    lines = [line for line in limits_server.log().splitlines() if "HTTP limits enforced" in line]
    assert lines and "evicted" in lines[0], limits_server.log()[-2000:]
    assert len(lines) <= 5, "one aggregated line per window, not one per connection"


def test_slow_bodies_cannot_lock_complete_requests_out(limits_server):
    """Every regular slot holds a /predict whose 100 KB body trickles in (1,100 of them once held
    every slot for the whole 30 s body timeout): complete requests are still served, evicting the
    longest-waiting slow body (a JSON 503), probes answer, and the slow bodies that are left get
    408 once they fall below the minimum rate after its grace (2 s), long before the timeout."""
    head = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
    holders = []
    try:
        for _ in range(MAX_CONNECTIONS):
            sock = connect(limits_server.port)
            sock.sendall(head)
            holders.append(sock)
        time.sleep(0.3)  # let the server read every head
        with httpx.Client(timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            assert client.get(limits_server.url + "/healthz").status_code == 200
            body = {"image_base64": GOOD_IMAGE}
            for _ in range(5):
                served = client.post(limits_server.url + "/predict", json=body)
                assert served.status_code == 200, served.text
        answers = [read_until_closed(sock, 8) for sock in holders]
        assert all(closed for _, closed in answers), "a slow body still held its slot after 8 s"
        statuses = [json_error(raw)[0] for raw, _ in answers if raw]
        # 503: evicted for a newcomer; 408: below the minimum rate after the grace
        assert set(statuses) <= {408, 503} and statuses.count(408) > MAX_CONNECTIONS // 2, statuses
        assert any(b"slower than 1024 bytes/s" in raw for raw, _ in answers)
    finally:
        for sock in holders:
            sock.close()


def test_pipelined_flood_is_bounded_and_leaves_no_memory_behind(digits_server):
    """One connection pipelining 20,000 GETs without reading an answer (200,000 once took the
    process from 97 to 705 MB, kept after the connection closed): at most 16 are queued behind
    the one answered; those and the next get a JSON 503 (none of them runs the app) and the
    connection closes; RSS barely moves."""
    pid = digits_server.proc.pid
    before = proc_rss_bytes(pid)
    with connect(digits_server.port) as sock:
        request = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
        try:
            for _ in range(20):
                sock.sendall(request * 1000)
        except OSError:
            pass  # the server closed it: what it had not read is reset
        raw, closed = read_until_closed(sock, 10)
    assert closed
    assert raw.count(b"HTTP/1.1 200 ") == 1 and raw.count(b"HTTP/1.1 503 ") == 17, raw[-400:]
    assert b"more than 16 requests were sent on one connection" in raw
    assert proc_rss_bytes(pid) - before < 16 * 2**20
    assert httpx.get(digits_server.url + "/healthz").status_code == 200


def test_non_http_1_and_missing_host_get_json_errors(digits_server):
    status, error = refusal(digits_server.port, b"GET /healthz HTTP/2.0\r\nHost: x\r\n\r\n")
    assert status == 505 and error["code"] == "http_version_not_supported"
    status, error = refusal(digits_server.port, b"GET /healthz HTTP/1.1\r\n\r\n")
    assert status == 400 and "Host" in error["message"]
