"""Hot reload: the `--config` file, the API keys file and every `model.yaml`, watched while serving.

What applies live: log level, trace sampling ratio, slow-request threshold, API keys and their
rate limit, whether /metrics needs a key, the poll interval; a model's batching settings
(policy, waits, queue bounds, timeouts, max batch size within what warm-up proved). What
reloads the model (zero failed requests: the new version warms up before traffic moves): any
other change of its model.yaml, lanes included. What is refused: an invalid file (a log line
names the file, field and reason; the running configuration stays; `/healthz`, `/admin/config`,
the console and `servewell_config_rejected_files` show it until a later version is applied), and
server settings that need a restart (listen address and ports, repository, memory budget, ...),
which are logged and listed under `pending_restart` in `GET /admin/config`.

A change applies once the file stayed the same for one poll (a half-written file is never
read as the new version); SIGHUP applies at once. A model or a version whose directory is gone is
taken out at each check (engine/removals.py): drained, then stopped. Files are read in a thread,
only regular files of at most `config_max_bytes`. Nothing a file holds can stop the watcher: every
error is logged once per version of the file, and polling goes on.

Keys fail closed: once keys are required, a reload that yields no key (an empty or comment-only
file, the file or setting removed) denies every request that needs a key until a key is
configured again; it never opens inference.

Admin PATCHes and files: a PATCH of batching settings lasts until that model's model.yaml next
changes (the file then wins, and the log says which overrides it replaced) or the server
restarts. Keep the file the source of truth; use PATCH for experiments.

Every change applied here goes to the audit trail (observability/audit.py), by `file` (a poll) or
`SIGHUP`: the `--config` file's settings that changed, old and new (secrets as `(set)` /
`(changed)`; settings that wait for a restart apart); the API keys by id (added, removed, changed
fields, a rotated key as `(rotated)`: never a key); each model.yaml's changed fields and what
happened (applied live, reloaded).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from servewell.api.keys import InferenceAccess
from servewell.api.state import LiveKnobs
from servewell.config.bounded_yaml import cut
from servewell.config.file_read import decode_utf8, read_config_bytes
from servewell.config.model_file import ModelConfigError
from servewell.config.problems import TOP_LEVEL
from servewell.config.rejections import RejectedFiles
from servewell.config.server import LIVE_FIELDS, ConfigFileError, ConfigSource, ServerConfig
from servewell.config.watch import FileChange, FileWatch
from servewell.engine.engine import InferenceEngine
from servewell.engine.repository import outside_refusal, outside_repository, read_model_config
from servewell.errors import ServeError
from servewell.observability.audit import BY_FILE, BY_SIGHUP, AuditTrail
from servewell.observability.tracing import Tracing, sample_ratio_or_default
from servewell.tenancy.keys import KeyFormatError, KeyRing, NoKeysError, check_distinct, parse_keys

log = logging.getLogger("servewell.config")

#: Longest one poll's file reads may take before the poll is abandoned (and logged): reads are
#: non-blocking and capped, so only a hung file system gets near it.
POLL_TIMEOUT_S = 10.0


def load_keys(settings: ServerConfig) -> KeyRing:
    """The API keys the settings name (file, then SERVEWELL_API_KEYS / config entries);
    `KeyFormatError` or `OSError` when they cannot be used, `NoKeysError` when keys are
    configured but none is found (an empty or comment-only file never means "open")."""
    keys = []
    if settings.api_keys_file is not None:
        where = str(settings.api_keys_file)
        try:
            text = decode_utf8(read_config_bytes(settings.api_keys_file, settings.config_max_bytes))
        except OSError as exc:
            raise KeyFormatError(f"{where}: {exc}") from None
        keys.extend(parse_keys(text.splitlines(), where))
    keys.extend(parse_keys(settings.api_keys, "api_keys (SERVEWELL_API_KEYS or the config file)"))
    if settings.api_keys_file is not None and not keys:
        raise NoKeysError(f"{settings.api_keys_file}: holds no key (empty or comments only)")
    check_distinct(keys)  # across the two sources: an id, or a key, in both
    return KeyRing(keys)


class ReloadMetrics(Collector):
    """`servewell_config_rejected_files` and `servewell_config_reloads_total{outcome}`: no label
    comes from a client or names a file."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.rejected_files = 0
        self.outcomes = {"applied": 0, "rejected": 0}
        if registry is not None:
            registry.register(self)

    def collect(self) -> Iterable[Metric]:
        gauge = GaugeMetricFamily("servewell_config_rejected_files",
                                  "Configuration files whose latest version was rejected (0: all applied).")
        gauge.add_metric([], self.rejected_files)
        counter = CounterMetricFamily("servewell_config_reloads", "Configuration file changes, by outcome.",
                                      labels=["outcome"])
        for outcome, count in self.outcomes.items():
            counter.add_metric([outcome], count)
        return [gauge, counter]


