"""Pipelines (issue 23): one call through a 3-step pipeline against the client calling the three
models itself, and a pipeline at saturation against its slowest step alone.

    flock /tmp/servewell-bench.lock .venv/bin/python -m bench.pipeline [--rounds 3] [--requests 400] [--seconds 10]

One server (`servewell serve`, the split as in production) serves, all CPU, one instance each:

* `pre` (python runtime: scale and shift 64 values), `post` (python runtime: softmax of 10);
* `mid_light`, an ONNX MLP 64 -> 256 -> 10 (tens of microseconds a row): the steps are cheap, so
  what a pipeline saves (round trips, serialisation) and adds (hops between processes) shows;
* `mid_heavy`, an ONNX MLP 64 -> 4096 -> 4096 -> 10 (about 1.4 ms a row, max batch 32), and
  `mid_heavier` (four 4096 layers, about 4x that): the slowest step by far, for the saturation
  goal. On this machine every step shares the same 2 cores, so the CPU a pipeline adds per
  request (the engine's work per step, the python workers' batches) comes out of the slowest
  step's share: the ratio depends on how heavy that step is, hence two weights;
* `chain_light`, `chain_heavy` and `chain_heavier`: pre -> that middle model -> post.

Per round, in alternating order:

* low load (one client, `--requests` sequential requests, the first 20 not measured), with this
  module's raw keep-alive HTTP/1.1 client and JSON bodies: `client3` (the client calls pre,
  mid_light and post itself, decoding each answer and sending it on), `pipeline` (one call to
  chain_light) and `mid` (mid_light alone), each alone for the server CPU per chain (the whole
  server tree's, /proc, over the phase divided by the chains completed), then the three taking
  turns chain by chain for the latency figures: this machine's latency drifts by tens of percent
  from one phase to the next (the same code measured 0.41 and 0.61 ms per step in two runs of
  separate phases), and taking turns gives each kind the same machine;
* saturation: each chain_heavy* and its middle model alone in closed loops of `--clients` clients
  (32, 64 and 128 by default; `--seconds` each), its saturation throughput the best of them, with
  the server's CPU per request by process (a worker by its model's name) at that best level. One
  fixed concurrency is not saturation for both: at 32 clients the middle model alone still gains
  about a third at 64, and a pipeline, whose requests spend part of their time in its other
  steps, needs more requests in flight to fill the middle model's batches as fully.

`--other-src DIR` (another checkout's src/) serves the same repository from that code too; every
round measures both servers, in alternating order, and the table compares them.

Goals (medians over the rounds): pipeline p50 <= 0.5x client3's, server CPU per chain lower than
client3's, (pipeline p50 - mid p50) / 2 <= 0.3 ms (two steps added to the middle model); each
chain_heavy* throughput >= 0.9x its middle model's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import yaml

from bench.processes import ServerProcess, TreeCpu, free_port, oip_load
from bench.report import finish_rounds, median_over
from bench.workspace import RESULTS, WORK
from servewell.perf.httpclient import HttpConnection, encode_request
from servewell.perf.loop import LoadShape
from servewell.perf.stats import summarize_ms

WIDTH, CLASSES = 64, 10
GOAL_LATENCY_RATIO = 0.5
GOAL_ADDED_MS_PER_STEP = 0.3
GOAL_SATURATION_RATIO = 0.9
WARMUP_REQUESTS = 20
LOW_LOAD = ("client3", "pipeline", "mid")

PRE = textwrap.dedent('''
    import numpy as np


    class Pre:
        def execute(self, inputs):
            return {"x": (inputs["raw"] * 0.5 + 0.25).astype(np.float32)}
''')
POST = textwrap.dedent('''
    import numpy as np


    class Post:
        def execute(self, inputs):
            z = inputs["logits"] - inputs["logits"].max(axis=-1, keepdims=True)
            e = np.exp(z)
            return {"probabilities": (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)}
''')


def _tensor(name: str, size: int) -> dict[str, Any]:
    return {"name": name, "datatype": "FP32", "shape": [size]}


def build_repository(root: Path) -> Path:
    """pre, post, mid_light, mid_heavy and the two chains."""
    import torch

    repository = root / "repository"
    for name, source, entry, given, made in (("pre", PRE, "Pre", _tensor("raw", WIDTH), _tensor("x", WIDTH)),
                                             ("post", POST, "Post", _tensor("logits", CLASSES),
                                              _tensor("probabilities", CLASSES))):
        directory = repository / name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{name}.py").write_text(source)
        (directory / "model.yaml").write_text(yaml.safe_dump({
            "runtime": "python", "artifact": f"{name}.py", "python": {"entry": f"{name}:{entry}"},
            "max_batch_size": 32, "inputs": [given], "outputs": [made]}))
    for name, hidden in (("mid_light", (256,)), ("mid_heavy", (4096, 4096)), ("mid_heavier", (4096,) * 4)):
        directory = repository / name
        directory.mkdir(parents=True, exist_ok=True)
        if not (directory / "model.onnx").exists():
            torch.manual_seed(23)
            sizes = (WIDTH, *hidden)
            layers: list[torch.nn.Module] = []
            for a, b in zip(sizes, sizes[1:], strict=False):
                layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
            net = torch.nn.Sequential(*layers, torch.nn.Linear(sizes[-1], CLASSES))
            torch.onnx.export(net, (torch.zeros(2, WIDTH),), str(directory / "model.onnx"), dynamo=False,
                              input_names=["x"], output_names=["logits"],
                              dynamic_axes={"x": {0: "b"}, "logits": {0: "b"}})
        (directory / "model.yaml").write_text(yaml.safe_dump({
            "runtime": "onnx", "artifact": "model.onnx", "max_batch_size": 32, "threads": 1,
            "inputs": [_tensor("x", WIDTH)], "outputs": [_tensor("logits", CLASSES)]}))
    for chain, mid in (("chain_light", "mid_light"), ("chain_heavy", "mid_heavy"), ("chain_heavier", "mid_heavier")):
        directory = repository / chain
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "model.yaml").write_text(yaml.safe_dump({
            "kind": "pipeline", "max_batch_size": 32, "inputs": [_tensor("raw", WIDTH)],
            "outputs": [_tensor("probabilities", CLASSES)],
            "pipeline": {"steps": [{"name": "pre", "model": "pre", "inputs": {"raw": "raw"}},
                                   {"name": "mid", "model": mid, "inputs": {"x": "pre.x"}},
                                   {"name": "post", "model": "post", "inputs": {"logits": "mid.logits"}}],
                         "outputs": {"probabilities": "post.probabilities"}}}))
    return repository


def _request(host: str, model: str, name: str, values: list[float]) -> bytes:
    body = orjson.dumps({"inputs": [{"name": name, "shape": [1, len(values)], "datatype": "FP32", "data": values}]})
    return encode_request("POST", host, f"/v2/models/{model}/infer", body)


def _first_output(body: bytes) -> list[float]:
    data: list[float] = orjson.loads(body)["outputs"][0]["data"]
    return data


async def _one(connection: HttpConnection, host: str, kind: str, raw: list[float]) -> None:
    """One chain of `kind`: the client calling pre, mid_light and post itself (client3), one call
    to chain_light (pipeline), or mid_light alone (mid)."""
    if kind == "client3":
        x = _first_output((await connection.request(_request(host, "pre", "raw", raw))).body)
        logits = _first_output((await connection.request(_request(host, "mid_light", "x", x))).body)
        reply = await connection.request(_request(host, "post", "logits", logits))
    elif kind == "pipeline":
        reply = await connection.request(_request(host, "chain_light", "raw", raw))
    else:
        reply = await connection.request(_request(host, "mid_light", "x", raw))
    _first_output(reply.body)
    if reply.status != 200:
        raise RuntimeError(f"{kind}: HTTP {reply.status}: {reply.body[:200]!r}")


async def _sequential(port: int, kinds: tuple[str, ...], requests: int,
                      rng: np.random.Generator) -> dict[str, list[float]]:
    """Latencies (ms) of `requests` chains of each of `kinds` from one client, the kinds taking
    turns chain by chain (so each sees the machine as the others do: this machine's latency drifts
    by tens of percent within seconds, which separate phases would read as a difference)."""
    host = f"127.0.0.1:{port}"
    connection = HttpConnection("127.0.0.1", port)
    latencies: dict[str, list[float]] = {kind: [] for kind in kinds}
    try:
        for i in range(requests):
            raw = rng.random(WIDTH, dtype=np.float32).tolist()
            for k in range(len(kinds)):
                kind = kinds[(i + k) % len(kinds)]
                started = time.perf_counter()
                await _one(connection, host, kind, raw)
                if i >= WARMUP_REQUESTS:
                    latencies[kind].append((time.perf_counter() - started) * 1000)
    finally:
        connection.close()
    return latencies


def low_load(server: ServerProcess, kind: str, requests: int, seed: int) -> dict[str, Any]:
    """One client, sequential, `kind` alone: latency and the server tree's CPU per chain."""
    meter = TreeCpu(server.pid).start()
    latencies = asyncio.run(_sequential(server.port, (kind,), requests, np.random.default_rng(seed)))[kind]
    spent = meter.stop()
    return {"latency_ms": summarize_ms(latencies), "cpu_us_per_chain": 1e6 * sum(spent.values()) / requests}


