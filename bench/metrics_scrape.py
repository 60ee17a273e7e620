"""What one `GET /metrics` costs the event loop, by model count: prometheus-client's
`generate_latest` (what the route did) against `render_text` (what it does).

    flock /tmp/servewell-bench.lock .venv/bin/python -m bench.metrics_scrape [--models 10 200 1000] [--rounds 7]

The server's own registry (`ServeMetrics`) with every family given one series per model (a
histogram's series has 16 lines) and the per-model gauges (`StateCollector`) of that many models,
each with one live worker whose facts are read from /proc as the server reads them (every
read is of this process, standing in for each worker: about 1 ms a read here, 0.6-2.4 ms for a
real worker), no server: the text is the same either way (checked, the /proc figures aside). For
each model count, the median over `--rounds` of the whole text's time and, for `render_text`, the longest stretch it
held the loop (timed by a task that runs between its slices). Goal: the loop is held at most
`GOAL_HOLD_MS` at a time with 200 models (issue 21's repository), against the whole scrape before.
JSON: bench/results/metrics_scrape.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

from prometheus_client import generate_latest

from bench.workspace import RESULTS
from servewell.observability.exposition import render_text
from servewell.observability.loop_metrics import LoopHistogram
from servewell.observability.metrics import ModelSample, ServeMetrics, StateCollector, WorkerSample
from servewell.observability.process import process_facts

GOAL_HOLD_MS = 10.0
_MOVING = re.compile(rb"^(# (HELP|TYPE) )?(process_|python_gc_|servewell_worker_(resident|private|mapped|cpu|thr))")


def registry_of(models: int) -> ServeMetrics:
    metrics = ServeMetrics()
    for i in range(models):
        name = f"model-{i:04d}"
        for family in metrics.families():
            values = [name] + ["x"] * (len(family.labelnames) - 1)
            if isinstance(family, LoopHistogram):
                family.labels(*values).observe(0.003 * (i % 50))
            else:
                family.labels(*values).inc(i)
    samples = [ModelSample(f"model-{i:04d}", "ready", {"normal": 0}, 0, 8,
                           (WorkerSample(f"model-{i:04d}", 0, True, 100_000 + i),), residency="resident",
                           estimated_bytes=1 << 20, last_used_at=1.7e9) for i in range(models)]
    metrics.registry.register(StateCollector(lambda: samples, read_own_process, budget=lambda: (1 << 31, 1 << 30)))
    return metrics


def read_own_process(_: int) -> dict[str, float]:
    """`process_facts` of this process, whatever the worker: every read costs a real one."""
    return process_facts(os.getpid())


def stable(text: bytes) -> list[bytes]:
    """The text without the process's own figures, which move between two reads."""
    return [line for line in text.splitlines() if not _MOVING.match(line)]


async def render_held(metrics: ServeMetrics) -> tuple[bytes, float, float]:
    """`render_text`'s text, its time, and the longest the loop waited for it (s)."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def other() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(other())
    await asyncio.sleep(0)
    started = time.perf_counter()
    text = await render_text(metrics.registry)
    took = time.perf_counter() - started
    done.set()
    await task
    return text, took, max(gaps)


def measure(models: int, rounds: int) -> dict[str, float | int | bool]:
    metrics = registry_of(models)
    reference = generate_latest(metrics.registry)
    old, new, held = [], [], []
    same = True
    for _ in range(rounds):
        started = time.perf_counter()
        reference = generate_latest(metrics.registry)
        old.append(time.perf_counter() - started)
        text, took, hold = asyncio.run(render_held(metrics))
        new.append(took)
        held.append(hold)
        same = same and stable(text) == stable(reference)
    return {"models": models, "lines": reference.count(b"\n"), "bytes": len(reference), "same_text": same,
            "generate_latest_ms": round(statistics.median(old) * 1e3, 2),
            "render_text_ms": round(statistics.median(new) * 1e3, 2),
            "render_text_longest_hold_ms": round(statistics.median(held) * 1e3, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, nargs="+", default=[10, 200, 1000])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS / "metrics_scrape.json")
    args = parser.parse_args(argv)
    rows = [measure(n, args.rounds) for n in args.models]
    print(f"{'models':>6} {'lines':>7} {'same text':>9} {'generate_latest (held)':>23} {'render_text':>12} "
          f"{'longest hold':>13} {'goal':>8}")
    for row in rows:
        goal = f"<= {GOAL_HOLD_MS:g} ms" if row["models"] == 200 else "-"
        print(f"{row['models']:>6} {row['lines']:>7} {row['same_text']!s:>9} {row['generate_latest_ms']:>20} ms "
              f"{row['render_text_ms']:>9} ms {row['render_text_longest_hold_ms']:>10} ms {goal:>8}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": args.rounds, "goal_hold_ms": GOAL_HOLD_MS, "rows": rows}, indent=2))
    at_200 = [r for r in rows if r["models"] == 200]
    ok = all(r["same_text"] for r in rows) and all(r["render_text_longest_hold_ms"] <= GOAL_HOLD_MS for r in at_200)
    print(f"written to {args.out}; {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
