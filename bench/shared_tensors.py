"""Tensors between the ingress processes and the engine: shared memory against inline, one checkout.

    flock /tmp/servewell-bench.lock .venv/bin/python -m bench.shared_tensors [--rounds 3] [--seconds 6]

Two servers of this checkout serve the same models at once: one with the default
`shared_tensor_min_bytes` (tensors of 32 KiB or more cross in shared memory, written once and read
in place), one with `--shared-tensor-limit-bytes 0` (every tensor pickled into the door's frames,
as before issue 20's shared-memory references). Each model multiplies its input by 2 (ONNX `Mul`,
so the worker's compute is small and the output as large as the input), at three sizes: 16 KiB
(below the threshold: both servers send it inline, the control), 147 KiB and 588 KiB (one
ResNet-50 input, 3x224x224 FP32). A closed loop of `--clients` sends binary-extension tensors
(raw FP32, binary outputs) to each server for `--seconds` per round, in alternating order, and
CPU per request comes from /proc for every process of each server (supervisor, engine, ingress,
workers). The verdict is the per-round ratio shared/inline (medians); the goal (issue 20: binary
tensors at most 0.5x of CPU per request) is printed beside the figure. `--other-src` adds a third
server started from another checkout's `src/` (for example a worktree of the last landed main,
whose tensors always cross inline) and the ratio this/other, which counts every change since it
(the HTTP body and response copies too), not only the shared memory. JSON:
bench/results/shared_tensors.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench.processes import ServerProcess, TreeCpu, closed_loop, free_port, role_groups
from bench.workspace import RESULTS, WORK, write_binary_body

#: Issue 20's goal for binary tensors: all processes' CPU per request, new / old.
GOAL_CPU_RATIO = 0.5
#: Floats per row of each model: 16 KiB (inline either way), 147 KiB, 588 KiB (3x224x224).
SIZES = {"f16k": 4096, "f147k": 37632, "f588k": 150528}


def build_models(root: Path) -> Path:
    """A repository of `y = 2 x` ONNX models, one per size (batching on, one instance, one thread)."""
    import onnx
    from onnx import TensorProto, helper

    repository = root / "shared_tensors_repo"
    for name, floats in SIZES.items():
        directory = repository / name
        directory.mkdir(parents=True, exist_ok=True)
        graph = helper.make_graph(
            [helper.make_node("Mul", ["x", "two"], ["y"])], name,
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", floats])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", floats])],
            initializer=[helper.make_tensor("two", TensorProto.FLOAT, [1], [2.0])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        onnx.save(model, str(directory / "model.onnx"))
        (directory / "model.yaml").write_text(yaml.safe_dump({
            "runtime": "onnx", "artifact": "model.onnx", "max_batch_size": 16, "instances": 1, "threads": 1,
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [floats]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [floats]}]}))
    return repository


def binary_bodies(root: Path, name: str, floats: int, count: int = 8) -> tuple[list[Path], int]:
    """`count` binary-extension bodies of one row, and the JSON header's length."""
    out = root / "shared_tensors_bodies"
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(floats)
    paths, lengths = [], set()
    for i in range(count):
        path = out / f"{name}_{i}.bin"
        lengths.add(write_binary_body(path, "x", rng.random(floats, dtype=np.float32)))
        paths.append(path)
    (length,) = lengths
    return paths, length


def start(name: str, repository: Path, extra: list[str], src: Path | None = None) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "servewell", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--model-repository", str(repository), "--log-format", "json", "--max-body-bytes", str(4 << 20),
            *extra]
    env = {"SERVEWELL_GRPC_PORT": "0"}
    if src is not None:
        env["PYTHONPATH"] = str(src.resolve())
    server = ServerProcess(name, argv, port, RESULTS / "logs" / f"shared_tensors_{name}.log", env=env)
    server.start()
    server.wait_ready(180)
    return server


