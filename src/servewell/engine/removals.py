"""Models and versions whose files left the repository stop serving (issue 45 H13).

A loaded model runs from the server's private snapshot of its directory (engine/snapshot.py), so
deleting the directory does not stop it by itself: a removed model went on answering 200 and a
removed `versions/2` kept its 50 % of the traffic. `RemovalWatch.sweep` runs at every repository
poll (lazy mode), at every configuration poll and on SIGHUP, and takes out

- a model whose directory is gone: out of the engine's table at once (new requests: 404, and the
  ingress processes' tables lose it), its queued and running requests finish, then its workers
  stop and its snapshot goes;
- a version of a traffic split whose `versions/<v>` directory is gone: out of the split at once
  (its weight spread over the versions left), listed as failed with the reason, drained the same way.

Each is logged (`model_removed`, `version_removed`) and listed under `pool.removed` in /healthz (the
most recent `REMOVED_KEPT`, `RemovalWatch.recent`). A
directory must be gone at two checks at least `MISSING_SETTLE_S` apart (a deployment that swaps a
directory with two renames is never caught in between); SIGHUP takes what is gone at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from servewell.config.rollout import VERSIONS_DIRECTORY
from servewell.engine.model_entry import ModelEntry
from servewell.engine.model_slot import ModelSlot
from servewell.engine.versions import stop_versions

log = logging.getLogger("servewell.engine")

#: How long a directory must have been gone before it is taken out (unless settle is off: SIGHUP).
MISSING_SETTLE_S = 1.0
#: Models and versions removed from the repository that /healthz lists (the most recent).
REMOVED_KEPT = 20

#: (model, version): version None is the model itself.
Key = tuple[str, str | None]


class RemovalWatch:
    """Notices the models and versions whose directories left the repository, and takes them out."""

    def __init__(self, repository: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self._repository = repository
        self._clock = clock
        #: Models and versions taken out, most recent last (/healthz shows them under pool.removed).
        self.recent: deque[dict[str, Any]] = deque(maxlen=REMOVED_KEPT)
        self._missing_since: dict[Key, float] = {}
        self._draining: set[asyncio.Task[None]] = set()  # removed entries finishing their requests

    async def sweep(self, slots: dict[str, ModelSlot], settle: bool = True) -> list[str]:
        """Take out of `slots` what is gone (see the module); the names of the models taken out."""
        wanted: list[Key] = [(name, None) for name in slots]
        wanted += [(name, version) for name, slot in slots.items() if slot.rollout is not None
                   for version in slot.rollout.candidates]
        gone = set(await asyncio.to_thread(self._gone, wanted))
        now = self._clock()
        self._missing_since = {key: self._missing_since.get(key, now) for key in gone}
        due = [key for key in gone if not settle or now - self._missing_since[key] >= MISSING_SETTLE_S]
        removed = []
        for name, version in sorted(due, key=lambda k: (k[0], k[1] or "")):
            self._missing_since.pop((name, version), None)
            slot = slots.get(name)
            if slot is None:
                continue
            if version is None:
                del slots[name]
                self._take_model(slot)
                removed.append(name)
            elif slot.rollout is not None and not slot.removed:
                self._take_version(slot, version)
        return removed

    def _gone(self, wanted: list[Key]) -> list[Key]:
        """The keys whose directory does not exist (run in a thread: a slow file system must not
        stall the event loop)."""
        return [key for key in wanted if not self._directory(key).is_dir()]

    def _directory(self, key: Key) -> Path:
        name, version = key
        model = self._repository / name
        return model if version is None else model / VERSIONS_DIRECTORY / version

    def _take_model(self, slot: ModelSlot) -> None:
        why = f"its directory {self._directory((slot.name, None))} was removed from the repository"
        slot.lifecycle.removed_now()  # a request that resolved it before now is refused, and no load starts
        self._note(slot.name, None, why)
        log.warning("model %s: %s; it takes no new request (404), its requests in flight finish, then its workers "
                    "stop", slot.name, why, extra={"event": "model_removed", "model": slot.name})
        self._drain(self._stop_model(slot, why))

    async def _stop_model(self, slot: ModelSlot, why: str) -> None:
        async with slot.lock:  # a load under way ends first, then what it loaded is stopped
            await slot.entry.stop("removing", why)
            await stop_versions(slot, "removing")
        await slot.entry.release_snapshot()  # one an eviction kept

    def _take_version(self, slot: ModelSlot, version: str) -> None:
        rollout = slot.rollout
        assert rollout is not None
        entry = rollout.candidates.pop(version, None)
        if entry is None:
            return
        why = f"its directory {self._directory((slot.name, version))} was removed from the repository"
        rollout.failed[version] = why
        if rollout.config_seen is not None:  # the split's weights, spread over the versions left
            rollout.configure(rollout.config_seen, rollout.config_seen)
        self._note(slot.name, version, why)
        log.warning("model %s: version %s: %s; it takes no new request, its requests in flight finish",
                    slot.name, version, why, extra={"event": "version_removed", "model": slot.name,
                                                    "version": version})
        self._drain(self._stop_version(entry, why))

    def _note(self, name: str, version: str | None, why: str) -> None:
        self.recent.append({"model": name, "version": version, "at": time.time(), "reason": why})

    @staticmethod
    async def _stop_version(entry: ModelEntry, why: str) -> None:
        await entry.stop("removing", why)

    def _drain(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._draining.add(task)
        task.add_done_callback(self._drained)

    def _drained(self, task: asyncio.Task[None]) -> None:
        self._draining.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("stopping a removed model failed: %r", task.exception())
