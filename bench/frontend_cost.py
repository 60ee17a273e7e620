"""CPU per request on the tiny MLP, frontend and all server processes: this checkout against another one.

    flock /tmp/servewell-bench.lock .venv/bin/python -m bench.frontend_cost --other-src ../old/src [--rounds 3]

Both servers serve the same MLP repository (512 -> 2048 -> 512, ONNX, one instance) at once;
a closed loop of 32 clients visits each for `--seconds` per round, in alternating order, and
the frontend process's CPU time (from /proc, user + system) is divided by the requests it
received. The per-round ratio new/other is the verdict (medians): the machine is shared and
noisy, so the two are always compared within a round. `--tensors json,binary` measures OIP JSON
tensors and the binary tensor extension (raw FP32 after a JSON header, binary outputs) in the
same rounds. `--other-src` is another checkout's
`src/` (for example a worktree of an older commit: `git worktree add ../old <commit>`); the
server is started from it with this checkout's virtual environment and only the flags every
version has (an older checkout runs as one process; `--ingress-processes N` is passed to this
checkout alone, default: the server's own default). JSON: bench/results/frontend_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.processes import ServerProcess, TreeCpu, closed_loop, free_port, role_groups, run_module
from bench.workspace import RESULTS, WORK, ServedModel, mlp_binary_bodies, prepare

SRC = Path(__file__).resolve().parents[1] / "src"
#: Issue 46's goals, against f53358e (`--other-src` a worktree of it): all server processes' CPU
#: per request, this / other, and the engine process's alone (the part that does not scale with
#: ingress processes). Against another checkout the ratios are printed, the verdicts mean little.
GOAL_ALL_CPU_RATIO = 0.9
GOAL_ENGINE_CPU_RATIO = 0.6


def start(name: str, src: Path, repository: Path, extra: list[str] | None = None) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "servewell", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--model-repository", str(repository), "--log-format", "json", *(extra or [])]
    server = ServerProcess(name, argv, port, RESULTS / "logs" / f"frontend_cost_{name}.log",
                           env={"PYTHONPATH": str(src.resolve()), "SERVEWELL_GRPC_PORT": "0"})
    server.start()
    server.wait_ready(180)
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--other-src", type=Path, required=True, help="the other checkout's src/ directory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "frontend_cost.json")
    parser.add_argument("--tensors", default="json", help="comma-separated: json, binary (default: json)")
    parser.add_argument("--ingress-processes", type=int, default=None,
                        help="passed to this checkout's server only (default: the server's default)")
    args = parser.parse_args(argv)
    encodings = [e.strip() for e in args.tensors.split(",") if e.strip()]
    if not encodings or set(encodings) - {"json", "binary"}:
        parser.error("--tensors takes json, binary or both (comma-separated)")
    if not (args.other_src / "servewell" / "__init__.py").is_file():
        parser.error(f"{args.other_src} has no servewell package")
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    run_module("bench.models", ["--work", str(WORK), "--skip-resnet"], timeout_s=300,
               log_path=RESULTS / "logs" / "build.log")
    workspace = prepare([ServedModel("mlp", "mlp", {"threads": 1, "instances": 1, "max_batch_size": 32})])
    binary_bodies, header_length = mlp_binary_bodies()
    loads = {"json": (workspace.bodies["mlp"], None),
             "binary": (binary_bodies, {"Inference-Header-Content-Length": str(header_length)})}
    # Older checkouts know fewer flags: both get only the ones every version has.
    extra = [] if args.ingress_processes is None else ["--ingress-processes", str(args.ingress_processes)]
    servers = {"this": start("this", SRC, workspace.repository, extra),
               "other": start("other", args.other_src, workspace.repository)}
    rounds: dict[str, list[dict[str, Any]]] = {encoding: [] for encoding in encodings}
    try:
        for r in range(args.rounds):
            for encoding in encodings:
                bodies, headers = loads[encoding]
                row: dict[str, Any] = {}
                for key in ("this", "other") if r % 2 == 0 else ("other", "this"):
                    server = servers[key]
                    meter = TreeCpu(server.pid).start()
                    summary = closed_loop(server.url, "/v2/models/mlp/infer", bodies, 32, args.seconds, 1.0,
                                          RESULTS / f"frontend_cost_{key}_{encoding}_{r}.json",
                                          RESULTS / "logs" / "loadgen.log", headers)
                    spent = meter.stop()
                    groups = role_groups(spent)
                    requests = max(1, summary["sent"])
                    row[key] = {"ok_per_s": summary["throughput_rps"], "requests": summary["sent"],
                                "statuses": summary["status_counts"],
                                "frontend_us_per_request": round(1e6 * groups["frontend"] / requests, 1),
                                "all_us_per_request": round(1e6 * groups["total"] / requests, 1),
                                "roles_us_per_request": {k: round(1e6 * v / requests, 1) for k, v in spent.items()},
                                "processes_cpu_s": meter.processes}
                row["cpu_ratio"] = row["this"]["frontend_us_per_request"] / row["other"]["frontend_us_per_request"]
                row["all_cpu_ratio"] = row["this"]["all_us_per_request"] / row["other"]["all_us_per_request"]
                row["throughput_ratio"] = row["this"]["ok_per_s"] / row["other"]["ok_per_s"]
                engines = [row[key]["roles_us_per_request"].get("engine") for key in ("this", "other")]
                row["engine_cpu_ratio"] = engines[0] / engines[1] if engines[0] and engines[1] else None
                rounds[encoding].append(row)
                print(f"round {r + 1} {encoding}: this {row['this']['all_us_per_request']:.0f} us/request all "
                      f"({row['this']['frontend_us_per_request']:.0f} frontend) {row['this']['ok_per_s']:.0f}/s, "
                      f"other {row['other']['all_us_per_request']:.0f} us/request all "
                      f"({row['other']['frontend_us_per_request']:.0f} frontend) {row['other']['ok_per_s']:.0f}/s",
                      flush=True)
    finally:
        for server in servers.values():
            server.stop()
    report: dict[str, Any] = {"other_src": str(args.other_src.resolve()), "goal_all_cpu_ratio": GOAL_ALL_CPU_RATIO,
                              "goal_engine_cpu_ratio": GOAL_ENGINE_CPU_RATIO,
                              "ingress_processes": args.ingress_processes}
    for encoding, rows in rounds.items():
        # JSON keeps its old top-level keys, so earlier results stay comparable.
        prefix = "" if encoding == "json" else f"{encoding}_"
        report[f"{prefix}rounds"] = rows
        for ratio in ("cpu_ratio", "all_cpu_ratio", "throughput_ratio", "engine_cpu_ratio"):
            values = [r[ratio] for r in rows if r[ratio] is not None]
            report[f"{prefix}median_{ratio}"] = statistics.median(values) if values else None
    print_table(report, encodings, args.rounds)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"written to {args.out}")
    return 0


def print_table(report: dict[str, Any], encodings: list[str], rounds: int) -> None:
    """Medians of the rounds, with the goal beside the figure it applies to."""
    print(f"\nmedian of {rounds} round(s); 'frontend' = a split server's supervisor + engine + ingress "
          "processes, a single-process server's one process; 'all' = every process of the server, workers too")
    header = f"{'tensors':<8} {'figure':<38} {'this':>9} {'other':>9} {'this/other':>11}  goal"
    print(header)
    print("-" * (len(header) + 12))
    for encoding in encodings:
        prefix = "" if encoding == "json" else f"{encoding}_"
        rows = report[f"{prefix}rounds"]

        def median(key: str, side: str, rows: list[dict[str, Any]] = rows) -> float:
            return statistics.median(r[side][key] for r in rows)

        for label, key, ratio, goal in (
                ("CPU us/request, all server processes", "all_us_per_request", "all_cpu_ratio", GOAL_ALL_CPU_RATIO),
                ("CPU us/request, frontend", "frontend_us_per_request", "cpu_ratio", None),
                ("CPU us/request, engine process", "engine", "engine_cpu_ratio", GOAL_ENGINE_CPU_RATIO),
                ("throughput ok/s", "ok_per_s", "throughput_ratio", None)):
            value = report[f"{prefix}median_{ratio}"]
            if value is None:  # a single-process server on either side: no engine process to compare
                continue
            this, other = (statistics.median(r[side]["roles_us_per_request"][key] for r in rows) if key == "engine"
                           else median(key, side) for side in ("this", "other"))
            verdict = "-" if goal is None else f"<= {goal}x  " + ("PASS" if value <= goal else "FAIL")
            print(f"{encoding:<8} {label:<38} {this:>9.1f} {other:>9.1f} {value:>10.3f}x  {verdict}")
        roles = sorted({role for r in rows for role in r["this"]["roles_us_per_request"]})
        per_role = ", ".join(
            f"{role} {statistics.median(r['this']['roles_us_per_request'].get(role, 0.0) for r in rows):.0f}"
            for role in roles)
        print(f"{encoding:<8} this checkout, CPU us/request by process: {per_role}")


if __name__ == "__main__":
    sys.exit(main())
