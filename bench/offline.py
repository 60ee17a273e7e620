"""Offline limit of one model: its own runtime in one process, no HTTP, at each batch size.

    python -m bench.offline --model-dir DIR --threads 2 --batch-sizes 1,2,4,8,16,32 --out r.json

Each batch size is warmed up, then timed in round-robin passes over all sizes until
`--min-time-s` has passed (at least `--min-passes`, at most `--max-passes`); the median of
each size is kept. The limit is items/s at the best
batch size. With `--images`, it also times the frontend's decode + preprocess of those
images, one thread (what each served image costs the frontend before the model sees it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def _load(model_dir: Path, threads: int):
    # Thread pools read these when the framework is first imported (as the worker does).
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    from servewell.engine.repository import read_model_config
    from servewell.runtimes import load_runtime

    config = read_model_config(model_dir).model_copy(update={"threads": threads})
    return load_runtime(config, model_dir, lambda stage: None), config


def time_batches(model_dir: Path, threads: int, batch_sizes: list[int], min_passes: int, max_passes: int,
                 min_time_s: float) -> dict:
    """Median latency and items/s of each batch size; the best one is the offline limit.

    The sizes are timed in round-robin passes (1, 2, 4, ... then again), not one after the
    other, so a burst of noise from other processes on a shared machine is spread over all
    sizes instead of ruining one of them.
    """
    from servewell.runtimes.warmup import dummy_batch

    runtime, config = _load(model_dir, threads)
    rng = np.random.default_rng(0)
    inputs = {}
    for size in batch_sizes:
        inputs[size] = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in dummy_batch(config, size).items()}
        runtime.run(inputs[size])  # warm-up: first-run allocations and kernel selection
    times: dict[int, list[float]] = {size: [] for size in batch_sizes}
    cpu: dict[int, float] = {size: 0.0 for size in batch_sizes}
    started = time.perf_counter()
    passes = 0
    while passes < max_passes and (passes < min_passes or time.perf_counter() - started < min_time_s):
        for size in batch_sizes:
            t0, c0 = time.perf_counter(), time.process_time()
            runtime.run(inputs[size])
            times[size].append(time.perf_counter() - t0)
            cpu[size] += time.process_time() - c0
        passes += 1
    runtime.close()
    table = []
    for size in batch_sizes:
        median = statistics.median(times[size])
        table.append({
            "batch_size": size,
            "runs": len(times[size]),
            "latency_ms_median": round(median * 1000, 3),
            "latency_ms_min": round(min(times[size]) * 1000, 3),
            "items_per_s": round(size / median, 2),
            # all threads of this process: what one item costs in CPU, spinning included
            "cpu_ms_per_item": round(1000 * cpu[size] / (size * len(times[size])), 2),
        })
    best = max(table, key=lambda row: row["items_per_s"])
    return {
        "model": config.name,
        "runtime": config.runtime,
        "threads": threads,
        "passes": passes,
        "batch_sizes": table,
        "best_batch_size": best["batch_size"],
        "limit_items_per_s": best["items_per_s"],
        "batch1_latency_ms": next((r["latency_ms_median"] for r in table if r["batch_size"] == 1), None),
    }


def time_preprocess(model_dir: Path, images: list[Path], repeats: int = 3) -> float | None:
    """Median ms per image of the frontend's decode + preprocess (one thread), or None without preprocessing."""
    from servewell.api.codecs.image import image_to_array
    from servewell.engine.repository import read_model_config

    spec = read_model_config(model_dir).preprocess
    if spec is None or not images:
        return None
    blobs = [p.read_bytes() for p in images]
    image_to_array(blobs[0], spec, 16_000_000)
    per_image = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for blob in blobs:
            image_to_array(blob, spec, 16_000_000)
        per_image.append((time.perf_counter() - t0) / len(blobs))
    return round(statistics.median(per_image) * 1000, 3)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(prog="python -m bench.offline", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    p.add_argument("--min-passes", type=int, default=3)
    p.add_argument("--max-passes", type=int, default=200)
    p.add_argument("--min-time-s", type=float, default=5.0, help="keep making passes until this much time has passed")
    p.add_argument("--images", type=Path, nargs="*", default=[])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    doc = time_batches(args.model_dir, args.threads, sizes, args.min_passes, args.max_passes, args.min_time_s)
    doc["preprocess_ms_per_image"] = time_preprocess(args.model_dir, args.images)
    args.out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