def measure(server: ServerProcess, model: str, bodies: list[Path], headers: dict[str, str], clients: int,
            seconds: float, out: Path) -> dict[str, Any]:
    meter = TreeCpu(server.pid).start()
    summary = closed_loop(server.url, f"/v2/models/{model}/infer", bodies, clients, seconds, 1.0, out,
                          RESULTS / "logs" / "loadgen.log", headers)
    spent = meter.stop()
    groups = role_groups(spent)
    requests = max(1, summary["sent"])
    return {"ok_per_s": summary["throughput_rps"], "requests": summary["sent"],
            "statuses": summary["status_counts"], "p50_ms": summary["classes"]["normal"]["latency_ms"]["p50"],
            "all_us_per_request": round(1e6 * groups["total"] / requests, 1),
            "frontend_us_per_request": round(1e6 * groups["frontend"] / requests, 1),
            "roles_us_per_request": {k: round(1e6 * v / requests, 1) for k, v in groups.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--ingress-processes", type=int, default=None,
                        help="passed to both servers (default: the server's default)")
    parser.add_argument("--other-src", type=Path, default=None,
                        help="another checkout's src/ directory: a third server, compared as this/other")
    parser.add_argument("--out", type=Path, default=RESULTS / "shared_tensors.json")
    args = parser.parse_args(argv)
    if args.other_src is not None and not (args.other_src / "servewell" / "__init__.py").is_file():
        parser.error(f"{args.other_src} has no servewell package")
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    repository = build_models(WORK)
    loads = {name: binary_bodies(WORK, name, floats) for name, floats in SIZES.items()}
    extra = [] if args.ingress_processes is None else ["--ingress-processes", str(args.ingress_processes)]
    servers = {"shared": start("shared", repository, extra),
               "inline": start("inline", repository, [*extra, "--shared-tensor-limit-bytes", "0"])}
    if args.other_src is not None:
        servers["other"] = start("other", repository, extra, args.other_src)
    keys = list(servers)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in SIZES}
    try:
        for r in range(args.rounds):
            for name in SIZES:
                bodies, header_length = loads[name]
                headers = {"Inference-Header-Content-Length": str(header_length)}
                row: dict[str, Any] = {}
                for key in keys[r % len(keys):] + keys[:r % len(keys)]:  # each server first in turn
                    row[key] = measure(servers[key], name, bodies, headers, args.clients, args.seconds,
                                       RESULTS / f"shared_tensors_{key}_{name}_{r}.json")
                row["all_cpu_ratio"] = row["shared"]["all_us_per_request"] / row["inline"]["all_us_per_request"]
                row["frontend_cpu_ratio"] = (row["shared"]["frontend_us_per_request"]
                                             / row["inline"]["frontend_us_per_request"])
                row["throughput_ratio"] = row["shared"]["ok_per_s"] / max(1e-9, row["inline"]["ok_per_s"])
                row["p50_ratio"] = row["shared"]["p50_ms"] / max(1e-9, row["inline"]["p50_ms"])
                if "other" in row:
                    row["other_all_cpu_ratio"] = (row["shared"]["all_us_per_request"]
                                                  / row["other"]["all_us_per_request"])
                    row["other_throughput_ratio"] = row["shared"]["ok_per_s"] / max(1e-9, row["other"]["ok_per_s"])
                rounds[name].append(row)
                print(f"round {r + 1} {name}: shared {row['shared']['all_us_per_request']:.0f} us/request "
                      f"{row['shared']['ok_per_s']:.0f}/s, inline {row['inline']['all_us_per_request']:.0f} "
                      f"us/request {row['inline']['ok_per_s']:.0f}/s", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    report: dict[str, Any] = {"goal_all_cpu_ratio": GOAL_CPU_RATIO, "clients": args.clients,
                              "seconds": args.seconds, "ingress_processes": args.ingress_processes,
                              "sizes_floats": SIZES, "rounds": rounds,
                              "other_src": str(args.other_src.resolve()) if args.other_src else None}
    ratios = ["all_cpu_ratio", "frontend_cpu_ratio", "throughput_ratio", "p50_ratio"]
    if args.other_src is not None:
        ratios += ["other_all_cpu_ratio", "other_throughput_ratio"]
    for name, rows in rounds.items():
        report[name] = {ratio: statistics.median(r[ratio] for r in rows) for ratio in ratios}
    print_table(report, args.rounds)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"written to {args.out}")
    return 0


def print_table(report: dict[str, Any], rounds: int) -> None:
    """Medians of the rounds, shared against inline, with the goal beside the CPU figure."""
    print(f"\nmedian of {rounds} round(s), binary tensors, closed loop of {report['clients']} clients; "
          "'all' = every process of the server, workers too")
    header = (f"{'model':<7} {'KiB':>5} {'all us/req shared':>18} {'inline':>8} {'ratio':>7} {'frontend ratio':>15} "
              f"{'req/s ratio':>12} {'p50 ratio':>10}  goal (all CPU)")
    print(header)
    print("-" * len(header))
    for name, floats in SIZES.items():
        rows = report["rounds"][name]
        shared = statistics.median(r["shared"]["all_us_per_request"] for r in rows)
        inline = statistics.median(r["inline"]["all_us_per_request"] for r in rows)
        medians = report[name]
        verdict = "PASS" if medians["all_cpu_ratio"] <= GOAL_CPU_RATIO else "FAIL"
        control = " (control: inline both)" if floats * 4 < 32768 else f" <= {GOAL_CPU_RATIO}x {verdict}"
        print(f"{name:<7} {floats * 4 / 1024:>5.0f} {shared:>18.0f} {inline:>8.0f} {medians['all_cpu_ratio']:>6.3f}x "
              f"{medians['frontend_cpu_ratio']:>14.3f}x {medians['throughput_ratio']:>11.3f}x "
              f"{medians['p50_ratio']:>9.3f}x {control}")
    if report["other_src"]:
        print(f"\nthis checkout (shared) against {report['other_src']}: all processes' CPU per request and "
              "throughput, medians")
        for name, floats in SIZES.items():
            medians = report[name]
            verdict = "PASS" if medians["other_all_cpu_ratio"] <= GOAL_CPU_RATIO else "FAIL"
            goal = "" if floats * 4 < 32768 else f"  goal <= {GOAL_CPU_RATIO}x {verdict}"
            print(f"{name:<7} CPU {medians['other_all_cpu_ratio']:.3f}x, throughput "
                  f"{medians['other_throughput_ratio']:.3f}x{goal}")


if __name__ == "__main__":
    sys.exit(main())
