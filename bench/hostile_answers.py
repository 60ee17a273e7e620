"""Hostile cases of large answers and of a full /dev/shm (issue 45, H1, H14), each with a server of
its own: a split server (one ingress process, so every request shares its event loop and the
engine's) serving python models.

- `large_answers` (H1): a 4-float model probed every 50 ms, alone and then while another model
  answers 60 MB a row (JSON, back to back); then that model asked for 200 MB. Bound: the probe's
  worst wait under the load stays under 0.35x a large answer's own time (both measured in the same
  run, so a slower machine moves both: before the fix a probe waited for a whole large answer's
  encoding), and the 200 MB answer is refused 500 output_too_large naming max_output_bytes.
- `shm_full` (H14): the server in a private 64 MiB /dev/shm (`unshare -m` and a tmpfs, as a
  container's; needs root), which is then filled. Bound: 40 of 40 small requests answered (half to a
  model first used then), a request larger than the worker's arena answered 503 shared_memory_full
  naming /dev/shm (never 500), and served again once memory is freed.

    python -m bench.hostile --attacks "" --cases large_answers,shm_full

Figures of the code before the fix: run the same with PYTHONPATH pointing at that checkout's `src`
(the servers are started with this interpreter and inherit it).
"""

from __future__ import annotations

import errno
import os
import shutil
import statistics
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import orjson
import yaml

from bench.hostile_cases import CaseResult, case
from bench.processes import HOST, ServerProcess, free_port

MODELS = textwrap.dedent('''
    import numpy as np


    class Wide:
        """y = x * ones(width) per row: an output of the size the model decides ([-1])."""

        def setup(self, config):
            self.ones = np.ones(config["settings"]["width"], dtype=np.float32)

        def execute(self, inputs):
            return {"y": inputs["x"] * self.ones}


    class Double:
        def setup(self, config):
            pass

        def execute(self, inputs):
            return {"y": inputs["x"] * 2}


    class Total:
        def setup(self, config):
            pass

        def execute(self, inputs):
            return {"y": inputs["x"].sum(axis=1, keepdims=True)}
''')
#: Floats a row of the large model: 60 MB (the issue's middle figure), under the default bound of 64 MiB.
WIDE = 15_000_000
#: Floats a row of the huge model: 200 MB, over the bound.
HUGE = 50_000_000
PROBE_EVERY_S = 0.05
BASELINE_S = 5.0
LOAD_S = 10.0
SMALL = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
#: Floats of the large request of `shm_full`: 2.4 MB, more than a worker's batch arena holds from its start.
LARGE_INPUT = 600_000


def _model(root: Path, name: str, entry: str, shapes: tuple[int, int], width: int = 0) -> None:
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "models.py").write_text(MODELS)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "python", "artifact": "models.py", "max_batch_size": 2, "warmup": False,
        "python": {"entry": f"models:{entry}", "settings": {"width": width}},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [shapes[0]]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [shapes[1]]}]}))


def _server(workdir: Path, name: str, extra: list[str], wrapper: list[str] | None = None) -> ServerProcess:
    port = free_port()
    server = ServerProcess(name, [
        *(wrapper or []), sys.executable, "-m", "servewell", "serve", "--host", HOST, "--port", str(port),
        "--grpc-port", str(free_port()), "--model-repository", str(workdir / "repository"),
        "--ingress-processes", "1", "--config-poll-s", "0", "--cache-dir", str(workdir / "cache"), *extra],
        port, workdir / "server.log")
    server.start()
    server.wait_ready(180)
    return server


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def _probe(url: str, seconds: float) -> list[float]:
    """Seconds each request to the small model took, one every PROBE_EVERY_S for `seconds`."""
    waits = []
    with httpx.Client(base_url=url, timeout=120) as http:
        ends_at = time.monotonic() + seconds
        while time.monotonic() < ends_at:
            started = time.monotonic()
            answer = http.post("/v2/models/small/infer", json=SMALL)
            waits.append(time.monotonic() - started)
            answer.raise_for_status()
            time.sleep(PROBE_EVERY_S)
    return waits


