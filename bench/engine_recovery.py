"""Time to the first 200 after `kill -9` of the engine, and where it went (issue 45, H15).

    python -m bench.engine_recovery [--models 4] [--rounds 3] [--ingress-processes 2]
                                    [--repository DIR --model NAME] [--out bench/results/engine_recovery.json]
                                    [-- --standby-engine true]

A split server over a repository of `--models` small python models (or `--repository`), quiet: no
load but the probe. Each round kills the engine with SIGKILL, then a probe sends one inference
request every 20 ms on a fresh connection (so every ingress is reached) until one answers 200,
and /healthz is polled until the server is ready again. The server's log (JSON lines) says where
the time went, as seconds from the kill:

    restart_scheduled  the supervisor saw the engine exit (`child_exited`) and its backoff
    engine_started     the new engine process exists (`child_started`)
    engine_up          its interpreter and imports are done (`engine_up`; a standby taking over
                       did them before the kill)
    ingress_connected  the first ingress is connected to its door again
    first_worker_ready / last_worker_ready   models' workers loaded and warmed up (`worker_cold_start`:
                       spawn, import, load, warm-up of each)
    first_200          the probe's first 200; before it, how long each refusal code was answered
    ready              /healthz 200 again (every model ready)

The table's rows are medians over the rounds. A machine shared with others makes every figure
longer: run it alone (the CONTRIBUTING's benchmark lock).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import yaml

from bench.processes import ENGINE, HOST, ServerProcess, free_port, http_json, tree_roles
from servewell.engine_standby import STANDBY_COMM

PROBE_EVERY_S = 0.02
RECOVERY_WAIT_S = 120.0

MODEL = textwrap.dedent('''
    class Model:
        """y = x."""

        def execute(self, inputs):
            return {"y": inputs["x"]}
''')
BODY = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}


def python_repository(root: Path, count: int) -> Path:
    """`count` python models m00, m01, ... (x [1] -> y [1])."""
    for i in range(count):
        directory = root / f"m{i:02d}"
        directory.mkdir(parents=True)
        (directory / "model.py").write_text(MODEL)
        (directory / "model.yaml").write_text(yaml.safe_dump({
            "runtime": "python", "artifact": "model.py", "python": {"entry": "model:Model"},
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}], "max_batch_size": 4}))
    return root


def standing_by(pid: int) -> bool:
    """Whether engine process `pid` is a standby still waiting (`--standby-engine`)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == STANDBY_COMM
    except OSError:
        return False


def log_events(path: Path, since_wall: float) -> list[dict[str, Any]]:
    """The server's JSON log lines written at or after `since_wall` (Unix seconds), with `t`: their time."""
    events = []
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
            t = datetime.datetime.fromisoformat(record["ts"]).timestamp()
        except (ValueError, KeyError, TypeError):
            continue
        if t >= since_wall - 0.001:
            record["t"] = t
            events.append(record)
    return events


def probe_until_200(port: int, model: str, killed_at: float) -> tuple[float | None, dict[str, float]]:
    """Send inference requests until one answers 200: (seconds from the kill to it, the first time
    each refusal code was seen, in seconds from the kill)."""
    first_seen: dict[str, float] = {}
    while time.time() - killed_at < RECOVERY_WAIT_S:
        try:
            status, body = http_json(port, "POST", f"/v2/models/{model}/infer", BODY, timeout_s=5.0)
        except OSError:
            status, body = 0, None
        now = time.time() - killed_at
        if status == 200:
            return now, first_seen
        code = body.get("error", {}).get("code") if isinstance(body, dict) and isinstance(body.get("error"),
                                                                                          dict) else None
        code = code or (body.get("code") if isinstance(body, dict) else None) or f"status {status}"
        first_seen.setdefault(str(code), round(now, 3))
        time.sleep(PROBE_EVERY_S)
    return None, first_seen


def wait_ready(port: int, killed_at: float) -> float | None:
    """Seconds from the kill until /healthz answers 200."""
    while time.time() - killed_at < RECOVERY_WAIT_S:
        try:
            if http_json(port, "GET", "/healthz", timeout_s=5.0)[0] == 200:
                return time.time() - killed_at
        except OSError:
            pass
        time.sleep(0.05)
    return None


