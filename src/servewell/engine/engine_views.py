"""What the engine shows of its models (`EngineViews`): each model's view for the metadata, health
and index endpoints and the console (its version's facts with its place in the pool and its traffic
split), the metrics scrape's samples, the alert webhook's facts, the active configuration, the
pool's summary, and the cheap key by which the door knows its model table changed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from servewell.engine.entry import Entry
from servewell.engine.memory_budget import MemoryBudget
from servewell.engine.model_pool import ModelPool
from servewell.engine.model_registry import ModelRegistry
from servewell.engine.model_slot import ModelSlot
from servewell.engine.protocol import ModelView
from servewell.engine.serving_gate import ServingGate
from servewell.observability.metrics import ModelSample
from servewell.observability.signals import ModelFacts


class EngineViews:
    """Read-only views of one engine's models, built from the registry, the pool and the budget."""

    __slots__ = ("_registry", "_pool", "_budget", "_gate")

    def __init__(self, registry: ModelRegistry, pool: ModelPool, budget: MemoryBudget, gate: ServingGate) -> None:
        self._registry = registry
        self._pool = pool
        self._budget = budget
        self._gate = gate

    def models(self) -> list[ModelView]:
        """Every model of the repository, valid or not."""
        return [self.view(s) for s in list(self._registry.slots.values())]

    def model(self, name: str, version: str | None = None) -> ModelView:
        """One model; `NotFound` for an unknown name or version."""
        return self.view(self._registry.slot(name, version))

    def view(self, slot: ModelSlot, entry: Entry | None = None) -> ModelView:
        """`slot`'s model as the API shows it: its current entry's view (or `entry`'s: the one an
        unload just stopped) with its pool facts and traffic split."""
        current = entry or slot.entry
        pool = getattr(current, "pool", None)
        breakdown = pool.last_start_breakdown if pool is not None else None
        rollout = slot.rollout
        return dataclasses.replace(
            current.view(), last_start=breakdown.as_dict() if breakdown is not None else None,
            versions=tuple(rollout.versions()) if rollout is not None else (),
            rollout=rollout.to_json() if rollout is not None else None,
            residency=slot.residency(), pinned=slot.pinned,
            last_used_at=slot.last_used_at, estimated_bytes=slot.estimated_bytes, loadable=self._pool.loadable(slot),
            cold_starts=slot.cold_starts, evictions=slot.evictions, measured_bytes=slot.measured_bytes,
            budget_bytes=self._budget.held_bytes(current))

    def loadable(self, name: str) -> bool:
        """Whether a request for `name` would load it now (lazy mode)."""
        slot = self._registry.get(name)
        return slot is not None and self._pool.loadable(slot)

    def table_key(self) -> tuple[Any, ...]:
        """What the door's model table reads (`engine/door.py`), cheaply: equal keys, equal tables,
        so its 50 ms poll builds no summaries nor readiness verdict while nothing changes."""
        gate, pool, registry = self._gate, self._pool, self._registry
        return (gate.accepting, gate.draining, gate.policy, gate.required, registry.default_model,
                tuple((name, slot.entry.version, slot.entry.state, slot.entry.reason, id(slot.entry.config),
                       pool.loadable(slot), pool.readiness_state(slot), registry.other_versions(name),
                       _live_batching(slot.entry))
                      for name, slot in registry.slots.items()))

    def samples(self) -> list[ModelSample]:
        """State of every model for the metrics scrape (with the pool's facts from its slot, as `view`)."""
        return [dataclasses.replace(slot.entry.sample(), residency=slot.residency(), pinned=slot.pinned,
                                    last_used_at=slot.last_used_at, estimated_bytes=slot.estimated_bytes)
                for slot in list(self._registry.slots.values())]

    def model_facts(self) -> list[ModelFacts]:
        """Per-model facts the alert webhook evaluates (queue fill, restarts, memory headroom, and the
        rollback its rollout stands in)."""
        facts = [(slot, slot.entry.facts()) for slot in list(self._registry.slots.values())]
        return [f if s.rollout is None else dataclasses.replace(f, rollback=s.rollout.lifecycle.alert_reason)
                for s, f in facts if f is not None]

    def config_report(self) -> dict[str, Any]:
        """Per model: the active config, when it was read, and admin overrides in force."""
        return {name: slot.entry.report() for name, slot in self._registry.slots.items()}

    def pool_report(self) -> dict[str, Any]:
        """The model pool as /healthz and the console show it: mode, budgets, counts, and the models
        and versions removed from the repository most recently."""
        return {**self._pool.report(), "removed": self._registry.removed_recently()}

    @property
    def memory_budget(self) -> tuple[int, int]:
        """(total, reserved) bytes."""
        return self._budget.total_bytes, self._budget.used_bytes


def _live_batching(entry: Entry) -> object:
    """The batching settings in force for `entry` (None without a scheduler): part of the table's key."""
    scheduler = getattr(entry, "scheduler", None)
    return scheduler.limits.batching if scheduler is not None else None
