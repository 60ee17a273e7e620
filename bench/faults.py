"""Fault timings and the load-time cost of artifact snapshots.

    flock /tmp/servewell-bench.lock python -m bench.faults [--rounds 3] [--out bench/results/faults.json]

1. Snapshot cost on the ResNet-50 (pytorch runtime, fp32 safetensors, ~100 MB): the time
   `SnapshotStore.take` needs to copy the model directory (fresh) and to link it again
   (unchanged files of an earlier snapshot), in this process; then the model's `load_s` (from
   /healthz) with `--artifact-snapshots true` and `false`, servers started one after the other in
   alternating order, `--rounds` each.
2. Fault timings on the built-in digits model under a closed loop of 8 clients with
   `X-Request-Timeout-Ms: 2000`: a worker stopped with SIGSTOP (never continued), then a worker
   killed with SIGKILL. For each: seconds from the signal to the first 503, to the model's state
   leaving `ready` (health shows it), to ready again with a new worker; the slowest answer;
   the answers by status and code.

Everything runs on 127.0.0.1, bounded in time; every child is stopped by its pid. The machine is
shared: compare the two snapshot settings within one run, not across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench.processes import ServerProcess, free_port
from servewell.engine.model_files import model_files
from servewell.engine.repository import read_model_config
from servewell.engine.snapshot import SnapshotStore

RESULTS = Path(__file__).resolve().parent / "results"
WORK = RESULTS / "work" / "faults"
IMAGE = Path(__file__).resolve().parents[1] / "src" / "servewell" / "examples" / "images" / "digit-3-200px.jpg"


def build_resnet50_pytorch() -> Path:
    """A repository with the seeded ResNet-50 as a pytorch model (safetensors), built once."""
    repo = WORK / "resnet-repo"
    if not (repo / "resnet50" / "model.yaml").is_file():
        command = [sys.executable, "-m", "servewell.examples.build", "resnet50", "--out", str(repo),
                   "--runtime", "pytorch"]
        subprocess.run(command, check=True, timeout=900)
    return repo


def snapshot_copy_times(model_dir: Path, rounds: int) -> dict[str, Any]:
    """Seconds to snapshot the directory fresh, and again when nothing changed (links)."""
    fresh, linked = [], []
    size = sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file())
    with tempfile.TemporaryDirectory(dir=WORK) as root:
        for _ in range(rounds):
            store = SnapshotStore(Path(root))
            files = model_files(read_model_config(model_dir), model_dir)
            first = store.take(model_dir, "resnet50", files)
            again = store.take(model_dir, "resnet50", files)
            fresh.append(first.seconds)
            linked.append(again.seconds)
            store.release(first)
            store.release(again)
    return {"directory_bytes": size, "fresh_copy_s": fresh, "linked_s": linked,
            "fresh_copy_median_s": statistics.median(fresh), "linked_median_s": statistics.median(linked)}


def serve(repo: Path | None, name: str, extra: list[str], cache: Path) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "servewell", "serve", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0",
            "--cache-dir", str(cache), "--shutdown-delay-s", "0", *(["--model-repository", str(repo)] if repo else []),
            *extra]
    server = ServerProcess(name, argv, port, WORK / f"{name}.log")
    server.start()
    return server


def load_times(repo: Path, rounds: int, cache: Path) -> dict[str, Any]:
    """The model's load_s with snapshots on and off, alternating."""
    results: dict[str, list[float]] = {"true": [], "false": []}
    for i in range(rounds):
        for setting in (("true", "false") if i % 2 == 0 else ("false", "true")):
            server = serve(repo, f"load-{setting}-{i}", ["--artifact-snapshots", setting], cache)
            try:
                server.wait_ready(300)
                health = httpx.get(server.url + "/healthz", timeout=10).json()
                results[setting].append(health["models"]["resnet50"]["load_s"])
            finally:
                server.stop()
    on, off = statistics.median(results["true"]), statistics.median(results["false"])
    return {"load_s_snapshots_on": results["true"], "load_s_snapshots_off": results["false"],
            "median_on_s": on, "median_off_s": off, "ratio_on_over_off": on / off}


