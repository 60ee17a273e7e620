"""Waiting for something that happens in another process or thread, without a copied loop.

`eventually` replaces "deadline + sleep" loops: it calls a probe until the probe returns
something truthy, returns that, and fails with a message that says what never happened.
A probe may raise to fail at once (a process that exited will not become ready).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

Message = str | Callable[[], str]


def _text(message: Message, timeout_s: float) -> str:
    detail = message() if callable(message) else message
    return f"not within {timeout_s:g} s: {detail}"


def eventually(probe: Callable[[], T | None], timeout_s: float, message: Message, interval_s: float = 0.2) -> T:
    """Call `probe` every `interval_s` until it returns a truthy value, and return that value.

    After `timeout_s` raise AssertionError with `message` (a string, or a callable that makes one
    then, e.g. with the tail of a log). The probe runs at least once, however short the timeout.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(_text(message, timeout_s))
        time.sleep(interval_s)


async def eventually_async(probe: Callable[[], Awaitable[T | None]], timeout_s: float, message: Message,
                           interval_s: float = 0.01) -> T:
    """`eventually` inside an event loop, for a coroutine function `probe`; waits with
    `asyncio.sleep`, so the loop keeps running the code under test meanwhile."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(_text(message, timeout_s))
        await asyncio.sleep(interval_s)
