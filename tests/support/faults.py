"""What the fault-injection e2e tests share: a closed-loop load that records every answer with its
latency, the shared-memory segments of a server, and a server in a process group of its own."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from model_dirs import infer_body
from processes import free_port

SHM = Path("/dev/shm")


@dataclass(slots=True, frozen=True)
class Answer:
    """One request as the client saw it."""

    sent_at: float
    seconds: float
    status: int | None  # None: a transport error (connection refused or reset)
    code: str | None  # the error code of a JSON error body
    error: str | None = None  # the transport error's class
    value: float | None = None  # y of a 200

    @property
    def label(self) -> str:
        """200, "503 worker_hung", "ConnectError", ..."""
        if self.status is None:
            return str(self.error)
        return str(self.status) if self.status == 200 else f"{self.status} {self.code}"


async def closed_loop(url: str, model: str, seconds: float, users: int = 8, headers: dict[str, str] | None = None,
                      value: float = 1.0, stop: asyncio.Event | None = None) -> list[Answer]:
    """`users` clients each sending one request after the other for `seconds` (or until `stop`)."""
    answers: list[Answer] = []
    ends_at = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=users + 4)) as c:
        async def user() -> None:
            while time.monotonic() < ends_at and not (stop is not None and stop.is_set()):
                sent = time.monotonic()
                try:
                    r = await c.post(f"/v2/models/{model}/infer", json=infer_body(value), headers=headers or {})
                except httpx.TransportError as exc:
                    answers.append(Answer(sent, time.monotonic() - sent, None, None, type(exc).__name__))
                    await asyncio.sleep(0.05)  # a refused connection comes back at once: do not spin
                    continue
                doc = r.json()
                code = doc["code"] if r.status_code != 200 else None  # OIP error: {"error": message, "code"}
                y = doc["outputs"][0]["data"][0] if r.status_code == 200 else None
                answers.append(Answer(sent, time.monotonic() - sent, r.status_code, code, value=y))

        await asyncio.gather(*(user() for _ in range(users)))
    return answers


def tally(answers: list[Answer]) -> Counter[str]:
    """How many answers of each kind."""
    return Counter(a.label for a in answers)


class _Logged(Protocol):
    proc: subprocess.Popen[bytes]
    log_path: Path


def engine_pids(server: _Logged) -> list[int]:
    """Every engine process the server's supervisor started (its log says so), or the server's
    own pid for a single-process server: the pids its shared-memory segments are named after."""
    pids = [int(m) for m in re.findall(r'"event":"child_started","role":"engine","index":\d+,"pid":(\d+)',
                                      server.log_path.read_text(errors="replace"))]
    return pids or [server.proc.pid]


def segments_of(server: _Logged) -> list[str]:
    """Shared-memory segments of `server` (named `servewell-<engine pid>-...`), alive or left behind."""
    return sorted(p.name for pid in engine_pids(server) for p in SHM.glob(f"servewell-{pid}-*"))


def workers_with_segments(server: _Logged) -> set[str]:
    """The worker serials that own segments: `servewell-<pid>-<serial>-<kind>`."""
    return {"-".join(name.split("-")[1:3]) for name in segments_of(server)}


def metric_value(url: str, name: str, **labels: str) -> float | None:
    """One sample of /metrics, or None when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


class SessionServer:
    """`servewell serve` in a new session (its own process group), as a service manager starts it,
    so that a signal can be sent to the whole group."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "servewell", "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--grpc-port", "0", *args],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "SERVEWELL_SHUTDOWN_DELAY_S": "0", **(env or {})},
        )

    def log(self) -> str:
        """Everything the server printed so far (also after `stop`)."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 180) -> None:
        """Wait until /healthz answers 200."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"not ready after {timeout_s} s:\n{self.log()[-3000:]}")

    def stop(self) -> None:
        """End the whole group if it is still running (by its pid, which is the group's id)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(10)
        self._log.close()
