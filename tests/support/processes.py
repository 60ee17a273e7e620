"""Child processes for tests (servewell, Prometheus): started with a log file, stopped by pid."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ChildProcess:
    """A process whose output goes to a log file; `stop` ends it (terminate, then kill)."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def log(self) -> str:
        """Everything the process printed so far."""
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_http_ok(self, url: str, timeout_s: float) -> None:
        """Wait until `url` answers 200; fail at once if the process exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args[0]} exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{url} not 200 after {timeout_s} s:\n{self.log()[-4000:]}")

    def stop(self) -> int:
        """End the process by its pid; its exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode
