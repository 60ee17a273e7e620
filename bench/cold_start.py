"""Cold start of a model, first request to answer: pre-spawned spare workers against fresh spawns.

    flock /tmp/servewell-bench.lock .venv/bin/python -m bench.cold_start [--runs 3]
        [--via lazy|repository] [--modes fresh,spare,spare_first] [--ingress-processes 0] [--build DIR]

Issue 21's goal: with pre-spawned workers, at least a 2x cut of a ResNet-50-sized model's first-load
time, and where the time goes. Driven through the real server. `--via lazy` (default): a server in
the lazy repository mode; each model is loaded once untimed by a first request, then per run
`POST /admin/models/<name>/evict` and the timed first request (`/v2/models/<name>/infer`, one row
of zeros), which waits for the load and answers. `--via repository`: the eager mode, per run
`POST /v2/repository/models/<name>/unload`, then the timed `POST .../load`, which answers once the
model is ready. Modes: `fresh` runs with `--spare-workers 0 --warmup-batch-sizes all` (how every
load started before issue 21), `spare` with `--spare-workers 1` (each load waits first until the
spare is ready, as it is between loads of a server that is not loading back to back), and
`spare_first` adds `--warmup-batch-sizes first` (warm-up of batch sizes 1 and 2 only: the lazy
mode's defaults). The breakdown (spawn, import, load, warm-up) is each load's `worker_cold_start`
log line (workers/cold_start.py). Medians over `--runs`; JSON: bench/results/cold_start.json.

Models: `small` (the benchmark MLP: 8 MiB ONNX) and `resnet50` (ResNet-50 ONNX, 98 MiB), each
with the build's model.yaml (max batch 32, warm-up 1..32) and one instance of one thread.
Snapshots are off (`--artifact-snapshots false`): the worker start is what is measured.
`--ingress-processes 0` is the single-process server; with more, the engine is
`python -m servewell.engine_main`, which freshly spawned workers re-imported before this issue.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench.processes import ServerProcess, free_port, http_json, run_module
from bench.workspace import RESULTS, WORK, link_build, write_model_yaml

SRC = Path(__file__).resolve().parents[1] / "src"
MODELS = {"small": "mlp", "resnet50": "resnet50"}  # served name -> build
#: mode -> (--spare-workers, --warmup-batch-sizes); "fresh" is how every load started before issue 21.
MODES = {"fresh": ("0", "all"), "spare": ("1", "all"), "spare_first": ("1", "first")}
GOAL_CUT = 2.0  # fresh / spare_first first-load time, ResNet-50 (issue 21)
STEPS = ("spawn_s", "import_s", "load_s", "warmup_s")


def ensure_builds(build: Path) -> None:
    """Build the MLP and ResNet-50 when absent (a few minutes the first time)."""
    if all((build / b / "model.yaml").is_file() for b in MODELS.values()):
        return
    if build != WORK / "build":
        raise SystemExit(f"{build} lacks the builds {sorted(MODELS.values())}")
    print("building the benchmark models (python -m bench.models)...", flush=True)
    run_module("bench.models", ["--work", str(WORK)], timeout_s=1800, log_path=RESULTS / "logs" / "models.log")


def write_repository(build: Path) -> Path:
    repository = WORK / "cold_start_repo"
    for name, source in MODELS.items():
        config = link_build(build / source, repository / name)
        write_model_yaml(repository / name, {**config, "name": name, "instances": 1, "threads": 1})
    return repository


def log_events(log_path: Path, event: str) -> list[dict[str, Any]]:
    found = []
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            doc = json.loads(line)
            if doc.get("event") == event:
                found.append(doc)
    return found


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    ends_at = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > ends_at:
            raise RuntimeError(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(0.05)


def infer_body(config: dict[str, Any]) -> dict[str, Any]:
    """An OIP request of one row of zeros for every input of `config` (a model.yaml)."""
    inputs = []
    for spec in config["inputs"]:
        shape = [1, *spec["shape"]]
        inputs.append({"name": spec["name"], "shape": shape, "datatype": spec["datatype"],
                       "data": [0] * math.prod(shape)})
    return {"inputs": inputs}


def cold_start_once(via: str, port: int, name: str, body: dict[str, Any]) -> float:
    """Unload `name`, then the timed part: its load call (`repository`) or, in the lazy mode, the
    first request after its eviction until its answer (`lazy`). Seconds."""
    if via == "lazy":
        status, answer = http_json(port, "POST", f"/admin/models/{name}/evict", timeout_s=120)
    else:
        status, answer = http_json(port, "POST", f"/v2/repository/models/{name}/unload", timeout_s=120)
    if status != 200:
        raise RuntimeError(f"unloading {name}: {status} {answer}")
    started = time.monotonic()
    if via == "lazy":
        status, answer = http_json(port, "POST", f"/v2/models/{name}/infer", body, timeout_s=600)
    else:
        status, answer = http_json(port, "POST", f"/v2/repository/models/{name}/load", timeout_s=600)
    if status != 200:
        raise RuntimeError(f"loading {name}: {status} {answer}")
    return time.monotonic() - started


def run_mode(mode: str, repository: Path, runs: int, ingress: int, via: str) -> dict[str, list[dict[str, Any]]]:
    """Per model, each run's seconds until ready (or answered) and its logged breakdown."""
    port = free_port()
    log_path = RESULTS / "logs" / f"cold_start_{mode}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text("")
    spares, warmup = MODES[mode]
    argv = [sys.executable, "-m", "servewell", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--model-repository", str(repository), "--log-format", "json", "--load-timeout-s", "300",
            "--config-poll-s", "0", "--ingress-processes", str(ingress), "--spare-workers", spares,
            "--warmup-batch-sizes", warmup, "--artifact-snapshots", "false",
            "--repository-mode", "lazy" if via == "lazy" else "eager", "--max-load-wait-ms", "300000"]
    server = ServerProcess(f"cold_start_{mode}", argv, port, log_path,
                           env={"PYTHONPATH": str(SRC), "SERVEWELL_GRPC_PORT": "0", "SERVEWELL_SHUTDOWN_DELAY_S": "0"})
    bodies = {name: infer_body(yaml.safe_load((repository / name / "model.yaml").read_text())) for name in MODELS}
    server.start()
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in MODELS}
    try:
        server.wait_ready(600)
        if via == "lazy":  # load each once, untimed, as the eager mode's start does
            for name in MODELS:
                status, answer = http_json(port, "POST", f"/v2/models/{name}/infer", bodies[name], timeout_s=600)
                if status != 200:
                    raise RuntimeError(f"first request to {name}: {status} {answer}")
        for run in range(runs):
            for name in MODELS:
                if spares != "0":  # the spare the previous load took has been replaced and is ready
                    adopted = {d["pid"] for d in log_events(log_path, "worker_cold_start") if d["spare"]}
                    wait_for(lambda taken=adopted: any(d["pid"] not in taken
                                                       for d in log_events(log_path, "spare_ready")),
                             120, "a spare worker ready")
                seen = len(log_events(log_path, "worker_cold_start"))
                seconds = cold_start_once(via, port, name, bodies[name])
                starts = [d for d in log_events(log_path, "worker_cold_start")[seen:] if d["model"] == name]
                breakdown = {k: starts[-1][k] for k in ("spare", "total_s", "other_s", *STEPS)} if starts else {}
                results[name].append({"seconds": round(seconds, 3), **breakdown})
                print(f"  {mode:11s} {name:8s} run {run + 1}: {seconds:.2f} s {breakdown}", flush=True)
    finally:
        server.stop()
    return results


