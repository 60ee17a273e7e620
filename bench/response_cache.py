"""The response cache (issue 22): repeated inputs answered from the cache, and what it costs
when nothing repeats.

    flock /tmp/servewell-bench.lock .venv/bin/python -m bench.response_cache [--rounds 3] [--seconds 10]

One server (`servewell serve`, the split as in production) serves two copies of one ONNX model
that computes about 20 ms per row on one thread here (a per-token MLP over 32 tokens of 256:
10 M multiply-adds a token, 0.33 G a row; max batch 8, one instance): `plain` without a cache and `cached` with
`cache: {max_bytes: 256 MiB, ttl_s: 3600}`. Requests use the binary tensor extension (32 KiB of
FP32 each), from `--clients` closed-loop clients (this process, its own cores' share). First
the 1,000 repeated inputs are sent once to `cached` (the trace's steady state is measured, not
its first minute). Per round, in alternating order, each phase runs `--seconds` (the first 2 s
not measured):

* repeat/plain and repeat/cached: the issue's trace: 90 % of requests repeat one of 1,000
  inputs (uniform), 10 % are new inputs; closed loop, so each is the most that side serves;
* repeat/cached@5x: the same trace to `cached` in an open loop (Poisson arrivals) at 5x what
  repeat/plain served this round: the goal's "5x the throughput at equal or better p99" (a
  closed loop at saturation only measures the queue its clients build: both p99s are then
  `clients / throughput` of whatever is the bottleneck, here the misses' model);
* hits/cached: only the 1,000 inputs, all kept by then: what a cached answer costs;
* unique/plain and unique/cached: every input new (the failure mode of a cache that slows
  down unique inputs).

Server CPU is every process of the server's tree (/proc, `bench/processes.TreeCpu`). Goals,
medians over the rounds: repeat/cached@5x answers >= 5x repeat/plain's ok/s at a p99 no worse
than repeat/plain's; CPU of a cached answer (hits) < 0.1x a computed one (unique/plain);
unique/cached CPU per request <= 1.03x unique/plain. The closed-loop ratio (most cached
serves / most plain serves) is printed beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import yaml

from bench.processes import ServerProcess, TreeCpu, free_port
from bench.report import finish_rounds, median_over
from bench.workspace import RESULTS, WORK
from servewell.perf import loop as load_loop
from servewell.perf.httpclient import encode_request
from servewell.perf.loop import LoadShape
from servewell.perf.oip_http import HttpOipConnection
from servewell.perf.stats import summarize_ms

TOKENS, WIDTH, HIDDEN, OUT = 32, 256, 3072, 16
REPEATED_INPUTS = 1000
REPEAT_SHARE = 0.9
GOAL_THROUGHPUT_RATIO = 5.0
GOAL_HIT_CPU_RATIO = 0.1
GOAL_UNIQUE_CPU_RATIO = 1.03
#: repeat/plain first in every round (repeat/cached@5x's rate comes from it); the rest alternate.
PHASES = (("repeat", "cached"), ("repeat", "cached@5x"), ("hits", "cached"), ("unique", "plain"), ("unique", "cached"))


def build_repository(root: Path) -> Path:
    """`plain` and `cached`: the same ONNX model (built once, hard-linked), with and without a cache."""
    import torch

    root.mkdir(parents=True, exist_ok=True)
    artifact = root / "model.onnx"
    if not artifact.exists():
        torch.manual_seed(22)
        net = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                                  torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))
        torch.onnx.export(net, (torch.zeros(2, TOKENS, WIDTH),), str(artifact), dynamo=False, input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "b"}, "y": {0: "b"}})
    repository = root / "repository"
    for name, extra in (("plain", {}), ("cached", {"cache": {"max_bytes": 256 << 20, "ttl_s": 3600}})):
        directory = repository / name
        directory.mkdir(parents=True, exist_ok=True)
        if not (directory / "model.onnx").exists():
            (directory / "model.onnx").hardlink_to(artifact)
        (directory / "model.yaml").write_text(yaml.safe_dump({
            "runtime": "onnx", "artifact": "model.onnx", "max_batch_size": 8, "instances": 1, "threads": 1,
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [TOKENS, WIDTH]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [TOKENS, OUT]}], **extra}))
    return repository


class Trace:
    """Requests of one phase: repeats of the fixed inputs and/or new ones, seeded."""

    def __init__(self, host: str, model: str, kind: str, repeated: list[bytes], seed: int) -> None:
        self._random = random.Random(seed)
        self._rng = np.random.default_rng(seed)
        self._host, self._path, self._kind = host, f"/v2/models/{model}/infer", kind
        self.repeated_requests = [self._encode(body) for body in repeated]

    def _encode(self, tensor: bytes) -> bytes:
        header = orjson.dumps({"inputs": [{"name": "x", "shape": [1, TOKENS, WIDTH], "datatype": "FP32",
                                           "parameters": {"binary_data_size": len(tensor)}}],
                               "parameters": {"binary_data_output": True}})
        return encode_request("POST", self._host, self._path, header + tensor,
                              {"Inference-Header-Content-Length": str(len(header))}, "application/octet-stream")

    def next(self) -> tuple[str, bytes]:
        """(repeat or new, the encoded request)."""
        share = {"repeat": REPEAT_SHARE, "hits": 1.0, "unique": 0.0}[self._kind]
        if self._random.random() < share:
            return "repeat", self.repeated_requests[self._random.randrange(len(self.repeated_requests))]
        return "new", self._encode(self._rng.random((TOKENS, WIDTH), dtype=np.float32).tobytes())


async def _load(port: int, trace: Trace, clients: int, seconds: float, rate: float | None) -> dict[str, Any]:
    shape = LoadShape("closed" if rate is None else "open", concurrency=clients, rate=rate or 0.0, duration_s=seconds,
                      warmup_s=min(2.0, seconds / 2), grace_s=15, max_requests=1_000_000)
    recorder = await load_loop.run_load(shape, lambda: HttpOipConnection("127.0.0.1", port), trace)
    window = [o for o in recorder.outcomes if recorder.in_window(o.arrival)]
    ok = [o for o in window if o.ok]
    span = recorder.window_end - recorder.window_start
    statuses: dict[str, int] = {}
    for o in recorder.outcomes:
        statuses[o.status] = statuses.get(o.status, 0) + 1
    return {"ok_per_s": len(ok) / span if span > 0 else 0.0, "answered": len(recorder.outcomes),
            "latency_ms": summarize_ms([o.latency_ms for o in ok]), "statuses": statuses}


async def _warm(port: int, repeated: list[bytes], clients: int) -> dict[str, int]:
    trace = Trace(f"127.0.0.1:{port}", "cached", "hits", repeated, 0)
    requests = list(trace.repeated_requests)  # the encoded inputs, each once
    statuses: dict[str, int] = {}

    async def client() -> None:
        connection = HttpOipConnection("127.0.0.1", port)
        try:
            while requests:
                reply = await connection.send(requests.pop())
                statuses[reply.status] = statuses.get(reply.status, 0) + 1
        finally:
            connection.close()

    await asyncio.gather(*(client() for _ in range(clients)))
    return statuses


def run_phase(server: ServerProcess, kind: str, model: str, repeated: list[bytes], clients: int, seconds: float,
              seed: int, rate: float | None = None) -> dict[str, Any]:
    """One phase (closed loop, or open at `rate`): the load, and the server tree's CPU over it per
    answered request."""
    trace = Trace(f"127.0.0.1:{server.port}", model, kind, repeated, seed)
    meter = TreeCpu(server.pid).start()
    result = asyncio.run(_load(server.port, trace, clients, seconds, rate))
    spent = meter.stop()
    result["cpu_us_per_request"] = 1e6 * sum(spent.values()) / max(1, result["answered"])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS / "response_cache.json")
    args = parser.parse_args(argv)
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    repository = build_repository(WORK / "response_cache")
    rng = np.random.default_rng(1000)
    repeated = [rng.random((TOKENS, WIDTH), dtype=np.float32).tobytes() for _ in range(REPEATED_INPUTS)]
    port = free_port()
    server = ServerProcess("response_cache", [sys.executable, "-m", "servewell", "serve", "--host", "127.0.0.1",
                                              "--port", str(port), "--model-repository", str(repository),
                                              "--log-format", "json"],
                           port, RESULTS / "logs" / "response_cache.log", env={"SERVEWELL_GRPC_PORT": "0"})
    server.start()
    server.wait_ready(180)
    rounds: list[dict[str, Any]] = []
    try:
        warm = asyncio.run(_warm(server.port, repeated, args.clients))
        print(f"warm-up: the {len(repeated)} repeated inputs sent once to cached: {warm}", flush=True)
        for r in range(args.rounds):
            row: dict[str, Any] = {}
            order = (("repeat", "plain"), *(PHASES if r % 2 == 0 else PHASES[::-1]))
            for kind, name in order:
                model, _, times = name.partition("@")
                rate = GOAL_THROUGHPUT_RATIO * row["repeat/plain"]["ok_per_s"] if times else None
                result = run_phase(server, kind, model, repeated, args.clients, args.seconds, 100 * r + len(row), rate)
                row[f"{kind}/{name}"] = result
                print(f"round {r + 1} {kind}/{name}: {result['ok_per_s']:.0f} ok/s, p99 "
                      f"{result['latency_ms']['p99']:.1f} ms, {result['cpu_us_per_request']:.0f} us CPU/request, "
                      f"statuses {result['statuses']}", flush=True)
            rounds.append(row)
    finally:
        server.stop()
    finish_rounds(summarize(rounds), rounds, print_table, args.out)
    return 0


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-round ratios and their medians."""
    median = median_over(rounds)
    return {
        "throughput_ratio": median(lambda r: r["repeat/cached@5x"]["ok_per_s"] / r["repeat/plain"]["ok_per_s"]),
        "p99_ratio": median(lambda r: r["repeat/cached@5x"]["latency_ms"]["p99"]
                            / r["repeat/plain"]["latency_ms"]["p99"]),
        "closed_throughput_ratio": median(lambda r: r["repeat/cached"]["ok_per_s"] / r["repeat/plain"]["ok_per_s"]),
        "hit_cpu_ratio": median(lambda r: r["hits/cached"]["cpu_us_per_request"]
                                / r["unique/plain"]["cpu_us_per_request"]),
        "unique_cpu_ratio": median(lambda r: r["unique/cached"]["cpu_us_per_request"]
                                   / r["unique/plain"]["cpu_us_per_request"]),
        "unique_throughput_ratio": median(lambda r: r["unique/cached"]["ok_per_s"] / r["unique/plain"]["ok_per_s"]),
        "computed_cpu_us": median(lambda r: r["unique/plain"]["cpu_us_per_request"]),
        "hit_cpu_us": median(lambda r: r["hits/cached"]["cpu_us_per_request"]),
    }