def health(url: str) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(url + "/healthz", timeout=10).json()["models"]["digits"]
    return doc


async def fault_under_load(url: str, sig: signal.Signals) -> dict[str, Any]:
    """Signal the digits worker under load; the timings and the answers."""
    payload = {"image_base64": base64.b64encode(IMAGE.read_bytes()).decode()}
    victim = health(url)["instances"][0]["pid"]
    answers: list[tuple[float, float, str]] = []
    marks: dict[str, float] = {}
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def user() -> None:
            while not stop.is_set():
                sent = time.monotonic()
                r = await client.post("/predict", json=payload, headers={"X-Request-Timeout-Ms": "2000"})
                label = "200" if r.status_code == 200 else f"{r.status_code} {r.json()['error']['code']}"
                answers.append((sent, time.monotonic() - sent, label))

        async def watch() -> None:
            while not stop.is_set():
                doc = (await client.get("/healthz")).json()["models"]["digits"]
                now = time.monotonic()
                if "signal" in marks and doc["state"] != "ready":
                    marks.setdefault("not_ready", now)
                if "not_ready" in marks and doc["state"] == "ready" and doc["instances"][0]["pid"] != victim:
                    marks.setdefault("ready_again", now)
                    stop.set()
                await asyncio.sleep(0.05)

        users = [asyncio.create_task(user()) for _ in range(8)]
        watcher = asyncio.create_task(watch())
        await asyncio.sleep(2.0)
        marks["signal"] = time.monotonic()
        os.kill(victim, sig)
        try:
            await asyncio.wait_for(watcher, 120)
        finally:
            stop.set()
            await asyncio.gather(*users)
    at = marks["signal"]
    failures = [s + d for s, d, label in answers if label != "200" and s + d >= at]
    return {
        "signal": sig.name,
        "first_503_after_s": (min(failures) - at) if failures else None,
        "not_ready_after_s": marks["not_ready"] - at if "not_ready" in marks else None,
        "ready_again_after_s": marks["ready_again"] - at if "ready_again" in marks else None,
        "slowest_answer_s": max(d for _, d, _ in answers),
        "answers": dict(Counter(label for _, _, label in answers)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "faults.json")
    args = parser.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    cache = WORK / "cache"
    repo = build_resnet50_pytorch()
    report: dict[str, Any] = {"snapshot_copy": snapshot_copy_times(repo / "resnet50", max(5, args.rounds))}
    report["snapshot_load"] = load_times(repo, args.rounds, cache)
    faults = []
    server = serve(None, "digits", [], cache)
    try:
        server.wait_ready(300)
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            faults.append(asyncio.run(fault_under_load(server.url, sig)))
    finally:
        server.stop()
    report["faults"] = faults
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    copy, load = report["snapshot_copy"], report["snapshot_load"]
    print(f"ResNet-50 directory {copy['directory_bytes'] / 2**20:.0f} MiB: snapshot "
          f"{copy['fresh_copy_median_s']:.3f} s fresh, {copy['linked_median_s']:.4f} s linked (median)")
    print(f"load_s with snapshots {load['median_on_s']:.2f} s, without {load['median_off_s']:.2f} s "
          f"(ratio {load['ratio_on_over_off']:.2f}, medians of {args.rounds})")
    print(f"{'fault':<8} {'first 503':>10} {'not ready':>10} {'ready again':>12} {'slowest':>8}  answers")
    for f in faults:
        def s(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f} s"
        print(f"{f['signal']:<8} {s(f['first_503_after_s']):>10} {s(f['not_ready_after_s']):>10} "
              f"{s(f['ready_again_after_s']):>12} {s(f['slowest_answer_s']):>8}  {f['answers']}")
    print(f"written to {args.out}")
    shutil.rmtree(cache / "snapshots", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
