"""Issue 48's measured goals for streams, in one run (ratios within the run: these machines are noisy).

    python -m bench.streams [--rounds 3] [--seconds 20] [--clients 32] [--step-ms 10] [--peer-python PY]
    python -m bench.streams --quick          # the smallest settings: proves it runs end to end

One split server serves the generative example twice (`examples/generative.py`'s charlm, built here
with no download): `charlm_continuous` (generate.batching: continuous) and `charlm_static` (static:
nobody joins a running batch, the classic batcher), both with `max_sequences` = the client count
(none kept for the urgent lane: the bench sends none) and `step_ms` = `--step-ms` (a fixed time
each step takes besides its compute, standing in for a model whose step costs about the same at
any batch size, as a GPU's does; 0 measures the tiny model itself). The default, 10 ms, is a
decode step of a model worth serving on an accelerator; at 2 ms, 32 streams ask for 16,000 parts a
second, which at the server's ~120 us of CPU a part (printed per process for each closed loop)
is more than this 2-core machine has beside its clients: that run measures the cores, not the
batching (docs/explanation/benchmarks.md has both). Per round, in alternating order:

1. **continuous vs static** (goal: outputs/s >= 2x, p99 time to first output <= 0.5x): `--clients`
   closed-loop SSE clients (`generate_stream`), each asking for an output length drawn log-uniformly
   from 16 to 256 parts (seeded: most answers short, a few long, as generations are);
2. **low load** (goal: time between outputs <= the model's step time + 0.3 ms): one client, 256-part
   streams; the step's time is the worker's own (`compute` of Server-Timing over the parts), so the
   figure is what streaming adds per part: the engine's step loop, the door, the ingress, SSE;
   the server's CPU per output by process (supervisor, engine, ingress, worker) from /proc;
3. **a peer** with `--peer-python` (a Python with `litserve` installed, e.g. its own venv: it is not
   one of servewell's dependencies): the same model under LitServe with `stream=True`, the same
   clients and lengths (goal: servewell ahead on outputs/s and p99 time to first output).

The clients are `bench/sse_client.py`'s (one keep-alive connection each, no per-line parsing
beyond counting parts): with httpx the 32 clients took a whole core of this 2-core machine and
capped the figure they measured. `bench/results/streams.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench.processes import HOST, ServerProcess, TreeCpu, free_port
from bench.sse_client import SseClient, StreamError
from servewell.perf.stats import percentile

RESULTS = Path(__file__).parent / "results"
MIN_PARTS, MAX_PARTS = 16, 256
PROMPT = "The batcher"


def pct(values: list[float], q: float) -> float:
    """The nearest-rank percentile `q` of `values` (NaN when there are none)."""
    found = percentile(sorted(values), q)
    return found if found is not None else math.nan


def lengths(count: int, seed: int) -> list[int]:
    """Output lengths drawn log-uniformly from MIN_PARTS to MAX_PARTS."""
    rng = np.random.default_rng(seed)
    return [int(round(math.exp(v))) for v in rng.uniform(math.log(MIN_PARTS), math.log(MAX_PARTS), count)]


def build_repository(root: Path, clients: int, step_ms: float) -> None:
    """charlm built once, served as charlm_continuous and charlm_static."""
    built = root / "built"
    if not (built / "charlm" / "model.yaml").is_file():
        subprocess.run([sys.executable, "-m", "servewell.examples.build", "charlm", "--out", str(built)], check=True,
                       capture_output=True)
    for mode in ("continuous", "static"):
        target = root / "repository" / f"charlm_{mode}"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(built / "charlm", target)
        doc = yaml.safe_load((target / "model.yaml").read_text())
        doc.pop("name", None)
        # urgent_sequences 0: all `clients` streams run at once (no urgent traffic here; by default an
        # eighth of the places wait for the urgent lane, and 4 of 32 clients would always wait).
        doc["generate"] = {**doc.get("generate", {}), "batching": mode, "max_sequences": clients,
                           "urgent_sequences": 0, "max_outputs": MAX_PARTS, "max_waiting": 4 * clients}
        doc["python"]["settings"] = {"step_ms": step_ms}
        (target / "model.yaml").write_text(yaml.safe_dump(doc))


async def one_stream(client: SseClient, parts: int) -> tuple[float, list[float], int, float]:
    """(time to first output s, gaps between outputs s, parts, the worker's compute s) of one stream."""
    result = await client.stream({"text_input": PROMPT, "parameters": {"max_tokens": parts}})
    compute = _timing(str((result.final or {}).get("server_timing", "")), "compute")
    return result.first, result.gaps, result.count, compute


def _timing(header: str, name: str) -> float:
    for item in header.split(","):
        fields = item.strip().split(";")
        if fields[0] == name:
            for field in fields[1:]:
                if field.startswith("dur="):
                    return float(field[4:]) / 1000.0
    return 0.0


async def closed_loop(url: str, clients: int, seconds: float, seed: int) -> dict[str, Any]:
    """`clients` closed-loop streams for `seconds`: outputs/s and time-to-first-output percentiles."""
    plan = lengths(100_000, seed)
    cursor = [0]
    ttfo: list[float] = []
    outputs = [0]
    errors: list[str] = []
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        client = SseClient(url)
        try:
            while time.perf_counter() < deadline:
                parts = plan[cursor[0] % len(plan)]
                cursor[0] += 1
                try:
                    first, _, count, _ = await one_stream(client, parts)
                except (OSError, asyncio.IncompleteReadError, TimeoutError, StreamError) as exc:
                    errors.append(str(exc)[:200])
                    continue
                if time.perf_counter() <= deadline:  # streams that finished inside the window
                    ttfo.append(first)
                    outputs[0] += count
        finally:
            await client.close()

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    elapsed = time.perf_counter() - began
    return {"outputs_per_s": outputs[0] / max(seconds, 1e-9), "streams": len(ttfo),
            "ttfo_p50_ms": pct(ttfo, 50) * 1000 if ttfo else None,
            "ttfo_p99_ms": pct(ttfo, 99) * 1000 if ttfo else None, "errors": errors[:5],
            "error_count": len(errors), "elapsed_s": elapsed}


async def low_load(url: str, streams: int) -> dict[str, Any]:
    """One client, `streams` streams of MAX_PARTS parts: time between outputs against the step time."""
    gaps: list[float] = []
    step_s: list[float] = []
    client = SseClient(url)
    try:
        for _ in range(streams):
            _, stream_gaps, count, compute = await one_stream(client, MAX_PARTS)
            gaps.extend(stream_gaps)
            step_s.append(compute / max(count, 1))
    finally:
        await client.close()
    step = statistics.median(step_s) if step_s else 0.0
    p50 = pct(gaps, 50)
    return {"tbo_p50_ms": p50 * 1000, "tbo_p99_ms": pct(gaps, 99) * 1000,
            "step_ms": step * 1000, "added_per_output_ms": (p50 - step) * 1000, "outputs": len(gaps) + streams}


PEER_SOURCE = textwrap.dedent('''
    """The same character model under LitServe with stream=True (bench/streams.py's peer)."""
    import importlib.util
    import sys

    import litserve as ls
    import numpy as np

    spec = importlib.util.spec_from_file_location("charlm", sys.argv[1] + "/charlm.py")
    charlm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(charlm)


    class CharLMAPI(ls.LitAPI):
        def setup(self, device):
            self.model = charlm.CharLM()
            self.model.setup({"directory": sys.argv[1], "settings": {"step_ms": float(sys.argv[3])}})

        def decode_request(self, request):
            return request["text_input"], int(request["parameters"]["max_tokens"])

        def predict(self, x):
            prompt, parts = x
            state = self.model.start([{"text_input": np.frombuffer(prompt.encode(), np.uint8)[None, :]}])
            for _ in range(parts):
                (outputs, done), = self.model.step(state)
                if done:
                    return
                yield bytes(outputs["text_output"].reshape(-1)).decode("utf-8", "replace")

        def encode_response(self, output):
            for text in output:
                yield {"text_output": text}


    if __name__ == "__main__":
        server = ls.LitServer(CharLMAPI(), stream=True, api_path="/generate_stream", workers_per_device=1)
        server.run(port=int(sys.argv[2]), generate_client_file=False)
''')


def start_servewell(workdir: Path) -> ServerProcess:
    port = free_port()
    server = ServerProcess("servewell-streams", [
        sys.executable, "-m", "servewell", "serve", "--host", HOST, "--port", str(port), "--grpc-port", "0",
        "--model-repository", str(workdir / "repository"), "--config-poll-s", "0",
        "--cache-dir", str(workdir / "cache")], port, workdir / "server.log")
    server.start()
    server.wait_ready(240)
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.streams", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0, help="each closed loop's window")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--low-load-streams", type=int, default=10)
    parser.add_argument("--peer-python", help="a Python with litserve installed: also measure LitServe")
    parser.add_argument("--quick", action="store_true", help="one round of 3 s, 4 clients: proves it runs")
    parser.add_argument("--out", type=Path, default=RESULTS / "streams.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.clients, args.low_load_streams = 1, 3.0, 4, 2
    workdir = RESULTS / "work" / "streams"
    workdir.mkdir(parents=True, exist_ok=True)
    build_repository(workdir, args.clients, args.step_ms)
    server = start_servewell(workdir)
    rounds: list[dict[str, Any]] = []
    peer: ServerProcess | None = None
    try:
        if args.peer_python:
            peer_port = free_port()
            (workdir / "peer.py").write_text(PEER_SOURCE)
            peer = ServerProcess("litserve-peer", [args.peer_python, str(workdir / "peer.py"),
                                                   str(workdir / "repository" / "charlm_continuous"),
                                                   str(peer_port), str(args.step_ms)], peer_port,
                                 workdir / "peer.log", new_session=True)  # its own group: LitServe forks workers
            peer.start()
            peer.wait_ready(120, "/health")
        for index in range(args.rounds):
            modes = ["continuous", "static"] if index % 2 == 0 else ["static", "continuous"]
            row: dict[str, Any] = {}
            for mode in modes:
                url = f"{server.url}/v2/models/charlm_{mode}/generate_stream"
                cpu = TreeCpu(server.pid).start()
                row[mode] = asyncio.run(closed_loop(url, args.clients, args.seconds, seed=index))
                spent = cpu.stop()
                made = max(row[mode]["outputs_per_s"] * args.seconds, 1.0)
                row[mode]["cpu_us_per_output"] = {role: round(seconds * 1e6 / made, 1)
                                                  for role, seconds in spent.items()}
                row[mode]["server_cores"] = round(sum(spent.values()) / max(row[mode]["elapsed_s"], 1e-9), 2)
            if peer is not None:
                row["peer"] = asyncio.run(closed_loop(f"{peer.url}/generate_stream", args.clients, args.seconds,
                                                      seed=index))
            cpu = TreeCpu(server.pid).start()
            row["low_load"] = asyncio.run(low_load(f"{server.url}/v2/models/charlm_continuous/generate_stream",
                                                   args.low_load_streams))
            spent = cpu.stop()
            row["low_load"]["cpu_us_per_output"] = {role: seconds * 1e6 / max(row["low_load"]["outputs"], 1)
                                                    for role, seconds in spent.items()}
            row["outputs_ratio"] = row["continuous"]["outputs_per_s"] / max(row["static"]["outputs_per_s"], 1e-9)
            if row["continuous"]["ttfo_p99_ms"] and row["static"]["ttfo_p99_ms"]:
                row["ttfo_p99_ratio"] = row["continuous"]["ttfo_p99_ms"] / row["static"]["ttfo_p99_ms"]
            if "peer" in row:  # servewell over the peer: goals outputs > 1, time to first output < 1
                row["peer_outputs_ratio"] = row["continuous"]["outputs_per_s"] / max(row["peer"]["outputs_per_s"],
                                                                                     1e-9)
                if row["continuous"]["ttfo_p99_ms"] and row["peer"]["ttfo_p99_ms"]:
                    row["peer_ttfo_p99_ratio"] = row["continuous"]["ttfo_p99_ms"] / row["peer"]["ttfo_p99_ms"]
            rounds.append(row)
            print(json.dumps({"round": index, **{k: v for k, v in row.items() if k.endswith("ratio")},
                              "added_per_output_ms": row["low_load"]["added_per_output_ms"]}), flush=True)
    finally:
        server.stop()
        if peer is not None:
            peer.stop()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(peer.pid, signal.SIGKILL)  # the workers it forked, in the group it leads
    summary = {
        "settings": vars(args) | {"out": str(args.out)},
        "outputs_ratio_median": statistics.median(r["outputs_ratio"] for r in rounds),
        "ttfo_p99_ratio_median": statistics.median(r.get("ttfo_p99_ratio", math.nan) for r in rounds),
        "added_per_output_ms_median": statistics.median(r["low_load"]["added_per_output_ms"] for r in rounds),
        "peer_outputs_ratio_median": statistics.median(r.get("peer_outputs_ratio", math.nan) for r in rounds),
        "peer_ttfo_p99_ratio_median": statistics.median(r.get("peer_ttfo_p99_ratio", math.nan) for r in rounds),
        "goals": {"outputs_ratio": ">= 2", "ttfo_p99_ratio": "<= 0.5", "added_per_output_ms": "<= 0.3",
                  "peer_outputs_ratio": "> 1", "peer_ttfo_p99_ratio": "< 1"},
        "rounds": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
