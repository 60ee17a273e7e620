"""Metric families of other processes, summed into this one's: the data side of "one view".

An ingress process records HTTP-side metrics (request latency, preprocess/postprocess, outcomes
refused before the scheduler, API keys, auth failures, fast-path counts) in its own
`ServeMetrics`; the engine process serves `/metrics`, the console and alerting. The engine
absorbs each ingress's `MetricsSnapshot` (`ServeMetrics.snapshot()` there: cumulative since that
ingress started) and every reader of a family (`collect()`, `snapshot()`) sees the sum of the
engine's own series, the latest snapshot of every live source and a permanent base holding the
last snapshot of every retired one: counters and histogram counts never go down when an ingress
dies and comes back.

Rules that keep a reader from double counting:
- one snapshot per source is kept (the latest); a snapshot of the same incarnation (the
  `ServeMetrics` object that took it) with a sequence number not above the kept one is stale and
  dropped (two refreshes racing);
- a snapshot of a new incarnation under a known source name (an ingress restarted under the
  same name) first folds the old incarnation's kept snapshot into the base;
- `retire(source)` folds the kept snapshot into the base and remembers its incarnation: a late
  snapshot of it (in flight when it died) is dropped rather than counted twice;
- snapshots carry only the taker's own series, never what it absorbed.

The sums are computed lazily, once per change (absorb, retire), on the first read after it;
costs in `view_sources.py`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

log = logging.getLogger("servewell.metrics")

Labels = tuple[str, ...]
#: Per bucket counts (not cumulative; the last is +Inf) and the sum of observed values.
HistogramValue = tuple[list[int], float]
#: Incarnations of retired sources remembered, to drop their late snapshots (one per restart).
RETIRED_REMEMBERED = 4096


@dataclass(slots=True, frozen=True)
class HistogramData:
    """One histogram family's series in a snapshot."""

    labelnames: Labels
    bounds: tuple[float, ...]  # finite bucket upper bounds, ascending
    series: dict[Labels, HistogramValue]


@dataclass(slots=True, frozen=True)
class CounterData:
    """One counter family's series in a snapshot."""

    labelnames: Labels
    series: dict[Labels, float]


@dataclass(slots=True, frozen=True)
class MetricsSnapshot:
    """Every series of servewell's own histogram and counter families of one `ServeMetrics`,
    cumulative since it was made (plain data: picklable). Not the process_/python_ collectors nor
    the gauges read at scrape time (`StateCollector`): those describe the engine process."""

    incarnation: str  # unique per ServeMetrics object: a restarted process has a new one
    sequence: int  # 1, 2, ... per snapshot of this incarnation
    histograms: dict[str, HistogramData]
    counters: dict[str, CounterData]


class _Sums:
    """Histogram and counter series summed over snapshots, by family name."""

    __slots__ = ("counters", "histograms")

    def __init__(self) -> None:
        self.histograms: dict[str, dict[Labels, HistogramValue]] = {}
        self.counters: dict[str, dict[Labels, float]] = {}

    def add(self, snapshot: MetricsSnapshot) -> None:
        for name, hist in snapshot.histograms.items():
            self.add_histogram(name, hist.series)
        for name, counter in snapshot.counters.items():
            self.add_counter(name, counter.series)

    def add_sums(self, other: _Sums) -> None:
        for name, hist_series in other.histograms.items():
            self.add_histogram(name, hist_series)
        for name, counter_series in other.counters.items():
            self.add_counter(name, counter_series)

    def add_histogram(self, name: str, series: Mapping[Labels, HistogramValue]) -> None:
        into = self.histograms.setdefault(name, {})
        for labels, (counts, total) in series.items():
            have = into.get(labels)
            if have is None:
                into[labels] = (list(counts), total)
            else:
                into[labels] = ([a + b for a, b in zip(have[0], counts, strict=True)], have[1] + total)

    def add_counter(self, name: str, series: Mapping[Labels, float]) -> None:
        into = self.counters.setdefault(name, {})
        for labels, value in series.items():
            into[labels] = into.get(labels, 0.0) + value


@dataclass(slots=True, frozen=True)
class FamilyShape:
    """What a family of the absorbing side looks like: a snapshot's family of another shape (other
    label names or bucket bounds) cannot be summed into it and is left out."""

    labelnames: Labels
    bounds: tuple[float, ...] | None  # None for a counter


