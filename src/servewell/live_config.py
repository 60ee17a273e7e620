"""Hot reload: the `--config` file, the API keys file and every `model.yaml`, watched while serving.

What applies live: log level, trace sampling ratio, slow-request threshold, API keys and their
rate limit, whether /metrics needs a key, the poll interval; a model's batching settings
(policy, waits, queue bounds, timeouts, max batch size within what warm-up proved). What
reloads the model (zero failed requests: the new version warms up before traffic moves): any
other change of its model.yaml, lanes included. What is refused: an invalid file (a log line
names the file, field and reason; the running configuration stays), and server settings that
need a restart (listen address and ports, repository, memory budget, ...), which are logged and
listed under `pending_restart` in `GET /admin/config`.

Admin PATCHes and files: a PATCH of batching settings lasts until that model's model.yaml next
changes (the file then wins, and the log says which overrides it replaced) or the server
restarts. Keep the file the source of truth; use PATCH for experiments.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from servewell.api.keys import InferenceAccess, KeyFormatError, KeyRing, parse_keys
from servewell.api.state import LiveKnobs
from servewell.config.server import LIVE_FIELDS, ConfigFileError, ConfigSource, ServerConfig
from servewell.config.watch import FileWatch
from servewell.engine.engine import InferenceEngine
from servewell.errors import ServeError
from servewell.observability.tracing import DEFAULT_SAMPLE_RATIO, Tracing

log = logging.getLogger("servewell.config")


def load_keys(settings: ServerConfig) -> KeyRing:
    """The API keys the settings name (file, then SERVEWELL_API_KEYS / config entries);
    `KeyFormatError` or `OSError` when they cannot be used."""
    keys = []
    if settings.api_keys_file is not None:
        lines = settings.api_keys_file.read_text(encoding="utf-8").splitlines()
        keys.extend(parse_keys(lines, str(settings.api_keys_file)))
    keys.extend(parse_keys(settings.api_keys, "api_keys (SERVEWELL_API_KEYS or the config file)"))
    ids = [k.id for k in keys]
    duplicated = sorted({i for i in ids if ids.count(i) > 1})
    if duplicated:
        raise KeyFormatError(f"key ids {duplicated} appear in both the keys file and api_keys")
    return KeyRing(keys)


class ConfigReloader:
    """Polls the watched files (and reacts to SIGHUP) and applies what changed."""

    def __init__(self, source: ConfigSource, settings: ServerConfig, engine: InferenceEngine, access: InferenceAccess,
                 tracing: Tracing, knobs: LiveKnobs) -> None:
        self._source = source
        self.settings = settings
        self._engine = engine
        self._access = access
        self._tracing = tracing
        self._knobs = knobs
        self._watch = FileWatch()
        self._lock = asyncio.Lock()
        self._models: dict[Path, str] = {}
        self.loaded_at = time.time()
        self.keys_loaded_at = time.time()
        self.pending_restart: list[str] = []
        if source.file is not None:
            self._watch.track(source.file)
        if settings.api_keys_file is not None:
            self._watch.track(settings.api_keys_file)

    def watch_models(self) -> None:
        """Start watching the model.yaml of every model the engine knows (call after it started)."""
        for view in self._engine.models():
            path = self._engine.repository / view.name / "model.yaml"
            if path not in self._models:
                self._models[path] = view.name
                self._watch.track(path)

    async def run(self, stop: asyncio.Event) -> None:
        """Check for changes every `config_poll_s` seconds until `stop` is set (0: only on SIGHUP)."""
        while not stop.is_set():
            poll_s = self.settings.config_poll_s
            try:
                await asyncio.wait_for(stop.wait(), poll_s if poll_s > 0 else None)
            except TimeoutError:
                await self.check()

    async def check(self) -> None:
        """Apply every watched file that changed since the last check."""
        async with self._lock:
            self.watch_models()
            for path in self._watch.changed():
                if path == self._source.file:
                    self._reload_server()
                elif path == self.settings.api_keys_file:
                    self._reload_keys(self.settings, f"keys file {path} changed")
                elif path in self._models:
                    await self._reload_model(self._models[path], path)

    def _reload_server(self) -> None:
        try:
            fresh = self._source.load()
        except ConfigFileError as exc:
            log.error("config file rejected, the running configuration is kept: %s", exc)
            return
        old = self.settings
        changed = [name for name in ServerConfig.model_fields if getattr(fresh, name) != getattr(old, name)]
        live = [name for name in changed if name in LIVE_FIELDS]
        self.pending_restart = [name for name in changed if name not in LIVE_FIELDS]
        if any(name.startswith("api_key") for name in live):
            if not self._reload_keys(fresh, f"config file {self._source.file} changed the API keys"):
                live = [name for name in live if not name.startswith("api_key")]
        self.settings = old.model_copy(update={name: getattr(fresh, name) for name in live})
        self._apply_knobs()
        if old.api_keys_file != self.settings.api_keys_file:
            if old.api_keys_file is not None:
                self._watch.forget(old.api_keys_file)
            if self.settings.api_keys_file is not None:
                self._watch.track(self.settings.api_keys_file)
        self.loaded_at = time.time()
        if live:
            log.info("config file %s reloaded: applied %s", self._source.file, live, extra={"fields": live})
        if self.pending_restart:
            log.warning("config file %s changes %s, which need a restart; the running values are kept",
                        self._source.file, self.pending_restart, extra={"fields": self.pending_restart})

    def _reload_keys(self, settings: ServerConfig, why: str) -> bool:
        try:
            ring = load_keys(settings)
        except (KeyFormatError, OSError) as exc:
            log.error("%s but the keys were rejected, the previous keys stay in force: %s", why, exc)
            return False
        self._access.replace(ring, settings.api_key_rate_per_s)
        self.keys_loaded_at = time.time()
        log.info("%s: %d API key(s) in force", why, len(ring.ids), extra={"key_ids": list(ring.ids)})
        return True

    def _apply_knobs(self) -> None:
        settings = self.settings
        logging.getLogger().setLevel(settings.log_level.upper())
        ratio = settings.trace_sample_ratio
        self._tracing.set_sample_ratio(ratio if ratio is not None else DEFAULT_SAMPLE_RATIO)
        self._knobs.slow_request_s = settings.slow_request_ms / 1000.0
        self._knobs.metrics_need_key = settings.metrics_require_key

    async def _reload_model(self, name: str, path: Path) -> None:
        try:
            outcome = await self._engine.reconfigure_model(name)
        except ServeError as exc:
            log.error("%s rejected, the running version keeps serving: %s", path, exc.message,
                      extra={"model": name})
            return
        log.info("%s changed: %s", path, outcome, extra={"model": name})

    def report(self) -> dict[str, Any]:
        """The active configuration for `GET /admin/config` (secrets left out)."""
        settings = self.settings.model_dump(mode="json")
        settings["admin_token"] = "(set)" if settings.get("admin_token") else None
        settings["api_keys"] = f"({len(self.settings.api_keys)} entries)" if self.settings.api_keys else []
        return {
            "server": {"file": str(self._source.file) if self._source.file else None, "loaded_at": self.loaded_at,
                       "settings": settings, "pending_restart": self.pending_restart},
            "api_keys": {"enabled": self._access.enabled, "ids": list(self._access.ids),
                         "loaded_at": self.keys_loaded_at},
            "models": self._engine.config_report(),
        }