def print_table(report: dict[str, Any]) -> None:
    """Each goal beside its figure (medians over the rounds)."""
    rows = [
        ("repeat trace: cached@5x answered / plain", report["throughput_ratio"],
         f">= {0.98 * GOAL_THROUGHPUT_RATIO:g}x", report["throughput_ratio"] >= 0.98 * GOAL_THROUGHPUT_RATIO),
        ("repeat trace: p99 cached@5x / plain", report["p99_ratio"], "<= 1x", report["p99_ratio"] <= 1.0),
        ("repeat trace: most served, cached / plain", report["closed_throughput_ratio"], "(reference)", None),
        ("CPU of a cached answer / a computed one", report["hit_cpu_ratio"], f"< {GOAL_HIT_CPU_RATIO:g}x",
         report["hit_cpu_ratio"] < GOAL_HIT_CPU_RATIO),
        ("unique inputs: CPU/request cache on / off", report["unique_cpu_ratio"], f"<= {GOAL_UNIQUE_CPU_RATIO:g}x",
         report["unique_cpu_ratio"] <= GOAL_UNIQUE_CPU_RATIO),
        ("unique inputs: throughput cache on / off", report["unique_throughput_ratio"], "(reference)", None),
    ]
    print(f"computed answer {report['computed_cpu_us']:.0f} us CPU, cached answer {report['hit_cpu_us']:.0f} us "
          "(server tree, per request)")
    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  {'value':>8}  {'goal':<9} verdict")
    for figure, value, goal, ok in rows:
        verdict = "-" if ok is None else ("PASS" if ok else "FAIL")
        print(f"{figure:<{width}}  {value:>7.3f}x  {goal:<9} {verdict}")


if __name__ == "__main__":
    raise SystemExit(main())
