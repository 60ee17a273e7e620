"""OIP v2 over gRPC vs HTTP with JSON tensors vs HTTP with binary tensors: same server, same run.

    python -m bench.protocols [--rounds 3] [--quick]

One servewell serves the tiny MLP (frontend-bound: the protocol's own cost shows) and ResNet-50
(compute-bound, 600 KB of input per request). For each workload, each round runs a closed loop
over each protocol in turn, the order rotating between rounds so no protocol always follows
another; the verdict is the median over rounds of each protocol's throughput and p99, and of its
throughput relative to HTTP/JSON in the same round (a ratio within one round cancels most of
what a shared, noisy machine does to absolute numbers). The load generator is servewell's own
(`servewell.perf`, the engine of `servewell bench`), the same for all three protocols.

Writes bench/results/protocols.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from dataclasses import dataclass
from typing import Any

from bench.processes import HOST, ServerProcess, free_port, run_module
from bench.workspace import RESULTS, WORK, ServedModel, prepare
from servewell.perf.loop import LoadShape
from servewell.perf.sweep import StepResult, measure
from servewell.perf.target import Endpoint, InputChoice, prepare_target

#: (label, protocol, tensor format) in the order of the first round.
PROTOCOLS = (("http-json", "http", "json"), ("http-binary", "http", "binary"), ("grpc", "grpc", "binary"))
MODELS = [
    ServedModel("mlp", "mlp", {"threads": 1, "instances": 1, "max_batch_size": 32}),
    ServedModel("resnet50", "resnet50", {"threads": 1, "instances": 2, "max_batch_size": 8,
                                         "batching": {"policy": "idle"}}),
]


@dataclass(slots=True, frozen=True)
class Workload:
    """One model under one closed loop."""

    model: str
    concurrency: int
    duration_s: float
    warmup_s: float


def workloads(quick: bool) -> list[Workload]:
    """The tiny MLP at 32 clients; ResNet-50 at 8 (two instances with batches of up to 8 full)."""
    scale = 0.4 if quick else 1.0
    return [Workload("mlp", 32, 6.0 * scale, 1.0), Workload("resnet50", 8, 12.0 * scale, 3.0 * scale)]


async def one_step(port: int, grpc_port: int, workload: Workload, protocol: str, fmt: str) -> StepResult:
    """Prepare the requests over `protocol` from the model's own metadata, then run the loop."""
    endpoint = Endpoint(protocol, HOST, grpc_port if protocol == "grpc" else port)  # type: ignore[arg-type]
    target, _ = await prepare_target(endpoint, workload.model, None, fmt, InputChoice(batch_size=1),  # type: ignore[arg-type]
                                     request_timeout_s=30.0)
    try:
        shape = LoadShape("closed", concurrency=workload.concurrency, duration_s=workload.duration_s,
                          warmup_s=workload.warmup_s, timeout_s=30.0, grace_s=31.0)
        return await measure(target, shape)
    finally:
        await target.client.close()


def summary(runs: dict[str, list[StepResult]]) -> dict[str, Any]:
    """Medians per protocol, and each protocol's throughput relative to HTTP/JSON round by round."""
    out: dict[str, Any] = {}
    baseline = runs["http-json"]
    for label, steps in runs.items():
        ratios = [s.throughput_rps / b.throughput_rps for s, b in zip(steps, baseline, strict=True)
                  if b.throughput_rps > 0]
        p99s = [s.p99_ms for s in steps if s.p99_ms is not None]
        out[label] = {
            "rps_median": round(statistics.median(s.throughput_rps for s in steps), 1),
            "p50_ms_median": round(statistics.median(s.p50_ms for s in steps if s.p50_ms is not None), 2),
            "p99_ms_median": round(statistics.median(p99s), 2) if p99s else None,
            "vs_http_json_median": round(statistics.median(ratios), 3) if ratios else None,
            "errors": sum(s.errors for s in steps),
            "rounds_rps": [round(s.throughput_rps, 1) for s in steps],
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="shorter steps (a smoke run, not a measurement)")
    args = parser.parse_args()
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    print("building the models (cached)", flush=True)
    run_module("bench.models", ["--work", str(WORK)], timeout_s=600, log_path=RESULTS / "logs" / "build.log")
    workspace = prepare(MODELS)
    port, grpc_port = free_port(), free_port()
    server = ServerProcess("servewell", [
        sys.executable, "-m", "servewell", "serve", "--model-repository", str(workspace.repository),
        "--host", HOST, "--port", str(port), "--grpc-port", str(grpc_port), "--log-format", "json",
        # ResNet-50's 1x3x224x224 FP32 input is ~1.5 MB as JSON text: above the 1 MB default.
        "--max-body-bytes", str(8 << 20),
    ], port, RESULTS / "logs" / "protocols_server.log")
    server.start()
    results: dict[str, Any] = {"rounds": args.rounds, "workloads": {}}
    try:
        server.wait_ready(300)
        for workload in workloads(args.quick):
            runs: dict[str, list[StepResult]] = {label: [] for label, _, _ in PROTOCOLS}
            for round_index in range(args.rounds):
                shift = round_index % len(PROTOCOLS)
                for label, protocol, fmt in PROTOCOLS[shift:] + PROTOCOLS[:shift]:
                    step = asyncio.run(one_step(port, grpc_port, workload, protocol, fmt))
                    runs[label].append(step)
                    print(f"  {workload.model:<9} round {round_index + 1} {label:<12} {step.throughput_rps:8.1f} req/s "
                          f"p99 {step.p99_ms if step.p99_ms is not None else float('nan'):7.1f} ms  "
                          f"errors {step.errors}", flush=True)
            results["workloads"][workload.model] = {
                "concurrency": workload.concurrency, "duration_s": workload.duration_s,
                "summary": summary(runs),
            }
    finally:
        server.stop()
    (RESULTS / "protocols.json").write_text(json.dumps(results, indent=2))
    print(f"\n{'workload':<10} {'protocol':<12} {'req/s':>8} {'vs JSON':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7}")
    for model, doc in results["workloads"].items():
        for label, row in doc["summary"].items():
            print(f"{model:<10} {label:<12} {row['rps_median']:>8} {row['vs_http_json_median']:>8} "
                  f"{row['p50_ms_median']:>8} {row['p99_ms_median']:>8} {row['errors']:>7}")
    print(f"\nmedians over {args.rounds} rounds; wrote {RESULTS / 'protocols.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

