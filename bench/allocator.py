"""System allocator vs jemalloc for a PyTorch-eager ResNet-50 worker, measured in one run.

    python -m bench.allocator

Builds the ResNet-50 example for the `pytorch` runtime (cached), then times the offline limit
(`bench.offline`: the runtime in one process, no HTTP) twice per allocator, alternating, with
`LD_PRELOAD` naming libjemalloc for the jemalloc runs, which is how a worker with
`allocator: jemalloc` starts. Needs Debian's libjemalloc2; says so and stops without it.
Writes bench/results/allocator.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.workspace import RESULTS, WORK
from servewell.workers.handle import find_jemalloc

ROUNDS = 2


def offline(model_dir: Path, preload: str | None, tag: str) -> dict:
    out = RESULTS / f"allocator_{tag}.json"
    env = {**os.environ}
    if preload:
        env["LD_PRELOAD"] = preload
    subprocess.run([sys.executable, "-m", "bench.offline", "--model-dir", str(model_dir), "--threads", "2",
                    "--batch-sizes", "1,8", "--min-time-s", "8", "--out", str(out)], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> int:
    jemalloc = find_jemalloc()
    if jemalloc is None:
        print("libjemalloc is not installed (Debian: apt-get install libjemalloc2); nothing to compare")
        return 1
    repo = WORK / "allocator"
    subprocess.run([sys.executable, "-m", "servewell.examples.build", "resnet50", "--out", str(repo),
                    "--runtime", "pytorch"], check=True, stdout=subprocess.DEVNULL)
    runs: dict[str, list[dict]] = {"system": [], "jemalloc": []}
    for i in range(ROUNDS):
        runs["system"].append(offline(repo / "resnet50", None, f"system_{i}"))
        runs["jemalloc"].append(offline(repo / "resnet50", jemalloc, f"jemalloc_{i}"))
    summary = {}
    for name, docs in runs.items():
        summary[name] = {
            "best_items_per_s": max(d["limit_items_per_s"] for d in docs),
            "batch1_latency_ms": min(d["batch1_latency_ms"] for d in docs),
        }
    ratio = summary["jemalloc"]["best_items_per_s"] / summary["system"]["best_items_per_s"]
    print(f"{'allocator':<10} {'img/s (best batch)':>18} {'batch-1 ms':>11}")
    for name, row in summary.items():
        print(f"{name:<10} {row['best_items_per_s']:>18.1f} {row['batch1_latency_ms']:>11.1f}")
    print(f"jemalloc / system throughput: {ratio:.2f}x")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "allocator.json").write_text(json.dumps({"summary": summary, "ratio": ratio, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
