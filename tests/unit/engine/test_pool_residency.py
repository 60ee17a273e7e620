"""A model name's residency through the pool's real parts (`ModelSlot`, `ModelEntry`, `ModelPool`,
`PoolMemory`), without a worker: a version is put in the phase a finished load leaves it in, then
evicted, unloaded or stopped as the engine does, and what /healthz and the pool read follows."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from servewell.config.model import ModelConfig
from servewell.engine.memory_budget import MemoryBudget
from servewell.engine.model_entry import EntryServices, ModelEntry
from servewell.engine.model_lifecycle import ResidencyPhase, VersionPhase
from servewell.engine.model_pool import ModelPool, PoolSettings
from servewell.engine.model_slot import ModelSlot
from servewell.engine.pool_memory import PoolMemory
from servewell.errors import Conflict, ModelLoading, ModelNotReady

CONFIG = {"name": "m", "runtime": "onnx", "artifact": "model.onnx", "max_batch_size": 4,
          "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
          "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}]}


def served(tmp_path: Path) -> tuple[ModelSlot, ModelPool, ModelEntry]:
    """Model `m` in a lazy pool, its version as a finished load leaves it (no worker runs)."""
    budget = MemoryBudget(1 << 30)
    services = EntryServices(load_timeout_s=1.0, budget=budget)
    config = ModelConfig.model_validate(CONFIG)
    entry = ModelEntry("m", tmp_path, config, services)
    slot = ModelSlot(entry)
    slots = {"m": slot}
    settings = PoolSettings(mode="lazy")
    memory = PoolMemory(slots, budget, True, settings.idle_unload_of)
    pool = ModelPool(settings, slots, budget, memory, lambda name, c: ModelEntry(name, tmp_path, c, services))
    assert slot.residency() == "not_loaded" and pool.loadable(slot)  # listed: its first request loads it
    slot.serve(entry)
    entry.lifecycle.loading()
    entry.lifecycle.loaded()
    return slot, pool, entry


def test_an_evicted_model_is_counted_shows_evicted_and_loads_again_on_a_request(tmp_path: Path) -> None:
    async def main() -> None:
        slot, pool, entry = served(tmp_path)
        assert (slot.residency(), slot.resident, pool.loadable(slot)) == ("resident", True, False)
        await pool.memory.evict(slot)
        assert (slot.residency(), slot.evictions, pool.loadable(slot)) == ("evicted", 1, True)
        assert slot.lifecycle.phase is ResidencyPhase.EVICTED and slot.eviction_ended() is None
        assert entry.lifecycle.phase is VersionPhase.STOPPED and entry.reason is not None
        assert entry.reason.startswith("evicted (operator)")
        with pytest.raises(Conflict, match=r"is not resident \(evicted\)"):
            await pool.memory.evict(slot)

    asyncio.run(main())


def test_a_model_an_operator_unloaded_is_not_loaded_by_a_request(tmp_path: Path) -> None:
    async def main() -> None:
        slot, pool, entry = served(tmp_path)
        await pool.memory.evict(slot)
        slot.lifecycle.unloaded()  # as ModelLoader.unload_model marks it
        await entry.stop("unloading", "unloaded by an operator")
        assert (slot.residency(), pool.loadable(slot)) == ("not_loaded", False)
        with pytest.raises(ModelNotReady, match="'m' is unloaded: unloaded by an operator"):
            await pool.acquire(slot, None)

    asyncio.run(main())


def test_a_version_being_stopped_refuses_new_requests_with_its_cause_while_it_still_shows_ready(
        tmp_path: Path) -> None:
    async def main() -> None:
        slot, pool, entry = served(tmp_path)
        assert entry.lifecycle.draining("evicting")
        assert (entry.state, slot.resident, pool.memory.evictable(slot)) == ("ready", False, False)
        refusal = entry.lifecycle.refusal(entry.label)
        assert isinstance(refusal, ModelLoading) and "being evicted" in refusal.message
        await entry.stop("evicting", "evicted (memory): test")
        assert (entry.state, entry.reason) == ("unloaded", "evicted (memory): test")

    asyncio.run(main())


def test_idleness_counts_from_the_load_when_it_ended_after_the_last_request(tmp_path: Path) -> None:
    # Seen under make test: a load that took 0.9 s of an idle_unload_s of 1 left the model resident
    # for 1.4 s, and a client polling for it missed it; a longer load would be evicted on arrival.
    slot, _, _ = served(tmp_path)
    assert slot.idle_s(1000.0) == 0.0  # nobody asked for it yet: never idle-evicted
    slot.last_used_at = 100.0  # the request that asked for the load (refused model_loading)
    assert slot.idle_s(104.0) == 4.0
    slot.resident_at = 103.0  # the load ended three seconds later
    assert slot.idle_s(104.0) == 1.0
    slot.last_used_at = 103.5  # a request after the load counts from itself
    assert slot.idle_s(104.0) == 0.5
