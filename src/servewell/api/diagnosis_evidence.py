"""The evidence each model's diagnosis reads, gathered where the engine runs, once per console tick.

`ServerViews.tick` runs after the console feed's reading (`ConsoleFeed.on_tick`, every 2 s): it
notes who holds each lane's places (only lanes at least half full are looked at), reads the host's
CPU pressure, builds one `ModelEvidence` per resident model from the feed's window (refusals,
cache lookups and repeats, the p99 split), the worker replacements and the memory series, and keeps
`diagnose()`'s verdicts in `feed.diagnoses`, the one place the console, `/healthz`, `/metrics`
(`servewell_diagnosis`) and the alerts read them from. It also lists the processes' memory for the
series (`process_memory`) and turns a traffic split's automatic rollback or promotion into an
audit entry (`watch_rollouts`).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Iterable
from typing import Any

from servewell.engine.engine import InferenceEngine
from servewell.engine.model_entry import ModelEntry
from servewell.engine.model_slot import ModelSlot
from servewell.errors import ServeError
from servewell.observability.audit import BY_RULES
from servewell.observability.console_feed import (
    ConsoleFeed,
    cache_between,
    refusals_between,
    summary_between,
)
from servewell.observability.diagnosis import (
    CacheFacts,
    Diagnosis,
    LaneHolding,
    ModelEvidence,
    ReplacementFact,
    diagnose,
)
from servewell.observability.latency_reading import latency_split
from servewell.observability.memory_series import ProcessMemory, worker_name
from servewell.observability.process import cpu_facts, rss_bytes
from servewell.tenancy.policy import tenant_label

log = logging.getLogger("servewell.console")

#: Replacements this recent (ended or still under way) are part of a model's evidence: longer than
#: the 30 s window, since the gap's requests still weigh on its p99 a while after.
REPLACEMENTS_WITHIN_S = 60.0
#: Samples of lane holders kept per model (15 ticks of 2 s: the 30 s window).
HOLDING_TICKS = 15


class ServerViews:
    """What the console feed's tick computes beyond the charts, for one engine."""

    def __init__(self, engine: InferenceEngine, feed: ConsoleFeed) -> None:
        self._engine = engine
        self._feed = feed
        self._held: dict[str, deque[frozenset[tuple[str, str]]]] = {}  # model -> per tick, (lane, tenant) holding
        self._rollouts: dict[str, tuple[Any, Any]] = {}  # model -> (state, changed_at) last seen

    def tick(self) -> None:
        """Diagnose every model, and watch the traffic splits (the feed's `on_tick` hook)."""
        self.watch_rollouts()
        self._feed.diagnoses = self.diagnose_all()

    def diagnose_all(self) -> dict[str, Diagnosis]:
        """A diagnosis per model that has a scheduler, from this moment's evidence."""
        window = self._feed.window()
        cpu = cpu_facts()
        found: dict[str, Diagnosis] = {}
        weights: dict[str, float] | None = None
        for name, slot in list(self._engine.registry.slots.items()):
            entry = slot.entry
            if not isinstance(entry, ModelEntry):
                continue
            holdings, weights = self._holdings(name, entry, weights)
            held = self._held.setdefault(name, deque(maxlen=HOLDING_TICKS))
            held.append(frozenset((h.lane, found_holder[0]) for h in holdings
                                  if (found_holder := h.holder()) is not None))
            found[name] = diagnose(self._evidence(name, entry, window, holdings, cpu))
        for gone in [n for n in self._held if n not in found]:
            del self._held[gone]
        return found

    def _holdings(self, name: str, entry: ModelEntry,
                  weights: dict[str, float] | None) -> tuple[list[LaneHolding], dict[str, float] | None]:
        scheduler = entry.scheduler
        depths = scheduler.lane_depths()
        if not any(depths.values()):
            return [], weights
        try:
            max_queue = int(self._engine.admin.batching(name)["max_queue_size"])
        except (ServeError, KeyError, TypeError, ValueError):
            return [], weights
        holdings = []
        for index, lane in enumerate(scheduler.lanes):
            depth = depths.get(lane, 0)
            if depth * 2 < max_queue:
                continue
            if weights is None:
                weights = self._weights()
            places = {tenant_label(t): n for t, n in scheduler.lane_places(index).items()}
            total = sum(weights.values()) or 1.0
            share = {t: weights.get(t, 1.0) / total for t in places}
            holdings.append(LaneHolding(lane, depth, max_queue, places, share))
        return holdings, weights

    def _weights(self) -> dict[str, float]:
        """Each configured tenant's weight (by label), the anonymous one included once it sent a request."""
        tenants = self._engine.tenants
        if tenants is None or not tenants.enabled:
            return {"-": 1.0}
        return {row["tenant"]: float(row["weight"]) for row in tenants.report()}

    def _evidence(self, name: str, entry: ModelEntry, window: Any, holdings: list[LaneHolding],
                  cpu: Any) -> ModelEvidence:
        feed = self._feed
        summary, refusals, cache, answered, window_s = None, {}, None, 0.0, 30.0
        if window is not None:
            window_s, before, after = window
            summary = summary_between(before, after, name, window_s)
            answered = (summary.get("requests_per_s") or 0.0) * window_s
            refusals = {(lane, tenant, reason): n for (_, lane, tenant, reason), n
                        in refusals_between(before, after, name).items()}
            if entry.cache is not None:
                facts = cache_between(before, after, name)
                cache = CacheFacts(entry.cache.ttl_s, facts["hit"], facts["coalesced"], facts["miss"],
                                   facts["reused_within_ttl"], facts["reused_beyond_ttl"], facts["reuse_p50_s"])
        split = latency_split(summary, feed.compute_by_batch_size(name))
        held = self._held.get(name, ())
        ticks = len(held)
        counts: dict[tuple[str, str], int] = {}
        for tick in held:
            for key in tick:
                counts[key] = counts.get(key, 0) + 1
        replacements = [ReplacementFact(e["instance"], e["reason"], e["detail"], e["at"], e["gap_s"], e.get("open_s"),
                                        e["others_serving"])
                        for e in feed.worker_events.to_json(name, REPLACEMENTS_WITHIN_S)]
        growth = {}
        for i in range(entry.config.instances):
            worker = worker_name(name, entry.version, i)
            growth[i] = (feed.memory.growth(worker), feed.memory.seconds_to_limit(worker))
        return ModelEvidence(name, window_s, answered, split, summary, refusals, holdings,
                             {key: n / ticks for key, n in counts.items()} if ticks else {}, cache,
                             replacements, cpu, growth)

    def watch_rollouts(self) -> None:
        """Record an automatic rollback or promotion (a split's state turning `rolled_back` or
        `promoted` since the last tick) in the audit trail, at the time it happened."""
        for name, slot in list(self._engine.registry.slots.items()):
            rollout = slot.rollout
            if rollout is None:
                self._rollouts.pop(name, None)
                continue
            doc = rollout.to_json()  # its public document: the state machine behind it is the rollout's own
            state, changed_at, reason = doc.get("state"), doc.get("changed_at"), doc.get("reason")
            before = self._rollouts.get(name)
            self._rollouts[name] = (state, changed_at)
            if before is None or before == (state, changed_at) or state not in ("rolled_back", "promoted"):
                continue
            self._feed.audit.record(
                BY_RULES, "automatic", "traffic", name, {"state": before[0]},
                {"state": state, "weights": doc.get("weights"), "reason": reason},
                f"traffic of {name}: {str(state).replace('_', ' ')} by its rollout rules ({reason})",
                at=changed_at if isinstance(changed_at, int | float) else None)