def median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return round(statistics.median(values), 3) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="loads per model and mode (median)")
    parser.add_argument("--ingress-processes", type=int, default=0, help="0: the single-process server")
    parser.add_argument("--build", type=Path, default=WORK / "build", help="where bench.models built the models")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--via", choices=("lazy", "repository"), default="lazy",
                        help="lazy: first request after an eviction until its answer; repository: the load call")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if "fresh" not in modes or any(m not in MODES for m in modes):
        parser.error(f"--modes: fresh (the baseline) and any of {', '.join(MODES)}")
    ensure_builds(args.build)
    repository = write_repository(args.build)
    raw = {mode: run_mode(mode, repository, args.runs, args.ingress_processes, args.via) for mode in modes}
    summary: dict[str, Any] = {}
    what = "first request to answer" if args.via == "lazy" else "load call to ready"
    print(f"\ncold start, {what}, median of {args.runs} ({args.ingress_processes} ingress processes)")
    print(f"{'model':9s} {'mode':11s} {'seconds':>9s} " + " ".join(f"{s[:-2]:>7s}" for s in STEPS) + "  cut")
    for name in MODELS:
        summary[name] = {}
        for mode in modes:
            summary[name][mode] = {k: median(raw[mode][name], k) for k in ("seconds", *STEPS)}
        fresh = summary[name]["fresh"]["seconds"]
        for mode in modes:
            row = summary[name][mode]
            cut = round(fresh / row["seconds"], 2) if fresh and row["seconds"] else None
            row["cut"] = cut
            steps = " ".join(f"{row[s]:7.3f}" if row[s] is not None else f"{'-':>7s}" for s in STEPS)
            tail = f"  {cut:.2f}x" if mode != "fresh" and cut is not None else ""
            if mode == "spare_first" and name == "resnet50" and cut is not None:
                tail += f"  goal >= {GOAL_CUT:g}x: {'met' if cut >= GOAL_CUT else 'NOT met'}"
            print(f"{name:9s} {mode:11s} {row['seconds']:9.3f} {steps}{tail}")
    out = RESULTS / "cold_start.json"
    out.write_text(json.dumps({"measured": what, "via": args.via, "runs": args.runs,
                               "ingress_processes": args.ingress_processes, "goal_cut": GOAL_CUT,
                               "summary": summary, "raw": raw}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
