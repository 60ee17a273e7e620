"""One view of the whole server: what ingress processes recorded, absorbed by the engine.

An ingress process records the HTTP side (request latency, preprocess/postprocess, outcomes
refused before the scheduler, API keys, auth failures, fast-path counts, the console's recent
slow/failed requests and refusals); the engine computes `/metrics`, the console's state and
alerting (an ingress's route asks for them as control operations, engine/control.py). Each
process's `ConsoleFeed` has a `ViewSources` (`feed.view`):

- in an ingress, `view.snapshot()` is a `ViewSnapshot` of its own data (picklable);
- in the engine, `view.absorb(source, snapshot)` keeps each source's latest and `view.retire(source)`
  folds a dead one's last into a permanent base (`metrics_merge.py` for the rules); every reader
  (the families' `collect()` and `snapshot()`, so `/metrics`, the console feed, alerting signals;
  the recent rings) then sees the sum, as if it were one process. With no source (one process)
  every reader sees exactly what it saw before.
- the read paths (`GET /metrics`, `GET /console/api/state`, the console feed's tick, the alert
  evaluation) `await view.refresh()` first: it runs the refresher the engine installed with
  `set_refresher` (ask every ingress for a snapshot, absorb them), at most one at a time, and
  waits for it at most `timeout_s` (1 s): a slow or hung ingress never hangs `/metrics`, which
  then serves what was absorbed. Without a refresher it returns at once.

Source names: use one per process, `f"ingress-{index}-{pid}"`: a restart is then a new source and
the supervisor `retire`s the old name when it sees the process die. A restart under the same name
is handled too (the snapshot's incarnation differs: the old one's is folded into the base first),
but a name per pid also keeps the two apart in logs. Requests an ingress served after its last
absorbed snapshot and before it died are not counted (a pull model: ask a draining ingress for
one last snapshot before it exits to close that gap).

Each request is recorded by one process only: the ingress process that accepted it serves every
route itself (the engine has no HTTP app: admin and view routes reach it as control operations,
engine/control.py), so its middleware records it, and the engine records none; in the
single-process server that one process does.

Figures (this machine, 2 shared cores, best of 5; `MEASURE=1 pytest -s tests/unit/observability/
test_view_sources.py -k pickle` prints a rougher set): an ingress with 3 models x 3 lanes x 5
outcomes, 6 routes x 3 status classes, 4 API keys, every family populated (147 series) and both
rings full: `ServeMetrics.snapshot()` 0.13 ms, `ViewSources.snapshot()` 0.20 ms, and pickled
0.56 ms, 43 KB (metrics 8 KB, rings 31 KB); on the engine, unpickling it 0.44 ms, absorbing two
such sources and summing them 0.85 ms; then reading every family (`collect()`) costs what one
process holding the same series costs (4.7 ms both: the sums are cached until the next absorb).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from servewell.observability.metrics import ServeMetrics
from servewell.observability.metrics_merge import MetricsSnapshot
from servewell.observability.process import rss_bytes
from servewell.observability.recent_requests import RecentRequests, RecentSnapshot

log = logging.getLogger("servewell.metrics")

#: How long a read path waits for the refresher before it serves what was absorbed: a scrape
#: timeout is 10 s by default in Prometheus, the console polls every 2 s.
REFRESH_TIMEOUT_S = 1.0
#: A refresh that failed or ran late is logged at most once per this many seconds.
WARN_EVERY_S = 60.0

Refresher = Callable[[], Awaitable[None]]


@dataclass(slots=True, frozen=True)
class ViewSnapshot:
    """Everything of one process that the engine's views show, cumulative since it started (plain
    data: picklable). Bounded: the recent rings hold at most 200 + 50 records (about 130 bytes
    pickled each: 31 KB when full), the metrics one entry per label set, bounded by the label
    values (models, lanes, outcomes, route templates, status classes, key ids): 43 KB in all for
    3 models with full rings (8 KB of metrics; each further model adds about 2 KB)."""

    metrics: MetricsSnapshot | None  # None where metrics are turned off
    recent: RecentSnapshot
    pid: int
    taken_at: float  # Unix time
    rss_bytes: int = 0  # the process's resident memory (the console's frontend memory adds it up)


class ViewSources:
    """This process's views and what it absorbed from others (see the module docstring)."""

    def __init__(self, metrics: ServeMetrics | None, recent: RecentRequests) -> None:
        self.metrics = metrics
        self.recent = recent
        self._refresher: Refresher | None = None
        self._timeout_s = REFRESH_TIMEOUT_S
        self._running: asyncio.Task[None] | None = None
        self._warned_at = float("-inf")
        self._rss: dict[str, int] = {}  # the latest of each live source

    def snapshot(self) -> ViewSnapshot:
        """This process's own data (never what it absorbed): what an ingress hands the engine."""
        return ViewSnapshot(self.metrics.snapshot() if self.metrics is not None else None,
                            self.recent.view_snapshot(), os.getpid(), time.time(), rss_bytes())

    def absorb(self, source: str, snapshot: ViewSnapshot) -> bool:
        """Keep `snapshot` as `source`'s latest; False when it was dropped as stale (an older
        snapshot than the one kept) or as a retired incarnation's."""
        kept = self.recent.absorb(source, snapshot.recent)
        if self.metrics is not None and snapshot.metrics is not None:
            kept = self.metrics.absorb(source, snapshot.metrics) or kept
        if kept:
            self._rss[source] = snapshot.rss_bytes
        return kept

    def retire(self, source: str) -> None:
        """`source` died (or will send no more): what it counted stays in every view for good."""
        self.recent.retire(source)
        self._rss.pop(source, None)
        if self.metrics is not None:
            self.metrics.retire(source)

    def sources(self) -> list[str]:
        """The live sources absorbed, by name."""
        return sorted(self._rss)

    def absorbed_rss_bytes(self) -> int:
        """The resident memory the live sources last reported, added up (0 in one process)."""
        return sum(self._rss.values())

    def absorbed_rss(self) -> dict[str, int]:
        """The resident memory each live source last reported, by source name."""
        return dict(self._rss)

    def set_refresher(self, refresher: Refresher | None, timeout_s: float = REFRESH_TIMEOUT_S) -> None:
        """Install (None: remove) the coroutine function `refresh()` runs before every read."""
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self._refresher, self._timeout_s = refresher, timeout_s

    async def refresh(self) -> None:
        """Run the refresher (or join the one running) and wait for it at most `timeout_s`; its
        failure or lateness is logged, never raised: the caller serves what was absorbed. The
        refresh goes on after a timeout, and a caller that is cancelled does not cancel it."""
        refresher = self._refresher
        if refresher is None:
            return
        running = self._running
        if running is None or running.done():
            # An empty context: the refresher's log lines are not about the request that woke it.
            running = self._running = asyncio.get_running_loop().create_task(
                self._run(refresher), context=contextvars.Context())
        # asyncio.wait, not wait_for: it leaves the refresh running on a timeout and, on Python
        # 3.11, wait_for swallows a cancellation that arrives as the awaited task finishes (the
        # console feed's task went on ticking after its cancel in a test).
        done, _ = await asyncio.wait((running,), timeout=self._timeout_s)
        if not done:
            self._warn("view refresh took over %.1f s; serving what was absorbed", self._timeout_s)

    async def _run(self, refresher: Refresher) -> None:
        try:
            await refresher()
        except Exception:  # a broken source must not break /metrics or the console
            self._warn("view refresh failed; serving what was absorbed", exc_info=True)

    def _warn(self, message: str, *args: object, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning(message, *args, exc_info=exc_info)