class ConfigReloader:
    """Polls the watched files (and reacts to SIGHUP) and applies what changed."""

    def __init__(self, source: ConfigSource, settings: ServerConfig, engine: InferenceEngine, access: InferenceAccess,
                 tracing: Tracing, knobs: LiveKnobs, registry: CollectorRegistry | None = None,
                 audit: AuditTrail | None = None) -> None:
        self._source = source
        self._audit = audit if audit is not None else AuditTrail()  # every change applied here
        self._who = BY_FILE  # who asked for the check under way: a poll (file) or SIGHUP
        self._key_salt = os.urandom(16)  # the audit trail's key versions mean nothing outside this process
        self.settings = settings
        self._engine = engine
        self._access = access
        self._tracing = tracing
        self._knobs = knobs
        self._watch = FileWatch(settings.config_max_bytes)
        self._lock = asyncio.Lock()
        self._models: dict[Path, str] = {}
        self._metrics = ReloadMetrics(registry)
        self.rejected = RejectedFiles(on_change=self._count_rejected)
        self._last_error = ""
        self.loaded_at = time.time()
        self.keys_loaded_at = time.time()
        self.pending_restart: list[str] = []
        if source.file is not None:
            self._watch.track(source.file)
        if settings.api_keys_file is not None:
            self._watch.track(settings.api_keys_file)

    def _count_rejected(self, files: int) -> None:
        self._metrics.rejected_files = files

    def watch_models(self) -> None:
        """Start watching the model.yaml of every model the engine knows (call after it started)."""
        for path in self._new_model_files():
            self._watch.track(path)

    def _new_model_files(self) -> list[Path]:
        new = []
        for entry in self._engine.registry.entries():  # names only: a view reads every worker's memory from /proc
            path = self._engine.repository / entry.name / "model.yaml"
            if path not in self._models:
                self._models[path] = entry.name
                new.append(path)
        return new

    async def run(self, stop: asyncio.Event) -> None:
        """Check for changes every `config_poll_s` seconds until `stop` is set (0: only on SIGHUP).
        Nothing stops it but `stop`: an unexpected error is logged (once while it repeats)."""
        while not stop.is_set():
            poll_s = self.settings.config_poll_s
            try:
                await asyncio.wait_for(stop.wait(), poll_s if poll_s > 0 else None)
            except TimeoutError:
                await self.check()

    async def check(self, settle: bool = True) -> None:
        """Apply every watched file whose change has settled (`settle=False`, for SIGHUP: at once),
        after taking out the models and versions whose directories are gone (their model.yaml is no
        longer watched: a removed model is not a rejected file)."""
        try:
            async with self._lock:
                self._who = BY_FILE if settle else BY_SIGHUP
                for name in await self._engine.registry.remove_missing(settle):
                    self._forget_model(name)
                new = self._new_model_files()
                changes = await asyncio.wait_for(asyncio.to_thread(self._look, new, settle), POLL_TIMEOUT_S)
                for change in changes:
                    try:
                        await self._apply(change)
                    except Exception as exc:  # one file's unexpected error never skips the others
                        self._reject(change.path, [(TOP_LEVEL, cut(f"{type(exc).__name__}: {exc}"))],
                                     "the running configuration is kept")
            self._last_error = ""
        except Exception as exc:  # the watcher must outlive any file and any bug
            message = cut(f"{type(exc).__name__}: {exc}")
            if message != self._last_error:
                log.error("configuration watcher: a check failed, polling goes on: %s", message)
                self._last_error = message

    def _forget_model(self, name: str) -> None:
        path = self._engine.repository / name / "model.yaml"
        self._models.pop(path, None)
        self._watch.forget(path)
        self.rejected.clear(path)

    def _look(self, new: list[Path], settle: bool) -> list[FileChange]:
        for path in new:  # models loaded since the last poll: their file as it is now is the baseline
            self._watch.track(path)
        return self._watch.poll(settle)

    def _label(self, path: Path) -> str:
        if path in self._models:
            return f"{self._models[path]}/model.yaml"
        return path.name

    def _reject(self, path: Path, problems: list[tuple[str, str]], kept: str) -> None:
        kind = "config file" if path == self._source.file else "model.yaml" if path in self._models else "keys file"
        # The keys file's reasons name key ids and tenants: /healthz (open) shows that it was refused only.
        self.rejected.reject(path, self._label(path), problems, private=kind == "keys file")
        self._metrics.outcomes["rejected"] += 1
        reasons = "; ".join(reason if field == TOP_LEVEL else f"field '{field}': {reason}"
                            for field, reason in problems)
        log.error("%s rejected, %s: %s: %s", kind, kept, path, cut(reasons, 1000), extra={"file": str(path)})

    def _applied(self, path: Path) -> None:
        self.rejected.clear(path)
        self._metrics.outcomes["applied"] += 1

    async def _apply(self, change: FileChange) -> None:
        path = change.path
        if not change.settled:
            log.info("%s changed; applied once it stays unchanged for one poll", path, extra={"file": str(path)})
            return
        kind = "config" if path == self._source.file else "keys" if path == self.settings.api_keys_file else "model"
        if change.problem is not None and kind != "keys":
            self._reject(path, [(TOP_LEVEL, change.problem)], "the running configuration is kept")
        elif kind == "config":
            self._reload_server()
        elif kind == "keys":
            self._reload_keys(self.settings, f"keys file {path} changed", path)
        elif path in self._models:
            await self._reload_model(self._models[path], path)

    def _reload_server(self) -> None:
        path = self._source.file
        assert path is not None
        try:
            fresh = self._source.load()
        except ConfigFileError as exc:
            self._reject(path, [(TOP_LEVEL, cut(str(exc).removeprefix(f"{path}: "), 600))],
                         "the running configuration is kept")
            return
        old = self.settings
        changed = [name for name in ServerConfig.model_fields if getattr(fresh, name) != getattr(old, name)]
        live = [name for name in changed if name in LIVE_FIELDS]
        self.pending_restart = [name for name in changed if name not in LIVE_FIELDS]
        if self.pending_restart:
            self._audit.record_fields(self._who, "file reload", "settings (need a restart)", path.name,
                                      {n: getattr(old, n) for n in self.pending_restart},
                                      {n: getattr(fresh, n) for n in self.pending_restart})
        self._applied(path)
        if "payload_log" in live and not self._apply_payload_log(fresh, path):
            live.remove("payload_log")
        if any(name.startswith("api_key") for name in live):
            if not self._reload_keys(fresh, f"config file {path} changed the API keys", path):
                live = [name for name in live if not name.startswith("api_key")]
        self.settings = old.model_copy(update={name: getattr(fresh, name) for name in live})
        self._apply_knobs()
        if old.api_keys_file != self.settings.api_keys_file:
            if old.api_keys_file is not None:
                self._watch.forget(old.api_keys_file)
                self.rejected.clear(old.api_keys_file)
            if self.settings.api_keys_file is not None:
                self._watch.track(self.settings.api_keys_file)
        self.loaded_at = time.time()
        if live:
            self._audit.record_fields(self._who, "file reload", "settings", path.name,
                                      {n: getattr(old, n) for n in live}, {n: getattr(self.settings, n) for n in live})
            log.info("config file %s reloaded: applied %s", path, live, extra={"fields": live})
        if self.pending_restart:
            log.warning("config file %s changes %s, which need a restart; the running values are kept",
                        path, self.pending_restart, extra={"fields": self.pending_restart})

    def _apply_payload_log(self, settings: ServerConfig, path: Path) -> bool:
        # A sink that cannot be opened rejects the change: the running payload log stays as it was.
        payload_log = self._engine.payload_log
        if payload_log is None:
            return False
        try:
            payload_log.apply(settings.payload_log)
        except OSError as exc:
            self._reject(path, [("payload_log", f"{type(exc).__name__}: {exc}")], "the running payload log is kept")
            return False
        return True

    def _reload_keys(self, settings: ServerConfig, why: str, path: Path) -> bool:
        try:
            ring = load_keys(settings)
        except NoKeysError as exc:
            self._deny_everyone(path, str(exc))
            return True
        except (KeyFormatError, OSError) as exc:
            self._reject(path, [(TOP_LEVEL, str(exc))], "the previous keys stay in force")
            return False
        if not ring.enabled and self._access.enabled:
            self._deny_everyone(path, "no API key is configured any more")
            return True
        before = key_table(self._access.ring.keys if self._access.enabled else (), self._key_salt)
        self._access.replace(ring, settings.api_key_rate_per_s)
        self._audit.record_fields(self._who, "file reload", "keys", path.name, before,
                                  key_table(ring.keys, self._key_salt))
        self.keys_loaded_at = time.time()
        self._applied(path)
        log.info("%s: %d API key(s) in force", why, len(ring.ids), extra={"key_ids": list(ring.ids)})
        return True

    def _deny_everyone(self, path: Path, reason: str) -> None:
        # Keys never fail open: revoking the last key must not leave it valid, nor open inference.
        before = key_table(self._access.ring.keys if self._access.enabled else (), self._key_salt)
        self._access.replace(KeyRing((), required=True), None)
        self._audit.record(self._who, "file reload", "keys", path.name, before, {},
                           f"keys of {path.name}: none in force ({reason}); every request that needs a key is refused")
        self.keys_loaded_at = time.time()
        self._reject(path, [(TOP_LEVEL, f"{reason}: no API key is in force")],
                     "every request that needs an API key is refused until a key is configured (fail closed)")

    def _apply_knobs(self) -> None:
        settings = self.settings
        logging.getLogger().setLevel(settings.log_level.upper())
        self._tracing.set_sample_ratio(sample_ratio_or_default(settings.trace_sample_ratio))
        self._knobs.slow_request_s = settings.slow_request_ms / 1000.0
        self._knobs.metrics_need_key = settings.metrics_require_key

    async def _reload_model(self, name: str, path: Path) -> None:
        # Read and validated in a thread (a 1 MiB file must not stall the event loop), once: the
        # engine applies this very config, and the rejection keeps each problem's field.
        try:
            config = await asyncio.to_thread(read_model_config, path.parent)
        except ModelConfigError as exc:
            self._reject(path, [(p.field, p.reason) for p in exc.problems], "the running version keeps serving")
            return
        except ValueError as exc:
            self._reject(path, [(TOP_LEVEL, str(exc))], "the running version keeps serving")
            return
        # Checked here as well as at load: a change applied live (batching only) loads nothing.
        refused = outside_refusal(self._engine.repository, path.parent, self.settings.models_outside_repository)
        if refused is not None:
            self._reject(path, [(TOP_LEVEL, refused)], "the running version keeps serving")
            return
        real = outside_repository(self._engine.repository, path.parent)
        if real is not None:  # a model directory swapped for a symlink out of the repository
            log.warning("model directory %s resolves to %s, outside the repository %s", name, real,
                        self._engine.repository, extra={"model": name})
        previous = self._running_config(name)
        try:
            outcome = await self._engine.loader.reconfigure_model(name, config)
        except ServeError as exc:
            self._reject(path, [(TOP_LEVEL, exc.message)], "the running version keeps serving")
            return
        self._applied(path)
        if previous is not None and outcome != "unchanged":
            old, new = flat(previous.model_dump(mode="json")), flat(config.model_dump(mode="json"))
            entry = self._audit.record_fields(self._who, "file reload", "model file", name, old, new)
            if entry is not None:
                log.info("%s: %s", entry.summary, outcome, extra={"model": name})
        log.info("%s changed: %s", path, outcome, extra={"model": name})

    def _running_config(self, name: str) -> Any:
        """The config the model serves with now (None: none, e.g. an invalid model.yaml)."""
        try:
            return self._engine.slot(name, None).entry.config
        except ServeError:
            return None

    def status(self) -> dict[str, Any]:
        """`{"status": "ok" | "degraded", "rejected": [...]}` for /healthz and the console (no full paths)."""
        return self.rejected.status()

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
            "models": self._engine.views.config_report(),
            "config": self.rejected.status(full_paths=True),
        }


def key_table(keys: Iterable[Any], salt: bytes) -> dict[str, dict[str, Any]]:
    """What the audit trail keeps of API keys: per key id, its tenant, role, weight, quotas and
    `version`, a short hash of its digest with `salt` (a process's random bytes: a key rotated under
    the same id changes it, and it confirms no guess of a key, nor means anything outside the
    process), never the key."""
    return {key.id: {"tenant": key.tenant_id, "operator": key.operator, "weight": key.weight,
                     "rate_per_s": key.rate_per_s, "max_concurrent": key.max_concurrent,
                     "max_queued": key.max_queued, "version": hashlib.sha256(salt + key.digest).hexdigest()[:8]}
            for key in keys}


def flat(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config dump with nested sections flattened to dotted names (`batching.max_wait_ms`)."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            out.update(flat(value, name + "."))
        else:
            out[name] = value
    return out
