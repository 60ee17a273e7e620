"""Child processes of the benchmark: servers under test, load generators, offline timers.

Every child is started here and stopped by its own pid (terminate, then kill), never by name.
"""

from __future__ import annotations

import http.client
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def http_json(port: int, method: str, path: str, body: Any = None, timeout_s: float = 10.0) -> tuple[int, Any]:
    """One JSON request to loopback; returns (status, decoded body or None)."""
    connection = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        connection.request(method, path, body=payload, headers=headers)
        response = connection.getresponse()
        raw = response.read()
        try:
            return response.status, json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return response.status, None
    finally:
        connection.close()


class ServerProcess:
    """A server under test, started as a child process with its output in a log file."""

    def __init__(self, name: str, argv: list[str], port: int, log_path: Path, new_session: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.new_session = new_session  # its own process group, as a service manager starts it
        self.env = env
        self.argv = argv
        self.port = port
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None
        self._log: BinaryIO | None = None

    @property
    def pid(self) -> int:
        """Process id (once started)."""
        if self._process is None:
            raise RuntimeError(f"{self.name} is not started")
        return self._process.pid

    @property
    def url(self) -> str:
        """Base URL."""
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        """Start the process (returns at once; see `wait_ready`)."""
        self._log = open(self.log_path, "ab")
        self._process = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=self.new_session,
                                         env=None if self.env is None else {**os.environ, **self.env})

    def wait(self, timeout_s: float) -> int | None:
        """Wait for the process to exit; its exit code, or None if it is still running."""
        if self._process is None:
            return None
        try:
            return self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self._process is not None and self._process.poll() is None

    def wait_ready(self, timeout_s: float, path: str = "/healthz") -> float:
        """Poll `path` until it answers 200; returns the seconds waited. Raises when it dies or times out."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self._process is None or self._process.poll() is not None:
                code = None if self._process is None else self._process.returncode
                raise RuntimeError(f"{self.name} exited with code {code}; see {self.log_path}")
            try:
                status, _ = http_json(self.port, "GET", path, timeout_s=2.0)
                if status == 200:
                    return time.monotonic() - started
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} was not ready within {timeout_s:g} s; see {self.log_path}")

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        if self._process is None:
            return None
        if self._process.poll() is None:
            stop_process(self._process, timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self._process.returncode


def stop_process(process: subprocess.Popen[bytes], grace_s: float) -> int:
    """SIGTERM, wait up to `grace_s`, then SIGKILL; the exit code."""
    process.terminate()
    try:
        return process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(5.0)


def run_module(module: str, args: list[str], timeout_s: float, log_path: Path | None = None) -> None:
    """Run `python -m module args` to completion (killed after `timeout_s`); raises on failure."""
    log = open(log_path, "ab") if log_path else None
    try:
        process = subprocess.Popen([sys.executable, "-m", module, *args], stdout=log or None,
                                   stderr=subprocess.STDOUT if log else None)
        try:
            code = process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            stop_process(process, 5.0)
            raise RuntimeError(f"python -m {module} ran past {timeout_s:g} s and was stopped") from None
        if code != 0:
            raise RuntimeError(f"python -m {module} {' '.join(args)} failed with exit code {code}"
                               + (f"; see {log_path}" if log_path else ""))
    finally:
        if log is not None:
            log.close()


def closed_loop(url: str, path: str, bodies: list[Path], clients: int, seconds: float, warmup_s: float,
                out: Path, log_path: Path, headers: dict[str, str] | None = None) -> dict:
    """Run `bench.loadgen` as a closed loop of `clients` for `seconds` after `warmup_s` (each
    request with `headers`); its summary."""
    args = ["--url", url, "--path", path, "--mode", "closed", "--concurrency", str(clients),
            "--duration-s", f"{seconds:g}", "--warmup-s", f"{warmup_s:g}", "--out", str(out), "--grace-s", "15"]
    for name, value in (headers or {}).items():
        args += ["--header", f"{name}:{value}"]
    for body in bodies:
        args += ["--body-file", str(body)]
    run_module("bench.loadgen", args, timeout_s=seconds + warmup_s + 60, log_path=log_path)
    return json.loads(out.read_text())


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def children_cpu_seconds() -> float:
    """CPU seconds of this process's finished children (the load generators)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def server_log_counts(path: Path) -> dict[str, int]:
    """Lines per level in the server's JSON log (errors and warnings tell of trouble under load)."""
    counts: dict[str, int] = {}
    if not path.is_file():
        return counts
    for line in path.read_text(errors="replace").splitlines():
        try:
            level = json.loads(line).get("level", "?")
        except (json.JSONDecodeError, AttributeError):
            level = "unstructured"
        counts[level] = counts.get(level, 0) + 1
    return counts
