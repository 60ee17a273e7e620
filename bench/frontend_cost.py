"""Frontend CPU per request on the tiny MLP: this checkout against another one, side by side.

    flock /tmp/servewell-bench.lock .venv/bin/python -m bench.frontend_cost --other-src ../old/src [--rounds 3]

Both servers serve the same MLP repository (512 -> 2048 -> 512, ONNX, one instance) at once;
a closed loop of 32 clients visits each for `--seconds` per round, in alternating order, and
the frontend process's CPU time (from /proc, user + system) is divided by the requests it
received. The per-round ratio new/other is the verdict (medians): the machine is shared and
noisy, so the two are always compared within a round. `--tensors json,binary` measures OIP JSON
tensors and the binary tensor extension (raw FP32 after a JSON header, binary outputs) in the
same rounds. `--other-src` is another checkout's
`src/` (for example a worktree of an older commit: `git worktree add ../old <commit>`); the
server is started from it with this checkout's virtual environment. JSON:
bench/results/frontend_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.processes import ServerProcess, closed_loop, cpu_seconds, free_port, run_module
from bench.workspace import RESULTS, WORK, ServedModel, mlp_binary_bodies, prepare

SRC = Path(__file__).resolve().parents[1] / "src"


def start(name: str, src: Path, repository: Path) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "servewell", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--model-repository", str(repository), "--log-format", "json"]
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
    servers = {"this": start("this", SRC, workspace.repository), "other": start("other", args.other_src,
                                                                               workspace.repository)}
    rounds: dict[str, list[dict[str, Any]]] = {encoding: [] for encoding in encodings}
    try:
        for r in range(args.rounds):
            for encoding in encodings:
                bodies, headers = loads[encoding]
                row: dict[str, Any] = {}
                for key in ("this", "other") if r % 2 == 0 else ("other", "this"):
                    server = servers[key]
                    before = cpu_seconds(server.pid)
                    summary = closed_loop(server.url, "/v2/models/mlp/infer", bodies, 32, args.seconds, 1.0,
                                          RESULTS / f"frontend_cost_{key}_{encoding}_{r}.json",
                                          RESULTS / "logs" / "loadgen.log", headers)
                    spent = cpu_seconds(server.pid) - before
                    row[key] = {"ok_per_s": summary["throughput_rps"], "requests": summary["sent"],
                                "statuses": summary["status_counts"],
                                "frontend_us_per_request": round(1e6 * spent / max(1, summary["sent"]), 1)}
                row["cpu_ratio"] = row["this"]["frontend_us_per_request"] / row["other"]["frontend_us_per_request"]
                row["throughput_ratio"] = row["this"]["ok_per_s"] / row["other"]["ok_per_s"]
                rounds[encoding].append(row)
                print(f"round {r + 1} {encoding}: this {row['this']['frontend_us_per_request']:.0f} us/request "
                      f"{row['this']['ok_per_s']:.0f}/s, other {row['other']['frontend_us_per_request']:.0f} "
                      f"us/request {row['other']['ok_per_s']:.0f}/s", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    report: dict[str, Any] = {"other_src": str(args.other_src.resolve())}
    for encoding, rows in rounds.items():
        # JSON keeps its old top-level keys, so earlier results stay comparable.
        prefix = "" if encoding == "json" else f"{encoding}_"
        report[f"{prefix}rounds"] = rows
        report[f"{prefix}median_cpu_ratio"] = statistics.median(r["cpu_ratio"] for r in rows)
        report[f"{prefix}median_throughput_ratio"] = statistics.median(r["throughput_ratio"] for r in rows)
        print(f"{encoding}: frontend CPU per request, this / other: {report[f'{prefix}median_cpu_ratio']:.3f}x "
              f"(median of {args.rounds}); throughput {report[f'{prefix}median_throughput_ratio']:.3f}x")
    args.out.write_text(json.dumps(report, indent=2))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