def process_memory(engine: InferenceEngine, feed: ConsoleFeed) -> list[ProcessMemory]:
    """Every process of the server with its resident memory now: this one (the engine), each ingress
    process (as its latest snapshot said), each worker of every model version."""
    readings = [ProcessMemory("engine", "engine", os.getpid(), rss_bytes())]
    for source, rss in feed.view.absorbed_rss().items():
        index = _ingress_index(source)
        readings.append(ProcessMemory(f"ingress {index}" if index is not None else source, "ingress",
                                      _ingress_pid(source), rss))
    for slot in list(engine.registry.slots.values()):
        for entry in _entries(slot):
            limit = entry.config.host_memory_limit_bytes
            for info in entry.instances():
                if info.alive and info.pid:
                    readings.append(ProcessMemory(worker_name(entry.name, entry.version, info.instance), "worker",
                                                  info.pid, info.rss_bytes, limit, entry.name, info.instance))
    return readings


def _entries(slot: ModelSlot) -> Iterable[ModelEntry]:
    if isinstance(slot.entry, ModelEntry):
        yield slot.entry
    if slot.rollout is not None:
        yield from slot.rollout.candidates.values()


def _ingress_index(source: str) -> int | None:
    # Source names are f"ingress-{index}-{pid}" (observability/view_sources.py).
    parts = source.split("-")
    return int(parts[1]) if len(parts) == 3 and parts[0] == "ingress" and parts[1].isdigit() else None


def _ingress_pid(source: str) -> int | None:
    parts = source.split("-")
    return int(parts[2]) if len(parts) == 3 and parts[2].isdigit() else None
