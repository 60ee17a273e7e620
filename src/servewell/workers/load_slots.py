"""Worker loads take turns, and a load that timed out or crashed is tried again later.

A worker's start (spawn, imports, model load, warm-up) keeps a core busy for a second or more.
Started all at once, thirteen python models on 2 cores each took the others' start-up as their
own, and twelve of them passed a 10 s load timeout that each would have met alone in 0.8-3 s
(issue 45). So an engine's worker starts share `LoadSlots`: at most `limit` run at once (by
default one per usable CPU), the others wait their turn in order, and a load's timeout counts
from its turn (`acquire` says when it began), never the time it queued. Every start takes a
turn: an eager start, a reload, a version, a lazy load, a restart.

`LoadRetryPolicy` says when a load that failed for a reason that may pass (it ran out of time,
its process died) is tried again: a bounded number of attempts with exponential backoff. A load
the model itself refused (an exception in its setup, a missing file) fails at once: the same
files would fail the same way. Bounded rather than forever, because a model that never loads in
time would otherwise take a core from the served models for its whole timeout at every retry;
an operator's load (the repository API) still loads it at any time.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from servewell.config.server import ServerConfig
from servewell.cpu_limit import usable_cpus

#: Longest wait between two attempts of one load, however many failed before.
MAX_RETRY_DELAY_S = 60.0


@dataclass(slots=True, frozen=True)
class LoadRetryPolicy:
    """`attempts` in all for a load that fails in a way that may pass; waits `first_delay_s`
    before the second, doubling each time up to `max_delay_s`."""

    attempts: int = 3
    first_delay_s: float = 2.0
    max_delay_s: float = MAX_RETRY_DELAY_S

    def delay_before(self, attempt: int) -> float | None:
        """Seconds to wait before attempt number `attempt` (the first is 1); None: no such
        attempt (they are used up)."""
        if attempt <= 1:
            return 0.0
        if attempt > self.attempts:
            return None
        return min(self.max_delay_s, self.first_delay_s * 2.0 ** (attempt - 2))


class LoadSlots:
    """At most `limit` worker loads at once; the others wait first come, first served.

    `acquire` returns when this load may begin (and the time it began, on `clock`); each
    `acquire` is matched by one `release`. A slot passes straight from the load that releases it
    to the one that waited longest, so a later arrival never overtakes a waiting one. A waiter
    cancelled before its turn leaves the line; one cancelled just after its turn came gives the
    slot on."""

    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic) -> None:
        if limit < 1:
            raise ValueError("at least one load must be able to run")
        self.limit = limit
        self._clock = clock
        self._running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def running(self) -> int:
        """Loads holding a slot now."""
        return self._running

    @property
    def waiting(self) -> int:
        """Loads waiting for a slot now."""
        return sum(1 for w in self._waiters if not w.done())

    async def acquire(self) -> float:
        """Wait for a slot; the time (on the clock) this load's turn began."""
        # A slot is free only while nobody waits: a release hands it to the first waiter instead.
        if self._running < self.limit:
            self._running += 1
            return self._clock()
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release()  # the slot was handed to us as we were cancelled: hand it on
            else:
                self._forget(turn)
            raise
        return self._clock()

    def release(self) -> None:
        """A load that held a slot is over (loaded or failed)."""
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot changes hands: `running` stays
                return
        self._running = max(0, self._running - 1)

    def _forget(self, turn: asyncio.Future[None]) -> None:
        try:
            self._waiters.remove(turn)
        except ValueError:
            pass


def load_slots_for(settings: ServerConfig) -> LoadSlots:
    """The engine's load slots: `max_loading_workers`, by default one per usable CPU."""
    return LoadSlots(settings.max_loading_workers or usable_cpus())


def load_retry_for(settings: ServerConfig) -> LoadRetryPolicy:
    """The engine's load retries: `load_attempts`, `load_retry_backoff_s`."""
    return LoadRetryPolicy(settings.load_attempts, settings.load_retry_backoff_s)
