"""Hostile clients for `bench.hostile`, run as their own process until SIGTERM (or `--max-s`).

    python -m bench.attacks NAME --port P --out stats.json [--heavy-body FILE] [--light-body FILE]

NAME is one of ATTACKS. Every attack is paced (a fixed number of workers, each with a bounded
rate), because on a 2-core machine the attacker shares the server's CPU: an unpaced attacker
would measure the machine, not the server. Traffic goes to 127.0.0.1 only. On exit every socket
is closed and a small JSON of what was sent is written to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import string
import struct
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import orjson

from bench import attacks_http
from bench.attacks_grpc import grpc_idle_connections, grpc_slowloris
from servewell.perf.httpclient import HttpConnection, ProtocolError, encode_request

HOST = "127.0.0.1"

Attack = Callable[["Context"], Coroutine[Any, Any, None]]


class Context:
    """What every attack worker shares: the target, the stop signal, counters, bodies."""

    def __init__(self, port: int, heavy_body: bytes, light_body: bytes) -> None:
        self.port = port
        self.grpc_port = 0  # set from --grpc-port, for the gRPC attacks
        self.stop = asyncio.Event()
        self.counts: Counter[str] = Counter()
        self.heavy_body = heavy_body
        self.light_body = light_body
        self.random = random.Random(11)

    async def pause(self, seconds: float) -> None:
        """Sleep, waking early when the attack is told to stop."""
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except TimeoutError:
            pass

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        try:
            return await asyncio.wait_for(asyncio.open_connection(HOST, self.port), 5)
        except (OSError, TimeoutError):
            self.counts["connect_failed"] += 1
            return None


def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()


async def oversized_headers(ctx: Context, workers: int = 4, header_mb: int = 50) -> None:
    """Each worker streams one header value of up to `header_mb` MB, then reconnects (at most 5/s)."""
    chunk = b"a" * (1 << 20)

    async def worker() -> None:
        while not ctx.stop.is_set():
            opened = await ctx.open()
            if opened is not None:
                _, writer = opened
                ctx.counts["connections"] += 1
                try:
                    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
                    for _ in range(header_mb):
                        if ctx.stop.is_set():
                            break
                        writer.write(chunk)
                        await writer.drain()
                        ctx.counts["header_mb_written"] += 1
                except OSError:
                    ctx.counts["cut_off"] += 1
                _close(writer)
            await ctx.pause(0.2)

    await asyncio.gather(*(worker() for _ in range(workers)))


async def slowloris(ctx: Context, connections: int = 3000, reopen_per_s: float = 300.0,
                    trickle_every_s: float = 5.0) -> None:
    """Hold `connections` connections that never finish their head; reopen closed ones (paced)."""
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"

    async def holder(index: int) -> None:
        await ctx.pause(index / reopen_per_s)  # ramp up at the reopen rate
        while not ctx.stop.is_set():
            opened = await ctx.open()
            if opened is None:
                await ctx.pause(1.0)
                continue
            reader, writer = opened
            ctx.counts["connections"] += 1
            try:
                writer.write(head)
                while not ctx.stop.is_set():
                    try:
                        data = await asyncio.wait_for(reader.read(4096), trickle_every_s)
                    except TimeoutError:
                        writer.write(b"X-Trickle-%d: 1\r\n" % ctx.random.randrange(10**6))
                        continue
                    if not data:  # closed (after a 503 or a 408, or evicted silently)
                        ctx.counts["closed_by_server"] += 1
                        break
            except OSError:
                ctx.counts["closed_by_server"] += 1
            _close(writer)
            await ctx.pause(connections / reopen_per_s * ctx.random.random())

    await asyncio.gather(*(holder(i) for i in range(connections)))


async def _closed_loop(ctx: Context, workers: int, per_worker_rps: float | None,
                       make: Callable[[], bytes]) -> None:
    async def worker() -> None:
        connection = HttpConnection(HOST, ctx.port)
        try:
            while not ctx.stop.is_set():
                started = time.monotonic()
                try:
                    response = await asyncio.wait_for(connection.request(make()), 30)
                    ctx.counts[f"status_{response.status}"] += 1
                except (OSError, TimeoutError, ValueError, ProtocolError, asyncio.IncompleteReadError) as exc:
                    # the attack goes on whatever the server does
                    ctx.counts[f"client_{type(exc).__name__}"] += 1
                    connection.close()
                if per_worker_rps:
                    await ctx.pause(max(0.0, 1.0 / per_worker_rps - (time.monotonic() - started)))
        finally:
            connection.close()

    await asyncio.gather(*(worker() for _ in range(workers)))


async def heavy_decode(ctx: Context) -> None:
    """Eight clients in a closed loop, each posting a PNG that decodes to 4000x4000 pixels."""
    host = f"{HOST}:{ctx.port}"
    request = encode_request("POST", host, "/predict", ctx.heavy_body)
    await _closed_loop(ctx, 8, None, lambda: request)


def _random_name(rng: random.Random) -> str:
    if rng.random() < 0.02:
        return "".join(rng.choices(string.ascii_letters, k=50_000))  # now and then a 50 KB name
    return "".join(rng.choices(string.ascii_lowercase + string.digits, k=rng.randrange(8, 64)))


async def label_flood(ctx: Context) -> None:
    """Random model names in URLs and /predict bodies: four clients, 200 requests/s in all."""
    host = f"{HOST}:{ctx.port}"
    image = orjson.loads(ctx.light_body)["image_base64"]

    def make() -> bytes:
        name = _random_name(ctx.random)
        kind = ctx.random.randrange(3)
        if kind == 0 and len(name) < 4000:
            return encode_request("GET", host, f"/v2/models/{name}")
        if kind == 1 and len(name) < 4000:
            return encode_request("POST", host, f"/v2/models/{name}/infer", b'{"inputs": []}')
        return encode_request("POST", host, "/predict", orjson.dumps({"image_base64": image, "model": name}))

    await _closed_loop(ctx, 4, 50.0, make)


async def mass_disconnects(ctx: Context, workers: int = 10, per_worker_rps: float = 10.0) -> None:
    """Clients that drop mid-upload (half a body sent) or mid-wait (whole request, no reading)."""
    host = f"{HOST}:{ctx.port}"
    whole = encode_request("POST", host, "/predict", ctx.light_body)
    big = b'{"image_base64": "' + b"A" * 200_000 + b'"}'
    half_upload = encode_request("POST", host, "/predict", big)[: 100_000]

    async def worker() -> None:
        while not ctx.stop.is_set():
            opened = await ctx.open()
            if opened is not None:
                _, writer = opened
                mid_wait = ctx.random.random() < 0.5
                try:
                    writer.write(whole if mid_wait else half_upload)
                    await writer.drain()
                    await asyncio.sleep(0.01 if mid_wait else 0.05)  # the server has it, then we leave
                    sock = writer.get_extra_info("socket")
                    if sock is not None:  # an abortive close (RST), as a crashed client's kernel sends
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    ctx.counts["mid_wait" if mid_wait else "mid_upload"] += 1
                except OSError:
                    ctx.counts["write_failed"] += 1
                writer.transport.abort()
            await ctx.pause(1.0 / per_worker_rps)

    await asyncio.gather(*(worker() for _ in range(workers)))


ATTACKS: dict[str, Attack] = {
    "oversized_headers": oversized_headers,
    "slowloris": slowloris,
    "heavy_decode": heavy_decode,
    "label_flood": label_flood,
    "mass_disconnects": mass_disconnects,
    "grpc_idle_connections": grpc_idle_connections,
    "grpc_slowloris": grpc_slowloris,
    "pipelining": attacks_http.pipelining,
    "slow_bodies": attacks_http.slow_bodies,
}


async def run(name: str, ctx: Context, max_s: float) -> None:
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, ctx.stop.set)
    loop.call_later(max_s, ctx.stop.set)
    task = loop.create_task(ATTACKS[name](ctx))
    await ctx.stop.wait()
    # The attack stops at once: requests in flight are abandoned, not awaited (their sockets close
    # with the process), so the server's recovery is measured from the moment the attack ends.
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.attacks", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(ATTACKS))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--heavy-body", type=Path, required=True, help="/predict body with the 4000x4000 PNG")
    parser.add_argument("--light-body", type=Path, required=True, help="/predict body with a small image")
    parser.add_argument("--max-s", type=float, default=120.0, help="stop by itself after this long")
    parser.add_argument("--grpc-port", type=int, default=0, help="the server's gRPC port (gRPC attacks)")
    args = parser.parse_args(argv)
    ctx = Context(args.port, args.heavy_body.read_bytes(), args.light_body.read_bytes())
    ctx.grpc_port = args.grpc_port
    started = time.monotonic()
    asyncio.run(run(args.name, ctx, args.max_s))
    args.out.write_text(json.dumps({"attack": args.name, "seconds": round(time.monotonic() - started, 2),
                                    "counts": dict(ctx.counts)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
