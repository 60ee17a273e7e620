"""`GET /metrics` without holding the event loop: the text written in slices, the loop served between.

With 200 models the engine's exposition is some 35,000 lines. prometheus-client's
`generate_latest` wrote them in one call on the event loop that every model's requests pass
through: 130-300 ms of the engine's loop per scrape, measured by a stall watcher under issue 21's
pool benchmark (a Prometheus scraping every 15 s would stall every model that often). Now:

* servewell's own families (`LoopHistogram`, `LoopCounter`) write their text themselves from
  line prefixes kept per series (`loop_metrics.render_chunks`), byte for byte what
  `generate_latest` writes for them; other collectors (process, GC, the per-model gauges read at
  scrape time) still go through `generate_latest`, one metric family at a time;
* `render_text` hands the loop back (`await asyncio.sleep(0)`) whenever it has written for
  `SLICE_S` since it last did, so a request that arrives mid-scrape waits at most about one slice;
* a collector with `collect_off_loop` (the per-model gauges, `StateCollector`) does its slow part
  (the workers' /proc reads) on a thread and says where it may be interrupted while it builds
  its families (after each model);
* a gauge family of many series is written `FAMILY_CHUNK` series at a time, its header once:
  what `generate_latest` writes for a gauge is its header, then one line per series, so the
  pieces join to the same text.

The collectors come in registration order (`OrderedRegistry`), the order `generate_latest` uses,
so the whole text is what `generate_latest(registry)` gives for the same state.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from servewell.observability.loop_metrics import LoopCounter, LoopHistogram, MetricList

#: Seconds of writing between two yields to the event loop.
SLICE_S = 0.002
#: Series of one gauge family written in one piece (1,800 series of 200 models' states held the
#: loop about 5 ms as one piece).
FAMILY_CHUNK = 256


@runtime_checkable
class OffLoopCollector(Protocol):
    """A collector whose slow part runs off the event loop: `collect_off_loop` awaits it and
    gives the families, with `None` where the caller may serve the loop before asking for more."""

    async def collect_off_loop(self) -> Iterator[Metric | None]: ...


class OrderedRegistry(CollectorRegistry):
    """A registry that also keeps its collectors in registration order, for `render_text`."""

    def __init__(self) -> None:
        super().__init__(auto_describe=True)
        self._in_order: list[Collector] = []
        self._order_lock = threading.Lock()

    def register(self, collector: Collector) -> None:
        super().register(collector)  # raises on a duplicate name: then it is not kept either
        with self._order_lock:
            self._in_order.append(collector)

    def unregister(self, collector: Collector) -> None:
        super().unregister(collector)
        with self._order_lock:
            self._in_order.remove(collector)

    def in_order(self) -> list[Collector]:
        """The registered collectors, first registered first."""
        with self._order_lock:
            return list(self._in_order)


async def render_text(registry: CollectorRegistry, slice_s: float = SLICE_S) -> bytes:
    """The registry in the Prometheus text format (0.0.4), written in slices of about `slice_s`
    with the event loop served between them. A registry that does not keep its order is written
    by `generate_latest` in one piece."""
    if not isinstance(registry, OrderedRegistry):
        return generate_latest(registry)
    out: list[str] = []
    until = time.perf_counter() + slice_s
    for collector in registry.in_order():
        chunks: Iterator[str | None]
        if isinstance(collector, LoopHistogram | LoopCounter):
            chunks = iter(collector.render_chunks())
        elif isinstance(collector, OffLoopCollector):
            chunks = _sliced_chunks(await collector.collect_off_loop())
        else:  # one family at a time (200 models' gauges in one piece held the loop 16 ms)
            chunks = (chunk for metric in collector.collect() for chunk in family_chunks(metric))
        for chunk in chunks:
            if chunk is not None:
                out.append(chunk)
            if time.perf_counter() >= until:
                await asyncio.sleep(0)
                until = time.perf_counter() + slice_s
    return "".join(out).encode()


def _sliced_chunks(metrics: Iterator[Metric | None]) -> Iterator[str | None]:
    """Families in pieces, their `None`s (points to yield at) kept."""
    for metric in metrics:
        if metric is None:
            yield None
        else:
            yield from family_chunks(metric)


def family_chunks(metric: Metric, per: int = FAMILY_CHUNK) -> Iterator[str]:
    """`generate_latest`'s text for one family, in pieces of at most `per` series. Only a gauge
    is split: another type may add lines after its series (a counter's `_created` gauge), so it
    is written in one piece."""
    samples = metric.samples
    if metric.type != "gauge" or len(samples) <= per:
        yield generate_latest(MetricList([metric])).decode()
        return
    for start in range(0, len(samples), per):
        piece = Metric(metric.name, metric.documentation, metric.type, metric.unit)
        piece.samples = samples[start:start + per]
        text = generate_latest(MetricList([piece])).decode()
        yield text if start == 0 else text.split("\n", 2)[2]  # the header (HELP, TYPE) once
