"""What observability costs, end to end: the same closed-loop loads against servewell with
everything off, with the default configuration, and with metrics plus tracing at 100%
sampling (exported over OTLP/HTTP to a sink in this process), in one run.

    python -m bench.observability [--quick] [--rounds N]

Targets (issue: full-chain observability): resnet50 with metrics + tracing at 100% >= 0.97 of
the throughput with everything off; the tiny MLP with the default configuration >= 0.9 (its
ratio at 100% sampling is reported). Then the per-request cost of each layer in microseconds
(`bench.layer_cost`). Writes bench/results/observability.json and prints a table.

A fourth server traces every request to a collector that never answers (a port that accepts
into its backlog and never reads): its MLP throughput against the reachable one shows that the
exporter never holds serving back.

How it stays honest on a shared, noisy 2-core machine: the servers run side by side
(an idle one costs nothing), and the load visits them in short windows, in a rotating order,
round after round. Each round compares configurations measured seconds apart, so drift in
the machine's speed hits them alike; the verdict is the median over rounds of each round's
ratio. Throughput is the completion rate (`servewell.perf.stats.completion_rate`), which does not jump
by whole batches the way a count of answers in a fixed window does.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from bench import layer_cost
from bench.processes import HOST, ServerProcess, closed_loop, cpu_seconds, free_port, http_json, run_module, tree_pids
from bench.workspace import RESULTS, WORK, ServedModel, prepare

MODELS = [
    ServedModel("mlp", "mlp", {"threads": 1, "instances": 1, "max_batch_size": 32}),
    ServedModel("resnet50", "resnet50", {"threads": 2, "instances": 1, "max_batch_size": 8}),
]
CONFIGS = {
    "off": ["--metrics-enabled", "false"],  # and no OTLP endpoint: no tracing
    "default": [],  # metrics on, tracing to the sink at its default sampling (1%)
    "full": ["--trace-sample-ratio", "1.0"],  # metrics on, every request traced
    "unreachable": ["--trace-sample-ratio", "1.0"],  # as full, to a collector that never answers (MLP only)
}
# (path, clients, warm-up s, window s) per workload
WORKLOADS = {
    "mlp": ("/v2/models/mlp/infer", 32, 1.0, 4.0),
    "resnet50": ("/predict", 16, 2.0, 8.0),
}


class SpanSink:
    """An OTLP/HTTP endpoint that accepts and counts export requests, nothing more."""

    def __init__(self) -> None:
        self.requests = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                sink.requests += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer((HOST, 0), Handler)
        self.url = f"http://{HOST}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def server_pids(server: ServerProcess) -> list[int]:
    """The frontend and its worker processes (a split server's supervisor, engine and ingress
    processes too: every process of its tree)."""
    _, health = http_json(server.port, "GET", "/healthz")
    models = (health or {}).get("models", {}).values()
    workers = [i["pid"] for m in models for i in m["instances"] if i["pid"]]
    return sorted(set(tree_pids(server.pid)) | set(workers) | {server.pid})


def run_load(url: str, workload: str, bodies: list[Path], seconds: float, warmup: float, name: str) -> dict:
    path, clients, _, _ = WORKLOADS[workload]
    doc = closed_loop(url, path, bodies, clients, seconds, warmup, RESULTS / "runs" / f"observability_{name}.json",
                      RESULTS / "logs" / "loadgen.log")
    if doc.get("error_codes"):
        print(f"  {name}: errors {doc['error_codes']}")
    return doc


def blackhole() -> socket.socket:
    """A port that accepts connections into its backlog and never reads: exports hang to their timeout."""
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(1)
    return listener


def make_servers(repository: Path, sink: SpanSink, unreachable: socket.socket) -> dict[str, ServerProcess]:
    """One server per configuration, not started yet."""
    servers = {}
    endpoints = {"off": None, "unreachable": f"http://{HOST}:{unreachable.getsockname()[1]}"}
    for config, flags in CONFIGS.items():
        endpoint = endpoints.get(config, sink.url)
        extra = ["--otlp-endpoint", endpoint] if endpoint else []
        port = free_port()
        servers[config] = ServerProcess(f"servewell-{config}", [
            sys.executable, "-m", "servewell", "serve", "--grpc-port", "0", "--model-repository", str(repository),
            "--host", HOST, "--port", str(port), "--load-timeout-s", "180", *flags, *extra,
        ], port, RESULTS / "logs" / f"servewell-observability-{config}.log")
    return servers


def start_servers(servers: dict[str, ServerProcess]) -> None:
    for server in servers.values():  # one at a time: loading them all at once would only contend
        server.start()
        server.wait_ready(240)
        http_json(server.port, "PATCH", "/admin/models/resnet50/batching", {"max_batch_size": 8})


def measure(servers: dict[str, ServerProcess], workload: str, bodies: list[Path], rounds: int,
            scale: float) -> dict[str, list[dict]]:
    """Rounds of one window per configuration (of `servers`), each round in a rotated order."""
    _, _, warmup, window = WORKLOADS[workload]
    names = list(servers)
    samples: dict[str, list[dict]] = {c: [] for c in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        order = names[shift:] + names[:shift]
        for config in order:
            server = servers[config]
            pids = server_pids(server)
            cpu_before = sum(cpu_seconds(p) for p in pids)
            doc = run_load(server.url, workload, bodies, window * scale, warmup * scale,
                           f"{workload}_{config}_{round_index}")
            cpu = sum(cpu_seconds(p) for p in pids) - cpu_before
            rate = doc.get("completion_rate_rps") or doc["throughput_rps"]
            # Whole-run server CPU (warm-up included) over whole-run answers: a per-request cost
            # that CPU stolen by neighbours does not inflate.
            sent = max(1, doc["sent"])
            samples[config].append({"rps": rate, "server_cpu_us": 1e6 * cpu / sent})
        line = ", ".join(f"{c} {samples[c][-1]['rps']:.1f}/s {samples[c][-1]['server_cpu_us']:.0f} us" for c in names)
        print(f"  {workload} round {round_index + 1}/{rounds}: {line}", flush=True)
    return samples


def round_ratios(samples: dict[str, list[dict]], config: str, key: str, inverse: bool = False) -> list[float]:
    """Per-round ratio of `config` to `off` (of `off` to `config` when `inverse`: a cost)."""
    pairs = zip(samples[config], samples["off"], strict=True)
    return [(o[key] / c[key]) if inverse else (c[key] / o[key]) for c, o in pairs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.observability", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs, for trying the script")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per workload (default 7, 2 with --quick)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 7)
    scale = 0.5 if args.quick else 1.0
    started = time.monotonic()
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    (RESULTS / "runs").mkdir(parents=True, exist_ok=True)
    run_module("bench.models", ["--work", str(WORK)], timeout_s=300, log_path=RESULTS / "logs" / "build.log")
    workspace = prepare(MODELS)
    sink = SpanSink()
    unreachable = blackhole()
    servers = make_servers(workspace.repository, sink, unreachable)
    try:
        start_servers(servers)  # inside the try: a server that fails to start stops the ones before it
        mlp = measure(servers, "mlp", workspace.bodies["mlp"], rounds, scale)
        resnet = measure({c: servers[c] for c in ("off", "default", "full")}, "resnet50", workspace.bodies["resnet50"],
                         rounds, scale)
    finally:
        for server in servers.values():
            server.stop()
        unreachable.close()
    per_round = {
        "resnet50_full_vs_off": round_ratios(resnet, "full", "rps"),
        "mlp_default_vs_off": round_ratios(mlp, "default", "rps"),
        "mlp_full_vs_off": round_ratios(mlp, "full", "rps"),
        "mlp_default_cpu_vs_off": round_ratios(mlp, "default", "server_cpu_us", inverse=True),
        "mlp_full_cpu_vs_off": round_ratios(mlp, "full", "server_cpu_us", inverse=True),
        "mlp_unreachable_vs_full": [u["rps"] / f["rps"] for u, f in zip(mlp["unreachable"], mlp["full"], strict=True)],
    }
    ratios = {k: statistics.median(v) for k, v in per_round.items()}
    medians = {w: {c: {k: statistics.median(s[k] for s in runs) for k in runs[0]} for c, runs in samples.items()}
               for w, samples in (("mlp", mlp), ("resnet50", resnet))}
    print()
    print(f"{'median over rounds':<20} {'MLP req/s':>10} {'server CPU us/req':>18} {'resnet50 img/s':>15}")
    for config in CONFIGS:
        resnet_rps = medians["resnet50"].get(config, {}).get("rps")
        print(f"{config:<20} {medians['mlp'][config]['rps']:>10.1f} {medians['mlp'][config]['server_cpu_us']:>18.0f} "
              f"{format(resnet_rps, '.2f') if resnet_rps else '-':>15}")
    print()
    print(f"{'target (median of per-round ratios)':<56} {'measured':>9} {'limit':>7}  {'range':>13}  result")
    checks = [("resnet50: metrics + tracing 100% vs everything off", "resnet50_full_vs_off", 0.97),
              ("tiny MLP: default configuration vs everything off", "mlp_default_vs_off", 0.90),
              ("tiny MLP: metrics + tracing 100% vs everything off", "mlp_full_vs_off", None),
              ("tiny MLP, by server CPU per request: default vs off", "mlp_default_cpu_vs_off", None),
              ("tiny MLP, by server CPU per request: 100% vs off", "mlp_full_cpu_vs_off", None),
              ("tiny MLP, 100%: collector unreachable vs reachable", "mlp_unreachable_vs_full", None)]
    for name, key, limit in checks:
        value, spread = ratios[key], f"{min(per_round[key]):.3f}-{max(per_round[key]):.3f}"
        verdict = "report" if limit is None else ("PASS" if value >= limit else "FAIL")
        bound = ('>= ' + format(limit, '.2f')) if limit else ''
        print(f"{name:<56} {value:>8.3f}x {bound:>7}  {spread:>13}  {verdict}")
    print(f"(spans exported to the sink in {sink.requests} OTLP requests)")
    print()
    layer_cost.main()
    doc = {"medians": medians, "samples": {"mlp": mlp, "resnet50": resnet}, "ratios": ratios,
           "per_round_ratios": per_round, "rounds": rounds, "otlp_requests": sink.requests,
           "wall_s": round(time.monotonic() - started, 1), "quick": args.quick}
    (RESULTS / "observability.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wall time {doc['wall_s']} s; results: {RESULTS / 'observability.json'}")
    sink.server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