def breakdown(events: list[dict[str, Any]], killed_at: float) -> dict[str, Any]:
    """Where the recovery's time went, from the server's log (seconds from the kill)."""
    def first(predicate: Any) -> float | None:
        times = [e["t"] - killed_at for e in events if predicate(e)]
        return round(min(times), 3) if times else None

    starts = [e for e in events if e.get("event") == "worker_cold_start"]
    scheduled = next((e for e in events if e.get("event") == "child_restart_scheduled" and e.get("role") == ENGINE),
                     None)
    up = next((e for e in events if e.get("event") == "engine_up"), None)
    return {
        "restart_scheduled": first(lambda e: e.get("event") == "child_restart_scheduled" and e.get("role") == ENGINE),
        "restart_delay_s": scheduled.get("delay_s") if scheduled else None,
        "engine_started": first(lambda e: e.get("event") == "child_started" and e.get("role") == ENGINE),
        "engine_up": first(lambda e: e.get("event") == "engine_up"),
        "engine_imports_s": up.get("imports_s") if up else None,
        "ingress_connected": first(lambda e: str(e.get("message", "")).startswith("ingress ")
                                   and "connected" in str(e.get("message", ""))
                                   and "disconnected" not in str(e.get("message", ""))),
        "first_worker_ready": round(min(e["t"] - killed_at for e in starts), 3) if starts else None,
        "last_worker_ready": round(max(e["t"] - killed_at for e in starts), 3) if starts else None,
        "workers": [{k: e.get(k) for k in ("model", "spare", "total_s", "spawn_s", "import_s", "load_s", "warmup_s")}
                    for e in starts],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="servewell-engine-recovery-"))
    repository = Path(args.repository) if args.repository else python_repository(work / "models", args.models)
    model = args.model or "m00"
    port = free_port()
    log_path = work / "server.log"
    server = ServerProcess("server", [sys.executable, "-m", "servewell", "serve", "--host", HOST, "--port", str(port),
                                     "--grpc-port", "0", "--model-repository", str(repository),
                                     "--ingress-processes", str(args.ingress_processes), "--config-poll-s", "0",
                                     "--load-timeout-s", "120", *args.server_args],
                           port, log_path)
    rounds = []
    server.start()
    try:
        server.wait_ready(300)
        for n in range(args.rounds):
            time.sleep(args.settle_s)  # quiet again, and past the supervisor's 30 s backoff reset
            engine = [pid for pid in tree_roles(server.pid).get(ENGINE, []) if not standing_by(pid)]
            if len(engine) != 1:
                raise RuntimeError(f"expected one engine process, found {engine}; see {log_path}")
            killed_at = time.time()
            os.kill(engine[0], signal.SIGKILL)
            first_200, refusals = probe_until_200(port, model, killed_at)
            ready = wait_ready(port, killed_at)
            time.sleep(0.5)  # the last log lines
            row = {"round": n, "first_200_s": None if first_200 is None else round(first_200, 3),
                   "ready_s": None if ready is None else round(ready, 3), "refusals_first_seen_s": refusals,
                   **breakdown(log_events(log_path, killed_at), killed_at)}
            rounds.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "workers"}), flush=True)
    finally:
        server.stop()
    keys = ("restart_scheduled", "restart_delay_s", "engine_started", "engine_up", "engine_imports_s",
            "ingress_connected", "first_worker_ready", "last_worker_ready", "first_200_s", "ready_s")
    medians = {k: (statistics.median(v) if (v := [r[k] for r in rounds if r.get(k) is not None]) else None)
               for k in keys}
    return {"models": args.models if not args.repository else str(repository), "rounds": rounds,
            "median": medians, "ingress_processes": args.ingress_processes, "cpus": os.cpu_count(),
            "log": str(log_path)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ingress-processes", type=int, default=2)
    parser.add_argument("--repository", help="serve this repository instead of generated python models")
    parser.add_argument("--model", help="the model the probe asks (default m00)")
    parser.add_argument("--settle-s", type=float, default=31.0, help="quiet seconds before each kill")
    parser.add_argument("--out", default="bench/results/engine_recovery.json")
    parser.add_argument("server_args", nargs="*", help="more `servewell serve` arguments (after --)")
    args = parser.parse_args(argv)
    report = run(args)
    print("median seconds from the kill:")
    for key, value in report["median"].items():
        print(f"  {key:20s} {value}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
