"""Hostile cases of worker starts and worker output (issue 45 H6 and H11), each with a server of its own.

- `loads_many_python_models` (H6): 13 python models whose setup burns 0.5 s of CPU, eager mode,
  `--load-timeout-s 10`, the server kept to 2 CPUs (its affinity mask) as on the machine of the
  finding. Before the fix every worker was spawned at once and each timeout counted the others'
  start-up: 12 of 13 failed. Now loads take turns (one per usable CPU), each timed from its own
  turn, a worker is forked rather than started afresh, and a load that timed out is tried again.
  Bound: every model ready (none failed), each answers 200.
- `worker_output_flood` (H11): a python model printing 2 MiB per request (half on stdout, half on
  stderr) gets 20 requests, beside a quiet model. Before the fix the server's log grew by all
  40 MiB. Bound: the log grows by at most one burst plus the rate over the run's seconds plus 1 MiB
  (the server's own lines), the drop is said (event `worker_output_dropped`), every request 200.

    python -m bench.hostile --attacks "" --cases loads_many_python_models,worker_output_flood
"""

from __future__ import annotations

import os
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.hostile_cases import CaseResult, case
from bench.processes import HOST, ServerProcess, free_port
from servewell.workers.output_cap import OutputLimits

MiB = 1 << 20
MODEL_SOURCE = textwrap.dedent('''
    import sys
    import time


    class Model:
        """y = x; its setup burns `setup_cpu_s` of CPU; each batch prints `print_bytes`."""

        def setup(self, config):
            settings = config["settings"]
            began = time.process_time()
            while time.process_time() - began < settings.get("setup_cpu_s", 0.0):
                pass
            self.print_bytes = settings.get("print_bytes", 0)

        def execute(self, inputs):
            line = "x" * 999 + "\\n"
            for _ in range(self.print_bytes // 2000):
                sys.stdout.write(line)
                sys.stderr.write(line)
            sys.stdout.flush()
            sys.stderr.flush()
            return {"y": inputs["x"]}
''')
BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}


def write_model(root: Path, name: str, **settings: Any) -> None:
    """A python model `name` under `root` with `settings` for its setup."""
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "model.py").write_text(MODEL_SOURCE)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "python", "artifact": "model.py", "python": {"entry": "model:Model", "settings": settings},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}], "max_batch_size": 4}))


def start_server(workdir: Path, repository: Path, *args: str, cpus: int | None = None) -> ServerProcess:
    """An eager split server on `repository` (returns once started; not waited for), kept to its
    first `cpus` CPUs when given."""
    port = free_port()
    server = ServerProcess("servewell-hostile-loads", [
        sys.executable, "-m", "servewell", "serve", "--host", HOST, "--port", str(port), "--grpc-port", "0",
        "--model-repository", str(repository), "--config-poll-s", "0", "--cache-dir", str(workdir / "cache"),
        *args], port, workdir / "server.log")
    before = os.sched_getaffinity(0)
    if cpus is not None:
        os.sched_setaffinity(0, sorted(before)[:cpus])  # inherited by the server and all it starts
    try:
        server.start()
    finally:
        os.sched_setaffinity(0, before)
    return server


def model_states(url: str) -> dict[str, dict[str, Any]]:
    """Each model's state, reason and instances from /healthz (whatever its status)."""
    models: dict[str, dict[str, Any]] = httpx.get(url + "/healthz", timeout=10).json()["models"]
    return models


@case("loads_many_python_models")
def many_python_models(workdir: Path) -> CaseResult:
    """H6: 13 python models, a 10 s load timeout, 2 CPUs."""
    names = [f"m{i:02d}" for i in range(13)]
    for name in names:
        write_model(workdir / "repository", name, setup_cpu_s=0.5)
    server = start_server(workdir, workdir / "repository", "--load-timeout-s", "10", cpus=2)
    started = time.monotonic()
    states: Counter[str] = Counter()
    answers: Counter[str] = Counter()
    attempts: dict[str, int] = {}
    seen_queued = False
    try:
        server.wait_ready(120, "/v2/health/live")
        while time.monotonic() - started < 240:
            models = model_states(server.url)
            seen_queued = seen_queued or any(i["state"] == "queued" for m in models.values() for i in m["instances"])
            if all(m["state"] in ("ready", "failed", "invalid") for m in models.values()):
                break
            time.sleep(0.2)
        all_loaded_s = time.monotonic() - started
        states = Counter(m["state"] for m in models.values())
        attempts = {n: m["instances"][0].get("load_attempt", 1) for n, m in models.items() if m["instances"]}
        for name in names:
            response = httpx.post(f"{server.url}/v2/models/{name}/infer", json=BODY, timeout=30)
            answers["200" if response.status_code == 200 else f"{response.status_code}"] += 1
    finally:
        server.stop()
    return CaseResult(
        "loads_many_python_models",
        "13 python models (0.5 s of CPU in setup each), --load-timeout-s 10, 2 CPUs: every model ready and "
        "answering 200 (before: 12 of 13 failed, 'load did not finish within 10 s')",
        states.get("ready", 0) == len(names) and answers.get("200", 0) == len(names),
        {"states": dict(states), "answers": dict(answers), "all_settled_s": round(all_loaded_s, 1),
         "queued_seen": seen_queued, "retried": {n: a for n, a in attempts.items() if a > 1}})


@case("worker_output_flood")
def output_flood(workdir: Path) -> CaseResult:
    """H11: 40 MiB printed by one model's worker against the log's growth."""
    write_model(workdir / "repository", "chatty", print_bytes=2 * MiB)
    write_model(workdir / "repository", "quiet")
    server = start_server(workdir, workdir / "repository")
    answers: Counter[str] = Counter()
    try:
        server.wait_ready(180)
        before = server.log_path.stat().st_size
        began = time.monotonic()
        for _ in range(20):
            response = httpx.post(f"{server.url}/v2/models/chatty/infer", json=BODY, timeout=60)
            answers["200" if response.status_code == 200 else f"{response.status_code}"] += 1
        quiet = httpx.post(f"{server.url}/v2/models/quiet/infer", json=BODY, timeout=60).status_code
        seconds = time.monotonic() - began
        time.sleep(1.5)  # the last drop notice (at most one a second)
        grown = server.log_path.stat().st_size - before
        text = server.log_path.read_text(errors="replace")
    finally:
        server.stop()
    limits = OutputLimits()
    allowed = limits.burst_bytes + int(limits.rate_bytes_per_s * (seconds + 1.5)) + MiB
    said = "worker_output_dropped" in text
    return CaseResult(
        "worker_output_flood",
        "20 requests of a model printing 2 MiB each (40 MiB): the log grows by at most the burst + the rate over "
        "the run + 1 MiB, the drop is said, every request 200 (before: the log grew by 40 MiB)",
        grown <= allowed and said and answers.get("200", 0) == 20 and quiet == 200,
        {"printed_mib": 40, "log_grew_bytes": grown, "allowed_bytes": allowed, "seconds": round(seconds, 2),
         "drop_said": said, "answers": dict(answers), "quiet_model": quiet})
