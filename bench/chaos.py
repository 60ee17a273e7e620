"""The chaos suite: faults an operator meets, each under steady load, with every answer counted.

    make chaos [SOAK_S=600]      # = python -m bench.chaos --soak-s 60 (about 6 minutes on 2 cores)

One server serves the digits model (/predict, PNG/JPEG digits) and ResNet-50 (/predict, 640x480
photos), both ONNX, plus two stand-ins: `flaky` (raises on negative inputs) and `leaky` (leaks
16 MiB per batch, `memory_limit_bytes` 1 GiB). First each real model's saturation is measured alone
(closed loop, 16 clients); then every scenario runs with open-loop Poisson load on both at once,
each at 30% of its own saturation (together about 60% of the machine; the soak 35% each, 70%
together; the overload 250% each, 5x the machine), with deadlines (digits 2 s, ResNet-50 8 s):

    kill-9             SIGKILL of both models' workers
    sigstop-10s        SIGSTOP of both workers, SIGCONT 10 s later (hung-worker detection)
    kill-9-ingress     SIGKILL of one ingress process of the split server (bench/chaos_split.py):
                       the others serve, it is restarted; its in-flight requests' connection errors
                       are counted apart ("conn error (in flight on the killed process)"), not lost
    kill-9-engine      SIGKILL of the engine process: 503 engine_unavailable from every ingress at
                       once, /healthz not ready, a new engine, models ready again; nothing hangs
    hanging-load       a model whose load never finishes is loaded (refused at --load-timeout-s)
    raising-model      load on `flaky`, every fourth request negative (500 model_error for those)
    memory-pressure    stress-ng --vm holding 75% of MemAvailable (written first, then 15 s measured)
    memory-limit       load on `leaky`: it passes memory_limit_bytes and is recycled, again and again
    overload-5x        30 s at 5x saturation
    soak               --soak-s at 70% of saturation: RSS and open fds of every process, /dev/shm
    sigterm-frontend   SIGTERM to the server's pid (a split server's supervisor) under load (drain, exit,
                       segments)
  on a second server, in its own process group, tracing every request to an OTLP endpoint:
    otlp-unreachable   nothing listens on the collector's port
    otlp-blackholed    a collector that accepts connections and never answers
    sigterm-group      SIGTERM to the whole process group under load, the collector still black-holed

Every answer is sorted: 200; a documented refusal (503 with its code; 4xx); `500 model_error`
(expected only for flaky's negative inputs); `refused` (connection refused: never accepted, only
while the server is going away); `lost` (accepted, never answered: reset, client timeout of 30 s, or
still open at the end). The table shows per scenario and model the answers, lost and unexpected
ones, the seconds from the fault to the first refusal and to the model serving again with a new
worker, and the p99 of the 200s. JSON: bench/results/chaos.json.

Targets (issue 12): nothing but 200, documented 4xx and 503; no accepted request lost; ready again
within 5 s of a worker fault; RSS growth under 2% over the soak; no leaked segment.

Every process is started here and stopped by its pid (or its group, which it leads); traffic goes
to 127.0.0.1 only; every load step ends by itself. Do not run it beside other benchmarks
(`flock /tmp/servewell-bench.lock make chaos`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.processes import ENGINE, HOST, INGRESS, ServerProcess, free_port, run_module, stop_process, tree_roles
from bench.workspace import RESULTS, link_build, write_model_yaml
from servewell.perf import loop as load_loop
from servewell.perf.httpclient import encode_request, fetch
from servewell.perf.loop import LoadShape, Recorder
from servewell.perf.oip_http import HttpOipConnection, error_code

WORK = RESULTS / "work" / "chaos"
SHM = Path("/dev/shm")
EXAMPLE_IMAGES = Path(__file__).resolve().parents[1] / "src" / "servewell" / "examples" / "images"
LOAD_TIMEOUT_S = 15
CLIENT_TIMEOUT_S = 30.0
#: Per model: the deadline sent as X-Request-Timeout-Ms.
DEADLINE_MS = {"digits": 2000, "resnet50": 8000}
STEADY, SOAK, OVERLOAD = 0.30, 0.35, 2.5  # of each model's own saturation (both models load the machine)
REFUSALS = {"overloaded", "deadline_exceeded", "worker_lost", "worker_hung", "model_not_ready", "shutting_down",
            "unavailable", "engine_unavailable"}
#: Label of a connection error that `tally` excuses: a request in flight on an ingress process
#: killed on purpose (its connection dies with it); not "lost", counted apart.
KILLED_IN_FLIGHT = "conn error (in flight on the killed process)"
#: Flags every server of the suite gets (--ingress-processes).
SERVER_FLAGS: list[str] = []
TELEMETRY_SCENARIOS = ("otlp-unreachable", "otlp-blackholed", "sigterm-group")
SCENARIOS = ("kill-9", "sigstop-10s", "kill-9-ingress", "kill-9-engine", "hanging-load", "raising-model",
             "memory-pressure", "memory-limit", "overload-5x", "soak", "sigterm-frontend", *TELEMETRY_SCENARIOS)


# -- requests -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Source:
    """Pre-encoded requests of one model, sent in turn; `kind` labels them (poison or not)."""

    model: str
    requests: list[tuple[str, bytes]]
    _next: int = 0

    def next(self) -> tuple[str, bytes]:
        self._next += 1
        return self.requests[self._next % len(self.requests)]


def predict_source(port: int, model: str, images: list[Path]) -> Source:
    headers = {"X-Request-Timeout-Ms": str(DEADLINE_MS[model])}
    host = f"{HOST}:{port}"
    requests = []
    for image in images:
        body = orjson.dumps({"model": model, "image_base64": base64.b64encode(image.read_bytes()).decode()})
        requests.append((model, encode_request("POST", host, "/predict", body, headers)))
    return Source(model, requests)


def scalar_source(port: int, model: str, poison_every: int = 0) -> Source:
    """OIP requests of one FP32 value; every `poison_every`-th is negative (kind `poison`)."""
    host = f"{HOST}:{port}"
    requests = []
    for i in range(max(poison_every, 4)):
        poison = poison_every > 0 and i % poison_every == 0
        value = -1.0 - i if poison else 1.0 + i
        body = orjson.dumps({"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [value]}]})
        raw = encode_request("POST", host, f"/v2/models/{model}/infer", body, {"X-Request-Timeout-Ms": "5000"})
        requests.append(("poison" if poison else model, raw))
    return Source(model, requests)


# -- observing the server -------------------------------------------------------------------------


async def get_json(port: int, path: str, timeout_s: float = 5.0) -> tuple[int, Any]:
    response = await fetch(HOST, port, "GET", path, timeout_s=timeout_s)
    return response.status, orjson.loads(response.body) if response.body else None


@dataclass(slots=True)
class Sample:
    at: float
    status: int  # of /healthz; 0 when it did not answer
    doc: dict[str, Any] | None


@dataclass(slots=True)
class HealthWatch:
    """/healthz ten times a second, on the load's event loop (its clock is the loop's)."""

    port: int
    samples: list[Sample] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            try:
                status, doc = await get_json(self.port, "/healthz", 2.0)
            except Exception:  # the server not answering is what this records
                status, doc = 0, None
            self.samples.append(Sample(loop.time(), status, doc))
            await asyncio.sleep(0.1)

    def model(self, sample: Sample, name: str) -> dict[str, Any] | None:
        # a refusal (503 engine_unavailable from an ingress while the engine is down) has no models
        models = sample.doc.get("models") if isinstance(sample.doc, dict) else None
        return None if not isinstance(models, dict) else models.get(name)

    def recovery(self, name: str, t0: float, victims: set[int]) -> dict[str, float | None]:
        """Seconds from `t0` until the model left `ready`, and until it was ready on new workers."""
        left = back = None
        for sample in self.samples:
            if sample.at < t0:
                continue
            entry = self.model(sample, name)
            if left is None and (entry is None or entry["state"] != "ready"):
                left = sample.at - t0
            if (entry is not None and entry["state"] == "ready" and entry["instances"]
                    and all(i["alive"] and i["pid"] not in victims for i in entry["instances"])):
                back = sample.at - t0
                break
        return {"not_ready_after_s": left, "ready_again_after_s": back}

    def unready_s(self, t0: float) -> float:
        """Seconds after `t0` in which /healthz did not answer 200 (the server out of rotation)."""
        later = [s for s in self.samples if s.at >= t0]
        return sum(b.at - a.at for a, b in zip(later, later[1:], strict=False) if a.status != 200)


def pids_of(health: dict[str, Any], name: str) -> list[int]:
    return [int(i["pid"]) for i in health["models"][name]["instances"] if i["pid"]]


def process_facts(pid: int) -> dict[str, int] | None:
    """RSS (bytes) and open file descriptors of a process; None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    rss = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
    return {"rss_bytes": rss, "fds": fds}