class AbsorbedMetrics:
    """The latest snapshot of each source and the retired base, summed per family on demand."""

    def __init__(self, shapes: Mapping[str, FamilyShape]) -> None:
        self._shapes = dict(shapes)
        self._latest: dict[str, MetricsSnapshot] = {}
        self._base = _Sums()
        self._retired: OrderedDict[str, None] = OrderedDict()
        self._sums: _Sums | None = None  # the cache; None after a change
        self._warned: set[tuple[str, str]] = set()
        #: True once anything was absorbed: readers merge only then (single-process: never).
        self.active = False

    def sources(self) -> list[str]:
        """The live sources, by name."""
        return sorted(self._latest)

    def absorb(self, source: str, snapshot: MetricsSnapshot) -> bool:
        """Keep `snapshot` as `source`'s latest; False when it was dropped (stale, or of a retired
        incarnation)."""
        if snapshot.incarnation in self._retired:
            return False
        previous = self._latest.get(source)
        if previous is not None:
            if previous.incarnation == snapshot.incarnation:
                if snapshot.sequence <= previous.sequence:
                    return False
            else:  # the same name, a new process: what the old one counted stays
                self._fold(previous)
        self._latest[source] = self._fit(source, snapshot)
        self._changed()
        return True

    def retire(self, source: str) -> bool:
        """Fold `source`'s latest snapshot into the base (it died); False when none was kept."""
        previous = self._latest.pop(source, None)
        if previous is None:
            return False
        self._fold(previous)
        self._changed()
        return True

    def histogram(self, name: str) -> Mapping[Labels, HistogramValue]:
        """Family `name`'s series summed over every source and the base."""
        return self._current().histograms.get(name, {})

    def counter(self, name: str) -> Mapping[Labels, float]:
        """Family `name`'s series summed over every source and the base."""
        return self._current().counters.get(name, {})

    def _fold(self, snapshot: MetricsSnapshot) -> None:
        self._base.add(snapshot)
        self._retired[snapshot.incarnation] = None
        while len(self._retired) > RETIRED_REMEMBERED:
            self._retired.popitem(last=False)

    def _changed(self) -> None:
        self._sums = None
        self.active = True

    def _current(self) -> _Sums:
        if self._sums is None:
            sums = _Sums()
            sums.add_sums(self._base)
            for source in sorted(self._latest):
                sums.add(self._latest[source])
            self._sums = sums
        return self._sums

    def _fit(self, source: str, snapshot: MetricsSnapshot) -> MetricsSnapshot:
        # Families this side does not have in the same shape are left out (and said once).
        histograms = {n: h for n, h in snapshot.histograms.items()
                      if self._fits(source, n, h.labelnames, h.bounds)
                      and all(len(c) == len(h.bounds) + 1 for c, _ in h.series.values())}
        counters = {n: c for n, c in snapshot.counters.items() if self._fits(source, n, c.labelnames, None)}
        if len(histograms) == len(snapshot.histograms) and len(counters) == len(snapshot.counters):
            return snapshot
        return MetricsSnapshot(snapshot.incarnation, snapshot.sequence, histograms, counters)

    def _fits(self, source: str, name: str, labelnames: Labels, bounds: tuple[float, ...] | None) -> bool:
        shape = self._shapes.get(name)
        if shape is not None and shape == FamilyShape(labelnames, bounds):
            return True
        if (source, name) not in self._warned:
            self._warned.add((source, name))
            log.warning("metrics of %s: family %s does not match this process's (labels or buckets); left out",
                        source, name)
        return False


def merge_histogram(own: Iterable[tuple[Labels, list[int], float]], absorbed: Mapping[Labels, HistogramValue],
                    ) -> list[tuple[Labels, list[int], float]]:
    """`own` series (label values, counts per bucket, sum) plus `absorbed`, bucket-wise, one entry
    per label values: own's order first, then series only absorbed ones have."""
    out, seen = [], set()
    for labels, counts, total in own:
        other = absorbed.get(labels)
        if other is not None:
            counts = [a + b for a, b in zip(counts, other[0], strict=True)]
            total += other[1]
        out.append((labels, counts, total))
        seen.add(labels)
    out.extend((labels, list(counts), total) for labels, (counts, total) in absorbed.items() if labels not in seen)
    return out


def merge_counter(own: Iterable[tuple[Labels, float]], absorbed: Mapping[Labels, float]) -> list[tuple[Labels, float]]:
    """`own` series (label values, value) plus `absorbed`, one entry per label values."""
    out, seen = [], set()
    for labels, value in own:
        out.append((labels, value + absorbed.get(labels, 0.0)))
        seen.add(labels)
    out.extend((labels, value) for labels, value in absorbed.items() if labels not in seen)
    return out
