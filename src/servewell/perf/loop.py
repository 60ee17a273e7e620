"""The load loops: closed (N clients) or open (seeded Poisson arrivals), over any transport.

Open loop: arrivals follow a seeded Poisson process at `rate`, whether or not earlier
requests have finished, and latency counts from the *scheduled* arrival time, so neither
server-side nor client-side queueing is hidden. Each arrival takes a free connection from a
pool capped at `max_connections`; an arrival that finds none is counted as
`client_saturated` (reported, never silently dropped). The arrivals are timed by a thread of their
own (`ArrivalClock`), not by `asyncio.sleep`: the event loop's timers wake through epoll, whose
timeout is whole milliseconds rounded up, so every send would start 0.6 ms late on average (p99
1.3 ms, measured on an idle 2-core VM) and that lateness would count as latency.

Closed loop: `concurrency` clients each send their next request when the previous one has
been answered (`think_s` later, if set); this measures saturation throughput, and with one client
and a think time, what a request costs when it finds the server idle.

Every loop is bounded by `duration_s` and `max_requests`; requests still unanswered
`grace_s` after the end are cancelled and counted as unfinished. Requests that arrive during
the first `warmup_s` seconds are sent but not recorded. A request that takes longer than
`timeout_s` is abandoned by the client and counted with status `timeout`.

While a loop runs, Python's cyclic garbage collector is off in the load generator
(`collector_paused`): its pauses would count as the server's latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

#: How often the progress callback is called while a step runs.
TICK_S = 0.25


@dataclass(slots=True, frozen=True)
class Reply:
    """What a transport says about one answered request."""

    status: str  # "200", "503" over HTTP; "OK", "UNAVAILABLE" over gRPC
    ok: bool
    code: str | None = None  # the server's machine-readable error code, when it sent one
    timings: dict[str, float] | None = None  # Server-Timing entries (ms), when sent


class Connection(Protocol):
    """One client's channel: an HTTP keep-alive socket, or a handle on a shared gRPC channel."""

    @property
    def retries(self) -> int:
        """Requests resent because the server had closed an idle connection."""

    async def connect(self) -> None:
        """Open the channel ahead of the first request (optional: `send` connects lazily)."""

    async def send(self, payload: Any) -> Reply:
        """Send one prepared request and wait for its answer."""

    def close(self) -> None:
        """Release the channel (no waiting)."""


class RequestSource(Protocol):
    """Where the next request comes from: its class (for per-class statistics) and payload."""

    def next(self) -> tuple[str, Any]:
        """(class, prepared payload) of the next request."""


@dataclass(slots=True)
class RoundRobin:
    """A `RequestSource` that sends prepared payloads in turn, all of one class."""

    payloads: list[Any]
    kind: str = "normal"
    _next: int = 0

    def next(self) -> tuple[str, Any]:
        """The next payload in turn."""
        self._next += 1
        return self.kind, self.payloads[self._next % len(self.payloads)]


@dataclass(slots=True, frozen=True)
class LoadShape:
    """One step of load: closed loop at `concurrency` or open loop at `rate`, and its bounds."""

    mode: Literal["closed", "open"]
    concurrency: int = 1
    rate: float = 0.0
    duration_s: float = 10.0
    warmup_s: float = 1.0
    max_requests: int = 200_000
    timeout_s: float | None = None
    grace_s: float = 10.0
    max_connections: int = 256
    seed: int = 1
    think_s: float = 0.0  # closed loop: each client waits this long after an answer before sending again

    def __post_init__(self) -> None:
        if self.mode == "closed" and self.concurrency < 1:
            raise ValueError("a closed loop needs concurrency >= 1")
        if self.mode == "open" and self.rate <= 0:
            raise ValueError("an open loop needs rate > 0")
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError("warmup_s must be at least 0 and shorter than duration_s")
        if self.max_requests < 1 or self.max_connections < 1:
            raise ValueError("max_requests and max_connections must be at least 1")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        if not 0 <= self.think_s <= 60:
            raise ValueError("think_s must be between 0 and 60 s")

    @property
    def level(self) -> float:
        """The load level this step is swept over: clients (closed) or arrivals per second (open)."""
        return float(self.concurrency) if self.mode == "closed" else self.rate


@dataclass(slots=True)
class Outcome:
    """One answered request: class, scheduled arrival and completion (loop time), status."""

    kind: str
    arrival: float
    done: float
    status: str
    ok: bool
    code: str | None
    timings: dict[str, float] | None

    @property
    def latency_ms(self) -> float:
        """From the (scheduled) arrival to the answer."""
        return (self.done - self.arrival) * 1000.0