def segments(owners: Iterable[int]) -> dict[str, int]:
    """Shared-memory segments named after any of `owners` (the process that owns the worker pools:
    a single-process server, or the engine process of a split one)."""
    found = [p for pid in set(owners) for p in SHM.glob(f"servewell-{pid}-*")]
    return {"count": len(found), "bytes": sum(p.stat().st_size for p in found if p.exists())}


def owners(root: int) -> list[int]:
    """The pids whose names the server's segments carry: the root, and a split server's engine and
    ingress processes (the ingress processes hold their requests' large tensors)."""
    roles = tree_roles(root)
    return [root, *(pid for role, pids in roles.items() if role == ENGINE or role.startswith(INGRESS) for pid in pids)]


# -- answers --------------------------------------------------------------------------------------


def label(outcome: load_loop.Outcome) -> str:
    if outcome.ok:
        return "200"
    if outcome.status == "client":
        refused = outcome.code in ("client:ConnectionRefusedError", "client:ConnectionRefused")
        return "refused" if refused else f"lost ({outcome.code})"
    if outcome.status == "timeout":
        return "lost (client timeout)"
    return f"{outcome.status} {outcome.code}"


def expected(text: str, kind: str, refused_ok: bool) -> bool:
    if text == "200" or text.startswith("4"):
        return True
    status, _, code = text.partition(" ")
    if status == "503" and code in REFUSALS:
        return True
    if text == "500 model_error" and kind == "poison":
        return True
    return text == "refused" and refused_ok


