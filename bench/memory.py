"""Private memory and time to ready of loading a ResNet-50: layered loading vs a naive unpickle.

    python -m bench.memory            (or: python bench/memory.py)   [--out bench/results/memory.json]

Writes a seeded ResNet-50 as safetensors and as a whole pickled module, then loads it in a
fresh child process per case while this process samples the child's private memory every
~5 ms: its anonymous resident pages (heap and anonymous maps, not the page cache of a
memory-mapped file). The samples read `RssAnon:` of /proc/<pid>/status, the kernel's counter,
rather than `Anonymous:` of /proc/<pid>/smaps_rollup: smaps_rollup walks the child's page
tables under its memory-map lock, and sampling it every 5 ms markedly slowed the child's first
forward pass on a 2-core machine (0.35 s unsampled, 0.85 s and more sampled). The child reports
both figures once, when ready, as a cross-check (`private_after_ready_bytes` vs `private_after_ready_smaps_bytes`).

- layered fp32: `load_runtime` (pytorch runtime) from safetensors; weights stay memory-mapped.
- layered bf16: the same, converted to bf16; the converted weights are private memory.
- naive: `torch.load(weights_only=False)` of the pickled module, then `.eval()`.

Each child imports everything first and reports that baseline; peaks are measured above it.
Time to ready is load plus one batch of 1 (servewell's warm-up at max_batch_size 1 for the
layered cases, a forward call for the naive one). Ratios are peak private memory during load
over the weight bytes in the serving dtype (target for layered loading: <= 1.1).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CASES = ("layered_fp32", "layered_bf16", "naive_pickle")
SAMPLE_INTERVAL_S = 0.005
CASE_TIMEOUT_S = 90.0
THREADS = 2
MIB = 1 << 20
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "memory.json"


# -- child side -------------------------------------------------------------------------------


def private_bytes(pid: int | str = "self") -> tuple[int, int]:
    """(anonymous resident, total resident) bytes of a process, from /proc/<pid>/status counters."""
    anonymous = rss = 0
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                anonymous = int(line.split()[1]) * 1024
            elif line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return anonymous, rss


def smaps_anonymous_bytes(pid: int | str = "self") -> int:
    """`Anonymous:` of /proc/<pid>/smaps_rollup in bytes: exact, but walks the page tables."""
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    return 0


def run_child(case: str, model_dir: Path) -> None:
    """Load the model as `case` says, handshaking with the parent over stdin/stdout."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(THREADS)
    import numpy as np
    import torch

    import servewell.examples.resnet  # the factory (and the pickle's classes), before the baseline
    import servewell.runtimes.pytorch_runtime  # noqa: F401 - imported before the baseline
    from servewell.config.model import ModelConfig
    from servewell.examples.resnet import resnet50_config_dict
    from servewell.runtimes import load_runtime
    from servewell.runtimes.warmup import dummy_batch, warm_up

    torch.set_num_threads(THREADS)
    base_anonymous, base_rss = private_bytes()
    base_smaps = smaps_anonymous_bytes()
    _say(f"BASE {base_anonymous} {base_rss}")
    sys.stdin.readline()  # GO
    started = time.perf_counter()
    serving_dtype = "fp32"
    if case == "naive_pickle":
        model = torch.load(model_dir / "model_full.pt", weights_only=False).eval()
        _say(f"LOADED {time.perf_counter() - started}")
        with torch.inference_mode():
            model(torch.zeros(1, 3, 224, 224))
    else:
        dtype = "bf16" if case == "layered_bf16" else "fp32"
        base = ModelConfig.model_validate(resnet50_config_dict("pytorch"))
        assert base.pytorch is not None
        config = ModelConfig.model_validate({
            **base.model_dump(), "threads": THREADS, "max_batch_size": 1,
            "pytorch": {**base.pytorch.model_dump(), "dtype": dtype},
        })
        runtime = load_runtime(config, model_dir, lambda stage: None)
        _say(f"LOADED {time.perf_counter() - started}")
        report = warm_up(runtime, config)
        serving_dtype = report.serving_dtype
        assert np.isfinite(runtime.run(dummy_batch(config, 1))["logits"]).all()
    ready_s = time.perf_counter() - started
    anonymous, rss = private_bytes()
    smaps = smaps_anonymous_bytes() - base_smaps
    _say(f"READY {ready_s} {anonymous - base_anonymous} {rss - base_rss} {serving_dtype} {smaps}")
    sys.stdin.readline()  # EXIT: the parent has its last sample


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# -- parent side ------------------------------------------------------------------------------


def write_artifacts(model_dir: Path) -> dict[str, int]:
    """Seeded ResNet-50 as model.safetensors and model_full.pt; weight bytes in fp32 and bf16."""
    import torch
    from safetensors.torch import save_file

    from servewell.examples.resnet import SEED, resnet50

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = resnet50().eval()
    state = {key: tensor.contiguous() for key, tensor in model.state_dict().items()}
    save_file(state, str(model_dir / "model.safetensors"))
    torch.save(model, model_dir / "model_full.pt")
    fp32 = sum(t.numel() * t.element_size() for t in state.values())
    bf16 = sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in state.values())
    return {"fp32": fp32, "bf16": bf16}


