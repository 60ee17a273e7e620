"""Which image decode runs next, so heavy decodes cannot starve light or urgent requests.

Decoding used to go straight into one FIFO thread pool, before the lanes: eight clients sending a
PNG that decodes to 4000x4000 (about 0.2 s of CPU each) pushed light `/predict` p50 from 7 ms to
663 ms, urgent requests included. Here every decode is a job whose cost (the pixels it will
produce, read from the header) is known before it waits:

- order: first-lane (urgent) jobs, then light ones (at most `light_pixels`), then heavy ones;
  first come, first served within each;
- slots: a heavy job that is not urgent may use all decode threads but one, so one thread is
  always left for urgent and light work (with a single thread there is nothing to reserve);
- CPU: heavy jobs run in their own threads at a lower CPU priority (`decode_heavy_nice`; Linux nice
  values are per thread), so what they take is what light requests, the event loop and the
  workers leave: with eight clients decoding 4000x4000 PNGs on two cores, a light `/predict`'s
  p99 went from 2.4x its unloaded value to 0.87x (`python -m bench.hostile --rounds 3`, median);
- bound: at most `max_waiting` jobs wait (urgent ones have their own bound of the same size);
  past it a request is refused at once with 503 `overloaded` and a `Retry-After` from the
  measured decode rate, before its body is decoded (`/predict` checks before reading it too).

`DecodeQueue` is the pure, synchronous rule (unit-tested without threads); `DecodeScheduler` runs
it on the event loop in front of a thread pool that it never gives more jobs than it has threads.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from servewell.errors import Overloaded

T = TypeVar("T")

#: Decodes up to this many pixels are "light" (a 1000x1000 image: about 10 ms here), and never
#: wait behind heavy ones.
LIGHT_PIXELS = 1_000_000
#: Kinds of job, in the order they are served.
URGENT, LIGHT, HEAVY = 0, 1, 2


@dataclass(slots=True, eq=False)
class DecodeJob(Generic[T]):
    """One request's decoding: its work, its cost and where its result goes."""

    work: Callable[[], T]
    pixels: int
    kind: int
    future: asyncio.Future[T] | None = None
    enqueued_at: float = field(default=0.0)


class DecodeQueue:
    """The pure rule: what may wait, and what runs next."""

    def __init__(self, threads: int, max_waiting: int, light_pixels: int = LIGHT_PIXELS) -> None:
        self.threads = threads
        self.max_waiting = max_waiting
        self.light_pixels = light_pixels
        self._waiting: tuple[deque[DecodeJob[Any]], ...] = (deque(), deque(), deque())
        self.running = 0
        self._running_heavy = 0
        # Decode seconds per megapixel, smoothed: what a Retry-After is estimated from.
        self._s_per_mpx = 0.012

    def kind(self, pixels: int, urgent: bool) -> int:
        """URGENT, LIGHT or HEAVY for a job of `pixels` from the first lane (`urgent`) or not."""
        return URGENT if urgent else LIGHT if pixels <= self.light_pixels else HEAVY

    def waiting(self, urgent: bool = False) -> int:
        """Jobs waiting that count against the bound of urgent (or other) requests."""
        if urgent:
            return len(self._waiting[URGENT])
        return len(self._waiting[LIGHT]) + len(self._waiting[HEAVY])

    def check(self, urgent: bool) -> None:
        """Refuse (`Overloaded`) a request whose decode could not wait now."""
        if self.waiting(urgent) >= self.max_waiting:
            raise Overloaded(
                f"{self.waiting(urgent)} image decodes are waiting, the limit; try again shortly",
                retry_after_s=self.drain_estimate_s(),
            )

    def push(self, job: DecodeJob[Any]) -> None:
        """Queue a job (`Overloaded` when its bound is reached)."""
        self.check(job.kind == URGENT)
        self._waiting[job.kind].append(job)

    def discard(self, job: DecodeJob[Any]) -> bool:
        """Drop a waiting job (its request went away); False if it is not waiting."""
        try:
            self._waiting[job.kind].remove(job)
        except ValueError:
            return False
        return True

    def pop_runnable(self) -> DecodeJob[Any] | None:
        """The next job to start now, or None when every slot it could use is taken."""
        if self.running >= self.threads:
            return None
        for kind in (URGENT, LIGHT, HEAVY):
            queue = self._waiting[kind]
            if not queue:
                continue
            if kind == HEAVY and self._running_heavy >= max(1, self.threads - 1):
                return None  # the last thread stays free for urgent and light work
            job = queue.popleft()
            self.running += 1
            self._running_heavy += kind == HEAVY
            return job
        return None

    def finished(self, job: DecodeJob[Any], seconds: float) -> None:
        """A started job ended after `seconds` of decoding."""
        self.running -= 1
        self._running_heavy -= job.kind == HEAVY
        if job.pixels >= 10_000:
            rate = seconds / (job.pixels / 1e6)
            self._s_per_mpx += 0.2 * (rate - self._s_per_mpx)

    def drain_estimate_s(self) -> float:
        """Seconds until what waits now would have been decoded, at the measured rate."""
        pixels = sum(job.pixels for queue in self._waiting for job in queue)
        return pixels / 1e6 * self._s_per_mpx / max(1, self.threads)


class DecodeScheduler:
    """Runs decode jobs on `executor` in `DecodeQueue` order, heavy ones on `heavy_executor` when
    given (one event loop; not thread-safe)."""

    def __init__(self, executor: Executor, threads: int, max_waiting: int, light_pixels: int = LIGHT_PIXELS,
                 heavy_executor: Executor | None = None) -> None:
        self._executor = executor
        self._heavy_executor = heavy_executor or executor
        self.queue = DecodeQueue(threads, max_waiting, light_pixels)

    def check(self, urgent: bool) -> None:
        """Refuse (`Overloaded`) at once when a decode could not wait now (before reading a body)."""
        self.queue.check(urgent)

    async def run(self, work: Callable[[], T], *, pixels: int, urgent: bool) -> T:
        """Run `work` (a decode of `pixels`) in the pool when its turn comes; its result."""
        loop = asyncio.get_running_loop()
        job: DecodeJob[T] = DecodeJob(work, pixels, self.queue.kind(pixels, urgent), loop.create_future())
        self.queue.push(job)
        self._pump(loop)
        assert job.future is not None
        try:
            return await job.future
        except asyncio.CancelledError:
            self.queue.discard(job)  # a job already running finishes; its result is dropped
            raise

    def _pump(self, loop: asyncio.AbstractEventLoop) -> None:
        while (job := self.queue.pop_runnable()) is not None:
            if job.future is not None and job.future.done():  # cancelled while it waited
                self.queue.finished(job, 0.0)
                continue
            executor = self._heavy_executor if job.kind == HEAVY else self._executor
            running = loop.run_in_executor(executor, job.work)
            running.add_done_callback(functools.partial(self._done, loop, job, time.perf_counter()))

    def _done(self, loop: asyncio.AbstractEventLoop, job: DecodeJob[Any], started: float,
              done: asyncio.Future[Any]) -> None:
        self.queue.finished(job, time.perf_counter() - started)
        future = job.future
        if future is not None and not future.done():
            if done.cancelled():
                future.cancel()
            elif (exc := done.exception()) is not None:
                future.set_exception(exc)
            else:
                future.set_result(done.result())
        self._pump(loop)
