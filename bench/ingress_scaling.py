"""Throughput against the number of ingress processes (issue 20), with CPU per request per process role.

    flock /tmp/servewell-bench.lock .venv/bin/python -m bench.ingress_scaling [--rounds 3] [--counts 1,2]

One split server per count in `--counts` (`servewell serve --ingress-processes N`), all serving
the tiny MLP (512 -> 2048 -> 512, ONNX, one single-threaded instance, max batch 32) at once; a
closed loop of `--clients` (64) OIP JSON clients visits each for `--seconds` per round, the order
rotated each round. Per run: answers per second, the CPU of every process of the server's tree
per request (`bench.processes.TreeCpu`: supervisor, engine, each ingress, the model worker), and
the load generator's own CPU (this process's children, from getrusage), which shares the cores.
The verdict is the median over rounds of each round's throughput ratio count / first count
(goal: >= 1.25x for 2 against 1 on a 2-core machine).

Projection for a machine of C cores, from the CPU per request of each role measured at the
largest count (medians over rounds), the load generator elsewhere:

    N = min(C, 8)                            ingress processes (the server's default on C cores)
    X(C) = min( C / (i + e + w + s),         all the cores, shared by every role
                N / i,                       ingress work scales with ingress processes (1 core each)
                1 / e,                       one engine process: at most one core (its event loop)
                W / w )                      the model worker: W = instances x threads cores (here 1)

with i, e, w, s the CPU seconds per request of all ingress processes together, the engine, the
model worker(s) and the rest (supervisor, helpers). The term that gives the minimum names the
bottleneck. It assumes CPU per request stays as measured (batches of the same size, no contention
costs), so it is a ceiling for what the split can reach, not a promise. `--counts 1,2,4,8` runs
the curve where more cores are at hand. JSON: bench/results/ingress_scaling.json.

Traffic goes to 127.0.0.1 only, every load step ends by itself, every server is stopped by its pid.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.processes import (
    INGRESS,
    WORKER,
    ServerProcess,
    TreeCpu,
    children_cpu_seconds,
    closed_loop,
    free_port,
    role_groups,
    run_module,
)
from bench.workspace import RESULTS, WORK, ServedModel, prepare

GOAL_RATIO = 1.25  # 2 ingress processes against 1, on the 2-core machine (issue 20)
PROJECT_CORES = (4, 8, 16)
DEFAULT_INGRESS_CAP = 8  # the server's default: usable CPUs, at most 8
WORKER_CORES = 1  # the MLP: one instance, one thread
MODEL = ServedModel("mlp", "mlp", {"threads": 1, "instances": 1, "max_batch_size": 32})


def start(count: int, repository: Path) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "servewell", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--grpc-port", "0", "--model-repository", str(repository), "--log-format", "json",
            "--ingress-processes", str(count)]
    server = ServerProcess(f"ingress{count}", argv, port, RESULTS / "logs" / f"ingress_scaling_{count}.log")
    server.start()
    server.wait_ready(180)
    return server


def measure(server: ServerProcess, bodies: list[Path], clients: int, seconds: float, tag: str) -> dict[str, Any]:
    """One closed-loop window against `server`: throughput and CPU per request per role."""
    meter = TreeCpu(server.pid).start()
    loadgen_before = children_cpu_seconds()
    started = time.monotonic()
    summary = closed_loop(server.url, "/v2/models/mlp/infer", bodies, clients, 1.0 + seconds, 1.0,
                          RESULTS / "runs" / f"ingress_scaling_{tag}.json", RESULTS / "logs" / "loadgen.log")
    wall_s = time.monotonic() - started
    spent = meter.stop()
    loadgen_s = children_cpu_seconds() - loadgen_before
    requests = max(1, summary["sent"])
    groups = role_groups(spent)
    latency = summary["classes"]["normal"]["latency_ms"]
    return {
        "ok_per_s": summary["throughput_rps"],
        "p50_ms": latency["p50"],
        "p99_ms": latency["p99"],
        "requests": summary["sent"],
        "statuses": summary["status_counts"],
        "roles_us_per_request": {k: round(1e6 * v / requests, 1) for k, v in sorted(spent.items())},
        "groups_us_per_request": {k: round(1e6 * v / requests, 1) for k, v in sorted(groups.items())},
        "loadgen_cpu_s": round(loadgen_s, 2),
        "wall_s": round(wall_s, 2),  # the load generator's start-up, warm-up and grace included
        "loadgen_us_per_request": round(1e6 * loadgen_s / requests, 1),
        # cores busy while requests flow: CPU per request x requests per second (the wall time of the
        # run would count the load generator's start-up and grace, when nothing is sent)
        "loadgen_cores": round(loadgen_s / requests * summary["throughput_rps"], 2),
        "server_cores": round(groups["total"] / requests * summary["throughput_rps"], 2),
    }


def project(groups_us: dict[str, float], cores: int) -> dict[str, Any]:
    """Projected requests per second on `cores` cores (the module docstring's formula)."""
    i = groups_us.get(INGRESS, 0.0) / 1e6
    e = groups_us.get("engine", 0.0) / 1e6
    w = groups_us.get(WORKER, 0.0) / 1e6
    total = groups_us.get("total", 0.0) / 1e6
    n = min(cores, DEFAULT_INGRESS_CAP)
    limits = {"all cores": cores / total if total else float("inf"),
              f"{n} ingress": n / i if i else float("inf"),
              "engine (1 core)": 1 / e if e else float("inf"),
              f"worker ({WORKER_CORES} core)": WORKER_CORES / w if w else float("inf")}
    bottleneck = min(limits, key=lambda k: limits[k])
    return {"cores": cores, "ingress_processes": n, "rps": round(limits[bottleneck], 1), "bottleneck": bottleneck,
            "limits_rps": {k: round(v, 1) for k, v in limits.items()}}


def median_of(runs: list[dict[str, Any]], key: str) -> dict[str, float]:
    names = sorted({name for r in runs for name in r[key]})
    return {name: round(statistics.median(r[key].get(name, 0.0) for r in runs), 1) for name in names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="1,2", help="ingress process counts, comma-separated (default 1,2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per window (after 1 s warm-up)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS / "ingress_scaling.json")
    args = parser.parse_args(argv)
    try:
        counts = [int(c) for c in args.counts.split(",") if c.strip()]
    except ValueError:
        parser.error("--counts takes whole numbers, comma-separated")
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        parser.error("--counts takes distinct counts of at least 1")
    if args.rounds < 1 or args.seconds <= 0 or args.clients < 1:
        parser.error("--rounds, --seconds and --clients must be positive")
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    (RESULTS / "runs").mkdir(parents=True, exist_ok=True)
    run_module("bench.models", ["--work", str(WORK), "--skip-resnet"], timeout_s=300,
               log_path=RESULTS / "logs" / "build.log")
    workspace = prepare([MODEL])
    bodies = workspace.bodies["mlp"]
    servers: dict[int, ServerProcess] = {}
    runs: dict[int, list[dict[str, Any]]] = {c: [] for c in counts}
    try:
        for count in counts:
            servers[count] = start(count, workspace.repository)
        for r in range(args.rounds):
            shift = r % len(counts)
            for count in counts[shift:] + counts[:shift]:
                run = measure(servers[count], bodies, args.clients, args.seconds, f"{count}_{r}")
                runs[count].append(run)
                print(f"round {r + 1} ingress {count}: {run['ok_per_s']:.0f} ok/s, p50 {run['p50_ms']} ms, server "
                      f"{run['groups_us_per_request']['total']:.0f} us/request "
                      f"({run['server_cores']} cores), loadgen {run['loadgen_cores']} cores", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    base = counts[0]
    ratios = {c: [a["ok_per_s"] / b["ok_per_s"] if b["ok_per_s"] else 0.0
                  for a, b in zip(runs[c], runs[base], strict=True)] for c in counts}
    summary = {c: {"ok_per_s": statistics.median(r["ok_per_s"] for r in runs[c]),
                   "throughput_ratio": statistics.median(ratios[c]),
                   "p50_ms": statistics.median(r["p50_ms"] for r in runs[c]),
                   "p99_ms": statistics.median(r["p99_ms"] for r in runs[c]),
                   "roles_us_per_request": median_of(runs[c], "roles_us_per_request"),
                   "groups_us_per_request": median_of(runs[c], "groups_us_per_request"),
                   "loadgen_cores": statistics.median(r["loadgen_cores"] for r in runs[c]),
                   "loadgen_us_per_request": statistics.median(r["loadgen_us_per_request"] for r in runs[c]),
                   "server_cores": statistics.median(r["server_cores"] for r in runs[c]),
                   "errors": sum(n for r in runs[c] for s, n in r["statuses"].items() if s != "200")}
               for c in counts}
    projection = [project(summary[counts[-1]]["groups_us_per_request"], cores) for cores in PROJECT_CORES]
    report = {"counts": counts, "rounds": args.rounds, "seconds": args.seconds, "clients": args.clients,
              "machine_cpus": os.cpu_count(), "goal_ratio_2_vs_1": GOAL_RATIO, "summary": summary,
              "projection_from": counts[-1], "projection": projection, "runs": runs}
    print_table(report)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {args.out}")
    return 0


def print_table(report: dict[str, Any]) -> None:
    """The medians per count, the goal beside the ratio, then the projection."""
    counts, summary = report["counts"], report["summary"]
    print(f"\nmedian of {report['rounds']} round(s), {report['clients']} clients, OIP JSON, tiny MLP, "
          f"{report['machine_cpus']} CPUs")
    header = (f"{'ingress':>7} {'ok/s':>8} {'vs ' + str(counts[0]):>7} {'goal':>8} {'p50 ms':>7} {'p99 ms':>7} "
              f"{'server cores':>12} "
              f"{'loadgen cores':>13}  CPU us/request by role")
    print(header)
    print("-" * (len(header) + 40))
    for c in counts:
        s = summary[c]
        goal = ""
        if counts[0] == 1 and c == 2:
            goal = f">={GOAL_RATIO}x " + ("ok" if s["throughput_ratio"] >= GOAL_RATIO else "NO")
        roles = ", ".join(f"{k} {v:.0f}" for k, v in s["roles_us_per_request"].items())
        print(f"{c:>7} {s['ok_per_s']:>8.1f} {s['throughput_ratio']:>6.2f}x {goal:>8} {s['p50_ms']:>7.1f} "
              f"{s['p99_ms']:>7.1f} {s['server_cores']:>12.2f} "
              f"{s['loadgen_cores']:>13.2f}  {roles}; loadgen {s['loadgen_us_per_request']:.0f}"
              + (f"; {s['errors']} non-200" if s["errors"] else ""))
    print(f"\nprojection from the CPU per request at {report['projection_from']} ingress processes "
          "(X = min(C / all, N / ingress, 1 / engine, 1 / worker); see the module docstring):")
    for p in report["projection"]:
        limits = ", ".join(f"{k} {v:.0f}" for k, v in p["limits_rps"].items())
        print(f"  {p['cores']:>2} cores, {p['ingress_processes']} ingress: {p['rps']:.0f} ok/s "
              f"(bottleneck: {p['bottleneck']}; {limits})")


if __name__ == "__main__":
    sys.exit(main())