@case("large_answers")
def large_answers(workdir: Path) -> CaseResult:
    """H1: a model's 60 MB answers leave another model's requests flowing; 200 MB is refused by name."""
    root = workdir / "repository"
    _model(root, "wide", "Wide", (1, -1), WIDE)
    _model(root, "huge", "Wide", (1, -1), HUGE)
    _model(root, "small", "Double", (4, 4))
    server = _server(workdir, "servewell-hostile-answers", [])
    stop = threading.Event()
    answers: list[float] = []
    failed: list[str] = []

    def large() -> None:
        body = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}
        with httpx.Client(base_url=server.url, timeout=300) as http:
            while not stop.is_set():
                started = time.monotonic()
                answer = http.post("/v2/models/wide/infer", json=body)
                answers.append(time.monotonic() - started)
                if answer.status_code != 200:
                    failed.append(f"{answer.status_code} {answer.text[:200]}")

    try:
        baseline = _probe(server.url, BASELINE_S)
        loader = threading.Thread(target=large, daemon=True)
        loader.start()
        while not answers and loader.is_alive() and len(failed) < 3:
            time.sleep(0.05)
        under_load = _probe(server.url, LOAD_S)
        stop.set()
        loader.join(300)
        started = time.monotonic()
        huge = httpx.post(f"{server.url}/v2/models/huge/infer", timeout=600,
                          json={"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]})
        huge_s = time.monotonic() - started
    finally:
        stop.set()
        server.stop()
    large_s = statistics.median(answers) if answers else float("nan")
    worst_s = max(under_load)
    huge_code = huge.headers.get("x-error-code", "")
    flowing = bool(answers) and not failed and worst_s < 0.35 * large_s
    refused = huge.status_code == 500 and huge_code == "output_too_large" and "max_output_bytes" in huge.text
    return CaseResult(
        "large_answers",
        "a 4-float model probed every 50 ms while another answers 60 MB a row (JSON, back to back) through the same "
        "ingress and engine: its worst wait < 0.35x a large answer's own time; a 200 MB answer is refused 500 "
        "output_too_large naming max_output_bytes",
        passed=flowing and refused,
        figures={"probe_alone_p50_ms": _ms(baseline, 0.5), "probe_alone_p99_ms": _ms(baseline, 0.99),
                 "probe_alone_worst_ms": _ms(baseline, 1.0), "probe_loaded_p50_ms": _ms(under_load, 0.5),
                 "probe_loaded_p99_ms": _ms(under_load, 0.99), "probe_loaded_worst_ms": _ms(under_load, 1.0),
                 "large_answers": len(answers), "large_answer_median_s": round(large_s, 2),
                 "worst_over_large": round(worst_s / large_s, 3) if answers else None, "large_failures": failed[:2],
                 "huge_status": huge.status_code, "huge_code": huge_code, "huge_s": round(huge_s, 2)})


def _fill(directory: Path) -> Path:
    """Write a file into `directory` until its filesystem is full; the file."""
    filler = directory / "filler"
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as out:
        while True:
            try:
                out.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return filler


def _large_request(http: httpx.Client) -> httpx.Response:
    values = np.ones((1, LARGE_INPUT), np.float32)
    header = orjson.dumps({"inputs": [{"name": "x", "shape": [1, LARGE_INPUT], "datatype": "FP32",
                                       "parameters": {"binary_data_size": values.nbytes}}]})
    return http.post("/v2/models/total/infer", content=header + values.tobytes(),
                     headers={"Content-Type": "application/octet-stream",
                              "Inference-Header-Content-Length": str(len(header))})


@case("shm_full")
def shm_full(workdir: Path) -> CaseResult:
    """H14: a full /dev/shm fails no small request; a large one is told why (503), never a 500."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        raise RuntimeError("shm_full needs root and unshare (util-linux) to give the server a private /dev/shm")
    root = workdir / "repository"
    _model(root, "small", "Double", (4, 4))
    _model(root, "fresh", "Double", (4, 4))
    _model(root, "total", "Total", (-1, 1))
    private_shm = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                   'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"', "sh"]
    server = _server(workdir, "servewell-hostile-shm", ["--max-body-bytes", str(8 << 20)], private_shm)
    statuses: dict[str, int] = {}
    try:
        shm = Path(f"/proc/{server.pid}/root/dev/shm")
        with httpx.Client(base_url=server.url, timeout=60) as http:
            http.post("/v2/models/small/infer", json=SMALL).raise_for_status()
            filler = _fill(shm)
            try:
                free_bytes = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize
                for n in range(40):  # half to a model first used now: its first batch
                    status = http.post(f"/v2/models/{'fresh' if n % 2 else 'small'}/infer", json=SMALL).status_code
                    statuses[str(status)] = statuses.get(str(status), 0) + 1
                large = _large_request(http)
            finally:
                filler.unlink()
            after = _large_request(http)
    finally:
        server.stop()
    large_code = large.headers.get("x-error-code", "")
    passed = (statuses == {"200": 40} and large.status_code == 503 and large_code == "shared_memory_full"
              and "/dev/shm" in large.text and after.status_code == 200)
    return CaseResult(
        "shm_full",
        "with a private 64 MiB /dev/shm filled: 40 of 40 small requests answered (half to a model first used then), a "
        "request larger than the arenas answered 503 shared_memory_full naming /dev/shm, and 200 once memory is freed",
        passed=passed,
        figures={"free_bytes_when_full": free_bytes, "small_statuses": statuses, "large_status": large.status_code,
                 "large_code": large_code, "large_message": large.text[:200], "after_freeing": after.status_code})
