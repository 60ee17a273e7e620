"""Scaling out on one machine: throughput and p99 latency with 1 and 2 servewell replicas behind
HAProxy (deploy/local/replicas.py), for the tiny MLP and ResNet-50, and the per-replica saturation
throughput that the autoscaling targets in deploy/kubernetes are computed from.

    flock /tmp/servewell-bench.lock .venv/bin/python -m bench.scaling [--quick]

Each measurement is a closed loop (bench.loadgen) at a fixed number of clients, enough to keep every
replica saturated: its throughput is the saturation throughput of that configuration. Configurations:

- `1 direct`: one replica, the load generator talking to it directly (no load balancer);
- `1 via LB`: the same behind HAProxy: what the load balancer costs on this machine;
- `2 via LB`: two replicas behind HAProxy, with the same threads per worker, and for ResNet-50 also
  with half the threads each (the same number of threads in all as one replica).

Per-replica saturation throughput X is `1 direct`'s; the queue-depth target of the autoscaler is
X x W for an acceptable queue wait W (Little's law), printed for W of deploy/README.md. Writes
bench/results/scaling.json and prints a table.

How it stays honest on a shared, noisy 2-core machine (as bench.observability): the fleets of one
workload run side by side (an idle one costs nothing), and the load visits them in short windows,
in a rotated order, round after round. The table gives the median over rounds of each
configuration's throughput and p99, and the median of the per-round ratios to `1 via LB`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.processes import HOST, closed_loop, cpu_seconds, free_port, run_module
from bench.workspace import RESULTS, WORK, ServedModel, prepare

ROOT = Path(__file__).resolve().parents[1]
SUPERVISOR = ROOT / "deploy" / "local" / "replicas.py"
SERVEWELL = str(Path(sys.executable).with_name("servewell"))
#: Acceptable queue wait per workload, for the autoscaling target X x W.
QUEUE_WAIT_S = {"mlp": 0.05, "resnet50": 0.25}


@dataclass(slots=True, frozen=True)
class Config:
    """One measured configuration."""

    workload: str
    replicas: int
    threads: int
    via_lb: bool

    @property
    def label(self) -> str:
        return (
            f"{self.replicas} {'via LB' if self.via_lb else 'direct'}, {self.threads} thread{'s' * (self.threads > 1)}"
        )


# (model path, clients, warm-up s, window s) per workload; --quick shortens the windows.
WORKLOADS = {
    "mlp": ("/v2/models/mlp/infer", 32, 1.0, 5.0),
    "resnet50": ("/predict", 32, 3.0, 15.0),
}
CONFIGS = [
    Config("mlp", 1, 1, False),
    Config("mlp", 1, 1, True),
    Config("mlp", 2, 1, True),
    Config("resnet50", 1, 2, False),
    Config("resnet50", 1, 2, True),
    Config("resnet50", 2, 1, True),
    Config("resnet50", 2, 2, True),
]


def load_supervisor_module():
    """deploy/local/replicas.py as a module (for its HAProxy admin client)."""
    spec = importlib.util.spec_from_file_location("replicas", SUPERVISOR)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class Fleet:
    """N replicas behind HAProxy, started by deploy/local/replicas.py, stopped by pid."""

    def __init__(self, repository: Path, replicas: int, logs: Path, tag: str,
                 server_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.replica_ports = [free_port() for _ in range(replicas)]
        self.state_dir = logs / f"replicas-{tag}"
        (self.state_dir / "state.json").unlink(missing_ok=True)  # an earlier run's must not look ready
        self.log = open(logs / f"supervisor-{tag}.log", "ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(SUPERVISOR),
                "up",
                "--port",
                str(self.port),
                "--replica-ports",
                ",".join(map(str, self.replica_ports)),
                "--servewell",
                SERVEWELL,
                "--state-dir",
                str(self.state_dir),
                "--",
                "--model-repository",
                str(repository),
                *server_args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def wait_ready(self, timeout_s: float = 300) -> None:
        admin_module = load_supervisor_module()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the replicas supervisor exited; see {self.state_dir}")
            try:
                state = json.loads((self.state_dir / "state.json").read_text())
                admin = admin_module.HaproxyAdmin(Path(state["haproxy"]["admin_socket"]))
                # Every replica ready by its own readiness too: HAProxy counts a server UP before its first check.
                if {row["status"] for row in admin.servers().values()} == {"UP"} and all(
                    admin_module.http_ok(p, "/v2/health/ready") for p in self.replica_ports
                ):
                    return
            except (OSError, ValueError, KeyError, TypeError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"replicas not ready within {timeout_s:g} s; see {self.state_dir}")

    def haproxy_pid(self) -> int:
        return json.loads((self.state_dir / "state.json").read_text())["haproxy"]["pid"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def served_model(workload: str, threads: int) -> ServedModel:
    if workload == "mlp":
        return ServedModel("mlp", "mlp", {"threads": threads, "instances": 1, "max_batch_size": 32})
    return ServedModel("resnet50", "resnet50", {"threads": threads, "instances": 1, "max_batch_size": 8})


def repository_for(workload: str, threads: int) -> tuple[Path, list[Path]]:
    """A served repository of its own for this thread count (prepare() rewrites one shared path)."""
    workspace = prepare([served_model(workload, threads)])
    target = WORK / f"scaling-repo-{workload}-{threads}"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(workspace.repository, target, symlinks=True)
    return target, workspace.bodies[workload]


def measure_workload(workload: str, rounds: int, quick: bool, logs: Path) -> list[dict[str, Any]]:
    """Every configuration of `workload`, `rounds` times in rotated order; one row per configuration."""
    configs = [c for c in CONFIGS if c.workload == workload]
    path, clients, warmup_s, window_s = WORKLOADS[workload]
    if quick:
        warmup_s, window_s = 1.0, 3.0
    fleets: dict[tuple[int, int], Fleet] = {}
    samples: dict[Config, list[dict[str, Any]]] = {c: [] for c in configs}
    try:
        bodies: list[Path] = []
        for config in configs:
            key = (config.replicas, config.threads)
            if key not in fleets:
                repository, bodies = repository_for(workload, config.threads)
                fleets[key] = Fleet(repository, config.replicas, logs, f"{workload}-{config.replicas}x{config.threads}")
        for fleet in fleets.values():
            fleet.wait_ready()
        for round_no in range(rounds):
            order = configs[round_no % len(configs) :] + configs[: round_no % len(configs)]
            for config in order:
                fleet = fleets[(config.replicas, config.threads)]
                port = fleet.port if config.via_lb else fleet.replica_ports[0]
                tag = f"{workload}-{config.replicas}x{config.threads}-{'lb' if config.via_lb else 'direct'}-r{round_no}"
                haproxy = fleet.haproxy_pid()
                cpu_before = cpu_seconds(haproxy)
                summary = closed_loop(
                    f"http://{HOST}:{port}",
                    path,
                    bodies,
                    clients,
                    window_s,
                    warmup_s,
                    logs / f"run-{tag}.json",
                    logs / f"loadgen-{tag}.log",
                )
                if fleet.proc.poll() is not None:
                    raise RuntimeError(f"the replicas supervisor of {tag} exited during the run; see {fleet.state_dir}")
                normal = summary["classes"].get("normal", {}).get("latency_ms", {})
                samples[config].append(
                    {
                        # The completion rate (bench.stats): answers counted in a fixed window jump by whole
                        # batches (8 ResNet-50 images of ~100 in a window); answers / window kept beside it.
                        "throughput_rps": summary.get("completion_rate_rps") or summary["throughput_rps"],
                        "answers_per_window_s": summary["throughput_rps"],
                        "p50_ms": normal.get("p50"),
                        "p99_ms": normal.get("p99"),
                        "status_counts": summary["status_counts"],
                        "error_codes": summary["error_codes"],
                        "haproxy_cpu_s": round(cpu_seconds(haproxy) - cpu_before, 2) if config.via_lb else None,
                    }
                )
    finally:
        for fleet in fleets.values():
            fleet.stop()
    base = next(c for c in configs if c.replicas == 1 and c.via_lb)
    rows = []
    for config in configs:
        runs = samples[config]
        ratios = [
            run["throughput_rps"] / b["throughput_rps"]
            for run, b in zip(runs, samples[base], strict=True)
            if b["throughput_rps"]
        ]
        errors: dict[str, int] = {}
        for run in runs:
            for status, n in run["status_counts"].items():
                if status != "200":
                    errors[status] = errors.get(status, 0) + n
        rows.append(
            {
                "workload": workload,
                "replicas": config.replicas,
                "threads": config.threads,
                "via_lb": config.via_lb,
                "label": config.label,
                "clients": clients,
                "window_s": window_s,
                "rounds": len(runs),
                "throughput_rps": round(statistics.median(r["throughput_rps"] for r in runs), 2),
                "throughput_range_rps": [
                    min(r["throughput_rps"] for r in runs),
                    max(r["throughput_rps"] for r in runs),
                ],
                "ratio_to_1_via_lb": round(statistics.median(ratios), 3) if ratios else None,
                "p50_ms": statistics.median(r["p50_ms"] or 0 for r in runs),
                "p99_ms": statistics.median(r["p99_ms"] or 0 for r in runs),
                "haproxy_cpu_s_per_window": statistics.median(r["haproxy_cpu_s"] for r in runs)
                if config.via_lb
                else None,
                "errors": errors,
                "samples": runs,
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'workload':9} {'configuration':26} {'req/s':>8} {'range':>15} {'vs 1 via LB':>11} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'LB CPU s':>8}  errors"
    ]
    for row in rows:
        low, high = row["throughput_range_rps"]
        ratio = f"{row['ratio_to_1_via_lb']:.2f}x" if row["ratio_to_1_via_lb"] else "-"
        lb_cpu = row["haproxy_cpu_s_per_window"]
        lines.append(
            f"{row['workload']:9} {row['label']:26} {row['throughput_rps']:>8.1f} {f'{low:.1f}-{high:.1f}':>15} "
            f"{ratio:>11} {row['p50_ms']:>8.1f} {row['p99_ms']:>8.1f} "
            f"{'-' if lb_cpu is None else f'{lb_cpu:.2f}':>8}  {sum(row['errors'].values())}"
        )
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per-replica saturation throughput (1 direct) and the queue-depth target X x W per workload."""
    out = {}
    for workload, wait_s in QUEUE_WAIT_S.items():
        row = next((r for r in rows if r["workload"] == workload and r["replicas"] == 1 and not r["via_lb"]), None)
        if row:
            x = row["throughput_rps"]
            out[workload] = {
                "per_replica_saturation_rps": x,
                "queue_wait_s": wait_s,
                "queue_depth_target": round(x * wait_s, 1),
            }
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short windows, for developing the benchmark")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), action="append", help="only these (repeatable)")
    parser.add_argument("--rounds", type=int, default=5, help="windows per configuration, in rotated order")
    args = parser.parse_args(argv)
    logs = RESULTS / "logs" / "scaling"
    logs.mkdir(parents=True, exist_ok=True)
    run_module("bench.models", ["--work", str(WORK)], timeout_s=900, log_path=logs / "build.log")  # cached builds
    started = time.time()
    rows = []
    for workload in WORKLOADS:
        if args.workload and workload not in args.workload:
            continue
        print(f"{workload}: {args.rounds} rounds ...", file=sys.stderr, flush=True)
        rows += measure_workload(workload, args.rounds, args.quick, logs)
    doc = {
        "started_at": started,
        "elapsed_s": round(time.time() - started, 1),
        "quick": args.quick,
        "cpu_count": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "workloads": {k: {"path": v[0], "clients": v[1]} for k, v in WORKLOADS.items()},
        "rounds": args.rounds,
        "runs": rows,
        "targets": targets(rows),
    }
    (RESULTS / "scaling.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(table(rows))
    for workload, t in doc["targets"].items():
        print(
            f"{workload}: per-replica saturation {t['per_replica_saturation_rps']:.1f} req/s x queue wait "
            f"{t['queue_wait_s'] * 1000:g} ms = queue-depth target {t['queue_depth_target']:g} per pod"
        )
    print(f"results: {RESULTS / 'scaling.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
