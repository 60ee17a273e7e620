"""Heavy image decodes against light and urgent traffic (issue 11, class 7).

One servewell server with the built-in digits model. A light load (small digit PNGs to /predict,
paced: `--light-clients` normal ones and one `X-Urgency: high` one, each sending every
`--interval-ms`) runs alone, then with `--heavy-clients` closed-loop clients sending a PNG of
about 30 KB that decodes to 4000x4000 pixels. Reported: light and urgent p50/p99 and errors in
both phases, and the heavy clients' answers. Before the decode queue, the issue measured a light
p50 of 7 ms alone and 663 ms under attack (665 ms for urgent requests).

    flock /tmp/servewell-bench.lock .venv/bin/python -m bench.decode_starvation [--server-src DIR]

`--server-src` runs the server from another checkout's `src/` (e.g. the commit before, for a
before/after in one run). Results: bench/results/decode_starvation.json.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from bench.processes import HOST, ServerProcess, free_port
from servewell.perf.httpclient import HttpConnection, encode_request
from servewell.perf.stats import summarize_ms

EXAMPLES = Path(__file__).parents[1] / "src" / "servewell" / "examples" / "images"
RESULTS = Path(__file__).parent / "results"


def heavy_png() -> bytes:
    """A 4000x4000 drawing of a digit: about 30 KB as PNG, 16 megapixels once decoded."""
    image = Image.new("L", (4000, 4000), 255)
    ImageDraw.Draw(image).ellipse((1000, 800, 3000, 3200), outline=0, width=220)
    buffer = io.BytesIO()
    image.save(buffer, "PNG", optimize=True)
    return buffer.getvalue()


def predict_request(port: int, image: bytes, urgent: bool = False) -> bytes:
    body = json.dumps({"image_base64": base64.b64encode(image).decode()}).encode()
    return encode_request("POST", f"{HOST}:{port}", "/predict", body, {"X-Urgency": "high"} if urgent else None)


async def paced_client(
    port: int,
    raw: bytes,
    interval_s: float,
    until: float,
    out: list[tuple[float, int]],
    stages: list[dict[str, float]] | None = None,
) -> None:
    """One request every `interval_s` (or right after the last answer when slower); (ms, status),
    and the server's Server-Timing stages of each answer into `stages`."""
    connection = HttpConnection(HOST, port)
    try:
        next_at = time.monotonic()
        while next_at < until:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            started = time.perf_counter()
            try:
                response = await asyncio.wait_for(connection.request(raw), 30)
                status = response.status
                if stages is not None and response.timings:
                    stages.append(response.timings)
            except (TimeoutError, OSError, ConnectionError):
                status = 0
                connection.close()
                connection = HttpConnection(HOST, port)
            out.append(((time.perf_counter() - started) * 1000, status))
            next_at = max(next_at + interval_s, time.monotonic())
    finally:
        connection.close()


async def closed_client(port: int, raw: bytes, until: float, out: list[tuple[float, int]]) -> None:
    """Requests back to back until `until`."""
    await paced_client(port, raw, 0.0, until, out)


def summary(samples: list[tuple[float, int]], stages: list[dict[str, float]] | None = None) -> dict[str, Any]:
    ok = [ms for ms, status in samples if status == 200]
    statuses: dict[str, int] = {}
    for _, status in samples:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    doc: dict[str, object] = {
        **summarize_ms(ok),
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "statuses": statuses,
    }
    if stages:
        doc["server_p50_ms"] = {k: summarize_ms(s[k] for s in stages if k in s)["p50"] for k in stages[0]}
    return doc


async def phase(port: int, args: argparse.Namespace, light: bytes, heavy: bytes | None) -> dict[str, dict[str, Any]]:
    until = time.monotonic() + args.seconds
    normal: list[tuple[float, int]] = []
    urgent: list[tuple[float, int]] = []
    attack: list[tuple[float, int]] = []
    interval = args.interval_ms / 1000
    normal_stages: list[dict[str, float]] = []
    urgent_stages: list[dict[str, float]] = []
    tasks = [
        paced_client(port, predict_request(port, light), interval, until, normal, normal_stages)
        for _ in range(args.light_clients)
    ]
    tasks.append(paced_client(port, predict_request(port, light, urgent=True), interval, until, urgent, urgent_stages))
    if heavy is not None:
        tasks += [closed_client(port, predict_request(port, heavy), until, attack) for _ in range(args.heavy_clients)]
    await asyncio.gather(*tasks)
    result = {"light": summary(normal, normal_stages), "urgent": summary(urgent, urgent_stages)}
    if heavy is not None:
        result["heavy"] = summary(attack)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="duration of each phase")
    parser.add_argument("--light-clients", type=int, default=2)
    parser.add_argument("--heavy-clients", type=int, default=8)
    parser.add_argument("--interval-ms", type=float, default=50.0, help="pace of each light client")
    parser.add_argument("--server-src", type=Path, default=None, help="run the server from this src/ directory")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "servewell")
    parser.add_argument("--label", default="this checkout")
    args = parser.parse_args()

    RESULTS.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env_src = str(args.server_src.resolve()) if args.server_src else None
    if env_src:
        os.environ["PYTHONPATH"] = env_src + os.pathsep + os.environ.get("PYTHONPATH", "")
    server = ServerProcess(
        "servewell",
        [
            sys.executable,
            "-m",
            "servewell",
            "serve",
            "--host",
            HOST,
            "--port",
            str(port),
            "--cache-dir",
            str(args.cache_dir),
        ],
        port,
        RESULTS / "decode_starvation.log",
    )
    light = sorted(EXAMPLES.glob("*.png"))[0].read_bytes()
    heavy = heavy_png()
    server.start()
    try:
        server.wait_ready(300)
        asyncio.run(phase(port, argparse.Namespace(**{**vars(args), "seconds": 3.0}), light, None))  # warm-up
        alone = asyncio.run(phase(port, args, light, None))
        attacked = asyncio.run(phase(port, args, light, heavy))
    finally:
        server.stop()
    report = {
        "label": args.label,
        "server_src": env_src,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "heavy_png_bytes": len(heavy),
        "alone": alone,
        "attacked": attacked,
    }
    name = "decode_starvation" + ("-" + args.label.replace(" ", "_") if args.label != "this checkout" else "")
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2))
    print(f"{'phase':<10} {'traffic':<8} {'p50 ms':>8} {'p99 ms':>8} {'requests':>9} {'errors':>7}")
    for phase_name, doc in (("alone", alone), ("attacked", attacked)):
        for traffic in ("light", "urgent", "heavy"):
            if traffic in doc:
                s = doc[traffic]
                print(
                    f"{phase_name:<10} {traffic:<8} {_ms(s.get('p50')):>8} {_ms(s.get('p99')):>8} "
                    f"{s['requests']:>9} {s['errors']:>7}  {s['statuses']} {s.get('server_p50_ms', '')}"
                )


def _ms(value: object) -> str:
    return f"{value:.1f}" if isinstance(value, (int, float)) else "-"


if __name__ == "__main__":
    main()
