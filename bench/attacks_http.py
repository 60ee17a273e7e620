"""HTTP/1.1 attacks on one connection's budget (issue 19, items 8 and 9), for `bench.attacks`.

- `pipelining`: connections that pipeline thousands of GETs and never read an answer (the
  server once queued every request it parsed: 200,000 took it from 97 to 705 MB);
- `slow_bodies`: /predict requests that declare 100 KB and send one byte every few seconds (the
  server once gave each a connection slot for the whole body timeout, and 1,100 of them locked
  complete requests out).

Both are paced and bounded like the other attacks (a fixed number of workers, a bounded rate),
send only to 127.0.0.1, and stop when the context says so.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.attacks import Context


def _abort(writer: asyncio.StreamWriter) -> None:
    writer.transport.abort()  # nothing unsent is waited for: the point was never to read


async def pipelining(ctx: Context, connections: int = 4, per_write: int = 2000, writes_per_s: float = 10.0,
                     max_requests: int = 200_000) -> None:
    """`connections` connections, each writing `per_write` pipelined GETs at most `writes_per_s`
    times a second without reading, up to `max_requests` on one connection; a closed one is reopened."""
    batch = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n" * per_write

    async def worker() -> None:
        while not ctx.stop.is_set():
            opened = await ctx.open()
            if opened is None:
                await ctx.pause(1.0)
                continue
            _, writer = opened
            ctx.counts["connections"] += 1
            sent = 0
            try:
                while not ctx.stop.is_set() and sent < max_requests:
                    writer.write(batch)
                    # A server that stops reading fills the socket buffers: drain then waits, bounded.
                    await asyncio.wait_for(writer.drain(), 5)
                    sent += per_write
                    ctx.counts["requests_written"] += per_write
                    await ctx.pause(1.0 / writes_per_s)
                ctx.counts["stalled_or_done"] += 1
            except TimeoutError:
                ctx.counts["writes_blocked"] += 1  # the server reads no more of it: fine, start anew
            except OSError:
                ctx.counts["closed_by_server"] += 1
            _abort(writer)
            await ctx.pause(0.2)

    await asyncio.gather(*(worker() for _ in range(connections)))


async def slow_bodies(ctx: Context, connections: int = 1100, reopen_per_s: float = 300.0,
                      byte_every_s: float = 3.0, declared_bytes: int = 100_000) -> None:
    """Hold `connections` /predict requests whose `declared_bytes` body comes one byte every
    `byte_every_s` seconds; a closed one is reopened (at most `reopen_per_s` a second in all)."""
    head = (b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n{" % declared_bytes)

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
                        data = await asyncio.wait_for(reader.read(4096), byte_every_s)
                    except TimeoutError:
                        writer.write(b" ")
                        ctx.counts["bytes_trickled"] += 1
                        continue
                    if not data:
                        ctx.counts["closed_by_server"] += 1
                        break
                    ctx.counts["answered_" + data[9:12].decode("latin-1", "replace")] += 1
            except OSError:
                ctx.counts["closed_by_server"] += 1
            _abort(writer)
            await ctx.pause(connections / reopen_per_s * ctx.random.random())

    await asyncio.gather(*(holder(i) for i in range(connections)))
