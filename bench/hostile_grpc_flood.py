"""Hostile case of the gRPC port (issue 45 H18), with a server of its own.

- `grpc_idle_flood`: 3,000 connections to the gRPC port that send the HTTP/2 preface and SETTINGS
  and nothing more (`bench.attacks_grpc.grpc_idle_connections`, opened at 500 a second and renewed
  as the server closes them), beyond every ingress process's connection cap (1,000 each); meanwhile
  new `tritonclient.grpc` clients, each with its own connection, call a small python model one after
  another. Before the fix every such call failed at once (UNAVAILABLE "Socket closed", 3 of 3) until
  the idle timeout (60 s) ended the flood's connections, which an attacker renews; with 500 idle
  connections a call answered in 10 ms. Bound: at least 95 % of the new clients' calls answered
  during the flood (the places are made by a sweep every 0.25 s: a flood renewing faster than a
  quarter of the cap per sweep can still refuse a call between two sweeps).

    python -m bench.hostile --attacks "" --cases grpc_idle_flood
"""

from __future__ import annotations

import asyncio
import resource
import statistics
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench.attacks_grpc import grpc_idle_connections
from bench.hostile_cases import CaseResult, case
from bench.processes import HOST, ServerProcess, free_port

FLOOD = 3000
FLOOD_PER_S = 500.0
CALLS = 40
GOAL_ANSWERED = 0.95
MODEL_SOURCE = textwrap.dedent('''
    class Doubler:
        def setup(self, config):
            pass

        def execute(self, inputs):
            return {"y": inputs["x"] * 2.0}
''')


class FloodTarget:
    """What `grpc_idle_connections` needs of `bench.attacks.Context`, on a loop of its own thread."""

    def __init__(self, grpc_port: int) -> None:
        self.grpc_port = grpc_port
        self.stop = asyncio.Event()
        self.counts: Counter[str] = Counter()

    async def pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except TimeoutError:
            pass


class Flood:
    """`grpc_idle_connections` holding `FLOOD` connections in a thread until `stop`."""

    def __init__(self, grpc_port: int) -> None:
        self.target = FloodTarget(grpc_port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(grpc_idle_connections(self.target, target=FLOOD, per_second=FLOOD_PER_S))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> dict[str, int]:
        self._loop.call_soon_threadsafe(self.target.stop.set)
        self._thread.join(60)
        return dict(self.target.counts)


def write_model(root: Path) -> None:
    directory = root / "doubler"
    directory.mkdir(parents=True)
    (directory / "doubler.py").write_text(MODEL_SOURCE)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "python", "artifact": "doubler.py", "max_batch_size": 4, "python": {"entry": "doubler:Doubler"},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [2]}]}))


def new_client_calls(grpc_url: str, count: int) -> tuple[Counter[str], list[float]]:
    """`count` calls, each by a new `tritonclient.grpc` client (its own connection): outcomes by status,
    and the seconds each answered call took (connecting included)."""
    import tritonclient.grpc as triton
    from tritonclient.utils import InferenceServerException

    outcomes: Counter[str] = Counter()
    took: list[float] = []
    for _ in range(count):
        started = time.monotonic()
        x = triton.InferInput("x", [1, 2], "FP32")
        x.set_data_from_numpy(np.ones((1, 2), np.float32))
        try:
            with triton.InferenceServerClient(grpc_url) as client:
                client.infer("doubler", [x], client_timeout=10)
            outcomes["ok"] += 1
            took.append(time.monotonic() - started)
        except InferenceServerException as exc:
            outcomes[f"{exc.status()} {exc.message()[:80]}"] += 1
        time.sleep(0.1)
    return outcomes, took


def _ms(values: list[float], quantile: float) -> float | None:
    if not values:
        return None
    return round(1000 * float(np.quantile(values, quantile)), 1)


@case("grpc_idle_flood")
def grpc_idle_flood(workdir: Path) -> CaseResult:
    """See the module doc."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < FLOOD + 500:  # the flood's own descriptors
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, FLOOD + 1000), hard))
    write_model(workdir / "repository")
    port, grpc_port = free_port(), free_port()
    server = ServerProcess("servewell-hostile-grpc", [
        sys.executable, "-m", "servewell", "serve", "--host", HOST, "--port", str(port), "--grpc-port",
        str(grpc_port), "--model-repository", str(workdir / "repository"), "--cache-dir", str(workdir / "cache")],
        port, workdir / "server.log")
    grpc_url = f"{HOST}:{grpc_port}"
    server.start()
    flood: Flood | None = None
    try:
        server.wait_ready(180)
        quiet, quiet_took = new_client_calls(grpc_url, 5)
        flood = Flood(grpc_port)
        flood.start()
        filled_by = time.monotonic() + FLOOD / FLOOD_PER_S + 5.0
        while time.monotonic() < filled_by and flood.target.counts["connections"] < FLOOD:
            time.sleep(0.2)
        during, took = new_client_calls(grpc_url, CALLS)
        counts = flood.stop()
        flood = None
    finally:
        if flood is not None:
            flood.stop()
        server.stop()
    answered = during["ok"] / CALLS
    figures: dict[str, Any] = {
        "flood": counts, "calls_during_flood": dict(during), "answered_share": round(answered, 3),
        "answered_ms": {"p50": _ms(took, 0.5), "max": _ms(took, 1.0),
                        "mean": None if not took else round(1000 * statistics.mean(took), 1)},
        "quiet_calls": dict(quiet), "quiet_ms": {"p50": _ms(quiet_took, 0.5), "max": _ms(quiet_took, 1.0)},
        "evictions_logged": (workdir / "server.log").read_text(errors="replace").count("to keep room for new ones"),
    }
    return CaseResult("grpc_idle_flood", f">= {GOAL_ANSWERED:.0%} of {CALLS} new tritonclient.grpc clients' calls "
                      f"answered during a flood of {FLOOD} idle HTTP/2 connections", answered >= GOAL_ANSWERED, figures)
