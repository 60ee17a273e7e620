"""Starts the real server (`python -m servewell serve ...`) as a user would, and stops it by pid."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest
from processes import ChildProcess, free_port


class ServerProcess(ChildProcess):
    """One running servewell, its base URL and its captured log."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.grpc_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        super().__init__(
            [sys.executable, "-m", "servewell", "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--grpc-port", str(self.grpc_port), *args],
            # Tests stop servers with SIGTERM: no load balancer needs the delay (a test that checks it sets it).
            log_path, {"SERVEWELL_SHUTDOWN_DELAY_S": "0", **(env or {})},
        )

    def wait_live(self, timeout_s: float = 120) -> None:
        self.wait_http_ok(self.url + "/v2/health/live", timeout_s)

    def wait_ready(self, timeout_s: float = 180) -> None:
        """Wait until every model is ready; fail at once when one has failed to load."""
        self.wait_live(timeout_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            health = httpx.get(self.url + "/healthz", timeout=5)
            if health.status_code == 200:
                return
            broken = {n: m["reason"] for n, m in health.json()["models"].items() if m["state"] in ("failed", "invalid")}
            if broken:
                raise RuntimeError(f"models failed to load: {broken}\n{self.log()[-3000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"not ready after {timeout_s} s:\n{self.log()[-4000:]}")


@pytest.fixture(scope="session")
def servewell_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache directory per test session, so the built-in model is built once."""
    return tmp_path_factory.mktemp("servewell-cache")


@pytest.fixture(scope="session")
def digits_server(servewell_cache: Path, tmp_path_factory: pytest.TempPathFactory):
    """The default server: `servewell serve` with the built-in digits model."""
    server = ServerProcess(["--cache-dir", str(servewell_cache)], tmp_path_factory.mktemp("logs") / "digits.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def start_server(tmp_path_factory: pytest.TempPathFactory):
    """Factory for extra servers; each is stopped at the end of the session."""
    started: list[ServerProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> ServerProcess:
        server = ServerProcess(args, tmp_path_factory.mktemp("logs") / f"server{len(started)}.log", env)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
