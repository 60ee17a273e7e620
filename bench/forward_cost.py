"""CPU per request that the ingress → engine hop adds to a small GET (api/forward.py), in-process.

    flock /tmp/servewell-bench.lock .venv/bin/python -m bench.forward_cost [--requests 2000] [--rounds 5]

One process, one uvloop event loop: a tiny Starlette app (the engine's stand-in, a 40-byte JSON
answer) served by uvicorn on a unix socket and on 127.0.0.1, and `EngineForwarder` served by
uvicorn on 127.0.0.1 in front of the unix socket. A minimal keep-alive client sends `--requests`
sequential GETs straight to the app ("direct") and through the forwarder ("forwarded"), in
alternating order round after round. The process's CPU time (user + system) covers client,
servers and app alike, so the difference per request is exactly what forwarding adds: the
ingress's HTTP parse and write, the forwarder, and the engine's side of the unix-socket
connection. Verdict: the median over rounds of that difference. JSON:
bench/results/forward_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import uvicorn
import uvloop
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from servewell.api.forward import EngineForwarder

RESULTS = Path(__file__).resolve().parent / "results"
REQUEST = b"GET /tiny HTTP/1.1\r\nhost: 127.0.0.1\r\naccept: */*\r\nuser-agent: bench\r\n\r\n"


async def tiny(request: Request) -> Response:
    return JSONResponse({"status": "ok", "ready": True, "models": 1})


async def start(app: Any, **where: Any) -> tuple[uvicorn.Server, asyncio.Task[None]]:
    config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, **where)
    server = uvicorn.Server(config)
    sockets = None
    if "uds" not in where:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        listener.bind(("127.0.0.1", 0))
        sockets = [listener]
    task = asyncio.ensure_future(server.serve(sockets=sockets))
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task


def port_of(server: uvicorn.Server) -> int:
    port: int = server.servers[0].sockets[0].getsockname()[1]
    return port


async def drive(port: int, requests: int) -> tuple[float, float]:
    """CPU seconds and wall seconds of `requests` sequential GETs on one keep-alive connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(requests):
        writer.write(REQUEST)
        head = await reader.readuntil(b"\r\n\r\n")
        at = head.index(b"content-length: ") + 16
        body = await reader.readexactly(int(head[at:head.index(b"\r\n", at)]))
        assert body.startswith(b'{"status":"ok"'), body
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    writer.close()
    return cpu, wall


async def measure(requests: int, rounds: int) -> dict[str, Any]:
    app = Starlette(routes=[Route("/tiny", tiny)])
    with tempfile.TemporaryDirectory(prefix="sw-fwd-bench-") as directory:
        path = str(Path(directory) / "engine.sock")
        engine_uds = await start(app, uds=path)
        engine_tcp = await start(app)
        forwarder = EngineForwarder(path)
        front = await start(forwarder)
        targets = {"direct": port_of(engine_tcp[0]), "forwarded": port_of(front[0])}
        for port in targets.values():
            await drive(port, 200)  # warm up
        per_round: list[dict[str, float]] = []
        for round_index in range(rounds):
            order = list(targets) if round_index % 2 == 0 else list(reversed(targets))
            row: dict[str, float] = {}
            for name in order:
                cpu, wall = await drive(targets[name], requests)
                row[f"{name}_cpu_us"] = cpu / requests * 1e6
                row[f"{name}_wall_us"] = wall / requests * 1e6
            row["added_cpu_us"] = row["forwarded_cpu_us"] - row["direct_cpu_us"]
            per_round.append(row)
            print(f"round {round_index + 1}: direct {row['direct_cpu_us']:.0f} us CPU/request, forwarded "
                  f"{row['forwarded_cpu_us']:.0f} us, added {row['added_cpu_us']:.0f} us "
                  f"(wall {row['direct_wall_us']:.0f} / {row['forwarded_wall_us']:.0f} us)")
        for server, task in (front, engine_tcp, engine_uds):
            server.should_exit = server.force_exit = True
            await task
        forwarder.close()
    summary = {key: statistics.median(row[key] for row in per_round) for key in per_round[0]}
    return {"requests_per_round": requests, "rounds": per_round, "median": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    result = uvloop.run(measure(args.requests, args.rounds))
    median = result["median"]
    print(f"median: direct {median['direct_cpu_us']:.0f} us CPU per request, forwarded "
          f"{median['forwarded_cpu_us']:.0f} us: forwarding adds {median['added_cpu_us']:.0f} us")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "forward_cost.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