def low_load_taking_turns(server: ServerProcess, requests: int, seed: int) -> dict[str, Any]:
    """One client, sequential, the three kinds taking turns chain by chain: latency of each."""
    latencies = asyncio.run(_sequential(server.port, LOW_LOAD, requests, np.random.default_rng(seed)))
    return {kind: summarize_ms(values) for kind, values in latencies.items()}


def _worker_models(port: int) -> dict[int, str]:
    """pid -> model name of every worker, from /healthz."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as reply:
        health = json.loads(reply.read())
    return {i["pid"]: name for name, model in health["models"].items() for i in model.get("instances", [])
            if i.get("pid")}


def saturation(server: ServerProcess, model: str, clients: int, seconds: float) -> dict[str, Any]:
    """Closed loop at `clients`: answered per second and latency."""
    name = "raw" if model.startswith("chain") else "x"
    payload = _request(f"127.0.0.1:{server.port}", model, name, np.linspace(0, 1, WIDTH, dtype=np.float32).tolist())
    shape = LoadShape("closed", concurrency=clients, duration_s=seconds, warmup_s=min(2.0, seconds / 2), grace_s=15,
                      max_requests=1_000_000)
    meter = TreeCpu(server.pid).start()
    recorder, figures = oip_load(server.port, payload, shape)
    meter.stop()
    cpu: dict[str, float] = {}
    workers = _worker_models(server.port)
    for key, seconds in meter.processes.items():  # role:pid; a model worker by its model's name
        role, _, pid = key.rpartition(":")
        label = workers.get(int(pid), role) if pid.isdigit() else role
        cpu[label] = cpu.get(label, 0.0) + seconds
    return {**figures, "cpu_us_per_request": {role: round(1e6 * seconds / max(1, len(recorder.outcomes)))
                                   for role, seconds in sorted(cpu.items())}}


def saturation_peak(server: ServerProcess, model: str, levels: list[int], seconds: float) -> dict[str, Any]:
    """`saturation` at each client count in `levels`: the best level's figures, and every level's ok/s."""
    runs = {clients: saturation(server, model, clients, seconds) for clients in levels}
    best = max(levels, key=lambda clients: runs[clients]["ok_per_s"])
    return {**runs[best], "clients": best, "ok_per_s_by_clients": {str(c): runs[c]["ok_per_s"] for c in levels}}


def start_server(name: str, repository: Path, src: Path | None = None) -> ServerProcess:
    """`servewell serve` on the repository, from this checkout or from `src` (another one's src/)."""
    port = free_port()
    env = {"SERVEWELL_GRPC_PORT": "0"}
    if src is not None:
        env["PYTHONPATH"] = str(src.resolve())
    server = ServerProcess(name, [sys.executable, "-m", "servewell", "serve", "--host", "127.0.0.1",
                                  "--port", str(port), "--model-repository", str(repository), "--log-format", "json"],
                           port, RESULTS / "logs" / f"{name}.log", env=env)
    server.start()
    server.wait_ready(180)
    return server


def measure_round(server: ServerProcess, r: int, args: argparse.Namespace, label: str) -> dict[str, Any]:
    """One round's low-load and saturation figures on `server`."""
    row: dict[str, Any] = {}
    kinds = ("client3", "pipeline", "mid") if r % 2 == 0 else ("mid", "pipeline", "client3")
    for kind in kinds:
        row[kind] = result = low_load(server, kind, args.requests, 100 * r + len(row))
        print(f"round {r + 1}{label} {kind} alone: p50 {result['latency_ms']['p50']:.3f} ms, p99 "
              f"{result['latency_ms']['p99']:.3f} ms, {result['cpu_us_per_chain']:.0f} us CPU/chain", flush=True)
    row["turns"] = turns = low_load_taking_turns(server, args.requests, 100 * r + 7)
    print(f"round {r + 1}{label} taking turns: p50 " + ", ".join(f"{kind} {turns[kind]['p50']:.3f} ms"
                                                                 for kind in LOW_LOAD), flush=True)
    models = ("mid_heavy", "chain_heavy", "mid_heavier", "chain_heavier")
    for model in (models if r % 2 == 0 else models[::-1]):
        row[model] = result = saturation_peak(server, model, args.clients, args.seconds)
        print(f"round {r + 1}{label} {model} at saturation: {result['ok_per_s']:.0f} ok/s with {result['clients']} "
              f"clients (ok/s by clients {result['ok_per_s_by_clients']}), p99 "
              f"{result['latency_ms']['p99']:.1f} ms, {result['errors']} errors, CPU us/request by process "
              f"{result['cpu_us_per_request']}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=lambda text: [int(c) for c in text.split(",")], default=[32, 64, 128],
                        help="closed-loop client counts tried at saturation, comma-separated (the best one counts)")
    parser.add_argument("--other-src", type=Path, default=None,
                        help="another checkout's src/: its server is measured the same way in every round, "
                             "alternating with this one's, and the figures are compared")
    parser.add_argument("--out", type=Path, default=RESULTS / "pipeline.json")
    args = parser.parse_args(argv)
    if args.other_src is not None and not (args.other_src / "servewell" / "__init__.py").is_file():
        parser.error(f"{args.other_src} has no servewell package")
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    repository = build_repository(WORK / "pipeline")
    servers = {"this": start_server("pipeline", repository)}
    rounds: list[dict[str, Any]] = []
    other_rounds: list[dict[str, Any]] = []
    try:
        if args.other_src is not None:
            servers["other"] = start_server("pipeline_other", repository, args.other_src)
        for r in range(args.rounds):
            order = ["this", "other"] if r % 2 == 0 else ["other", "this"]
            for name in (n for n in order if n in servers):
                row = measure_round(servers[name], r, args, "" if name == "this" else " (other)")
                (rounds if name == "this" else other_rounds).append(row)
    finally:
        for server in servers.values():
            server.stop()
    report = summarize(rounds)
    if other_rounds:
        report["other_src"] = str(args.other_src.resolve())
        report["other"] = summarize(other_rounds)
        report["other_rounds"] = other_rounds
    finish_rounds(report, rounds, print_table, args.out)
    return 0


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-round figures and their medians."""
    median = median_over(rounds)
    return {
        "latency_ratio": median(lambda r: r["turns"]["pipeline"]["p50"] / r["turns"]["client3"]["p50"]),
        "cpu_ratio": median(lambda r: r["pipeline"]["cpu_us_per_chain"] / r["client3"]["cpu_us_per_chain"]),
        "added_ms_per_step": median(lambda r: (r["turns"]["pipeline"]["p50"] - r["turns"]["mid"]["p50"]) / 2),
        "saturation_ratio": median(lambda r: r["chain_heavy"]["ok_per_s"] / r["mid_heavy"]["ok_per_s"]),
        "saturation_ratio_heavier": median(lambda r: r["chain_heavier"]["ok_per_s"] / r["mid_heavier"]["ok_per_s"]),
        "p50_ms": {k: statistics.median(r["turns"][k]["p50"] for r in rounds) for k in LOW_LOAD},
        "p50_ms_alone": {k: statistics.median(r[k]["latency_ms"]["p50"] for r in rounds) for k in LOW_LOAD},
        "cpu_us": {k: statistics.median(r[k]["cpu_us_per_chain"] for r in rounds) for k in LOW_LOAD},
        "ok_per_s": {k: statistics.median(r[k]["ok_per_s"] for r in rounds)
                     for k in ("mid_heavy", "chain_heavy", "mid_heavier", "chain_heavier")},
    }


def print_table(report: dict[str, Any]) -> None:
    """Each goal beside its figure (medians over the rounds)."""
    p50, cpu, ok = report["p50_ms"], report["cpu_us"], report["ok_per_s"]
    print(f"p50 ms: client3 {p50['client3']:.3f}, pipeline {p50['pipeline']:.3f}, mid alone {p50['mid']:.3f}; "
          f"server CPU us per chain: client3 {cpu['client3']:.0f}, pipeline {cpu['pipeline']:.0f}, "
          f"mid {cpu['mid']:.0f}; saturation ok/s: mid_heavy {ok['mid_heavy']:.0f}, "
          f"chain_heavy {ok['chain_heavy']:.0f}, mid_heavier {ok['mid_heavier']:.0f}, "
          f"chain_heavier {ok['chain_heavier']:.0f}")
    rows = [
        ("p50: pipeline / client calling the 3 models", report["latency_ratio"], "x", f"<= {GOAL_LATENCY_RATIO:g}x",
         report["latency_ratio"] <= GOAL_LATENCY_RATIO),
        ("server CPU per chain: pipeline / client3", report["cpu_ratio"], "x", "< 1x", report["cpu_ratio"] < 1.0),
        ("added p50 per step vs the middle model alone", report["added_ms_per_step"], " ms",
         f"<= {GOAL_ADDED_MS_PER_STEP:g} ms", report["added_ms_per_step"] <= GOAL_ADDED_MS_PER_STEP),
        ("saturation: chain_heavy / mid_heavy alone", report["saturation_ratio"], "x",
         f">= {GOAL_SATURATION_RATIO:g}x", report["saturation_ratio"] >= GOAL_SATURATION_RATIO),
        ("saturation: chain_heavier / mid_heavier alone", report["saturation_ratio_heavier"], "x",
         f">= {GOAL_SATURATION_RATIO:g}x", report["saturation_ratio_heavier"] >= GOAL_SATURATION_RATIO),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  {'value':>9}  {'goal':<9} verdict")
    for figure, value, unit, goal, passed in rows:
        print(f"{figure:<{width}}  {value:>7.3f}{unit:<2} {goal:<9} {'PASS' if passed else 'FAIL'}")
    other = report.get("other")
    if other:
        print(f"\nthe same figures from {report['other_src']}, measured in the same rounds (medians):")
        for key, label in (("latency_ratio", "p50 ratio to client3"), ("added_ms_per_step", "added ms per step"),
                           ("saturation_ratio", "saturation chain_heavy"),
                           ("saturation_ratio_heavier", "saturation chain_heavier")):
            print(f"  {label:<26} this {report[key]:.3f}  other {other[key]:.3f}")
        this_p50, other_p50 = report["p50_ms"]["pipeline"], other["p50_ms"]["pipeline"]
        print(f"  {'pipeline p50 ms':<26} this {this_p50:.3f}  other {other_p50:.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
