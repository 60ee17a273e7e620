"""The alert loop against a real HTTP receiver on 127.0.0.1 (a few lines of asyncio, no framework):
delivery, a receiver that is down, and one that hangs past the timeout while the loop stays free."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

from servewell.config.alerting import AlertingConfig
from servewell.observability.alerting import SignalSnapshot, run_alerting
from waiting import eventually_async


class HttpReceiver:
    """Accepts POSTs, records (path, JSON body), answers 200 after `delay_s`."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.received: list[tuple[str, dict]] = []
        self.arrived = asyncio.Event()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            request_line, *header_lines = head.split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            self.received.append((request_line.split()[1], json.loads(body)))
            self.arrived.set()
            await asyncio.sleep(self.delay_s)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 27\r\n"
                         b"connection: close\r\n\r\n{\"errcode\":0,\"errmsg\":\"ok\"}")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FAILING = [SignalSnapshot("digits", error_ratio=0.5, queue_fill_ratio=0.95)]


def test_alerts_reach_a_wecom_style_receiver():
    async def main():
        receiver = HttpReceiver()
        async with receiver as base:
            config = AlertingConfig(webhook_url=f"{base}/cgi-bin/webhook/send?key=abc", format="wecom",
                                    source="ci", evaluation_interval_s=0.05)
            stop = asyncio.Event()
            task = asyncio.create_task(run_alerting(config, lambda: FAILING, stop))
            await asyncio.wait_for(receiver.arrived.wait(), 10)
            stop.set()
            await asyncio.wait_for(task, 10)
        return receiver.received

    received = asyncio.run(main())
    path, body = received[0]
    assert path == "/cgi-bin/webhook/send?key=abc"
    assert body["msgtype"] == "markdown"
    content = body["markdown"]["content"]
    assert content.startswith("**ci: 2 alert(s)**")
    assert "digits: 50.0% of requests fail with 5xx" in content and "queue 95.0% full" in content


def test_a_receiver_that_is_down_is_logged_and_the_loop_goes_on(caplog):
    caplog.set_level(logging.WARNING, logger="servewell.alerting")
    rounds = 0

    def snapshots():
        nonlocal rounds
        rounds += 1
        return [SignalSnapshot(f"model-{rounds}", error_ratio=0.5)]  # a new model each round: never rate-limited

    async def main():
        config = AlertingConfig(webhook_url=f"http://127.0.0.1:{closed_port()}/hook", evaluation_interval_s=0.02)
        stop = asyncio.Event()
        task = asyncio.create_task(run_alerting(config, snapshots, stop))

        async def three_rounds() -> bool:
            return rounds >= 3

        await eventually_async(three_rounds, 10, "the alerting loop stopped after a failed POST")
        stop.set()
        await asyncio.wait_for(task, 10)

    asyncio.run(main())
    assert rounds >= 3
    assert caplog.text.count("alert webhook at 127.0.0.1 failed: ConnectError") >= 2


def test_a_hanging_receiver_times_out_without_blocking_the_event_loop(caplog):
    caplog.set_level(logging.WARNING, logger="servewell.alerting")

    async def main():
        receiver = HttpReceiver(delay_s=30)
        async with receiver as base:
            config = AlertingConfig(webhook_url=f"{base}/hook", evaluation_interval_s=0.01, timeout_s=0.5)
            stop = asyncio.Event()
            task = asyncio.create_task(run_alerting(config, lambda: FAILING, stop))
            await asyncio.wait_for(receiver.arrived.wait(), 10)
            # while the POST hangs, the loop keeps serving other work on time
            worst_lag = 0.0
            for _ in range(20):
                before = time.monotonic()
                await asyncio.sleep(0.01)
                worst_lag = max(worst_lag, time.monotonic() - before - 0.01)
            async def timed_out() -> bool:
                return "ReadTimeout" in caplog.text

            await eventually_async(timed_out, 10, "the hanging POST was not given up at timeout_s")
            stop.set()
            await asyncio.wait_for(task, 10)
        return worst_lag

    worst_lag = asyncio.run(main())
    assert worst_lag < 0.1
    assert "ReadTimeout" in caplog.text