def tally(recorder: Recorder, t0: float, refused_ok: bool = False,
          excused: Callable[[load_loop.Outcome], bool] | None = None) -> dict[str, Any]:
    """Answers of one model's load: counts, lost, unexpected, first refusal after t0, p99 of 200s.
    A connection error for which `excused` says yes is counted as `KILLED_IN_FLIGHT`, not lost."""
    counts: Counter[str] = Counter()
    unexpected: Counter[str] = Counter()
    first_refusal = None
    for o in recorder.outcomes:
        text = label(o)
        if excused is not None and text.startswith("lost") and excused(o):
            counts[KILLED_IN_FLIGHT] += 1
            continue
        counts[text if o.kind != "poison" else f"{text} (negative input)"] += 1
        if not expected(text, o.kind, refused_ok):
            unexpected[text] += 1
        if not o.ok and o.done >= t0 and (first_refusal is None or o.done - t0 < first_refusal):
            first_refusal = o.done - t0
    unfinished = recorder.sent - len(recorder.outcomes)
    if unfinished:
        counts["lost (unanswered at the end)"] += unfinished
        unexpected["lost (unanswered at the end)"] += unfinished
    ok_ms = sorted(o.latency_ms for o in recorder.outcomes if o.ok)
    lost = sum(n for text, n in counts.items() if text.startswith("lost"))
    return {
        "sent": recorder.sent, "client_saturated": recorder.client_saturated,
        "answers": dict(counts.most_common()), "lost": lost, "unexpected": sum(unexpected.values()),
        "unexpected_answers": dict(unexpected),
        "first_refusal_after_s": None if first_refusal is None else round(first_refusal, 3),
        "p50_ok_ms": round(statistics.median(ok_ms), 1) if ok_ms else None,
        "p99_ok_ms": round(ok_ms[min(len(ok_ms) - 1, int(len(ok_ms) * 0.99))], 1) if ok_ms else None,
    }


# -- load -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class Load:
    source: Source
    rate: float


Fault = Callable[[], Awaitable[dict[str, Any]]]


@dataclass(slots=True)
class Run:
    recorders: dict[str, Recorder]
    watch: HealthWatch
    t0: float
    fault: dict[str, Any]