@dataclass(slots=True)
class Recorder:
    """Every answered request, the measured window, and the counters of what never got an answer."""

    started: float
    window_start: float
    window_end: float
    outcomes: list[Outcome] = field(default_factory=list)
    connections: list[Connection] = field(default_factory=list)
    sent: int = 0
    ok_answers: int = 0  # successful answers so far (for the progress display)
    client_saturated: int = 0
    saturated_in_window: int = 0
    arrivals_in_window: int = 0
    capped: bool = False  # the step ended at max_requests rather than at duration_s
    warmup_dropped: bool = False  # the cap came before the warm-up ended, so the window starts at 0

    def in_window(self, at: float) -> bool:
        """Whether a loop time lies in the measured window."""
        return self.window_start <= at < self.window_end

    @property
    def answered(self) -> int:
        """Requests answered so far (any status)."""
        return len(self.outcomes)


Tick = Callable[[Recorder, float], None]


async def _send(connection: Connection, kind: str, payload: Any, arrival: float, recorder: Recorder,
                timeout_s: float | None) -> None:
    loop = asyncio.get_running_loop()
    try:
        if timeout_s is None:
            reply = await connection.send(payload)
        else:
            reply = await asyncio.wait_for(connection.send(payload), timeout_s)
    except asyncio.CancelledError:
        raise
    except TimeoutError:
        recorder.outcomes.append(Outcome(kind, arrival, loop.time(), "timeout", False, "client_timeout", None))
        return
    except Exception as exc:  # a reset or refused connection is a result to report, not a crash
        recorder.outcomes.append(Outcome(kind, arrival, loop.time(), "client", False,
                                         f"client:{type(exc).__name__}", None))
        return
    recorder.outcomes.append(Outcome(kind, arrival, loop.time(), reply.status, reply.ok, reply.code, reply.timings))
    recorder.ok_answers += reply.ok


async def _closed_loop(shape: LoadShape, connect: Callable[[], Connection], source: RequestSource,
                       recorder: Recorder) -> None:
    loop = asyncio.get_running_loop()
    end = recorder.started + shape.duration_s

    async def client() -> None:
        connection = connect()
        recorder.connections.append(connection)
        await asyncio.sleep(max(0.0, recorder.started - loop.time()))  # every client starts with the clock
        try:
            while loop.time() < end and recorder.sent < shape.max_requests:
                kind, payload = source.next()
                recorder.sent += 1
                arrival = loop.time()
                if recorder.in_window(arrival):
                    recorder.arrivals_in_window += 1
                await _send(connection, kind, payload, arrival, recorder, shape.timeout_s)
                if shape.think_s:
                    await asyncio.sleep(shape.think_s)
        finally:
            connection.close()

    tasks = [loop.create_task(client()) for _ in range(shape.concurrency)]
    await _finish(tasks, end + shape.grace_s)
    recorder.capped = recorder.sent >= shape.max_requests


def poisson_offsets(rng: random.Random, shape: LoadShape) -> Iterator[float]:
    """Seeded Poisson arrival offsets (s) within the step, at most `max_requests` of them, drawn as
    they are needed (a long step at a high rate would be millions)."""
    offset = rng.expovariate(shape.rate)
    count = 0
    while offset < shape.duration_s and count < shape.max_requests:
        yield offset
        count += 1
        offset += rng.expovariate(shape.rate)


class ArrivalClock:
    """Hands the loop each scheduled arrival when it is due, timed by a thread of its own.

    The thread sleeps with the OS's sub-millisecond precision and wakes the loop through
    `call_soon_threadsafe`; the loop's own timers (epoll, whole milliseconds rounded up) would
    start every send late. `next()` answers the next due arrival (loop time), None after the last.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, arrivals: Iterable[float]) -> None:
        self._loop = loop
        self._arrivals = arrivals
        self._due: asyncio.Queue[float | None] = asyncio.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="arrival-clock", daemon=True)

    def start(self) -> None:
        """Start handing out arrivals."""
        self._thread.start()

    def _run(self) -> None:
        put = self._due.put_nowait
        for arrival in self._arrivals:
            # the loop's clock is time.monotonic; wait(0) only says whether the clock was stopped
            if self._stop.wait(max(0.0, arrival - time.monotonic())):
                return
            self._loop.call_soon_threadsafe(put, arrival)
        if not self._stop.is_set():
            self._loop.call_soon_threadsafe(put, None)

    async def next(self) -> float | None:
        """The next arrival once it is due; None when there are no more."""
        return await self._due.get()

    def stop(self) -> bool:
        """Stop the thread (at once: it sleeps on an event); whether it has ended."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        return not self._thread.is_alive()


