"""Does a profile capture stop a model answering? A closed loop on each model while
`POST /admin/models/{name}/profile` captures, successes per second before / during / after.

    flock /tmp/servewell-bench.lock python -m bench.profile_stall [--clients 4] [--seconds 3]

Two small models are served: `torchm` (PyTorch; its forward calls a Python function that sleeps
2 ms, so the trace has a Python frame to find) and `onnxm` (onnxruntime). Both are captured at
once, on a fresh server (the first capture in a process is the one that paid for lazy imports).
Prints one JSON document: per model, ok/s before, during and after the capture, the emptiest
0.25 s bucket during it (0 = the model stopped answering), the capture's size and time, and
the workers' own log of how long stopping the profiler held the compute thread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx

from bench.processes import HOST, ServerProcess, free_port

BUCKET_S = 0.25

TORCH_FACTORY = textwrap.dedent('''
    import time

    import torch
    from torch import nn


    def think(x):
        time.sleep(0.002)
        return x


    class Thinker(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return think(x) * self.scale


    def build():
        return Thinker()
''')

SCALAR_IO = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
             "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}]}


def write_models(root: Path) -> None:
    """`torchm` and `onnxm` under `root`."""
    import torch
    import yaml
    from safetensors.torch import save_file

    torch_dir = root / "torchm"
    torch_dir.mkdir(parents=True)
    (torch_dir / "thinker.py").write_text(TORCH_FACTORY)
    save_file({"scale": torch.ones(1)}, str(torch_dir / "model.safetensors"))
    (torch_dir / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "pytorch", "artifact": "model.safetensors", "max_batch_size": 8,
        "pytorch": {"factory": "thinker:build"}, **SCALAR_IO}))
    onnx_dir = root / "onnxm"
    onnx_dir.mkdir(parents=True)
    torch.onnx.export(torch.nn.Linear(1, 1), (torch.zeros(2, 1),), str(onnx_dir / "model.onnx"), dynamo=False,
                      input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "b"}, "y": {0: "b"}})
    (onnx_dir / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "onnx", "artifact": "model.onnx", "max_batch_size": 8, **SCALAR_IO}))


async def closed_loop(url: str, model: str, clients: int, until: float, done: list[tuple[float, bool]]) -> None:
    """`clients` users sending one request after another until `until` (monotonic)."""
    body = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}
    async with httpx.AsyncClient(base_url=url, timeout=30,
                                 limits=httpx.Limits(max_connections=clients + 2)) as client:
        async def user() -> None:
            while time.monotonic() < until:
                try:
                    r = await client.post(f"/v2/models/{model}/infer", json=body)
                    done.append((time.monotonic(), r.status_code == 200))
                except httpx.HTTPError:
                    done.append((time.monotonic(), False))
        await asyncio.gather(*(user() for _ in range(clients)))


async def capture(client: httpx.AsyncClient, model: str, seconds: float) -> dict[str, Any]:
    sent = time.monotonic()
    r = await client.post(f"/admin/models/{model}/profile", params={"seconds": seconds})
    return {"status": r.status_code, "sent": sent, "answered": time.monotonic(), "bytes": len(r.content),
            "python_frames": r.content.count(b"think")}


def rates(done: list[tuple[float, bool]], start: float, end: float) -> float:
    ok = sum(1 for t, good in done if good and start <= t < end)
    return round(ok / (end - start), 1) if end > start else 0.0


def buckets(done: list[tuple[float, bool]], start: float, end: float) -> list[int]:
    """Successes in each whole BUCKET_S from `start` to `end`."""
    counts = []
    t = start
    while t + BUCKET_S <= end:
        counts.append(sum(1 for d, good in done if good and t <= d < t + BUCKET_S))
        t += BUCKET_S
    return counts


async def run(url: str, clients: int, seconds: float, settle_s: float) -> dict[str, Any]:
    models = ("torchm", "onnxm")
    began = time.monotonic()
    until = began + settle_s * 2 + seconds + 1.5
    done: dict[str, list[tuple[float, bool]]] = {m: [] for m in models}
    # Made before the load starts: a new httpx client loads the CA store, 0.25 s of this loop.
    async with httpx.AsyncClient(base_url=url, timeout=120) as control:
        loops = [asyncio.create_task(closed_loop(url, m, clients, until, done[m])) for m in models]
        await asyncio.sleep(settle_s)
        captures = await asyncio.gather(*(capture(control, m, seconds) for m in models))
        await asyncio.gather(*loops)
    out: dict[str, Any] = {}
    for model, cap in zip(models, captures, strict=True):
        d = done[model]
        out[model] = {
            "capture_status": cap["status"], "capture_wall_s": round(cap["answered"] - cap["sent"], 2),
            "trace_bytes": cap["bytes"], "trace_mentions_think": cap["python_frames"],
            "ok_per_s_before": rates(d, began + 0.5, cap["sent"]),
            "ok_per_s_during": rates(d, cap["sent"], cap["answered"]),
            "ok_per_s_after": rates(d, cap["answered"] + 0.25, until),
            "emptiest_bucket_during": min(buckets(d, cap["sent"], cap["answered"]), default=0),
            "buckets_from_1s_before": buckets(d, cap["sent"] - 1.0, cap["answered"] + 1.0),
            "failed": sum(1 for _, good in d if not good),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4, help="closed-loop clients per model")
    parser.add_argument("--seconds", type=float, default=3.0, help="capture length")
    parser.add_argument("--settle-s", type=float, default=3.0, help="load before and after the capture")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="servewell-profile-stall-") as work:
        root = Path(work) / "repo"
        write_models(root)
        port = free_port()
        log_path = Path(work) / "server.log"
        server = ServerProcess("servewell", [sys.executable, "-m", "servewell", "serve", "--model-repository",
                                             str(root), "--host", HOST, "--port", str(port),
                                             "--grpc-port", str(free_port())], port, log_path)
        server.start()
        try:
            server.wait_ready(180)
            result = asyncio.run(run(server.url, args.clients, args.seconds, args.settle_s))
            lines = log_path.read_text(errors="replace").splitlines()
            worker_log = [json.loads(line)["message"] for line in lines
                          if '"logger":"servewell.workers"' in line and "profile" in line]
        finally:
            server.stop(30)
    print(json.dumps({"clients": args.clients, "capture_s": args.seconds, "models": result,
                      "worker_log": worker_log}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
