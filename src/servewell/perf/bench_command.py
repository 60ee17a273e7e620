"""`servewell bench TARGET`: a closed-loop concurrency sweep or an open-loop rate sweep against
any OIP v2 server (servewell, Triton, MLServer), over HTTP (JSON or binary tensors) or gRPC.

TARGET is a URL (`http://HOST:PORT`, `grpc://HOST:PORT`) or a model directory (or repository),
which is served by its own `servewell serve` for the length of the run (on free ports unless
--port / --grpc-port; --load-timeout-s for a model slow to load). SIGTERM or SIGINT stop that
server and remove its temporary directory before bench exits (128 + the signal's number).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

from servewell.cpu_limit import cpu_quota, usable_cpus
from servewell.observability.process import tree_cpu_seconds
from servewell.perf.commands import DEFAULT_CONCURRENCY, REQUESTS_ONLY_DURATION_S
from servewell.perf.inputs import InputError, parse_shape_overrides
from servewell.perf.local_server import LocalServerError
from servewell.perf.loop import LoadShape
from servewell.perf.oip_http import ServerError
from servewell.perf.progress import Progress
from servewell.perf.report import (
    MissingDependency,
    plot_latency_vs_throughput,
    require_matplotlib,
    step_points,
    steps_table,
    write_csv,
    write_json,
)
from servewell.perf.stop_signals import Stopped, stop_on_signals
from servewell.perf.sweep import StepResult, run_sweep
from servewell.perf.target import Endpoint, InputChoice, parse_endpoint, prepare_target, start_local

#: The longest --idle-ms: a minute between requests says all there is to say about idleness.
MAX_IDLE_MS = 60_000


def machine_facts() -> dict[str, Any]:
    """The CPUs this run could use (`cpus`: the affinity mask and the container's CPU limit, what
    `servewell plan` takes as the measured node's cores) beside the machine's own count."""
    quota = cpu_quota()
    return {"cpus": usable_cpus(), "machine_cpus": os.cpu_count(), "cpu_limit": quota}


def _levels(text: str, kind: type[int] | type[float], flag: str) -> list[float]:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{flag} takes positive numbers, got {text!r}")
    return [float(v) for v in values]


def parse_headers(texts: list[str]) -> dict[str, str]:
    """`Name: value` options as a dict (names with anything but token characters refused)."""
    headers = {}
    for text in texts:
        name, colon, value = text.partition(":")
        name = name.strip()
        if not colon or not name or not all(c.isalnum() or c in "-_" for c in name) or "\n" in value:
            raise ValueError(f"--header {text!r} must look like 'Name: value'")
        headers[name] = value.strip()
    return headers


def load_shapes(args: argparse.Namespace) -> list[LoadShape]:
    """The steps the flags ask for."""
    duration = args.duration_s if args.duration_s is not None else (
        REQUESTS_ONLY_DURATION_S if args.requests else 10.0)
    common: dict[str, Any] = {
        "duration_s": duration, "warmup_s": min(args.warmup_s, duration / 2),
        "max_requests": args.requests or 10_000_000, "timeout_s": args.timeout_ms / 1000.0,
        "grace_s": args.timeout_ms / 1000.0 + 1.0, "max_connections": args.max_connections, "seed": args.seed,
    }
    idle = args.idle_ms
    if args.rate is not None:
        if idle is not None:
            raise ValueError("--idle-ms goes with a closed loop (--concurrency), not --rate")
        return [LoadShape("open", rate=r, **common) for r in _levels(args.rate, float, "--rate")]
    levels = _levels(DEFAULT_CONCURRENCY if args.concurrency is None else args.concurrency, int, "--concurrency")
    thinks = [] if idle is None else _levels(idle, float, "--idle-ms")
    if any(ms > MAX_IDLE_MS for ms in thinks):
        raise ValueError(f"--idle-ms takes at most {MAX_IDLE_MS} ms")
    return [LoadShape("closed", concurrency=int(c), **common) for c in levels] + [
        LoadShape("closed", concurrency=1, think_s=ms / 1000, **common) for ms in thinks]


def idle_points(results: list[StepResult], shapes: list[LoadShape]) -> list[dict[str, Any]]:
    """The `--idle-ms` steps as the curve's idle points (`servewell plan` reads them)."""
    return [{"idle_ms": shape.think_s * 1000, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms,
             "server_cpu_ms_per_request": r.server_cpu_ms_per_request}
            for r, shape in zip(results, shapes, strict=True) if shape.think_s > 0 and r.p50_ms is not None]


def input_choice(args: argparse.Namespace) -> InputChoice:
    """The inputs the flags ask for."""
    return InputChoice(npy=args.npy, images=args.images, image_input=args.image_input, batch_size=args.batch_size,
                       dynamic_size=args.dynamic_size, shapes=parse_shape_overrides(args.shapes), seed=args.seed)


async def _bench(endpoint: Endpoint, args: argparse.Namespace, model: str | None, shapes: list[LoadShape],
                 progress: Progress, server_pid: int | None) -> tuple[list[StepResult], dict[str, Any]]:
    headers = parse_headers(args.headers)
    target, described = await prepare_target(endpoint, model, args.model_version, args.fmt, input_choice(args),
                                              headers, args.timeout_ms / 1000.0)
    try:
        progress.note(f"benchmarking model '{target.model.name}' at {target.url} ({target.protocol}/{target.fmt}), "
                      f"{len(shapes)} step(s) of {shapes[0].duration_s:g} s")
        cpu_before = time.process_time()
        # a local server's CPU per request at each step tells `servewell plan` how its work per
        # request falls as requests arrive together
        results = await run_sweep(target, shapes, progress,
                                  None if server_pid is None else lambda: tree_cpu_seconds(server_pid))
        client_cpu_s = time.process_time() - cpu_before
    finally:
        await target.client.close()
    doc = {
        "model": {"name": target.model.name, "platform": target.model.platform,
                  "max_batch_size": target.model.max_batch_size,
                  "inputs": [asdict(t) for t in target.model.inputs]},
        "target": {"url": target.url, "protocol": target.protocol, "format": target.fmt},
        "inputs": {**described, "batch_size": args.batch_size},
        # this process's CPU per request sent (warm-ups included): with a local server it shared the
        # cores, and `servewell plan` takes it out of the curve
        "client_cpu_s_per_request": client_cpu_s / max(1, sum(r.sent for r in results)),
    }
    return results, doc


def check_local_flags(args: argparse.Namespace, local: bool) -> None:
    """The flags of the server bench starts go with a model directory only."""
    if local:
        return
    given = [flag for flag, value in (("--port", args.port), ("--grpc-port", args.grpc_port),
                                      ("--load-timeout-s", args.load_timeout_s)) if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)} set the server bench starts for a model directory; "
                         f"{args.target!r} is a running server's URL")


