"""Microseconds of CPU per request that the HTTP protocol itself costs, in-process: uvicorn's
stock httptools protocol (how servewell ran before the limits) against servewell's
`LimitedHttpToolsProtocol`, on the tiny MLP's request bytes over one keep-alive connection.

    python -m bench.protocol_cost [--requests N] [--rounds N]

No sockets and a trivial ASGI app: what differs between the two is exactly the limits' code.
Both run on uvloop, interleaved round after round; the verdict is the median over rounds of
the per-round difference of process CPU time per request (and the best round of each).
Prints a table; returns the numbers
to `bench.http_cost`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import uvloop
from starlette.types import Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from servewell.api.http_limits import HttpLimits, limited_protocol
from servewell.config.server import ServerConfig

BODY = (
    b'{"inputs":[{"name":"input","shape":[1,512],"datatype":"FP32","data":[' + b",".join([b"0.123456"] * 512) + b"]}]}"
)
REQUEST = (
    b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Length: %d\r\n"
    b"Content-Type: application/json\r\n\r\n" % len(BODY)
) + BODY


class SinkTransport(asyncio.Transport):
    """Counts what is written; never closes on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.responses = 0
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if bytes(data[:9]) == b"HTTP/1.1 ":
            self.responses += 1

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """Reads the body, answers 2 bytes."""
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def cpu_us_per_request(protocol_class: type[asyncio.Protocol], requests: int) -> float:
    config = Config(app=app, ws="none", log_config=None)
    config.load()
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})  # type: ignore[call-arg]
    transport = SinkTransport()
    protocol.connection_made(transport)
    started = time.process_time()
    for _ in range(requests):
        protocol.data_received(REQUEST)
        while transport.responses == 0:
            await asyncio.sleep(0)
        transport.responses = 0
    return 1e6 * (time.process_time() - started) / requests


def measure(requests: int = 20_000, rounds: int = 9) -> dict[str, Any]:
    """Per-round CPU us per request of both protocols, and the median of their differences."""
    limited = limited_protocol(HttpLimits.from_settings(ServerConfig()))  # the default limits
    samples: dict[str, list[float]] = {"stock": [], "limited": []}
    for round_index in range(rounds):
        order = [("stock", HttpToolsProtocol), ("limited", limited)]
        for name, cls in order if round_index % 2 == 0 else order[::-1]:
            samples[name].append(uvloop.run(cpu_us_per_request(cls, requests)))
    differences = [lim - stock for lim, stock in zip(samples["limited"], samples["stock"], strict=True)]
    # The fastest round of each is the one least disturbed by neighbours on a shared machine.
    return {
        "samples_us": samples,
        "difference_us": differences,
        "median_difference_us": statistics.median(differences),
        "median_us": {k: statistics.median(v) for k, v in samples.items()},
        "best_us": {k: min(v) for k, v in samples.items()},
        "requests": requests,
        "rounds": rounds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.protocol_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    doc = measure(args.requests, args.rounds)
    print(f"{'HTTP protocol, in-process':<34} {'CPU us/request (median)':>24}")
    print(f"{'uvicorn httptools (before)':<34} {doc['median_us']['stock']:>24.2f}")
    print(f"{'servewell limited httptools':<34} {doc['median_us']['limited']:>24.2f}")
    spread = f"{min(doc['difference_us']):.2f} to {max(doc['difference_us']):.2f}"
    print(f"{'difference (median of rounds)':<34} {doc['median_difference_us']:>24.2f}   range {spread}")
    best = doc["best_us"]
    print(
        f"{'best round of each':<34} {best['stock']:>11.2f} -> {best['limited']:.2f} "
        f"(+{best['limited'] - best['stock']:.2f})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
