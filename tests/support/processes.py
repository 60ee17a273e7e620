"""Child processes for tests (servewell, Prometheus): started with a log file, stopped by pid."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from waiting import eventually


def require_program(name: str, debian_package: str) -> str:
    """The path of program `name`; fails the test (never skips it) when it is not installed."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: `make test` installs it (scripts/install-test-deps.sh), "
                    f"or: sudo apt-get install {debian_package}")
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ChildProcess:
    """A process whose output goes to a log file; `stop` ends it (terminate, then kill)."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.program = args[0]
        self.log_path = log_path
        self._log = open(log_path, "wb")  # closed by stop()
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def log(self) -> str:
        """Everything the process printed so far."""
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def exited(self) -> bool:
        """Whether the process has ended."""
        return self.proc.poll() is not None

    def check_running(self) -> None:
        """Raise at once (with the log's tail) when the process has ended."""
        if self.exited():
            raise RuntimeError(f"{self.program} exited with {self.proc.returncode}:\n{self.log()[-4000:]}")

    def wait_http_ok(self, url: str, timeout_s: float) -> None:
        """Wait until `url` answers 200; fail at once if the process exits."""
        def answers_200() -> bool:
            self.check_running()
            try:
                return httpx.get(url, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        eventually(answers_200, timeout_s, lambda: f"{url} did not answer 200:\n{self.log()[-4000:]}")

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


def thread_nices(pid: int) -> dict[int, int]:
    """Each thread of process `pid` and its nice value (/proc/PID/task/TID/stat, field 19)."""
    nices = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        nices[int(task.name)] = int(fields[16])  # the fields after the name start at the third
    return nices