def run_bench(args: argparse.Namespace) -> int:
    """Entry point of `servewell bench`: on SIGTERM or SIGINT the server it started is stopped and
    its temporary directory removed (the `with` blocks unwind), and it exits with 128 + the signal."""
    try:
        with stop_on_signals():
            return _run_bench(args)
    except Stopped as stopped:
        print(f"servewell bench: stopped by {stopped.name}", file=sys.stderr)
        return 128 + stopped.signum


def _run_bench(args: argparse.Namespace) -> int:
    try:
        shapes = load_shapes(args)
        parse_headers(args.headers)
        check_local_flags(args, Path(args.target).is_dir())
        if args.out is not None and not args.no_plot:
            require_matplotlib()
    except (ValueError, MissingDependency) as exc:
        print(f"servewell bench: {exc}", file=sys.stderr)
        return 2
    progress = Progress(quiet=args.quiet)
    started = datetime.datetime.now(datetime.UTC)
    with ExitStack() as stack, progress:
        try:
            local = Path(args.target).is_dir()
            ready_s: float | None = None
            server_pid: int | None = None
            model = args.model
            if local:
                progress.note(f"starting servewell for {args.target} ...")
                server, found = start_local(Path(args.target), stack, args.out, args.protocol == "grpc",
                                            port=args.port or 0, grpc_port=args.grpc_port or 0,
                                            load_timeout_s=args.load_timeout_s)
                model = model or found
                endpoint = Endpoint(args.protocol or "http", "127.0.0.1",
                                    server.grpc_port if args.protocol == "grpc" else server.port)
                ready_s = None if server.started_s is None else round(server.started_s, 2)
                server_pid = server.pid
                progress.note(f"servewell ready in {ready_s} s (pid {server.pid})")
            else:
                endpoint = parse_endpoint(args.target, args.protocol)
            results, doc = asyncio.run(_bench(endpoint, args, model, shapes, progress, server_pid))
        except (ValueError, ServerError, InputError, LocalServerError, OSError) as exc:
            progress.clear()
            print(f"servewell bench: {exc}", file=sys.stderr)
            return 1
    ladder = [r for r, shape in zip(results, shapes, strict=True) if shape.think_s == 0]
    print(steps_table(ladder))
    idle = idle_points(results, shapes)
    for point in idle:
        print(f"idle {point['idle_ms']:g} ms between requests: p50 {point['p50_ms']:.2f} ms, "
              f"p99 {point['p99_ms']:.2f} ms")
    doc = {"tool": "servewell bench", "started_at": started.isoformat(timespec="seconds"),
           "machine": machine_facts(), **doc, "local_server": local,
           "local_server_ready_s": ready_s,  # start -> ready: the cold start `servewell plan` uses
           "settings": {"mode": shapes[0].mode, "levels": [s.level for s in shapes if s.think_s == 0],
                        "idle_ms": [s.think_s * 1000 for s in shapes if s.think_s > 0],
                        "duration_s": shapes[0].duration_s, "warmup_s": shapes[0].warmup_s,
                        "max_requests": args.requests, "timeout_ms": args.timeout_ms},
           "steps": [asdict(r) for r in ladder], "idle": idle}
    if args.out is not None:
        write_json(doc, args.out / "results.json")
        write_csv(ladder, args.out / "results.csv")
        written = ["results.json", "results.csv"]
        if not args.no_plot:
            title = (f"{doc['model']['name']} at {doc['target']['url']} ({doc['target']['protocol']}/"
                     f"{doc['target']['format']}), {shapes[0].mode} loop, {doc['machine']['cpus']} CPUs")
            plot_latency_vs_throughput({"": step_points(ladder)}, title, args.out / "latency_vs_throughput.png")
            written.append("latency_vs_throughput.png")
        print(f"\nwrote {', '.join(str(args.out / w) for w in written)}")
    if not any(r.ok for r in results):
        print("servewell bench: no request succeeded", file=sys.stderr)
        return 1
    return 0