def measure(case: str, model_dir: Path) -> dict[str, Any]:
    """Run one case in a child process, sampling its private memory until it is ready."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", case, str(model_dir)]
    child = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_child_env()
    )
    assert child.stdin is not None and child.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    stdout = child.stdout

    def pump() -> None:
        for line in stdout:
            lines.put(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        base = _expect(lines, "BASE", child)
        base_anonymous, base_rss = int(base[1]), int(base[2])
        phase = "load"
        peaks = {"load": [0, 0], "ready": [0, 0]}
        samples = 0
        child.stdin.write("GO\n")
        child.stdin.flush()
        deadline = time.monotonic() + CASE_TIMEOUT_S
        load_s = ready = None
        while ready is None:
            if time.monotonic() > deadline or child.poll() is not None:
                raise RuntimeError(f"{case}: the child stopped or timed out (exit {child.poll()})")
            anonymous, rss = private_bytes(child.pid)
            samples += 1
            for name in ("load", "ready") if phase == "load" else ("ready",):
                peaks[name][0] = max(peaks[name][0], anonymous - base_anonymous)
                peaks[name][1] = max(peaks[name][1], rss - base_rss)
            while not lines.empty():
                words = lines.get().split()
                if words and words[0] == "LOADED":
                    load_s, phase = float(words[1]), "ready"
                elif words and words[0] == "READY":
                    ready = words
            time.sleep(SAMPLE_INTERVAL_S)
        child.stdin.write("EXIT\n")
        child.stdin.flush()
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return {
        "case": case,
        "baseline_private_bytes": base_anonymous,
        "baseline_rss_bytes": base_rss,
        "peak_private_load_bytes": peaks["load"][0],
        "peak_private_ready_bytes": peaks["ready"][0],
        "peak_rss_load_bytes": peaks["load"][1],
        "private_after_ready_bytes": int(ready[2]),
        "private_after_ready_smaps_bytes": int(ready[5]),
        "load_s": load_s,
        "ready_s": float(ready[1]),
        "serving_dtype": ready[4],
        "samples": samples,
    }


def _expect(lines: queue.Queue[str], word: str, child: subprocess.Popen[str]) -> list[str]:
    try:
        words = lines.get(timeout=CASE_TIMEOUT_S).split()
    except queue.Empty:
        raise RuntimeError(f"no {word} from the child (exit {child.poll()})") from None
    if not words or words[0] != word:
        raise RuntimeError(f"expected {word} from the child, got {words}")
    return words


def _child_env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parent.parent / "src")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    return env


def main(argv: list[str] | None = None) -> int:
    """Measure every case, print a table, write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--child", nargs=2, metavar=("CASE", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_child(args.child[0], Path(args.child[1]))
        return 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="servewell-memory-") as tmp:
        model_dir = Path(tmp)
        weight_bytes = write_artifacts(model_dir)
        results = [measure(case, model_dir) for case in CASES]
    for result in results:
        weights = weight_bytes["bf16" if result["serving_dtype"] == "bf16" else "fp32"]
        result["weight_bytes"] = weights
        result["peak_private_load_over_weights"] = round(result["peak_private_load_bytes"] / weights, 3)
        result["peak_private_ready_over_weights"] = round(result["peak_private_ready_bytes"] / weights, 3)
    document = {
        "benchmark": "memory",
        "model": "resnet50 (seeded random weights)",
        "threads": THREADS,
        "sample_interval_s": SAMPLE_INTERVAL_S,
        "weight_bytes": weight_bytes,
        "cases": results,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print(format_table(results))
    print("baseline private memory after imports: "
          + ", ".join(f"{r['case']} {r['baseline_private_bytes'] / MIB:.0f} MiB" for r in results))
    print("private after ready, status counter vs smaps_rollup: " + ", ".join(
        f"{r['case']} {r['private_after_ready_bytes'] / MIB:.1f}/{r['private_after_ready_smaps_bytes'] / MIB:.1f} MiB"
        for r in results))
    print(f"wrote {args.out} ({document['wall_s']} s)")
    return 0


def format_table(results: list[dict[str, Any]]) -> str:
    """One row per case: MiB above the child's baseline, ratios, seconds."""
    header = (f"{'case':<14}{'dtype':>6}{'weights':>9}{'peak priv load':>15}{'ratio':>7}"
              f"{'peak priv ready':>16}{'ratio':>7}{'rss load':>9}{'load s':>8}{'ready s':>8}")
    rows = [header, "-" * len(header)]
    for r in results:
        rows.append(
            f"{r['case']:<14}{r['serving_dtype']:>6}{r['weight_bytes'] / MIB:>8.1f}M"
            f"{r['peak_private_load_bytes'] / MIB:>14.1f}M{r['peak_private_load_over_weights']:>7.2f}"
            f"{r['peak_private_ready_bytes'] / MIB:>15.1f}M{r['peak_private_ready_over_weights']:>7.2f}"
            f"{r['peak_rss_load_bytes'] / MIB:>8.1f}M{r['load_s']:>8.2f}{r['ready_s']:>8.2f}"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    sys.exit(main())
