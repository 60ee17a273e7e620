"""A model's traffic split between versions, its shadow, and the judge that takes a bad canary back.

A `Rollout` lives in the model's slot beside the stable version (the slot's entry, from the
model's own model.yaml) and holds the other versions it loaded from `versions/<v>/`. For every
request that names no version it draws the version by the weights in force: the client's route
key (or tenant) hashed onto the weights keeps one client on one version while they hold; without
one, each request is drawn anew. A version that is not serving is never drawn (its share goes to
the others).

While a canary takes traffic, every answer of every version is reported to the judge
(engine/rollout_rules.py), and `judge()`, called each second by the engine, applies its verdict:
a rollback takes the canary's weight to 0 (and stops a shadow), logs why with the numbers, counts
it in metrics, and keeps the evidence for the console, /healthz and the alert; a promotion (off by
default) gives the canary all the traffic. Both last until model.yaml's traffic changes or an
admin sets weights: the file or the admin wins, as with batching overrides.

Shadowing copies a share of the requests to the shadow version on spare capacity only: its lowest
lane, outside the tenant's quotas, and not at all while the primary has more than a batch queued
or the shadow has a batch's worth outstanding (it is shed, and counted). Its answer is compared
with the primary's (engine/shadow_compare.py) and never returned.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import random
import time
import zlib
from collections.abc import Mapping
from functools import partial
from types import EllipsisType
from typing import TYPE_CHECKING, Any

from servewell.config.model import ModelConfig
from servewell.config.rollout import RollbackConfig, RolloutConfig
from servewell.engine.model_lifecycle import RolloutLifecycle, RolloutPhase
from servewell.engine.protocol import RequestResult
from servewell.engine.rollout_rules import RollbackRules, RolloutJudge, Verdict
from servewell.engine.shadow_compare import compare_outputs
from servewell.errors import NotFound, ServeError, quote
from servewell.observability.metrics import RolloutGauges

if TYPE_CHECKING:
    from servewell.engine.model_entry import ModelEntry
    from servewell.engine.request import InferenceRequest
    from servewell.observability.metrics import ServeMetrics

log = logging.getLogger("servewell.rollout")

#: Error codes that count against a version in the rules: its own failures, not the client's
#: mistakes nor the server's load (a full queue is capacity, not a bad model).
JUDGED_ERRORS = frozenset(("model_error", "worker_lost", "worker_hung", "deadline_exceeded"))
#: The shadow's deadline: a copy that cannot finish in this long is dropped, not waited for.
SHADOW_TIMEOUT_S = 10.0
#: Spare capacity: shadow copies stop while more than this share of the primary's recent requests
#: (a moving average, weight SHADOW_PRESSURE_ALPHA per request) queued behind a running batch.
SHADOW_PRESSURE_LIMIT = 0.5
SHADOW_PRESSURE_ALPHA = 0.05
#: Niceness of a version that only shadows (no weight in model.yaml); its workers also run under
#: SCHED_IDLE (`cpu_policy: idle`): they get the CPU the serving versions leave.
SHADOW_NICE = 19


def rules_of(config: RollbackConfig) -> RollbackRules:
    """The judge's rules from model.yaml's `rollout.rollback`."""
    return RollbackRules(window_s=config.window_s, min_requests=config.min_requests,
                         max_error_rate_increase=config.max_error_rate_increase,
                         max_p99_ratio=config.max_p99_ratio, min_p99_increase_s=config.min_p99_increase_ms / 1000.0,
                         min_shadow_agreement=config.min_shadow_agreement,
                         promote_after_requests=config.promote_after_requests)


def _file_shadow(config: ModelConfig) -> tuple[str | None, float]:
    """(version, percent) of model.yaml's shadow; (None, 0) without one."""
    shadow = config.rollout.shadow if config.rollout is not None else None
    return (shadow.version, shadow.percent) if shadow is not None else (None, 0.0)