async def under_load(port: int, loads: list[Load], duration_s: float, fault: Fault | None = None,
                     fault_at_s: float = 3.0, seed: int = 1) -> Run:
    """Open-loop load on every model for `duration_s`; `fault` runs `fault_at_s` in (t0)."""
    loop = asyncio.get_running_loop()
    watch = HealthWatch(port)
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch.run(stop))
    runs = {}
    for i, load in enumerate(loads):
        shape = LoadShape("open", rate=load.rate, duration_s=duration_s, warmup_s=0.0, timeout_s=CLIENT_TIMEOUT_S,
                          grace_s=CLIENT_TIMEOUT_S + 2, max_connections=256, seed=seed + i)
        runs[load.source.model] = asyncio.create_task(
            load_loop.run_load(shape, lambda: HttpOipConnection(HOST, port), load.source))
    await asyncio.sleep(fault_at_s)
    t0 = loop.time()
    result = await fault() if fault is not None else {}
    recorders = {name: await task for name, task in runs.items()}
    stop.set()
    await watcher
    return Run(recorders, watch, t0, result)


async def saturation(port: int, source: Source, seconds: float = 6.0) -> float:
    """Answers per second of a closed loop of 16 clients (after 1 s of warm-up)."""
    shape = LoadShape("closed", concurrency=16, duration_s=seconds, warmup_s=1.0, timeout_s=CLIENT_TIMEOUT_S)
    recorder = await load_loop.run_load(shape, lambda: HttpOipConnection(HOST, port), source)
    ok = sum(1 for o in recorder.outcomes if o.ok and recorder.in_window(o.done))
    return ok / (recorder.window_end - recorder.window_start)


# -- the suite ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Suite:
    work: Path
    soak_s: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    saturation: dict[str, float] = field(default_factory=dict)
    sources: dict[str, Source] = field(default_factory=dict)
    only: set[str] | None = None  # --only: these scenarios and no others

    def wants(self, scenario: str) -> bool:
        return self.only is None or scenario in self.only

    def log(self, message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    def steady(self, fraction: float = STEADY) -> list[Load]:
        return [Load(self.sources[m], max(0.5, fraction * self.saturation[m])) for m in ("digits", "resnet50")]

    def record(self, scenario: str, run: Run, facts: dict[str, Any] | None = None, refused_ok: bool = False,
               victims: dict[str, set[int]] | None = None,
               excused: Callable[[load_loop.Outcome], bool] | None = None) -> None:
        for model, recorder in run.recorders.items():
            row: dict[str, Any] = {"scenario": scenario, "model": model,
                                   **tally(recorder, run.t0, refused_ok, excused)}
            if victims and model in victims:
                row.update(run.watch.recovery(model, run.t0, victims[model]))
            self.rows.append(row)
        if self.rows:
            self.rows[-len(run.recorders)]["facts"] = {"server_unready_s": round(run.watch.unready_s(run.t0), 2),
                                                       **run.fault, **(facts or {})}
        last = self.rows[-len(run.recorders):]
        self.log(f"  {scenario}: " + "; ".join(f"{r['model']} {r['answers']}" for r in last)
                 + f"; {last[0]['facts']}")


def repository(work: Path) -> Path:
    """The served repository: the example builds linked, ResNet-50's max batch 8, flaky and leaky."""
    repo = work / "repo"
    if repo.exists():
        shutil.rmtree(repo)
    for name in ("digits", "resnet50"):
        config = link_build(work / "build" / name, repo / name)
        if name == "resnet50":
            config["max_batch_size"] = 8  # a batch of 32 takes seconds on 2 cores
        write_model_yaml(repo / name, config)
    for name in ("flaky", "leaky"):
        shutil.copytree(work / name, repo / name)
    return repo


def start_server(name: str, repo: Path, extra: list[str], new_session: bool = False,
                 env: dict[str, str] | None = None) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "servewell", "serve", "--host", HOST, "--port", str(port), "--grpc-port", "0",
            "--model-repository", str(repo), "--config-poll-s", "0", "--load-timeout-s", str(LOAD_TIMEOUT_S),
            "--shutdown-delay-s", "1", "--cache-dir", str(WORK / "cache"), *SERVER_FLAGS, *extra]
    log_path = WORK / f"{name}.log"
    log_path.unlink(missing_ok=True)
    server = ServerProcess(name, argv, port, log_path, new_session=new_session, env=env)
    server.start()
    server.wait_ready(300)
    return server


async def health(port: int) -> dict[str, Any]:
    _, doc = await get_json(port, "/healthz", 10.0)
    assert isinstance(doc, dict)
    return doc


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


async def worker_signal_scenario(suite: Suite, port: int, name: str, sig: signal.Signals, hold_s: float = 0.0,
                                 duration_s: float = 15.0) -> None:
    doc = await health(port)
    victims = {m: set(pids_of(doc, m)) for m in ("digits", "resnet50")}
    everyone = [p for pids in victims.values() for p in pids]

    async def fault() -> dict[str, Any]:
        signal_all(everyone, sig)
        if hold_s:
            await asyncio.sleep(hold_s)
            signal_all(everyone, signal.SIGCONT)  # those not killed as hung by then carry on
        return {}

    run = await under_load(port, suite.steady(), duration_s, fault)
    suite.record(name, run, victims=victims)


async def hanging_load(suite: Suite, server: ServerProcess, repo: Path) -> None:
    port = server.port

    async def fault() -> dict[str, Any]:
        shutil.copytree(suite.work / "hanging", repo / "hanging", dirs_exist_ok=True)
        started = time.monotonic()
        response = await fetch(HOST, port, "POST", "/v2/repository/models/hanging/load", timeout_s=120.0)
        took = time.monotonic() - started
        code = error_code(response.body) if response.body else None
        return {"load_answer": f"{response.status} {code or ''}".strip(), "load_answer_after_s": round(took, 2)}

    run = await under_load(port, suite.steady(), LOAD_TIMEOUT_S + 8.0, fault, fault_at_s=2.0)
    doc = await health(port)
    state = doc["models"].get("hanging", {})
    suite.record("hanging-load", run, {"hanging_state": state.get("state"), "hanging_reason": state.get("reason")})
    await fetch(HOST, port, "POST", "/v2/repository/models/hanging/unload", timeout_s=30.0)


async def raising_model(suite: Suite, port: int) -> None:
    loads = [*suite.steady(), Load(scalar_source(port, "flaky", poison_every=4), 40.0)]
    run = await under_load(port, loads, 12.0, fault_at_s=0.0)
    suite.record("raising-model", run)


async def memory_limit(suite: Suite, port: int) -> None:
    before = (await health(port))["models"]["leaky"]
    loads = [*suite.steady(), Load(scalar_source(port, "leaky"), 20.0)]
    run = await under_load(port, loads, 15.0, fault_at_s=0.0)
    after = (await health(port))["models"]["leaky"]
    # /healthz counts a replacement for memory as a restart too (issue 47): the other causes apart.
    suite.record("memory-limit", run, {"leaky_recycles": after["recycles"] - before["recycles"],
                                       "leaky_restarts": (after["restarts"] - after["recycles"])
                                       - (before["restarts"] - before["recycles"])})


def mem_available() -> int:
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
    return int(line.split()[1]) * 1024


async def memory_pressure(suite: Suite, port: int) -> None:
    """stress-ng takes 75% of MemAvailable and holds it while the models serve. The memory is
    written first (on this VM, first-touched memory comes at ~0.3 GB/s, so filling takes up to a
    minute), then the models serve the steady load while it is held."""
    before = await health(port)
    available = mem_available()
    share = int(available * 0.75)
    log = open(WORK / "stress-ng.log", "wb")
    # --vm-populate maps it prefaulted, --vm-hang 0 holds it without rewriting (memory, not CPU).
    process = subprocess.Popen(
        ["stress-ng", "--vm", "1", "--vm-bytes", f"{share // 1024}k", "--vm-populate", "--vm-hang", "0",
         "--timeout", "150s"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        fill_started = time.monotonic()
        while time.monotonic() - fill_started < 85 and available - mem_available() < 0.95 * share:
            await asyncio.sleep(1.0)
        fill_s = time.monotonic() - fill_started
        held = available - mem_available()
        run = await under_load(port, suite.steady(), 15.0, fault_at_s=0.0)
        under_pressure = mem_available()
    finally:
        stop_process(process, 30.0)
        log.close()
    after = await health(port)
    restarts = {m: after["models"][m]["restarts"] - before["models"][m]["restarts"] for m in ("digits", "resnet50")}
    suite.record("memory-pressure", run, {
        "mem_available_before_gib": round(available / 2**30, 1), "held_by_stress_ng_gib": round(held / 2**30, 1),
        "fill_s": round(fill_s, 1), "mem_available_during_gib": round(under_pressure / 2**30, 1),
        "worker_restarts": restarts})


async def overload(suite: Suite, port: int) -> None:
    run = await under_load(port, suite.steady(OVERLOAD), 30.0, fault_at_s=0.0)
    sent = {m: round(r.sent / 30.0, 1) for m, r in run.recorders.items()}
    # Afterwards: is everything served normally again?
    after = await under_load(port, suite.steady(), 5.0, fault_at_s=0.0, seed=7)
    again = {m: tally(r, after.t0)["answers"] for m, r in after.recorders.items()}
    suite.record("overload-5x", run, {"offered_rps": {m: round(load.rate, 1) for m, load in
                                                      zip(("digits", "resnet50"), suite.steady(OVERLOAD), strict=True)},
                                      "sent_rps": sent, "next_5_s_at_30%": again})


def every_process(doc: dict[str, Any], frontend: int) -> dict[str, int]:
    """Every process of the server by name: the frontend (a split server's supervisor), a split
    server's engine and ingress processes, each model instance's worker."""
    pids = {"frontend": frontend}
    for role, found in tree_roles(frontend).items():
        if role == ENGINE or role.startswith(INGRESS):
            pids.update({role if len(found) == 1 else f"{role}#{i}": p for i, p in enumerate(found)})
    for name, model in doc["models"].items():
        for instance in model["instances"]:
            if instance["pid"] and instance["alive"]:
                pids[f"{name}#{instance['instance']}"] = int(instance["pid"])
    return pids


async def soak(suite: Suite, server: ServerProcess) -> None:
    port = server.port
    marks: dict[str, Any] = {}

    async def fault() -> dict[str, Any]:
        # Start figures after 10 s under load (allocators and caches warm); end figures at the end.
        marks["pids"] = every_process(await health(port), server.pid)
        marks["start"] = {k: process_facts(p) for k, p in marks["pids"].items()}
        marks["shm_start"] = segments(owners(server.pid))
        await asyncio.sleep(max(0.0, suite.soak_s - 10.5))
        marks["end"] = {k: process_facts(p) for k, p in marks["pids"].items()}
        marks["shm_end"] = segments(owners(server.pid))
        return {}

    run = await under_load(port, suite.steady(SOAK), suite.soak_s, fault, fault_at_s=10.0)
    growth = {}
    for key in marks["pids"]:
        start, end = marks["start"].get(key), marks["end"].get(key)
        if start and end:
            growth[key] = {"rss_start_mib": round(start["rss_bytes"] / 2**20, 1),
                           "rss_end_mib": round(end["rss_bytes"] / 2**20, 1),
                           "rss_growth_pct": round(100 * (end["rss_bytes"] / start["rss_bytes"] - 1), 2),
                           "fds_start": start["fds"], "fds_end": end["fds"]}
        else:
            growth[key] = {"replaced_during_soak": True}
    suite.record("soak", run, {"soak_s": suite.soak_s, "processes": growth, "shm_start": marks["shm_start"],
                               "shm_end": marks["shm_end"]})


async def stop_under_load(suite: Suite, server: ServerProcess, name: str, group: bool) -> None:
    frontend = server.pid
    doc = await health(server.port)
    workers = [p for k, p in every_process(doc, frontend).items() if k != "frontend"]  # and engine, ingress
    segment_owners = owners(frontend)
    loop = asyncio.get_running_loop()
    exit_facts: dict[str, Any] = {}
    log_from = server.log_path.stat().st_size

    async def fault() -> dict[str, Any]:
        if group:
            os.killpg(frontend, signal.SIGTERM)  # the server leads its group (start_new_session)
        else:
            os.kill(frontend, signal.SIGTERM)
        started = time.monotonic()
        code = await loop.run_in_executor(None, server.wait, 60.0)
        exit_facts.update(exit_code=code, exit_after_s=round(time.monotonic() - started, 2))
        return {}

    run = await under_load(server.port, suite.steady(), 10.0, fault, fault_at_s=3.0)
    left = [p for p in workers if process_facts(p) is not None]
    server.stop()  # closes the log; kills only if it did not exit
    with open(server.log_path, "rb") as f:
        f.seek(log_from)
        log = f.read().decode(errors="replace")  # what it printed from the signal on
    exit_facts.update(
        workers_left_running=len(left), leaked_segments=segments(segment_owners)["count"],
        resource_tracker_warnings=log.count("resource_tracker"),
        restarts_during_shutdown=sum(1 for line in log.splitlines() if "restarting" in line and "died" in line),
    )
    suite.record(name, run, exit_facts, refused_ok=True)


class BlackHole:
    """A collector that accepts connections and never reads or answers them."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((HOST, port))
        self.sock.listen(128)
        self.held: list[socket.socket] = []
        self.closed = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                connection, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(connection)

    def close(self) -> None:
        self.closed = True
        self.sock.close()
        for connection in self.held:
            connection.close()


async def telemetry_server(suite: Suite, repo: Path) -> None:
    collector_port = free_port()
    server = start_server("otlp", repo, ["--otlp-endpoint", f"http://{HOST}:{collector_port}",
                                          "--trace-sample-ratio", "1.0"], new_session=True)
    hole: BlackHole | None = None
    try:
        suite.sources = {m: predict_source(server.port, m, images) for m, images in suite_images(suite).items()}
        run = await under_load(server.port, suite.steady(), 12.0, fault_at_s=0.0)
        suite.record("otlp-unreachable", run)
        hole = BlackHole(collector_port)
        run = await under_load(server.port, suite.steady(), 12.0, fault_at_s=0.0)
        suite.record("otlp-blackholed", run, {"collector_connections_held": len(hole.held)})
        await stop_under_load(suite, server, "sigterm-group", group=True)
    finally:
        server.stop()
        if hole is not None:
            hole.close()


def suite_images(suite: Suite) -> dict[str, list[Path]]:
    photos = sorted((suite.work / "images").glob("photo_*.jpg"))
    digits = sorted(p for p in EXAMPLE_IMAGES.iterdir() if p.suffix in (".png", ".jpg"))
    return {"digits": digits, "resnet50": photos}


async def main_server(suite: Suite, repo: Path) -> None:
    server = start_server("main", repo, [])
    try:
        suite.sources = {m: predict_source(server.port, m, images) for m, images in suite_images(suite).items()}
        for model in ("digits", "resnet50"):
            suite.saturation[model] = round(await saturation(server.port, suite.sources[model]), 2)
        suite.log(f"saturation alone (closed loop, 16 clients): {suite.saturation} answers/s")
        from bench.chaos_split import kill_engine, kill_ingress  # it builds on this module

        port = server.port
        scenarios: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("kill-9", lambda: worker_signal_scenario(suite, port, "kill-9", signal.SIGKILL)),
            ("sigstop-10s", lambda: worker_signal_scenario(suite, port, "sigstop-10s", signal.SIGSTOP, hold_s=10.0,
                                                           duration_s=20.0)),
            ("kill-9-ingress", lambda: kill_ingress(suite, server)),
            # before hanging-load: a new engine loads the whole repository
            ("kill-9-engine", lambda: kill_engine(suite, server)),
            ("hanging-load", lambda: hanging_load(suite, server, repo)),
            ("raising-model", lambda: raising_model(suite, port)),
            ("memory-pressure", lambda: memory_pressure(suite, port)),
            ("memory-limit", lambda: memory_limit(suite, port)),
            ("overload-5x", lambda: overload(suite, port)),
            ("soak", lambda: soak(suite, server)),
            ("sigterm-frontend", lambda: stop_under_load(suite, server, "sigterm-frontend", group=False)),
        ]
        for name, scenario in scenarios:
            if suite.wants(name):
                await scenario()
    finally:
        server.stop()


# -- report ---------------------------------------------------------------------------------------


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def brief(answers: dict[str, int]) -> str:
    ok = answers.get("200", 0)
    refused = sum(n for k, n in answers.items() if k.startswith("503"))
    other = {k: n for k, n in answers.items() if k != "200" and not k.startswith("503")}
    text = f"{ok} ok, {refused} 503"
    return text + ("; " + ", ".join(f"{n} {k}" for k, n in other.items()) if other else "")


def print_table(report: dict[str, Any]) -> None:
    header = (f"{'scenario':<17} {'model':<9} {'answers':<48} {'lost':>4} {'unexp':>5} {'1st 503':>7} "
              f"{'ready':>6} {'p99 ok':>8}")
    print(header)
    print("-" * len(header))
    for row in report["rows"]:
        print(f"{row['scenario']:<17} {row['model']:<9} {brief(row['answers'])[:48]:<48} {row['lost']:>4} "
              f"{row['unexpected']:>5} {seconds(row['first_refusal_after_s']):>7} "
              f"{seconds(row.get('ready_again_after_s')):>6} "
              f"{'-' if row['p99_ok_ms'] is None else str(round(row['p99_ok_ms'])) + ' ms':>8}")
    print("\nfacts per scenario:")
    for row in report["rows"]:
        if "facts" in row:
            print(f"  {row['scenario']}: {json.dumps(row['facts'])}")
    print(f"\ntargets: {json.dumps(report['targets'])}")


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    recoveries = [r["ready_again_after_s"] for r in rows if r.get("ready_again_after_s") is not None]
    soak: dict[str, Any] = next((r["facts"] for r in rows if r["scenario"] == "soak" and "facts" in r), {})
    growth = [p["rss_growth_pct"] for p in soak.get("processes", {}).values() if "rss_growth_pct" in p]
    leaked = sum(r["facts"].get("leaked_segments", 0) for r in rows if "facts" in r)
    facts = {r["scenario"]: r["facts"] for r in rows if "facts" in r}
    return {
        "ingress_restarted_after_s": facts.get("kill-9-ingress", {}).get("restarted_after_s"),
        "ingress_accepts_after_s": facts.get("kill-9-ingress", {}).get("accepts_after_s"),
        "killed_ingress_in_flight_conn_errors": sum(r["answers"].get(KILLED_IN_FLIGHT, 0) for r in rows),
        "engine_ready_again_after_s": facts.get("kill-9-engine", {}).get("healthz_ready_again_after_s"),
        "unexpected_answers": sum(r["unexpected"] for r in rows),
        "lost": sum(r["lost"] for r in rows),
        "slowest_recovery_s": max(recoveries) if recoveries else None,
        "max_rss_growth_pct_over_soak": max(growth) if growth else None,
        "leaked_segments": leaked,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--soak-s", type=float, default=60.0, help="length of the soak (issue 12 asks for 600)")
    parser.add_argument("--out", type=Path, default=RESULTS / "chaos.json")
    parser.add_argument("--ingress-processes", type=int, default=None,
                        help="passed to every server (default: the server's default; 0: the single-process server)")
    parser.add_argument("--only", default=None, metavar="NAMES",
                        help="run only these scenarios (comma-separated names, as in the table), for developing")
    args = parser.parse_args(argv)
    only = None if args.only is None else {s.strip() for s in args.only.split(",") if s.strip()}
    if only is not None and not only <= set(SCENARIOS):
        parser.error(f"--only: unknown scenario(s) {sorted(only - set(SCENARIOS))}; known: {', '.join(SCENARIOS)}")
    if args.soak_s < 20:
        parser.error("--soak-s must be at least 20")
    if shutil.which("stress-ng") is None:
        parser.error("stress-ng is not installed (make test-deps installs it)")
    WORK.mkdir(parents=True, exist_ok=True)
    if args.ingress_processes is not None:
        SERVER_FLAGS[:] = ["--ingress-processes", str(args.ingress_processes)]
    suite = Suite(WORK, args.soak_s, only=only)
    started = time.monotonic()
    suite.log("building the models (cached after the first run)")
    run_module("bench.chaos_models", ["--work", str(WORK)], timeout_s=1800, log_path=WORK / "build.log")
    from bench.models import build_images  # numpy and PIL only

    build_images(WORK / "images")
    repo = repository(WORK)
    asyncio.run(main_server(suite, repo))
    repo = repository(WORK)  # without the hanging model
    if any(suite.wants(s) for s in TELEMETRY_SCENARIOS):
        asyncio.run(telemetry_server(suite, repo))
    report = {"saturation_rps": suite.saturation, "soak_s": args.soak_s, "rows": suite.rows,
              "targets": targets(suite.rows), "elapsed_s": round(time.monotonic() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print()
    print_table(report)
    print(f"\n{report['elapsed_s']:.0f} s; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