async def _open_loop(shape: LoadShape, connect: Callable[[], Connection], source: RequestSource,
                     recorder: Recorder) -> None:
    loop = asyncio.get_running_loop()
    rng = random.Random(shape.seed + 1)
    tasks: set[asyncio.Task[None]] = set()

    # Open a few connections before the clock starts, so the first arrivals do not pay for connecting.
    idle = [connect() for _ in range(min(shape.max_connections, 16))]
    recorder.connections.extend(idle)
    await asyncio.gather(*(c.connect() for c in idle), return_exceptions=True)
    opened = len(idle)

    async def one(connection: Connection, kind: str, payload: Any, arrival: float) -> None:
        try:
            await _send(connection, kind, payload, arrival, recorder, shape.timeout_s)
        finally:
            idle.append(connection)

    start = max(recorder.started, loop.time())
    clock = ArrivalClock(loop, (start + offset for offset in poisson_offsets(rng, shape)))
    clock.start()
    try:
        while (arrival := await clock.next()) is not None:
            in_window = recorder.in_window(arrival)
            if in_window:
                recorder.arrivals_in_window += 1
            kind, payload = source.next()
            if idle:
                connection = idle.pop()
            elif opened < shape.max_connections:
                connection = connect()
                recorder.connections.append(connection)
                opened += 1
            else:
                recorder.client_saturated += 1
                recorder.saturated_in_window += in_window
                continue
            recorder.sent += 1
            task = loop.create_task(one(connection, kind, payload, arrival))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        clock.stop()
    recorder.capped = recorder.sent + recorder.client_saturated >= shape.max_requests
    await _finish(list(tasks), start + shape.duration_s + shape.grace_s)
    for connection in idle:
        connection.close()


async def _finish(tasks: list[asyncio.Task[None]], give_up_at: float) -> int:
    """Wait for `tasks` until `give_up_at` (loop time), then cancel the rest; returns how many were cancelled."""
    pending = [t for t in tasks if not t.done()]
    if not pending:
        return 0
    _, still = await asyncio.wait(pending, timeout=max(0.0, give_up_at - asyncio.get_running_loop().time()))
    for task in still:
        task.cancel()
    if still:
        await asyncio.wait(still, timeout=2.0)
    return len(still)


async def _ticker(recorder: Recorder, tick: Tick) -> None:
    loop = asyncio.get_running_loop()
    while True:
        tick(recorder, loop.time() - recorder.started)
        await asyncio.sleep(TICK_S)


async def run_load(shape: LoadShape, connect: Callable[[], Connection], source: RequestSource,
                   tick: Tick | None = None) -> Recorder:
    """Run one step of load and return what was recorded.

    `connect` makes a new (lazily connecting) `Connection`; `tick` is called about four times
    a second with the recorder and the seconds since the step started (for a progress display).
    """
    loop = asyncio.get_running_loop()
    with collector_paused():  # first: its collection before the step must not delay the first arrivals
        start = loop.time() + 0.05
        recorder = Recorder(start, start + shape.warmup_s, start + shape.duration_s)
        ticker = loop.create_task(_ticker(recorder, tick)) if tick is not None else None
        try:
            if shape.mode == "closed":
                await _closed_loop(shape, connect, source, recorder)
            else:
                await _open_loop(shape, connect, source, recorder)
        finally:
            if ticker is not None:
                ticker.cancel()
    if recorder.capped:
        _close_window_at_cap(recorder)
    return recorder


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a step of load runs, collected once before and once
    after. A load generator holds thousands of requests in flight, so a full collection walks them
    all: one paused `bench.tenant_fairness`'s generator 138 ms, and every request it had in flight
    or due then counted the pause as the server's latency (its worst samples, all at that moment).
    Reference counting still frees nearly all a request allocates; the collection after frees the
    rest."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        gc.collect()


def _close_window_at_cap(recorder: Recorder) -> None:
    """A step that ended at its request cap ends its window at its last answer, not at duration_s.

    If the cap came before the warm-up was over, the warm-up is dropped: a window of every
    request is better than an empty one (and the report says so).
    """
    last = max((o.done for o in recorder.outcomes), default=recorder.window_start)
    recorder.window_end = min(recorder.window_end, last + 1e-6)
    if recorder.window_end <= recorder.window_start:
        recorder.window_start = recorder.started
        recorder.warmup_dropped = True
        recorder.arrivals_in_window = recorder.sent + recorder.client_saturated
        recorder.saturated_in_window = recorder.client_saturated
