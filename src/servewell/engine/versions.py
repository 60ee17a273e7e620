"""The versions a model serves beside its stable one: loaded from `<model>/versions/<v>/` when its
model.yaml's `traffic` or `rollout.shadow` names them, replaced when their model.yaml changed,
stopped when no longer named (engine/rollout.py splits the requests between them).

Every version must take the stable version's inputs and give its outputs (names, datatypes,
shapes): a request is decoded against the stable version's config before its version is drawn.
A version that fails to load or differs is listed with its reason and takes no traffic; the
others keep serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping

from servewell.config.model_file import signature_problem
from servewell.config.rollout import VERSIONS_DIRECTORY
from servewell.engine.model_entry import EntryServices, ModelEntry
from servewell.engine.model_lifecycle import StopCause
from servewell.engine.model_slot import ModelSlot
from servewell.engine.repository import outside_repository, read_model_config
from servewell.engine.rollout import SHADOW_NICE, Rollout
from servewell.observability.metrics import RolloutGauges, ServeMetrics

log = logging.getLogger("servewell.rollout")

#: How often the rollout rules are applied.
JUDGE_INTERVAL_S = 1.0


async def sync_versions(slot: ModelSlot, services: EntryServices, metrics: ServeMetrics | None) -> None:
    """Make `slot`'s versions what its stable version's model.yaml names (call with `slot.lock`
    held, after the stable version loaded or its model.yaml changed)."""
    stable = slot.entry
    if not isinstance(stable, ModelEntry) or not stable.lifecycle.resident:
        return
    config = stable.config
    rollout = slot.rollout
    if rollout is None and config.traffic is None and config.rollout is None:
        return
    previous = rollout.config_seen if rollout is not None else None
    if rollout is None:
        rollout = slot.rollout = Rollout(stable.name, config, metrics)
    wanted = config.other_versions
    for version in [v for v in rollout.candidates if v not in wanted]:
        await rollout.candidates.pop(version).stop("unloading", "no longer named by traffic or shadow")
    rollout.failed = {}
    await asyncio.gather(*(_load_version(rollout, stable, version, services) for version in sorted(wanted)))
    if config.traffic is None and config.rollout is None:
        slot.rollout = None
        return
    rollout.configure(config, previous)
    rollout.config_seen = config


async def _load_version(rollout: Rollout, stable: ModelEntry, version: str, services: EntryServices) -> None:
    directory = stable.directory / VERSIONS_DIRECTORY / version
    if not await asyncio.to_thread(directory.is_dir):
        # Gone (issue 45 H13: a deleted versions/2 kept its share through a reload): it takes no new
        # request, its requests in flight finish. A version whose model.yaml is broken keeps serving.
        rollout.failed[version] = f"its directory {directory} was removed from the repository"
        current = rollout.candidates.pop(version, None)
        if current is not None:
            log.warning("model %s: version %s: its directory %s is gone; it takes no new request, its requests in "
                        "flight finish", stable.name, version, directory,
                        extra={"event": "version_removed", "model": stable.name, "version": version})
            await current.stop("removing", rollout.failed[version])
        return
    try:
        config = await asyncio.to_thread(read_model_config, directory, stable.name)
    except ValueError as exc:
        rollout.failed[version] = str(exc)
        log.error("model %s: version %s cannot be read: %s", stable.name, version, exc, extra={"model": stable.name})
        return
    # As for a model directory: a version that resolves outside the repository is served with a warning
    # (and shown in the rollout's view), or refused by ModelEntry.load with models_outside_repository: refuse.
    real = None if services.repository is None else await asyncio.to_thread(
        outside_repository, services.repository, directory)
    if real is None:
        rollout.outside.pop(version, None)
    else:
        rollout.outside[version] = str(real)
        log.warning("model %s: version %s: its directory %s resolves to %s, outside the repository %s", stable.name,
                    version, directory, real, services.repository, extra={"model": stable.name, "version": version})
    if rollout.shadow_only(version, stable.config):
        config = config.model_copy(update={"nice": max(config.nice, SHADOW_NICE), "cpu_policy": "idle"})
    problem = signature_problem(stable.config, config)
    if problem is not None:
        rollout.failed[version] = problem
        log.error("model %s: version %s takes no traffic: %s", stable.name, version, problem,
                  extra={"model": stable.name})
        return
    current = rollout.candidates.get(version)
    if current is not None and current.config == config and current.lifecycle.resident:
        return
    fresh = ModelEntry(stable.name, directory, config, services)
    await fresh.load()
    if not fresh.lifecycle.serving:
        rollout.failed[version] = f"failed to load: {fresh.reason}"
        return  # a version that served before keeps serving
    rollout.candidates[version] = fresh
    if current is not None:
        await current.stop("reloading", reason="replaced by a reload")


async def stop_versions(slot: ModelSlot, cause: StopCause, worker_timeout_s: float = 5.0) -> None:
    """Stop every version beside the stable one (the model is unloaded, or the server stops)."""
    rollout = slot.rollout
    if rollout is None:
        return
    entries = list(rollout.candidates.values())
    rollout.candidates.clear()
    await asyncio.gather(*(e.stop(cause, worker_timeout_s=worker_timeout_s) for e in entries))
    slot.rollout = None


def candidate_entries(slots: Iterable[ModelSlot]) -> list[ModelEntry]:
    """Every loaded version beside the stable ones (shutdown closes and fails them too)."""
    return [e for s in slots if s.rollout is not None for e in s.rollout.candidates.values()]


def rollout_gauges(slots: Iterable[ModelSlot]) -> list[RolloutGauges]:
    """Every traffic split, for the metrics scrape."""
    return [s.rollout.gauges() for s in slots if s.rollout is not None]


async def judge_forever(slots: Mapping[str, ModelSlot], interval_s: float = JUDGE_INTERVAL_S) -> None:
    """Apply the rollout rules of every model each `interval_s` (a background task of the engine)."""
    while True:
        await asyncio.sleep(interval_s)
        for slot in list(slots.values()):
            if slot.rollout is not None:
                try:
                    slot.rollout.judge_now()
                except Exception:  # a bug in one rollout must not end the others' judging
                    log.exception("model %s: the rollout rules failed", slot.name)
