"""CPU per control-plane request (metadata, health, metrics) of every server process: this checkout, and
optionally another one side by side.

    flock /tmp/servewell-bench.lock .venv/bin/python -m bench.control_cost [--other-src ../old/src]
        [--requests 1000] [--rounds 3] [--ingress-processes 1]

One python-runtime model (`m`, nothing computed: no request here reaches it); for each path
(`GET /v2/models/m`, `GET /healthz`, `GET /metrics`) one client sends `--requests` sequential
keep-alive GETs and the server tree's CPU (user + system, from /proc, per process role) is divided
by them. The client's own CPU is not counted (it is not in the server's tree). With `--other-src`
(another checkout's `src/`, e.g. `git archive <commit> src | tar -x -C ../old`) both servers run at
once and each round visits them in alternating order: compare the two within one run, these
machines are noisy. JSON: bench/results/control_cost.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import yaml

from bench.processes import HOST, ServerProcess, TreeCpu, free_port, role_groups
from bench.workspace import RESULTS, WORK

SRC = Path(__file__).resolve().parents[1] / "src"
PATHS = ("/v2/models/m", "/healthz", "/metrics")
ECHO = textwrap.dedent('''
    class Echo:
        def setup(self, config):
            pass

        def execute(self, inputs):
            return {"y": inputs["x"]}
''')


def write_repository(root: Path) -> Path:
    """A repository of one python-runtime model `m` (no framework to import)."""
    directory = root / "m"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "echo.py").write_text(ECHO)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "python", "artifact": "echo.py", "max_batch_size": 1, "python": {"entry": "echo:Echo"},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}]}))
    return root


def start(name: str, src: Path, repository: Path, ingress_processes: int) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "servewell", "serve", "--host", HOST, "--port", str(port),
            "--model-repository", str(repository), "--log-format", "json",
            "--ingress-processes", str(ingress_processes), "--cache-dir", str(WORK / "control_cost" / "cache")]
    server = ServerProcess(name, argv, port, RESULTS / "logs" / f"control_cost_{name}.log",
                           env={"PYTHONPATH": str(src.resolve()), "SERVEWELL_GRPC_PORT": "0"})
    server.start()
    server.wait_ready(180)
    return server


def sequential_gets(port: int, path: str, requests: int) -> tuple[int, dict[int, int]]:
    """`requests` GETs on one keep-alive connection; (wall microseconds per request, statuses)."""
    connection = http.client.HTTPConnection(HOST, port, timeout=30)
    statuses: dict[int, int] = {}
    started = time.perf_counter()
    try:
        for _ in range(requests):
            connection.request("GET", path)
            response = connection.getresponse()
            response.read()
            statuses[response.status] = statuses.get(response.status, 0) + 1
    finally:
        connection.close()
    return round(1e6 * (time.perf_counter() - started) / requests), statuses


def measure(server: ServerProcess, path: str, requests: int) -> dict[str, Any]:
    sequential_gets(server.port, path, max(10, requests // 20))  # warm: routes, caches, connections
    meter = TreeCpu(server.pid, interval_s=0.1).start()
    wall_us, statuses = sequential_gets(server.port, path, requests)
    spent = role_groups(meter.stop())
    return {"statuses": statuses, "wall_us_per_request": wall_us,
            "cpu_us_per_request": {role: round(1e6 * seconds / requests, 1) for role, seconds in spent.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--other-src", type=Path, default=None, help="another checkout's src/ to compare with")
    parser.add_argument("--requests", type=int, default=1000, help="GETs per path per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ingress-processes", type=int, default=1, help="0: the single-process server")
    parser.add_argument("--out", type=Path, default=RESULTS / "control_cost.json")
    args = parser.parse_args(argv)
    if args.other_src is not None and not (args.other_src / "servewell" / "__init__.py").is_file():
        parser.error(f"{args.other_src} has no servewell package")
    if args.requests < 1 or args.rounds < 1:
        parser.error("--requests and --rounds must be at least 1")
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    repository = write_repository(WORK / "control_cost" / "repository")
    sources = {"this": SRC, **({"other": args.other_src} if args.other_src is not None else {})}
    servers: dict[str, ServerProcess] = {}
    rounds: list[dict[str, Any]] = []
    try:
        for key, src in sources.items():
            servers[key] = start(key, src, repository, args.ingress_processes)
        for r in range(args.rounds):
            row: dict[str, Any] = {}
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for path in PATHS:
                row[path] = {key: measure(servers[key], path, args.requests) for key in order}
                said = ", ".join(f"{key} {row[path][key]['cpu_us_per_request']['frontend']:.0f} us "
                                 f"({row[path][key]['statuses']})" for key in servers)
                print(f"round {r + 1} {path}: server CPU per request {said}", flush=True)
            rounds.append(row)
    finally:
        for server in servers.values():
            server.stop()
    report: dict[str, Any] = {"requests": args.requests, "ingress_processes": args.ingress_processes,
                              "other_src": str(args.other_src) if args.other_src else None, "rounds": rounds,
                              "median_cpu_us_per_request": {}}
    print(f"\nmedian of {args.rounds} round(s), CPU us per request ('frontend': every server process but the "
          "model workers)")
    for path in PATHS:
        report["median_cpu_us_per_request"][path] = {}
        for key in servers:
            roles = sorted({role for row in rounds for role in row[path][key]["cpu_us_per_request"]})
            medians = {role: statistics.median(row[path][key]["cpu_us_per_request"].get(role, 0.0) for row in rounds)
                       for role in roles}
            report["median_cpu_us_per_request"][path][key] = medians
            parts = ", ".join(f"{role} {value:.0f}" for role, value in medians.items()
                              if role not in ("total", "frontend", "worker"))
            print(f"{path:<16} {key:<6} frontend {medians.get('frontend', 0.0):>7.0f}  ({parts})")
    args.out.write_text(json.dumps(report, indent=2))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
