"""Refusals (503: overloaded, not ready, deadline, ...) logged as one line per model, code, tenant
and second, with a count.

Under overload every refused request used to log its own warning: 3,878 lines in one 10-second
overload of `make bench`, flooding log pipelines exactly when they matter. The metrics
(`servewell_requests_total{outcome="rejected"}`, the request histogram) stay exact per request;
the log says what happened and how often.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable
from dataclasses import dataclass

#: Schedules `callback` after `delay_s` seconds (the event loop's `call_later` by default).
Scheduler = Callable[[float, Callable[[], None]], object]


@dataclass(slots=True)
class _Window:
    count: int
    example: str
    status: int


class RefusalDigest:
    """Counts refusals per (model, code, tenant) over a window and logs each window once, at its end."""

    def __init__(self, logger: logging.Logger, window_s: float = 1.0, schedule: Scheduler | None = None) -> None:
        self._log = logger
        self.window_s = window_s
        self._schedule = schedule
        self._open: dict[tuple[str, str, str | None], _Window] = {}

    def refused(self, model: str, code: str, status: int, message: str, tenant: str | None = None) -> None:
        """Note one refusal of `tenant`'s request (None: not known, "": requests without a key);
        the first of a window schedules that window's log line."""
        key = (model, code, tenant)
        window = self._open.get(key)
        if window is not None:
            window.count += 1
            return
        self._open[key] = _Window(1, message, status)
        schedule = self._schedule or loop_call_later
        schedule(self.window_s, lambda: self._flush(key))

    def flush_all(self) -> None:
        """Log every open window now (at shutdown, or in tests)."""
        for key in list(self._open):
            self._flush(key)

    def _flush(self, key: tuple[str, str, str | None]) -> None:
        window = self._open.pop(key, None)
        if window is None:
            return
        model, code, tenant = key
        whose = "" if tenant is None else f", tenant {tenant or '-'}"
        self._log.warning(
            "refused %d request(s) with %s in %.0f s (model %s%s), e.g.: %s", window.count, code, self.window_s,
            model or "-", whose, window.example,
            extra={"code": code, "status": window.status, "count": window.count, "window_s": self.window_s,
                   "model": model or None, "tenant": None if tenant is None else (tenant or "-")},
        )


def loop_call_later(delay_s: float, callback: Callable[[], None]) -> object:
    """The default `Scheduler`: the running event loop's `call_later`, in an empty context (a
    window's line is about many requests, not the one that opened the window)."""
    return asyncio.get_running_loop().call_later(delay_s, callback, context=contextvars.Context())
