"""Identical requests in flight share one computation (the response cache's coalescing,
engine/response_cache.py).

A computation belongs to the requests waiting for it, not to the first of them (its leader, whose
`submit` queued it): when the leader's client goes away the computation goes on for the others,
and it is dropped (before compute, if it has not started) only when every request waiting for it
is gone. Each request that joined waits up to its own deadline.

An error of the computation is never shared, since it may be its leader's own (its deadline): the
leader gets it, and the requests still waiting share one new computation, led by the first of them.

Counting: the scheduler counts one outcome per computation, which stands for its leader (or, once
the leader left, for the first request it answers); each other request's outcome is counted
through its own `Count` (success, cancelled, deadline_exceeded).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from servewell.engine.clock import Clock, TimerHandle
from servewell.engine.protocol import RequestResult
from servewell.errors import DeadlineExceeded

log = logging.getLogger("servewell.engine")

#: Queues one computation for a request (the scheduler's submit, bound to that request).
Submit = Callable[[], "asyncio.Future[RequestResult]"]
#: Counts one request's outcome (`observability.metrics.OUTCOMES`).
Count = Callable[[str], None]


def uncounted(outcome: str) -> None:
    """A `Count` that counts nothing."""


def uncounted_done(future: asyncio.Future[RequestResult]) -> None:
    """A done callback that does nothing (a waiter's until it is registered)."""


@dataclass(slots=True, eq=False)
class _Waiter:
    """One request waiting for a computation (the future its caller holds)."""

    future: asyncio.Future[RequestResult]
    submit: Submit
    deadline_at: float
    count: Count
    computation: _Computation | None = None
    timer: TimerHandle | None = None  # its deadline, while the computation's own deadline is another's
    on_done: Callable[[asyncio.Future[RequestResult]], None] = uncounted_done


@dataclass(slots=True, eq=False)
class _Computation:
    key: bytes
    future: asyncio.Future[RequestResult]  # the scheduler's
    leader: _Waiter | None  # whose submit queued it (its deadline is the computation's); None once it left
    waiters: dict[_Waiter, bool] = field(default_factory=dict)  # insertion-ordered, O(1) removal
    ended: bool = False


class SharedComputations:
    """The computations in flight of one cache, by key, and the requests waiting for each."""

    def __init__(self, clock: Clock, answered: Callable[[bytes, RequestResult], None],
                 started: Callable[[], None]) -> None:
        self._clock = clock
        self._answered = answered  # a computation succeeded: the cache keeps its answer
        self._started = started  # a computation was queued: the cache counts a miss
        self._by_key: dict[bytes, _Computation] = {}

    @property
    def in_flight(self) -> int:
        """Computations queued or running."""
        return len(self._by_key)

    def has(self, key: bytes) -> bool:
        """Whether a computation of `key` is in flight."""
        return key in self._by_key

    def settle(self, key: bytes) -> None:
        """Take the end of `key`'s computation now if it ended in this loop turn (its callback has
        not run yet), so that a request arriving now finds its answer kept."""
        computation = self._by_key.get(key)
        if computation is not None and computation.future.done():
            self._ended(computation)

    def lead(self, key: bytes, submit: Submit, deadline_at: float, count: Count) -> asyncio.Future[RequestResult]:
        """Queue a computation of `key` through `submit()` (whose refusal is raised as it is) for
        one request; the future it gets."""
        waiter = _Waiter(asyncio.get_running_loop().create_future(), submit, deadline_at, count)
        self._start(key, waiter)
        self._watch(waiter)
        return waiter.future

    def join(self, key: bytes, deadline_at: float, submit: Submit, count: Count) -> asyncio.Future[RequestResult]:
        """Wait for `key`'s computation (`has(key)`) up to `deadline_at`; `submit` queues this
        request's own computation should that one fail."""
        computation = self._by_key[key]
        waiter = _Waiter(asyncio.get_running_loop().create_future(), submit, deadline_at, count, computation)
        computation.waiters[waiter] = True
        waiter.timer = self._clock.call_at(deadline_at, partial(self._deadline_passed, waiter))
        self._watch(waiter)
        return waiter.future

    def _watch(self, waiter: _Waiter) -> None:
        """Learn when `waiter`'s caller cancels it (its client went away)."""
        waiter.on_done = partial(self._left, waiter)
        waiter.future.add_done_callback(waiter.on_done)

    def _start(self, key: bytes, leader: _Waiter) -> None:
        future = leader.submit()
        self._started()
        computation = _Computation(key, future, leader, {leader: True})
        leader.computation = computation
        self._by_key[key] = computation
        future.add_done_callback(partial(self._ended, computation))

    def _deadline_passed(self, waiter: _Waiter) -> None:
        if not waiter.future.done():
            self._leave(waiter, "deadline_exceeded")
            waiter.future.set_exception(DeadlineExceeded(
                "the request's deadline passed while it waited for the answer of an identical request being "
                "computed"))

    def _left(self, waiter: _Waiter, future: asyncio.Future[RequestResult]) -> None:
        if future.cancelled():  # its client went away
            self._leave(waiter, "cancelled")

    def _leave(self, waiter: _Waiter, outcome: str) -> None:
        """`waiter` ends before its computation answered it."""
        computation = waiter.computation
        if computation is None or not computation.waiters.pop(waiter, False):
            return  # answered already
        if waiter.timer is not None:
            waiter.timer.cancel()
        if computation.leader is waiter:
            computation.leader = None  # the computation goes on for the others
        if not computation.waiters and not computation.future.done():
            # Nobody waits: dropped before compute if it has not started (the scheduler counts it).
            computation.future.cancel()
        else:
            waiter.count(outcome)

    def _ended(self, computation: _Computation, _future: object = None) -> None:
        if computation.ended:
            return
        computation.ended = True
        if self._by_key.get(computation.key) is computation:
            del self._by_key[computation.key]
        for waiter in [w for w in computation.waiters if w.future.cancelled()]:
            self._leave(waiter, "cancelled")  # left in this loop turn, before its callback ran
        waiting = list(computation.waiters)
        computation.waiters.clear()
        for waiter in waiting:
            if waiter.timer is not None:
                waiter.timer.cancel()
                waiter.timer = None
        future = computation.future
        if not future.cancelled() and future.exception() is None:
            result = future.result()
            self._answer(computation.leader, waiting, result)
            try:
                self._answered(computation.key, result)
            except Exception:  # a bug in keeping it must not cost the answers already given
                log.exception("the response cache could not keep an answer")
            return
        leader = computation.leader
        error = None if future.cancelled() else future.exception()
        if error is not None and leader is not None and leader in waiting:
            waiting.remove(leader)
            leader.future.set_exception(error)
        self._regroup(computation.key, waiting)

    def _answer(self, leader: _Waiter | None, waiting: list[_Waiter], result: RequestResult) -> None:
        shared: RequestResult | None = None
        counted = leader is None  # the scheduler's count of the computation still stands for no one
        for waiter in waiting:
            waiter.future.remove_done_callback(waiter.on_done)  # answered: nothing to do when it is done
            if waiter is leader:
                waiter.future.set_result(result)
                continue
            if shared is None:
                shared = dataclasses.replace(result, cache="coalesced")
            waiter.future.set_result(shared)
            if counted:
                counted = False
            else:
                waiter.count("success")

    def _regroup(self, key: bytes, waiting: list[_Waiter]) -> None:
        """The requests that waited for a failed computation share one new computation (or the one
        a request arriving meanwhile started), led by the first whose submit is taken."""
        for index, waiter in enumerate(waiting):
            current = self._by_key.get(key)
            if current is None:
                try:
                    self._start(key, waiter)
                except Exception as exc:  # its own refusal (a full lane, shutting down), counted by the scheduler
                    waiter.future.set_exception(exc)
                    continue
                if waiter.timer is not None:  # its deadline is the computation's now
                    waiter.timer.cancel()
                    waiter.timer = None
                current = self._by_key[key]
                rest = waiting[index + 1:]
            else:
                rest = waiting[index:]
            for follower in rest:
                follower.computation = current
                current.waiters[follower] = True
                if follower.timer is None:
                    follower.timer = self._clock.call_at(follower.deadline_at, partial(self._deadline_passed, follower))
            return