def judged_error(error: BaseException | None) -> bool:
    """Whether a request's failure counts against the version that served it."""
    return isinstance(error, ServeError) and error.code in JUDGED_ERRORS


class Rollout:
    """The versions of one model beyond its stable one, and how its requests are split."""

    def __init__(self, name: str, config: ModelConfig, metrics: ServeMetrics | None) -> None:
        self.name = name
        self.candidates: dict[str, ModelEntry] = {}  # loaded versions other than the stable one
        self.failed: dict[str, str] = {}  # version -> why it is not serving (load failed, wrong inputs)
        #: version -> where its directory really is, when that is outside the model repository (a symlink out)
        self.outside: dict[str, str] = {}
        self._metrics = metrics
        self.stable = config.version
        self.settings = RolloutConfig()
        self.file_weights: dict[str, float] = {}
        self.weights: dict[str, float] = {}  # in force: the file's, an admin's, or after a verdict
        self.admin_set = False
        self.shadow_version: str | None = None
        self.shadow_percent = 0.0
        #: steady, canary, rolled back or promoted, why, with the evidence (engine/model_lifecycle.py)
        self.lifecycle = RolloutLifecycle(changed_at=time.time())
        self.judge = RolloutJudge(self.stable, RollbackRules())
        self.shadow_counts = {"compared": 0, "shed": 0, "failed": 0}
        self.agreement = {"rows": 0, "top1_matches": 0, "max_abs_diff": 0.0}
        self._versions: list[str] = []  # the draw table: versions and cumulative weights
        self._bounds: list[float] = []
        self._shares: dict[str, float] = {}
        self._judging = False  # a canary takes traffic: every answer is reported to the judge
        self._shed = 0  # copies shed under pressure, not yet counted in the metrics
        self._pressure = 0.0  # moving share of requests that queued behind a running batch of the primary
        self.config_seen: ModelConfig | None = None  # the stable model.yaml last applied (engine/versions.py)
        self.configure(config, None)

    # --- settings --------------------------------------------------------------------------

    def configure(self, config: ModelConfig, previous: ModelConfig | None) -> None:
        """Take the stable version's model.yaml (at load, or changed live). Changed weights in the
        file replace an admin's and a verdict's; unchanged ones leave them in force."""
        self.stable = config.version
        self.settings = config.rollout or RolloutConfig()
        weights = dict(config.traffic) if config.traffic is not None else {config.version: 1.0}
        changed = previous is None or weights != self.file_weights or previous.version != config.version
        self.file_weights = weights
        if previous is None or _file_shadow(config) != _file_shadow(previous):  # else an admin's share stays
            self.shadow_version, self.shadow_percent = _file_shadow(config)
        if changed:
            self.weights, self.admin_set = dict(weights), False
            self.lifecycle.weights_set(bool(self.canaries()), None, time.time())
        elif self.lifecycle.phase in (RolloutPhase.STEADY, RolloutPhase.CANARY) and \
                (self.lifecycle.phase is RolloutPhase.CANARY) != bool(self.canaries()):
            # The same weights, but a canary's version loaded (or left) since: it takes traffic now (or not).
            self.lifecycle.weights_set(bool(self.canaries()), None, time.time())
        rules = rules_of(self.settings.rollback)
        if rules != self.judge.rules or self.judge.stable != self.stable:  # else its windows are kept
            self.judge = RolloutJudge(self.stable, rules)
        self._rebuild()

    def set_by_admin(self, traffic: Mapping[str, float] | None | EllipsisType,
                     shadow_percent: float | None | EllipsisType) -> None:
        """An admin's weights and/or shadow share (`...`: unchanged; None: model.yaml's); versions
        must be loaded. A verdict is cleared: the admin decided."""
        if shadow_percent is not ... and self.shadow_version is None:
            raise NotFound(f"model '{self.name}' has no shadow version (rollout.shadow in model.yaml)")
        if traffic is not ...:
            weights = dict(self.file_weights) if traffic is None else dict(traffic)
            unknown = [v for v in weights if v != self.stable and v not in self.candidates]
            if unknown:
                raise NotFound(f"model '{self.name}' has no loaded version {quote(unknown[0])}; loaded: "
                               f"{self.versions()}")
            self.weights, self.admin_set = weights, traffic is not None
            for version in weights:
                self.judge.reset(version)
            self.lifecycle.weights_set(bool(self.canaries()), "weights set by an admin", time.time())
        if shadow_percent is not ...:
            shadow = self.settings.shadow
            self.shadow_percent = float(shadow.percent if shadow is not None and shadow_percent is None
                                        else shadow_percent or 0.0)
        self._rebuild()

    @staticmethod
    def shadow_only(version: str, config: ModelConfig) -> bool:
        """Whether `config` names `version` as its shadow and gives it no traffic (it runs at SHADOW_NICE)."""
        return _file_shadow(config)[0] == version and not (config.traffic or {}).get(version)

    def versions(self) -> list[str]:
        """The stable version, then the loaded candidates."""
        return [self.stable, *sorted(self.candidates)]

    def canaries(self) -> list[str]:
        """Candidate versions with traffic in force."""
        return [v for v, w in self.weights.items() if v != self.stable and w > 0 and v in self.candidates]

    def _rebuild(self) -> None:
        serving = {v: w for v, w in self.weights.items() if w > 0 and (v == self.stable or v in self.candidates)}
        versions, bounds, total = [], [], 0.0
        for version in sorted(serving):
            total += serving[version]
            versions.append(version)
            bounds.append(total)
        self._versions, self._bounds = versions, [b / total for b in bounds] if total else []
        self._shares = {v: (serving.get(v, 0.0) / total if total else 0.0) for v in self.versions()}
        self._judging = bool(self.canaries())

    # --- the request path ------------------------------------------------------------------

    def choose(self, stable: ModelEntry, asked: str | None, request: InferenceRequest | None = None) -> ModelEntry:
        """The entry that serves a request: the version it asked for, else drawn by the weights
        (sticky by `request`'s route key or tenant, per `rollout.sticky`)."""
        if asked not in (None, ""):
            if asked == stable.version:
                return stable
            entry = self.candidates.get(asked or "")
            if entry is None:
                raise NotFound(f"model '{self.name}' has no version {quote(asked)}; it serves {self.versions()}")
            return entry.ready_entry()
        versions = self._versions
        if not versions or versions == [stable.version]:
            return stable
        sticky = self.settings.sticky
        key = request.route_key if sticky == "route_key" and request is not None else ""
        if not key and sticky != "none" and request is not None:
            key = request.tenant or request.key_id
        point = (zlib.crc32(key.encode("utf-8", "replace")) / 4294967296.0) if key else random.random()
        version = versions[min(bisect.bisect_right(self._bounds, point), len(versions) - 1)]
        if version == stable.version:
            return stable
        entry = self.candidates.get(version)
        if entry is None or not entry.lifecycle.serving:
            return stable
        return entry

    def watching(self) -> bool:
        """Whether the rules have anything to judge (a canary takes traffic, or a shadow runs)."""
        return self._judging or (self.shadow_version is not None and self.shadow_percent > 0)

    def submitted(self, entry: ModelEntry, future: asyncio.Future[RequestResult]) -> None:
        """A request that names no version or one of ours was queued on `entry`: while a canary is
        judged, its answer is reported to the judge."""
        if self._judging:
            future.add_done_callback(partial(self.report, entry.version, time.monotonic()))

    def report(self, version: str, started: float, future: asyncio.Future[RequestResult]) -> None:
        """A request of `version` finished (a done callback): feed the judge and the counters."""
        if future.cancelled():
            return
        error = future.exception()
        bad = judged_error(error)
        now = time.monotonic()
        # The batch's compute time too (not for an answer the response cache gave: nothing ran for it).
        result = None if error is not None else future.result()
        compute_s = None if result is None or result.cache else result.compute_s
        self.judge.request_done(version, now, now - started, bad, compute_s)
        if self._metrics is not None:
            self._metrics.rollout_requests.labels(self.name, version, "error" if bad else "success").inc()

    def shadow_for(self, primary: ModelEntry) -> str | None:
        """The version a request served by `primary` is copied to, if the dice say so and the
        primary has spare capacity (None: no copy; a copy shed under pressure is counted)."""
        version = self.shadow_version
        if version is None or version == primary.version or self.shadow_percent <= 0 or \
                random.random() * 100.0 >= self.shadow_percent:
            return None
        scheduler = primary.scheduler
        # Pressure: the share of recent requests that found the primary computing with others waiting.
        waited = 1.0 if scheduler.running_rows and scheduler.queue_depth > 1 else 0.0
        self._pressure += SHADOW_PRESSURE_ALPHA * (waited - self._pressure)
        if self._pressure > SHADOW_PRESSURE_LIMIT or scheduler.queue_depth > max(1, scheduler.limits.max_batch_size):
            self._shed += 1  # counted in the metrics each second (`flush_shed`): at saturation, every request
            return None
        return version

    def shadow_room(self, version: str) -> ModelEntry | None:
        """The shadow version's entry when a copy may be queued on it now: it serves and is not a
        batch's worth behind (None: the copy is shed, and counted)."""
        entry = self.candidates.get(version)
        if entry is None or not entry.lifecycle.serving or self.shadow_version != version:
            return None
        scheduler = entry.scheduler
        room = max(1, scheduler.limits.max_batch_size) * entry.config.instances
        if scheduler.queue_depth + scheduler.running_rows >= room:
            self.shadow_shed(version)  # the shadow is behind: drop the copy rather than queue it
            return None
        return entry

    def shadow_shed(self, version: str) -> None:
        """A copy for `version` could not be queued."""
        self._count_shadow(version, "shed")

    def compare(self, version: str, primary: RequestResult, batched: bool,
                copy: asyncio.Future[RequestResult]) -> None:
        """A done callback of a shadow copy: compare its answer with the primary's."""
        if copy.cancelled() or copy.exception() is not None:
            self._count_shadow(version, "failed")
            return
        shadow = copy.result()
        self._count_shadow(version, "compared")
        rows = top1 = 0
        worst = 0.0
        for agreement in compare_outputs(primary.outputs, shadow.outputs, batched=batched):
            matches = agreement.top1_matches
            if matches is not None:
                rows += agreement.rows
                top1 += matches
            if agreement.max_abs_diff is not None:
                worst = max(worst, agreement.max_abs_diff)
            if self._metrics is not None:
                if matches is not None:
                    self._metrics.shadow_rows.labels(self.name, version, agreement.output).inc(agreement.rows)
                    self._metrics.shadow_top1_matches.labels(self.name, version, agreement.output).inc(matches)
                if agreement.max_abs_diff is not None:
                    self._metrics.shadow_max_abs_diff.labels(self.name, version, agreement.output).observe(
                        agreement.max_abs_diff)
        self.agreement["rows"] += rows
        self.agreement["top1_matches"] += top1
        self.agreement["max_abs_diff"] = max(float(self.agreement["max_abs_diff"]), worst)
        if rows:
            self.judge.shadow_compared(version, time.monotonic(), rows, top1)
        if self._metrics is not None:  # both as the engine saw them: queue + compute
            latency = self._metrics.shadow_latency
            latency.labels(self.name, version, "primary").observe(primary.queue_s + primary.compute_s)
            latency.labels(self.name, version, "shadow").observe(shadow.queue_s + shadow.compute_s)

    def flush_shed(self) -> None:
        """Count the copies shed under pressure since the last call (the judge's loop calls it)."""
        shed, self._shed = self._shed, 0
        if shed and self.shadow_version is not None:
            self._count_shadow(self.shadow_version, "shed", shed)

    def _count_shadow(self, version: str, outcome: str, n: int = 1) -> None:
        self.shadow_counts[outcome] += n
        if self._metrics is not None:
            self._metrics.shadow_requests.labels(self.name, version, outcome).inc(n)

    # --- verdicts --------------------------------------------------------------------------

    def judge_now(self) -> Verdict | None:
        """Apply the judge's verdict, if any (the engine calls this each second)."""
        self.flush_shed()
        if not self.watching():
            return None
        shadow = self.shadow_version if self.shadow_percent > 0 else None
        verdict = self.judge.judge(time.monotonic(), self.canaries(), shadow)
        if verdict is None or (verdict.action == "promote" and self.lifecycle.promoted_already(verdict.version)):
            return None  # promoted already: the rules keep watching it, the promotion is not repeated
        if verdict.action == "rollback":
            if verdict.version != self.stable:  # a stable version is never taken out of traffic
                self.weights[verdict.version] = 0.0
            if verdict.version == self.shadow_version:
                self.shadow_percent = 0.0
            self.lifecycle.rolled_back(verdict.reason, {"version": verdict.version, "rule": verdict.rule,
                                                        **verdict.evidence}, time.time())
            log.warning("model %s: rolled back version %s (%s): %s", self.name, verdict.version, verdict.rule,
                        verdict.reason, extra={"model": self.name})
        else:
            self.weights = {verdict.version: 100.0}
            self.lifecycle.promoted(verdict.reason, {"version": verdict.version, **verdict.evidence}, time.time())
            log.info("model %s: promoted version %s to all traffic: %s", self.name, verdict.version, verdict.reason,
                     extra={"model": self.name})
        self.judge.reset(verdict.version)
        if self._metrics is not None:
            self._metrics.rollout_events.labels(self.name, verdict.version, verdict.action, verdict.rule).inc()
        self._rebuild()
        return verdict

    def gauges(self) -> RolloutGauges:
        """What the metrics scrape shows of this rollout now."""
        rolled = self.lifecycle.rolled_back_version
        return RolloutGauges(self.name, self.lifecycle.state, dict(self._shares),
                             {v: 1.0 if v == rolled else 0.0 for v in self.versions()})

    def to_json(self) -> dict[str, Any]:
        """The rollout as /healthz, the console and GET /admin/models/{name}/rollout show it."""
        self.flush_shed()
        now = time.monotonic()
        window = self.judge.rules.window_s
        stats = {}
        for version in self.versions():
            s = self.judge.window_stats(version, now)
            stats[version] = {"requests": s.requests, "errors": s.errors, "error_rate": s.error_rate,
                              "p99_ms": None if s.p99_s is None else round(s.p99_s * 1000, 3)}
        rows = int(self.agreement["rows"])
        life = self.lifecycle
        return {
            "state": life.state, "stable": self.stable, "weights": dict(self.weights),
            "file_weights": dict(self.file_weights), "set_by_admin": self.admin_set,
            "sticky": self.settings.sticky, "reason": life.reason, "evidence": dict(life.evidence),
            "changed_at": life.changed_at,
            "versions": {v: {"state": e.state, "reason": e.reason, "cpu_policy": e.config.cpu_policy,
                             "instances": [{"instance": i.instance, "pid": i.pid, "alive": i.alive,
                                            "rss_bytes": i.rss_bytes} for i in e.instances()],
                             "outside_repository": self.outside.get(v)}
                         for v, e in sorted(self.candidates.items())}
            | {v: {"state": "failed", "reason": why, "outside_repository": self.outside.get(v)}
               for v, why in sorted(self.failed.items())},
            "shadow": None if self.shadow_version is None else {
                "version": self.shadow_version, "percent": self.shadow_percent, **self.shadow_counts,
                "top1_agreement": (self.agreement["top1_matches"] / rows) if rows else None,
                "max_abs_diff": self.agreement["max_abs_diff"]},
            "window_s": window, "window": stats,
        }
