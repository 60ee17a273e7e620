"""What the HTTP limits cost per request: the tiny MLP's closed loop against `servewell serve`
(our limited httptools protocol), the same app behind uvicorn's stock httptools protocol (how
servewell ran before: no limits), and behind uvicorn's h11 protocol with its native head bound.

    python -m bench.http_cost [--quick] [--rounds N]

Three servers side by side, short windows in a rotating order, round after round (as
`bench.observability`): the verdict is the median over rounds of each round's ratio, for the
completion rate and for the server's CPU per request. Writes bench/results/http_cost.json and
prints a table. Then `bench.protocol_cost`: the same comparison in-process, without sockets, where
what differs is exactly the limits' code (steadier than the end-to-end ratio on a busy machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench import protocol_cost
from bench.processes import HOST, ServerProcess, closed_loop, cpu_seconds, free_port, run_module
from bench.workspace import RESULTS, WORK, ServedModel, prepare

MODELS = [ServedModel("mlp", "mlp", {"threads": 1, "instances": 1, "max_batch_size": 32})]
VARIANTS = {
    # one process, as the variants run: what differs is the HTTP protocol, not the process split
    "limits": ["-m", "servewell", "serve", "--ingress-processes", "0"],
    "plain": ["-m", "bench.http_variants", "plain"],
    "h11": ["-m", "bench.http_variants", "h11"],
}
PATH, CLIENTS, WARMUP_S, WINDOW_S = "/v2/models/mlp/infer", 32, 1.0, 4.0


def make_servers(repository: Path) -> dict[str, ServerProcess]:
    servers = {}
    for name, command in VARIANTS.items():
        port = free_port()
        servers[name] = ServerProcess(
            f"servewell-{name}",
            [
                sys.executable,
                *command,
                "--model-repository",
                str(repository),
                "--host",
                HOST,
                "--port",
                str(port),
                "--load-timeout-s",
                "180",
            ],
            port,
            RESULTS / "logs" / f"servewell-http-{name}.log",
        )
    return servers


def measure(servers: dict[str, ServerProcess], bodies: list[Path], rounds: int, scale: float) -> dict[str, list[dict]]:
    names = list(servers)
    samples: dict[str, list[dict]] = {n: [] for n in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            server = servers[name]
            pids = [server.pid]  # the frontend: where HTTP is parsed (the worker's share is the same for all)
            cpu_before = sum(cpu_seconds(p) for p in pids)
            doc = closed_loop(
                server.url,
                PATH,
                bodies,
                CLIENTS,
                WINDOW_S * scale,
                WARMUP_S * scale,
                RESULTS / "runs" / f"http_cost_{name}_{round_index}.json",
                RESULTS / "logs" / "loadgen.log",
            )
            cpu = sum(cpu_seconds(p) for p in pids) - cpu_before
            errors = sum(v for k, v in doc["status_counts"].items() if k != "200")
            samples[name].append(
                {
                    "rps": doc.get("completion_rate_rps") or doc["throughput_rps"],
                    "frontend_cpu_us": 1e6 * cpu / max(1, doc["sent"]),
                    "errors": errors,
                }
            )
        line = ", ".join(f"{n} {samples[n][-1]['rps']:.0f}/s {samples[n][-1]['frontend_cpu_us']:.0f} us" for n in names)
        print(f"  round {round_index + 1}/{rounds}: {line}", flush=True)
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.http_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs, for trying the script")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 9, 2 with --quick)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 9)
    scale = 0.5 if args.quick else 1.0
    started = time.monotonic()
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    (RESULTS / "runs").mkdir(parents=True, exist_ok=True)
    run_module("bench.models", ["--work", str(WORK)], timeout_s=300, log_path=RESULTS / "logs" / "build.log")
    workspace = prepare(MODELS)
    servers = make_servers(workspace.repository)
    try:
        for server in servers.values():
            server.start()
            server.wait_ready(240)
        samples = measure(servers, workspace.bodies["mlp"], rounds, scale)
    finally:
        for server in servers.values():
            server.stop()
    ratios = {}
    for name in ("limits", "h11"):
        pairs = list(zip(samples[name], samples["plain"], strict=True))
        ratios[f"{name}_vs_plain_rps"] = [s["rps"] / p["rps"] for s, p in pairs]
        ratios[f"{name}_minus_plain_cpu_us"] = [s["frontend_cpu_us"] - p["frontend_cpu_us"] for s, p in pairs]
    medians = {k: statistics.median(v) for k, v in ratios.items()}
    print()
    print(f"{'median over rounds':<22} {'MLP req/s':>10} {'frontend CPU us/req':>20} {'errors':>7}")
    for name, runs in samples.items():
        print(
            f"{name:<22} {statistics.median(r['rps'] for r in runs):>10.1f} "
            f"{statistics.median(r['frontend_cpu_us'] for r in runs):>20.1f} {sum(r['errors'] for r in runs):>7}"
        )
    print()
    for key, values in ratios.items():
        unit = "x" if key.endswith("rps") else " us"
        print(f"{key:<28} median {medians[key]:>8.3f}{unit}  range {min(values):.3f} to {max(values):.3f}")
    print()
    in_process = protocol_cost.measure(rounds=rounds)
    print(
        f"in-process protocol CPU per request: stock {in_process['median_us']['stock']:.2f} us, limited "
        f"{in_process['median_us']['limited']:.2f} us, difference (median of rounds) "
        f"{in_process['median_difference_us']:.2f} us"
    )
    doc = {
        "samples": samples,
        "in_process": in_process,
        "per_round": ratios,
        "medians": medians,
        "rounds": rounds,
        "quick": args.quick,
        "workload": {"path": PATH, "clients": CLIENTS, "window_s": WINDOW_S * scale},
        "wall_s": round(time.monotonic() - started, 1),
    }
    (RESULTS / "http_cost.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wall time {doc['wall_s']} s; results: {RESULTS / 'http_cost.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
