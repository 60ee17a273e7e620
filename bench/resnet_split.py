"""ResNet-50 `/predict` with JPEGs: served/offline of the split server against the single-process server, one run.

    flock /tmp/servewell-bench.lock .venv/bin/python -m bench.resnet_split [--rounds 2] [--seconds 15]
        [--ingress-processes N] [--other-src DIR]

Issue 20's goal: served/offline at least as high as the single-process server, and image decoding
off the event loop's core (CPU per image in the ingress halved, or moved where it scales: ingress
work grows with ingress processes, the engine's does not).

The same model as `make bench` serves (`bench.run`: ResNet-50 ONNX, 2 instances x 1 thread,
max batch 8, idle batching), on two servers started at once: `split` (this checkout,
`--ingress-processes N`, default the server's default) and `single` (this checkout with
`--ingress-processes 0`, or with `--other-src` another checkout's `src/`, e.g. main before the
split, started with only the flags every version has). A closed loop of 16 clients (2 x max
batch) sends the 640x480 JPEGs to each in turn for `--seconds` after 5 s of warm-up, the order
alternating per round. The offline limit (`bench.offline`, 2 threads, batch sizes 1, 4, 8; the
better of a timing before and one after the rounds) is the denominator of both. Per run: images/s,
and the CPU of every process of the server per image (`bench.processes.TreeCpu`): for `split`
the ingress processes (where JPEGs are decoded now), the engine and the workers; for `single`
the one frontend process and the workers. JSON: bench/results/resnet_split.json.

It takes about 4 minutes on 2 cores (the first run builds ResNet-50 too, a few minutes more):
that is why it is its own command and not part of `make bench`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.processes import INGRESS, WORKER, ServerProcess, TreeCpu, closed_loop, free_port, role_groups, run_module
from bench.workspace import RESULTS, WORK, ServedModel, prepare

SRC = Path(__file__).resolve().parents[1] / "src"
MODEL = ServedModel("resnet50", "resnet50", {"threads": 1, "instances": 2, "max_batch_size": 8,
                                             "batching": {"policy": "idle", "reserve_instance_for_high": False}})
CLIENTS, WARMUP_S, OFFLINE_THREADS = 16, 5.0, 2
GOAL_SERVED_RATIO = 1.0  # split served/offline >= single's
GOAL_DECODE_CPU_RATIO = 0.5  # ingress CPU per image <= half the single frontend's (or it scales)


def start(name: str, src: Path, repository: Path, extra: list[str]) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "servewell", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--model-repository", str(repository), "--log-format", "json", "--load-timeout-s", "180", *extra]
    server = ServerProcess(name, argv, port, RESULTS / "logs" / f"resnet_split_{name}.log",
                           env={"PYTHONPATH": str(src.resolve()), "SERVEWELL_GRPC_PORT": "0"})
    server.start()
    server.wait_ready(300)
    return server


def offline(repository: Path, images: list[Path], tag: str) -> dict[str, Any]:
    out = RESULTS / f"resnet_split_offline_{tag}.json"
    run_module("bench.offline", ["--model-dir", str(repository / MODEL.name), "--threads", str(OFFLINE_THREADS),
                                 "--batch-sizes", "1,4,8", "--min-time-s", "5", "--out", str(out),
                                 "--images", *map(str, images)],
               timeout_s=300, log_path=RESULTS / "logs" / "offline.log")
    doc: dict[str, Any] = json.loads(out.read_text())
    print(f"offline ({tag}): {doc['limit_items_per_s']:.1f} img/s at batch {doc['best_batch_size']}, "
          f"decode+preprocess {doc['preprocess_ms_per_image']} ms/img", flush=True)
    return doc


def measure(server: ServerProcess, bodies: list[Path], seconds: float, tag: str) -> dict[str, Any]:
    meter = TreeCpu(server.pid).start()
    summary = closed_loop(server.url, "/predict", bodies, CLIENTS, WARMUP_S + seconds, WARMUP_S,
                          RESULTS / "runs" / f"resnet_split_{tag}.json", RESULTS / "logs" / "loadgen.log")
    spent = meter.stop()
    images = max(1, summary["sent"])
    groups = role_groups(spent)
    return {"img_per_s": summary["throughput_rps"], "requests": summary["sent"],
            "statuses": summary["status_counts"],
            "cpu_ms_per_image": {k: round(1e3 * v / images, 2) for k, v in sorted({**spent, **groups}.items())}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=15.0, help="measured seconds per window (after 5 s warm-up)")
    parser.add_argument("--ingress-processes", type=int, default=None, help="the split server's (default: its default)")
    parser.add_argument("--other-src", type=Path, default=None,
                        help="run the single-process server from this checkout's src/ (default: this checkout, "
                             "--ingress-processes 0)")
    parser.add_argument("--out", type=Path, default=RESULTS / "resnet_split.json")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0:
        parser.error("--rounds and --seconds must be positive")
    if args.ingress_processes is not None and args.ingress_processes < 1:
        parser.error("--ingress-processes: the split server needs at least 1")
    if args.other_src is not None and not (args.other_src / "servewell" / "__init__.py").is_file():
        parser.error(f"{args.other_src} has no servewell package")
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    (RESULTS / "runs").mkdir(parents=True, exist_ok=True)
    run_module("bench.models", ["--work", str(WORK)], timeout_s=1200, log_path=RESULTS / "logs" / "build.log")
    workspace = prepare([MODEL])
    bodies = workspace.bodies[MODEL.name]
    offline_runs = [offline(workspace.repository, workspace.images, "before")]
    split_flags = [] if args.ingress_processes is None else ["--ingress-processes", str(args.ingress_processes)]
    servers: dict[str, ServerProcess] = {}
    runs: dict[str, list[dict[str, Any]]] = {"split": [], "single": []}
    try:
        servers["split"] = start("split", SRC, workspace.repository, split_flags)
        servers["single"] = (start("single", args.other_src, workspace.repository, []) if args.other_src
                             else start("single", SRC, workspace.repository, ["--ingress-processes", "0"]))
        for r in range(args.rounds):
            for key in ("split", "single") if r % 2 == 0 else ("single", "split"):
                run = measure(servers[key], bodies, args.seconds, f"{key}_{r}")
                runs[key].append(run)
                cpu = run["cpu_ms_per_image"]
                print(f"round {r + 1} {key}: {run['img_per_s']:.1f} img/s, CPU ms/image: frontend "
                      f"{cpu['frontend']:.1f} (ingress {cpu.get(INGRESS, 0.0):.1f}), worker {cpu.get(WORKER, 0.0):.1f}",
                      flush=True)
    finally:
        for server in servers.values():
            server.stop()
    offline_runs.append(offline(workspace.repository, [], "after"))
    limit = max(d["limit_items_per_s"] for d in offline_runs)
    report = summarize(runs, limit, offline_runs, args)
    print_table(report)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {args.out}")
    return 0


def summarize(runs: dict[str, list[dict[str, Any]]], limit: float, offline_runs: list[dict[str, Any]],
              args: argparse.Namespace) -> dict[str, Any]:
    def median(key: str, role: str | None = None) -> float:
        return statistics.median(r["img_per_s"] if role is None else r["cpu_ms_per_image"].get(role, 0.0)
                                 for r in runs[key])

    served = {key: median(key) for key in runs}
    decode_ratio = median("split", INGRESS) / median("single", "frontend") if median("single", "frontend") else None
    roles = sorted({role for rows in runs.values() for r in rows for role in r["cpu_ms_per_image"]})
    return {
        "offline_limit_img_per_s": limit, "offline": offline_runs,
        "ingress_processes": args.ingress_processes, "other_src": str(args.other_src) if args.other_src else None,
        "served_img_per_s": served,
        "served_vs_offline": {key: served[key] / limit for key in runs},
        "split_vs_single_served": statistics.median(a["img_per_s"] / b["img_per_s"] if b["img_per_s"] else 0.0
                                                    for a, b in zip(runs["split"], runs["single"], strict=True)),
        "cpu_ms_per_image": {key: {role: median(key, role) for role in roles} for key in runs},
        "ingress_vs_single_frontend_cpu": decode_ratio,
        # the part of the split's frontend work that does not scale with ingress processes
        "engine_vs_single_frontend_cpu": (median("split", "engine") / median("single", "frontend")
                                          if median("single", "frontend") else None),
        "errors": {key: sum(n for r in rows for s, n in r["statuses"].items() if s != "200")
                   for key, rows in runs.items()},
        "rounds": runs,
    }


def print_table(report: dict[str, Any]) -> None:
    limit = report["offline_limit_img_per_s"]
    print(f"\nResNet-50 /predict, 640x480 JPEGs, {CLIENTS} clients; offline limit {limit:.1f} img/s "
          f"({OFFLINE_THREADS} threads, better of before/after); medians of {len(report['rounds']['split'])} round(s)")
    header = f"{'server':<8} {'img/s':>7} {'served/offline':>15}  CPU ms per image by process role"
    print(header)
    print("-" * (len(header) + 30))
    for key in ("split", "single"):
        cpu = ", ".join(f"{k} {v:.1f}" for k, v in report["cpu_ms_per_image"][key].items() if v)
        print(f"{key:<8} {report['served_img_per_s'][key]:>7.1f} {report['served_vs_offline'][key]:>14.2f}x  {cpu}")
    ratio = report["split_vs_single_served"]
    print(f"\nsplit / single served img/s: {ratio:.2f}x (goal >= {GOAL_SERVED_RATIO}x: "
          f"{'ok' if ratio >= GOAL_SERVED_RATIO else 'NO'})")
    decode = report["ingress_vs_single_frontend_cpu"]
    if decode is not None:
        print(f"ingress CPU per image / single-process frontend CPU per image: {decode:.2f}x (goal <= "
              f"{GOAL_DECODE_CPU_RATIO}x, or moved where it scales: the ingress processes scale, the engine "
              f"does not; engine {report['cpu_ms_per_image']['split'].get('engine', 0.0):.1f} ms/image)")
        print(f"engine CPU per image (what does not scale) / single-process frontend CPU per image: "
              f"{report['engine_vs_single_frontend_cpu']:.2f}x")
    if any(report["errors"].values()):
        print(f"non-200 answers: {report['errors']}")


if __name__ == "__main__":
    sys.exit(main())
