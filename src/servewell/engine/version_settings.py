"""The live settings of one served version (`VersionSettings`): what changes while it serves, and
from where. A changed model.yaml whose changes need no new workers applies at once (its batching
settings, a max batch size within what warm-up proved, its response cache); an admin's change of
batching settings is an override that lasts until the file next changes or the server restarts.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from servewell.config.model import ModelConfig
from servewell.engine.response_cache import ResponseCache
from servewell.errors import Conflict

if TYPE_CHECKING:
    from servewell.engine.clock import Clock
    from servewell.engine.model_entry import ModelEntry
    from servewell.observability.metrics import ServeMetrics

#: What of a model.yaml may change without new workers, besides batching and max_batch_size (checked
#: apart): the pool reads pinned and idle_unload_s per use, the response cache is rebuilt, and the
#: traffic split is applied by engine/versions.py.
_LIVE_FIELDS = {"batching", "max_batch_size", "pinned", "idle_unload_s", "cache", "deterministic", "traffic",
                "rollout"}


class VersionSettings:
    """The settings one version serves with: its model.yaml (`entry.config`, and when it was read),
    the admin's batching overrides in force, and its response cache (`entry.cache`), rebuilt with
    every change of the file: a changed config may change the answers."""

    __slots__ = ("_entry", "_metrics", "_clock", "configured_at", "overrides")

    def __init__(self, entry: ModelEntry, metrics: ServeMetrics | None, clock: Clock | None) -> None:
        self._entry = entry
        self._metrics = metrics
        self._clock = clock
        self.configured_at = time.time()  # when the config was read from model.yaml (wall clock)
        self.overrides: dict[str, object] = {}  # batching settings an admin changed since then

    def new_cache(self, config: ModelConfig) -> ResponseCache | None:
        """The response cache `config` asks for (None: none, or a model whose answers may differ)."""
        if config.cache is None or not config.deterministic:
            return None
        return ResponseCache(self._entry.name, config.cache, self._metrics, self._clock, version=config.version)

    def live_changes_only(self, config: ModelConfig) -> bool:
        """Whether `config` differs from the serving one only in what applies without new workers:
        batching settings other than lanes, a max batch size within the proven maximum, and the
        model pool's `pinned` and `idle_unload_s`."""
        serving = self._entry.config
        if config.batching.lanes != serving.batching.lanes:
            return False
        proven = self._entry.scheduler.limits.proven_max_batch_size
        if config.max_batch_size > proven or (config.max_batch_size == 0) != (serving.max_batch_size == 0):
            return False
        return config.model_dump(exclude=_LIVE_FIELDS) == serving.model_dump(exclude=_LIVE_FIELDS)

    def apply_file(self, config: ModelConfig) -> dict[str, object]:
        """Take a new model.yaml whose only changes are live ones (`live_changes_only`): the file's
        values apply, admin overrides end, and the response cache starts empty. Returns the
        overrides that were dropped."""
        entry = self._entry
        entry.scheduler.update({**config.batching.model_dump(exclude={"lanes"}),
                                "max_batch_size": max(1, config.max_batch_size)})
        dropped, self.overrides = self.overrides, {}
        entry.config, self.configured_at = config, time.time()
        entry.cache = self.new_cache(config)
        return dropped

    def update_batching(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        """An admin's live change of batching settings (all or nothing); a None value returns that
        setting to model.yaml's value and ends its override. `Conflict` (409) once the version may
        not be configured (unloaded, failed or stopping: its settings would apply to nothing)."""
        entry = self._entry
        life = entry.lifecycle
        if not life.configurable:
            raise Conflict(f"{entry.label} is {life.condition()}: its batching settings cannot change (load it "
                           "through the repository API first)")
        resolved = {key: self._file_value(key) if value is None else value for key, value in changes.items()}
        settings = entry.scheduler.update(resolved)
        for key, value in changes.items():
            if value is None:
                self.overrides.pop(key, None)
            else:
                self.overrides[key] = value
        return settings

    def _file_value(self, key: str) -> object:
        """What model.yaml gives a live setting (the built-in default when the file sets none)."""
        config = self._entry.config
        if key == "max_batch_size":
            return min(max(1, config.max_batch_size), self._entry.scheduler.limits.proven_max_batch_size)
        return getattr(config.batching, key)
