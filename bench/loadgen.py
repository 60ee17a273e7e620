"""Load generator, run as its own process: closed loop (N clients) or open loop (Poisson arrivals).

    python -m bench.loadgen --url http://127.0.0.1:8000 --path /predict --body-file img.json \\
        --mode open --rate 20 --duration-s 10 --urgent-fraction 0.05 --model resnet50 --out r.json

The loops themselves (open loop with seeded Poisson arrivals and latency from the scheduled
arrival, closed loop, bounds, warm-up, unfinished and client_saturated counts) are
`servewell.perf.loop`, shared with `servewell bench`; this module adds what `make bench`
needs on top: urgent-lane traffic, the server's stage timings per class, and /healthz facts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import orjson

from servewell.perf import loop as load_loop
from servewell.perf.httpclient import encode_request, fetch
from servewell.perf.loop import LoadShape, Recorder
from servewell.perf.oip_http import HttpOipConnection
from servewell.perf.stats import completion_rate, summarize_ms

URGENT, NORMAL = "urgent", "normal"
SERVER_STAGES = ("preprocess", "queue", "compute", "total")


@dataclass(slots=True)
class LoadSpec:
    """One load run, as the command line describes it."""

    host: str
    port: int
    path: str
    bodies: list[bytes]
    mode: str
    concurrency: int
    rate: float
    duration_s: float
    warmup_s: float
    urgent_fraction: float
    timeout_ms: float | None
    model: str | None
    max_connections: int
    max_requests: int
    grace_s: float
    seed: int
    headers: dict[str, str] = field(default_factory=dict)  # sent with every request
    think_s: float = 0.0  # closed loop: each client's wait after an answer


class RequestMaker:
    """Pre-encoded requests: every body variant, as a normal and as an urgent request."""

    def __init__(self, spec: LoadSpec) -> None:
        extra = {**spec.headers, **({"X-Request-Timeout-Ms": f"{spec.timeout_ms:g}"} if spec.timeout_ms else {})}
        host = f"{spec.host}:{spec.port}"
        self._normal = [encode_request("POST", host, spec.path, b, extra) for b in spec.bodies]
        self._urgent = [encode_request("POST", host, spec.path, b, {**extra, "X-Urgency": "high"}) for b in spec.bodies]
        self._fraction = spec.urgent_fraction
        self._random = random.Random(spec.seed)
        self._next = 0

    def next(self) -> tuple[str, bytes]:
        """The class and bytes of the next request (body variants in turn, urgency at random)."""
        self._next += 1
        if self._fraction > 0 and self._random.random() < self._fraction:
            return URGENT, self._urgent[self._next % len(self._urgent)]
        return NORMAL, self._normal[self._next % len(self._normal)]


async def _health(spec: LoadSpec) -> dict | None:
    try:
        response = await fetch(spec.host, spec.port, "GET", "/healthz", timeout_s=10.0)
        return orjson.loads(response.body)
    except Exception:  # the report says the server did not answer; that is a result too
        return None


def _model_facts(health: dict | None, model: str | None) -> dict:
    if health is None:
        return {"answered": False}
    facts: dict = {"answered": True, "frontend_rss_bytes": health.get("frontend_rss_bytes")}
    entry = (health.get("models") or {}).get(model or "")
    if entry:
        facts.update(state=entry.get("state"), rss_bytes=entry.get("rss_bytes"), scheduler=entry.get("scheduler"))
    return facts


async def run_load(spec: LoadSpec) -> dict:
    """Run the load and return the summary document."""
    loop = asyncio.get_running_loop()
    before = await _health(spec)
    maker = RequestMaker(spec)
    shape = LoadShape("closed" if spec.mode == "closed" else "open", concurrency=max(1, spec.concurrency),
                      rate=spec.rate if spec.rate > 0 else 1.0,
                      duration_s=spec.duration_s, warmup_s=spec.warmup_s, max_requests=spec.max_requests,
                      grace_s=spec.grace_s, max_connections=spec.max_connections, seed=spec.seed,
                      think_s=spec.think_s)
    wall_started = time.time()
    recorder = await load_loop.run_load(shape, lambda: HttpOipConnection(spec.host, spec.port), maker)
    elapsed_s = loop.time() - recorder.started
    after = await _health(spec)
    doc = summarize(spec, recorder)
    doc.update(started_at=wall_started, elapsed_s=round(elapsed_s, 3),
               server_before=_model_facts(before, spec.model), server_after=_model_facts(after, spec.model))
    doc["mean_batch_size"] = _mean_batch(doc["server_before"], doc["server_after"])
    return doc


def _mean_batch(before: dict, after: dict) -> float | None:
    b, a = before.get("scheduler"), after.get("scheduler")
    if not b or not a or a["batches"] <= b["batches"]:
        return None
    return round((a["rows"] - b["rows"]) / (a["batches"] - b["batches"]), 3)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def summarize(spec: LoadSpec, recorder: Recorder) -> dict:
    """Throughput, latency percentiles per class, status and error counts of the measured window."""
    window_s = recorder.window_end - recorder.window_start
    # Latencies and error counts belong to requests that *arrived* in the window; throughput
    # counts answers *completed* in it, whenever their request arrived.
    ok_done_in_window = sum(1 for o in recorder.outcomes if o.ok and recorder.in_window(o.done))
    outcomes = [o for o in recorder.outcomes if recorder.in_window(o.arrival)]
    answered = len(outcomes)
    classes = {}
    for kind in (NORMAL, URGENT):
        mine = [o for o in outcomes if o.kind == kind]
        if not mine and kind == URGENT:
            continue
        ok = [o for o in mine if o.ok]
        refused = [o for o in mine if o.code == "overloaded"]
        classes[kind] = {
            "answered": len(mine),
            "ok": len(ok),
            "latency_ms": summarize_ms(o.latency_ms for o in ok),
            "refusal_latency_ms": summarize_ms(o.latency_ms for o in refused),
        }
        # What the server says each answered request spent where: compute is the batch's run
        # time on the worker; client latency minus the server's total is HTTP + event-loop wait.
        for stage in SERVER_STAGES:
            classes[kind][f"{stage}_ms"] = summarize_ms(o.timings[stage] for o in ok
                                                        if o.timings and stage in o.timings)
        classes[kind]["outside_server_ms"] = summarize_ms(
            o.latency_ms - o.timings["total"] for o in ok if o.timings and "total" in o.timings
        )
        if spec.timeout_ms:
            classes[kind]["ok_over_deadline"] = sum(1 for o in ok if o.latency_ms > spec.timeout_ms)
    statuses = Counter(o.status for o in outcomes)  # "200", "503", ...; "client": no HTTP answer
    codes = Counter(o.code for o in outcomes if o.code is not None)
    return {
        "mode": spec.mode,
        "path": spec.path,
        "model": spec.model,
        "concurrency": spec.concurrency if spec.mode == "closed" else None,
        "think_ms": spec.think_s * 1000 if spec.mode == "closed" else None,
        "rate": spec.rate if spec.mode == "open" else None,
        "duration_s": spec.duration_s,
        "warmup_s": spec.warmup_s,
        "window_s": round(window_s, 3),
        "urgent_fraction": spec.urgent_fraction,
        "timeout_ms": spec.timeout_ms,
        "sent": recorder.sent,
        "arrivals_in_window": recorder.arrivals_in_window,
        "offered_rps": round(recorder.arrivals_in_window / window_s, 3),
        "answered_in_window": answered,
        "unfinished": recorder.arrivals_in_window - recorder.saturated_in_window - answered,
        "client_saturated": recorder.saturated_in_window,
        "connections_opened": len(recorder.connections),
        "keepalive_retries": sum(c.retries for c in recorder.connections),
        "throughput_rps": round(ok_done_in_window / window_s, 3),
        "completion_rate_rps": _round(completion_rate(o.done for o in recorder.outcomes
                                                      if o.ok and recorder.in_window(o.done))),
        "status_counts": dict(sorted(statuses.items())),
        "error_codes": dict(sorted(codes.items())),
        "classes": classes,
    }


def parse_args(argv: list[str] | None = None) -> tuple[LoadSpec, Path | None]:
    """The command line as a `LoadSpec`, and where to write the summary (None: stdout)."""
    p = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000 (loopback only)")
    p.add_argument("--path", default="/predict", help="request path")
    p.add_argument("--body-file", action="append", required=True, type=Path,
                   help="request body (repeatable; used in turn)")
    p.add_argument("--mode", choices=("closed", "open"), required=True)
    p.add_argument("--concurrency", type=int, default=8, help="closed loop: clients")
    p.add_argument("--think-ms", type=float, default=0.0, help="closed loop: each client's wait after an answer")
    p.add_argument("--rate", type=float, default=10.0, help="open loop: mean arrivals per second")
    p.add_argument("--duration-s", type=float, default=10.0, help="arrivals stop after this many seconds")
    p.add_argument("--warmup-s", type=float, default=1.0, help="arrivals in the first seconds are not recorded")
    p.add_argument("--urgent-fraction", type=float, default=0.0, help="share of requests sent with X-Urgency: high")
    p.add_argument("--timeout-ms", type=float, default=None, help="deadline sent as X-Request-Timeout-Ms")
    p.add_argument("--model", default=None, help="model whose /healthz counters give the mean batch size")
    p.add_argument("--max-connections", type=int, default=256, help="open loop: connection pool cap")
    p.add_argument("--max-requests", type=int, default=200_000, help="hard cap on requests sent")
    p.add_argument("--grace-s", type=float, default=10.0, help="wait this long for answers after the end")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--header", action="append", default=[], metavar="NAME:VALUE",
                   help="header sent with every request (repeatable), e.g. Inference-Header-Content-Length:120")
    p.add_argument("--out", type=Path, default=None, help="write the summary JSON here (default: stdout)")
    args = p.parse_args(argv)
    url = urlsplit(args.url)
    if url.hostname not in ("127.0.0.1", "localhost", "::1"):
        p.error("the benchmark sends traffic to loopback addresses only")
    if args.mode == "closed" and args.concurrency < 1 or args.mode == "open" and args.rate <= 0:
        p.error("closed loop needs --concurrency >= 1, open loop --rate > 0")
    if not 0 <= args.warmup_s < args.duration_s:
        p.error("--warmup-s must be shorter than --duration-s")
    if not 0 <= args.think_ms <= 60_000:
        p.error("--think-ms must be between 0 and 60000")
    spec = LoadSpec(
        url.hostname, url.port or 80, args.path, [f.read_bytes() for f in args.body_file], args.mode,
        args.concurrency, args.rate, args.duration_s, args.warmup_s, args.urgent_fraction, args.timeout_ms,
        args.model, args.max_connections, args.max_requests, args.grace_s, args.seed,
        dict(_header(p, h) for h in args.header), args.think_ms / 1000,
    )
    return spec, args.out


def _header(parser: argparse.ArgumentParser, text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip() or any(c in text for c in "\r\n"):
        parser.error(f"--header {text!r}: expected NAME:VALUE on one line")
    return name.strip(), value.strip()


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the load, write the summary."""
    spec, out = parse_args(argv)
    doc = asyncio.run(run_load(spec))
    text = json.dumps(doc, indent=2)
    if out is None:
        print(text)
    else:
        out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
