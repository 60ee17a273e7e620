"""Hostile cases of streams (issue 48), each with a server of its own serving the generative example
(`examples/generative.py`'s charlm, built here with no download):

- `streams_never_read`: 1,000 clients each open a `generate_stream` and never read a byte, while a
  probe asks the same model for a short answer every 0.2 s in the urgent lane. Bound: the server's
  processes grow by at most 256 MiB of RSS (each stream holds at most `stream_buffer_parts` parts;
  the rest waits in the clients' unread socket buffers or is refused 503 overloaded past
  `max_waiting`), every probe is answered 200, and once the clients close every sequence has ended.
- `streams_disconnect_mid_stream`: 500 clients each open a stream, read its first part and close.
  Bound: every sequence that started is counted ended as cancelled within 2 s of the last close,
  and the model makes no more parts after that (its parts counter stops).

    python -m bench.hostile --attacks "" --cases streams_never_read,streams_disconnect_mid_stream
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.hostile_cases import CaseResult, case
from bench.processes import HOST, ServerProcess, free_port, tree_pids

MiB = 1 << 20


def start_server(workdir: Path) -> ServerProcess:
    """A split server on the generative examples, ready."""
    repository = workdir / "repository"
    subprocess.run([sys.executable, "-m", "servewell.examples.build", "charlm", "--out", str(repository)],
                   check=True, capture_output=True)
    # 2 ms a step (the example's step_ms), as a larger model's: a stream of 512 parts lasts about a
    # second, so clients leave mid-stream (the tiny model itself makes 512 parts in ~25 ms).
    config = repository / "charlm" / "model.yaml"
    doc = yaml.safe_load(config.read_text())
    doc["python"]["settings"] = {"step_ms": 2}
    config.write_text(yaml.safe_dump(doc))
    port = free_port()
    server = ServerProcess("servewell-hostile-streams", [
        sys.executable, "-m", "servewell", "serve", "--host", HOST, "--port", str(port), "--grpc-port", "0",
        "--model-repository", str(repository), "--config-poll-s", "0", "--cache-dir", str(workdir / "cache")],
        port, workdir / "server.log")
    server.start()
    server.wait_ready(240)
    return server


def tree_rss_bytes(root: int) -> int:
    """Resident bytes of `root` and every descendant."""
    total = 0
    for pid in tree_pids(root):
        try:
            with open(f"/proc/{pid}/statm") as file:
                total += int(file.read().split()[1]) * 4096
        except (OSError, IndexError, ValueError):
            continue
    return total


def scraped(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def request_bytes(max_tokens: int) -> bytes:
    body = json.dumps({"text_input": "The batcher", "parameters": {"max_tokens": max_tokens}}).encode()
    return (f"POST /v2/models/charlm/generate_stream HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def probe(url: str, stop: asyncio.Event, answers: Counter[str], latencies: list[float]) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        while not stop.is_set():
            began = time.perf_counter()
            response = await client.post(url + "/v2/models/charlm/generate", headers={"X-Urgency": "high"},
                                         json={"text_input": "A", "parameters": {"max_tokens": 8}})
            latencies.append(time.perf_counter() - began)
            answers[str(response.status_code)] += 1
            await asyncio.sleep(0.2)


@case("streams_never_read")
def never_read(workdir: Path) -> CaseResult:
    """1,000 streams opened and never read, a probe served beside them."""
    server = start_server(workdir)
    answers: Counter[str] = Counter()
    latencies: list[float] = []
    figures: dict[str, Any] = {}
    try:
        before = tree_rss_bytes(server.pid)

        async def attack() -> int:
            stop = asyncio.Event()
            prober = asyncio.ensure_future(probe(server.url, stop, answers, latencies))
            writers = []
            peak = before
            for _ in range(1000):
                try:
                    _, writer = await asyncio.open_connection(HOST, server.port)
                except OSError:
                    continue
                writer.write(request_bytes(512))
                writers.append(writer)
            for _ in range(20):  # 10 s with every stream open and unread
                await asyncio.sleep(0.5)
                peak = max(peak, tree_rss_bytes(server.pid))
            stop.set()
            await prober
            for writer in writers:
                writer.close()
            figures["opened"] = len(writers)
            return peak

        peak = asyncio.run(attack())
        time.sleep(3)
        ended = scraped(server.url, "servewell_sequences_ended_total", model="charlm")
        refused = scraped(server.url, "servewell_refusals_total", model="charlm")
        figures.update({"rss_before_mib": round(before / MiB, 1), "rss_peak_mib": round(peak / MiB, 1),
                        "probe_answers": dict(answers), "probe_p99_ms": round(sorted(latencies)[
                            int(0.99 * (len(latencies) - 1))] * 1000, 1) if latencies else None,
                        "sequences_ended": ended, "refused": refused})
    finally:
        server.stop()
    grown = figures["rss_peak_mib"] - figures["rss_before_mib"]
    return CaseResult(
        "streams_never_read",
        "1,000 streams opened and never read: the server grows by at most 256 MiB of RSS, every urgent probe is "
        "answered 200",
        grown <= 256 and bool(answers) and set(answers) == {"200"},
        figures)


@case("streams_disconnect_mid_stream")
def disconnect_mid_stream(workdir: Path) -> CaseResult:
    """500 clients disconnecting after their first part."""
    server = start_server(workdir)
    figures: dict[str, Any] = {}
    try:
        cancelled_before = scraped(server.url, "servewell_sequences_ended_total", model="charlm", reason="cancelled")

        async def attack() -> tuple[int, float]:
            async def one() -> bool:
                try:
                    reader, writer = await asyncio.open_connection(HOST, server.port)
                except OSError:
                    return False
                writer.write(request_bytes(100_000))
                started = False
                try:
                    while True:
                        line = await asyncio.wait_for(reader.readline(), 30)
                        if not line:
                            break
                        if line.startswith(b"data: "):
                            started = b'"final"' not in line
                            break
                finally:
                    writer.close()
                return started

            results = await asyncio.gather(*(one() for _ in range(500)))
            return sum(results), time.monotonic()

        started, last_close = asyncio.run(attack())
        freed_s = None
        while time.monotonic() - last_close < 10:
            cancelled = scraped(server.url, "servewell_sequences_ended_total", model="charlm", reason="cancelled")
            if cancelled - cancelled_before >= started:
                freed_s = time.monotonic() - last_close
                break
            time.sleep(0.05)
        parts = scraped(server.url, "servewell_stream_outputs_total", model="charlm")
        time.sleep(0.5)
        still_making = scraped(server.url, "servewell_stream_outputs_total", model="charlm") - parts
        figures.update({"streams_started": started, "cancelled_counted": cancelled - cancelled_before,
                        "all_freed_after_s": freed_s, "parts_made_after": still_making})
    finally:
        server.stop()
    return CaseResult(
        "streams_disconnect_mid_stream",
        "500 clients disconnect after their first part: every started sequence counted cancelled within 2 s of the "
        "last close, and no part made for them after",
        freed_s is not None and freed_s <= 2.0 and still_making == 0,
        figures)
