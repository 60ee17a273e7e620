"""A real servewell started as a user starts it (`python -m servewell serve ...`), stopped by pid."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from processes import ChildProcess, free_port
from waiting import eventually

#: Ingress processes of the servers tests start when a test does not choose (`--ingress-processes`
#: on a test's command line wins): 1 by default, `SERVEWELL_TEST_INGRESS_PROCESSES` to run a file's
#: tests against another shape, e.g. 0 for the single-process server.
TEST_INGRESS_PROCESSES = os.environ.get("SERVEWELL_TEST_INGRESS_PROCESSES", "1")


class ServerProcess(ChildProcess):
    """One running servewell, its base URL and its captured log."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 wrapper: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.grpc_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        super().__init__(
            # `wrapper`: a command that ends by exec'ing the rest (the pid stays the server's).
            [*wrapper, sys.executable, "-m", "servewell", "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--grpc-port", str(self.grpc_port), *args],
            # Tests stop servers with SIGTERM: no load balancer needs the delay (a test that checks it sets it).
            # One ingress process unless a test asks for more (tests/e2e/test_split.py): the split
            # path is the same, and each further process costs every server start its imports.
            # SERVEWELL_TEST_INGRESS_PROCESSES=0 runs a test file against the single-process server.
            log_path, {"SERVEWELL_SHUTDOWN_DELAY_S": "0", "SERVEWELL_INGRESS_PROCESSES": TEST_INGRESS_PROCESSES,
                       **(env or {})},
        )

    def health(self) -> dict[str, Any]:
        """`GET /healthz` as JSON (whatever its status)."""
        doc: dict[str, Any] = httpx.get(self.url + "/healthz", timeout=5).json()
        return doc

    def wait_live(self, timeout_s: float = 120) -> None:
        """Wait until the frontend answers (models may still be loading)."""
        self.wait_http_ok(self.url + "/v2/health/live", timeout_s)

    def wait_ready(self, timeout_s: float = 180) -> None:
        """Wait until every model is ready; fail at once when one has failed to load."""
        self.wait_live(timeout_s)

        def ready() -> bool:
            self.check_running()
            response = httpx.get(self.url + "/healthz", timeout=5)
            if response.status_code == 200:
                return True
            models = response.json().get("models", {})  # none yet: the ingress has not reached the engine
            broken = {n: m["reason"] for n, m in models.items() if m["state"] in ("failed", "invalid")}
            if broken:
                raise RuntimeError(f"models failed to load: {broken}\n{self.log()[-3000:]}")
            return False

        eventually(ready, timeout_s, lambda: f"models not ready:\n{self.log()[-4000:]}")


class ServerFactory:
    """Starts servers with their logs in one directory and stops them all at once."""

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = log_dir
        self._started: list[ServerProcess] = []

    def __call__(self, args: list[str], env: dict[str, str] | None = None,
                 wrapper: Sequence[str] = ()) -> ServerProcess:
        """Start `servewell serve ARGS` (returns at once; see `wait_live` and `wait_ready`), run
        through `wrapper` when given (a command that execs the rest)."""
        server = ServerProcess(args, self._log_dir / f"server{len(self._started)}.log", env, wrapper)
        self._started.append(server)
        return server

    def stop_all(self) -> None:
        """Stop every server started here, by pid."""
        for server in self._started:
            server.stop()
        self._started.clear()
