"""A model's lifecycle as explicit phases, each changed only through named transitions that a table
allows (the `workers/lifecycle.py` pattern), and the one place that says what each phase allows.

Where a model is has three parts, one machine each:

- `VersionPhase`, of one version that serves or may serve (a `ModelEntry`, a pipeline's
  `PipelineEntry`; an `InvalidModel` is always INVALID): new → loading → ready ⇄ restarting →
  failed, and draining → stopped once it is stopped. `VersionLifecycle` keeps why it was stopped
  (an operator's unload, a reload replacing it, an eviction, its files removed, the server
  stopping: each refuses with its own 503) and, while it drains, the state it had: its requests
  in flight still finish there, so users see that state until it has stopped.
- `ResidencyPhase`, of a model name across the versions a reload or a lazy load swaps in (its
  `ModelSlot`): listed → loaded → evicting → evicted → loaded again; unloaded by an operator;
  removed from the repository.
- `RolloutPhase`, of a model's traffic split (`Rollout`): steady, canary, rolled back, promoted.

The questions every caller asks are answered here and nowhere else: does it take new requests
(`serving`), is it resident, would a request load it (`ResidencyLifecycle.loads_on_request`), may
its settings change (`configurable`), does it hold memory in the budget (`holds_memory`), and the
state and residency users see in /healthz, the metadata, the metrics and the console. A transition
a table does not allow raises `InvalidTransition`: a bug in the engine, caught by the tests.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from servewell.engine.protocol import ModelState
from servewell.errors import ModelLoading, ModelNotReady, ModelReloading, ModelUnloading, ShuttingDown, Unavailable

#: Why a version stops taking requests: an operator unloads it, a reload replaces it, the server
#: stops, the pool evicts it, or its files left the repository. Each has its own 503, so a client
#: (and an operator reading the counts) can tell an unload or a reload from a shutdown: before, all
#: three said `shutting_down` (issue 19.17: 382 of 3,116 predictions during unload/reload races, on a
#: server that was not shutting down).
StopCause = Literal["unloading", "reloading", "shutting_down", "evicting", "removing"]

#: Where a model is, as /healthz, the repository index, the console and metrics show it.
Residency = Literal["resident", "loading", "evicted", "not_loaded", "failed", "invalid"]

#: What the metrics and /healthz show of a traffic split.
RolloutState = Literal["steady", "canary", "rolled_back", "promoted"]

#: Retry-After of a request refused by a version that is being replaced: the new version serves now.
RELOADING_RETRY_S = 1.0
#: Retry-After of a request refused by a model being unloaded: it comes back only when loaded again.
UNLOADING_RETRY_S = 5.0


class InvalidTransition(RuntimeError):
    """A lifecycle was moved in a way its table does not allow (a bug, never a user's error)."""


def _check(table: Mapping[Any, frozenset[Any]], kind: str, now: enum.Enum, to: enum.Enum) -> None:
    if to not in table[now]:
        raise InvalidTransition(f"a {kind} cannot go from {now.value} to {to.value}")


# --- one version ----------------------------------------------------------------------------------


class VersionPhase(enum.Enum):
    """Where one version is in its life."""

    NEW = "new"  # built, not loaded (a lazy model's entry waits here for its first request)
    LOADING = "loading"  # its memory reserved, its workers starting and warming up
    READY = "ready"  # takes requests
    RESTARTING = "restarting"  # lost every worker; the pool starts new ones
    FAILED = "failed"  # could not load, or its workers could not be brought back
    DRAINING = "draining"  # being stopped: takes no new request, those in flight finish
    STOPPED = "stopped"  # its workers stopped, its memory given back
    INVALID = "invalid"  # its model.yaml cannot be used: it never serves

    @property
    def serving(self) -> bool:
        """Whether it admits new requests."""
        return self is VersionPhase.READY

    @property
    def resident(self) -> bool:
        """Whether its workers serve, or will again once the pool has replaced them."""
        return self in (VersionPhase.READY, VersionPhase.RESTARTING)

    @property
    def configurable(self) -> bool:
        """Whether its live settings (batching, the response cache) may change: they apply to a
        version that loads or serves, and to nothing once it stops or failed."""
        return self in (VersionPhase.LOADING, VersionPhase.READY, VersionPhase.RESTARTING)

    @property
    def holds_memory(self) -> bool:
        """Whether it holds a reservation in the memory budget: from its load until its workers stopped."""
        return self in (VersionPhase.LOADING, VersionPhase.READY, VersionPhase.RESTARTING, VersionPhase.DRAINING)

    @property
    def replaceable(self) -> bool:
        """Whether a lazy load may put a new version in its place: it has not loaded, is loading
        (the load under way is the one), or has stopped."""
        return self in (VersionPhase.NEW, VersionPhase.LOADING, VersionPhase.STOPPED)


_STATE_OF: Mapping[VersionPhase, ModelState] = {
    VersionPhase.NEW: "unloaded",
    VersionPhase.LOADING: "loading",
    VersionPhase.READY: "ready",
    VersionPhase.RESTARTING: "restarting",
    VersionPhase.FAILED: "failed",
    VersionPhase.DRAINING: "ready",  # never read: a draining version shows the phase it drains from
    VersionPhase.STOPPED: "unloaded",
    VersionPhase.INVALID: "invalid",
}

_V = VersionPhase
#: Every allowed move of a version. STOPPED and INVALID are final: a reload or a lazy load makes a
#: new version. FAILED is final for a model version; a pipeline that failed its check is checked
#: again (loading) once a step model it needs has loaded (engine/pipeline.py `recheck_pipelines`).
#: A failed version that is stopped stays failed: its reason stays in view.
VERSION_TRANSITIONS: Mapping[VersionPhase, frozenset[VersionPhase]] = {
    _V.NEW: frozenset({_V.LOADING, _V.DRAINING}),
    _V.LOADING: frozenset({_V.READY, _V.FAILED, _V.DRAINING}),
    _V.READY: frozenset({_V.RESTARTING, _V.FAILED, _V.DRAINING}),
    _V.RESTARTING: frozenset({_V.READY, _V.FAILED, _V.DRAINING}),
    _V.FAILED: frozenset({_V.LOADING}),
    _V.DRAINING: frozenset({_V.STOPPED, _V.FAILED}),
    _V.STOPPED: frozenset(),
    _V.INVALID: frozenset(),
}


def not_ready(name: str, state: str, reason: str | None) -> ModelNotReady:
    """The 503 for a model that takes no requests in `state` (retry soon unless it will not recover;
    an invalid one never does until its files change: no Retry-After)."""
    retry = None if state == "invalid" else 5.0 if state in ("failed", "unloaded") else 2.0
    detail = f": {reason}" if reason else ""
    return ModelNotReady(f"model '{name}' is {state}{detail}", retry_after_s=retry)


def stop_refusal(cause: StopCause, label: str) -> Unavailable:
    """The 503 a version stopped for `cause` answers a new request with (`label` names it)."""
    if cause == "unloading":
        return ModelUnloading(f"{label} is being unloaded by an operator and takes no new requests",
                              retry_after_s=UNLOADING_RETRY_S)
    if cause == "reloading":
        return ModelReloading(f"{label} is being replaced by a reload; retry: the new version serves",
                              retry_after_s=RELOADING_RETRY_S)
    if cause == "removing":
        return ModelUnloading(f"{label}: its files were removed from the repository; it takes no new requests",
                              retry_after_s=None)
    if cause == "evicting":
        return ModelLoading(f"{label} is being evicted to make room; it loads again on a request",
                            retry_after_s=UNLOADING_RETRY_S)
    return ShuttingDown("the server is shutting down and accepts no new requests")


@dataclass(slots=True)
class VersionLifecycle:
    """The phase of one version, why it is where it is, and why it was stopped; changed only by the
    transition methods below."""

    phase: VersionPhase = VersionPhase.NEW
    #: Why it is not ready (a failure, how it was stopped); None while it loads or serves.
    reason: str | None = None
    #: Why it was stopped (set once: the first cause wins); None until then.
    stop_cause: StopCause | None = None
    #: While DRAINING, the phase users see: the one it drained from (ready becomes restarting if its
    #: last worker is lost meanwhile).
    shown: VersionPhase = VersionPhase.NEW

    @property
    def state(self) -> ModelState:
        """The state users see in /healthz, the metadata, the metrics and the console."""
        return _STATE_OF[self.shown if self.phase is VersionPhase.DRAINING else self.phase]

    @property
    def serving(self) -> bool:
        """Whether it admits new requests."""
        return self.phase.serving

    @property
    def resident(self) -> bool:
        """Whether it holds workers that serve (or will, once restarted) and takes requests."""
        return self.phase.resident

    @property
    def configurable(self) -> bool:
        """Whether its live settings may change."""
        return self.phase.configurable

    @property
    def holds_memory(self) -> bool:
        """Whether it holds a reservation in the memory budget."""
        return self.phase.holds_memory

    @property
    def stopping(self) -> bool:
        """Whether it was asked to stop (it drains or has stopped, or failed and was stopped)."""
        return self.stop_cause is not None

    @property
    def drains_queue(self) -> bool:
        """While it stops: whether it had workers serving requests that must finish first."""
        return self.phase is VersionPhase.DRAINING and self.shown.resident

    @property
    def supervised(self) -> bool:
        """Whether its worker pool's reports (a worker lost, all back, given up) change its phase:
        once loaded and until it has stopped (while loading, the load decides)."""
        return self.phase.resident or self.drains_queue

    @property
    def recheckable(self) -> bool:
        """Whether a failed pipeline check may be tried again (it was not stopped since)."""
        return self.phase is VersionPhase.FAILED and self.stop_cause is None

    def condition(self) -> str:
        """One word for why it may not be changed: how it is being stopped, else its state."""
        if self.phase is VersionPhase.DRAINING and self.stop_cause is not None:
            return self.stop_cause
        return self.state

    def refusal(self, label: str) -> Unavailable | None:
        """Why it refuses a new request because it was stopped (None: it was not stopped)."""
        return None if self.stop_cause is None else stop_refusal(self.stop_cause, label)

    # --- transitions -----------------------------------------------------------------------------

    def loading(self) -> None:
        """Its load began."""
        self._move(VersionPhase.LOADING, None)

    def loaded(self) -> None:
        """Every worker has warmed up: it serves."""
        self._move(VersionPhase.READY, None)

    def load_failed(self, reason: str) -> None:
        """It could not be loaded (or a pipeline does not fit its step models)."""
        self._move(VersionPhase.FAILED, reason)

    def workers_lost(self, reason: str | None) -> None:
        """Its last worker was lost; the pool restarts them (or, while it drains, nothing will).
        Lost again while restarting: the reason is the latest."""
        if self.phase is VersionPhase.DRAINING:
            self.shown, self.reason = VersionPhase.RESTARTING, reason
        elif self.phase is VersionPhase.RESTARTING:
            self.reason = reason
        else:
            self._move(VersionPhase.RESTARTING, reason)

    def workers_back(self) -> None:
        """Every worker serves again (one that was replaced while the others served: nothing moves)."""
        if self.phase is VersionPhase.DRAINING:
            self.shown, self.reason = VersionPhase.READY, None
        elif self.phase is not VersionPhase.READY:
            self._move(VersionPhase.READY, None)

    def gave_up(self, reason: str | None) -> None:
        """Its workers could not be brought back."""
        self._move(VersionPhase.FAILED, reason)

    def draining(self, cause: StopCause) -> bool:
        """It was asked to stop: it takes no new request from now on. Asking again keeps the first
        cause; a version that failed or has stopped keeps its phase (a failure stays in view).
        Returns whether this began its drain."""
        if self.phase in (VersionPhase.DRAINING, VersionPhase.FAILED, VersionPhase.STOPPED):
            self.stop_cause = self.stop_cause or cause
            return False
        shown = self.phase
        self._move(VersionPhase.DRAINING, self.reason)
        self.shown, self.stop_cause = shown, cause
        return True

    def stopped(self, reason: str | None) -> None:
        """Its workers have stopped and its memory is given back. A failed version stays failed,
        with its reason; one stopped again (an eviction, then an operator's unload) says why it is
        stopped now."""
        if self.phase is VersionPhase.DRAINING:
            self._move(VersionPhase.STOPPED, reason)
        elif self.phase is VersionPhase.STOPPED:
            self.reason = reason

    def _move(self, to: VersionPhase, reason: str | None) -> None:
        _check(VERSION_TRANSITIONS, "model version", self.phase, to)
        self.phase, self.reason = to, reason


def invalid_lifecycle(reason: str) -> VersionLifecycle:
    """The lifecycle of an `InvalidModel`: INVALID, with why."""
    return VersionLifecycle(VersionPhase.INVALID, reason, shown=VersionPhase.INVALID)


# --- a model name in the pool -----------------------------------------------------------------------


class ResidencyPhase(enum.Enum):
    """Where a model name is in the pool, across the versions that serve it."""

    LISTED = "listed"  # in the repository, never loaded since the server started
    LOADED = "loaded"  # a load made its current version (that version's phase says how it is)
    EVICTING = "evicting"  # its workers stop to free memory; a request waits for that, then loads it
    EVICTED = "evicted"  # evicted (for memory, when idle, or by an operator): a request loads it again
    UNLOADED = "unloaded"  # unloaded by an operator: nothing loads it until an operator does
    REMOVED = "removed"  # its directory left the repository: out of the table, it takes nothing


_R = ResidencyPhase
#: Every allowed move of a model name. LOADED → LOADED is a reload (a new version swapped in). While
#: it is evicted, an operator may unload or load it, and its files may go. REMOVED is final.
RESIDENCY_TRANSITIONS: Mapping[ResidencyPhase, frozenset[ResidencyPhase]] = {
    _R.LISTED: frozenset({_R.LOADED, _R.UNLOADED, _R.REMOVED}),
    _R.LOADED: frozenset({_R.LOADED, _R.EVICTING, _R.UNLOADED, _R.REMOVED}),
    _R.EVICTING: frozenset({_R.EVICTED, _R.LOADED, _R.UNLOADED, _R.REMOVED}),
    _R.EVICTED: frozenset({_R.LOADED, _R.UNLOADED, _R.REMOVED}),
    _R.UNLOADED: frozenset({_R.LOADED, _R.REMOVED}),
    _R.REMOVED: frozenset(),
}


@dataclass(slots=True)
class ResidencyLifecycle:
    """The phase of one model name in the pool; changed only by the transition methods below."""

    phase: ResidencyPhase = ResidencyPhase.LISTED

    @property
    def removed(self) -> bool:
        """Whether its directory left the repository (404 from now on)."""
        return self.phase is ResidencyPhase.REMOVED

    @property
    def evicting(self) -> bool:
        """Whether its workers are being stopped to free memory."""
        return self.phase is ResidencyPhase.EVICTING

    def loads_on_request(self, version: VersionLifecycle) -> bool:
        """Whether a request loads it (in lazy mode, for a model with a valid config): neither an
        operator's unload nor a removal stopped it, and its version has not loaded, is loading or
        has stopped (not failed since its last change); one being evicted is: its requests wait
        for the eviction to end, then for the load."""
        if self.phase in (ResidencyPhase.UNLOADED, ResidencyPhase.REMOVED):
            return False
        return self.evicting or version.phase.replaceable

    def residency(self, version: VersionLifecycle, load_pending: bool) -> Residency:
        """Where it is, as users see it (`load_pending`: a lazy load was asked for and has not ended)."""
        shown = version.shown if version.phase is VersionPhase.DRAINING else version.phase
        if version.phase is VersionPhase.INVALID:
            return "invalid"
        if version.resident:
            return "resident"
        if shown is VersionPhase.LOADING or load_pending:
            return "loading"
        if version.phase is VersionPhase.FAILED:
            return "failed"
        if self.phase in (ResidencyPhase.EVICTING, ResidencyPhase.EVICTED):
            return "evicted"
        return "not_loaded"

    # --- transitions -----------------------------------------------------------------------------

    def loaded(self) -> None:
        """A load made (or is making) its version: that version's own phase says whether it serves."""
        self._move(ResidencyPhase.LOADED)

    def evicting_now(self) -> None:
        """Its workers are being stopped to free memory."""
        self._move(ResidencyPhase.EVICTING)

    def evicted(self) -> None:
        """The eviction ended (unless an operator or a removal moved it meanwhile: that phase stays)."""
        if self.phase is ResidencyPhase.EVICTING:
            self._move(ResidencyPhase.EVICTED)

    def unloaded(self) -> None:
        """An operator unloaded it (again: nothing moves; removed meanwhile: it stays removed)."""
        if self.phase not in (ResidencyPhase.UNLOADED, ResidencyPhase.REMOVED):
            self._move(ResidencyPhase.UNLOADED)

    def removed_now(self) -> None:
        """Its directory left the repository."""
        self._move(ResidencyPhase.REMOVED)

    def _move(self, to: ResidencyPhase) -> None:
        _check(RESIDENCY_TRANSITIONS, "model", self.phase, to)
        self.phase = to


# --- a traffic split ------------------------------------------------------------------------------


class RolloutPhase(enum.Enum):
    """Where a model's traffic split is."""

    STEADY = "steady"  # no canary takes traffic (a shadow may run)
    CANARY = "canary"  # a candidate version takes a share, judged by the rollback rules
    ROLLED_BACK = "rolled_back"  # the rules took a version out of traffic (or stopped its shadow)
    PROMOTED = "promoted"  # the rules gave a canary all the traffic


_ROLLOUT_STATE_OF: Mapping[RolloutPhase, RolloutState] = {
    RolloutPhase.STEADY: "steady",
    RolloutPhase.CANARY: "canary",
    RolloutPhase.ROLLED_BACK: "rolled_back",
    RolloutPhase.PROMOTED: "promoted",
}

_O = RolloutPhase
#: Every allowed move of a split. Weights from model.yaml or an admin make it steady or canary from
#: anywhere; the rules roll back a canary or a shadow (steady: a shadow only), and promote a canary
#: only, once.
ROLLOUT_TRANSITIONS: Mapping[RolloutPhase, frozenset[RolloutPhase]] = {
    _O.STEADY: frozenset({_O.STEADY, _O.CANARY, _O.ROLLED_BACK}),
    _O.CANARY: frozenset({_O.STEADY, _O.CANARY, _O.ROLLED_BACK, _O.PROMOTED}),
    _O.ROLLED_BACK: frozenset({_O.STEADY, _O.CANARY, _O.ROLLED_BACK, _O.PROMOTED}),
    _O.PROMOTED: frozenset({_O.STEADY, _O.CANARY, _O.ROLLED_BACK}),
}


@dataclass(slots=True)
class RolloutLifecycle:
    """The phase of one traffic split, why, with the evidence, and when it changed (wall clock)."""

    phase: RolloutPhase = RolloutPhase.STEADY
    reason: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    changed_at: float = 0.0

    @property
    def state(self) -> RolloutState:
        """The state the metrics, /healthz and the console show."""
        return _ROLLOUT_STATE_OF[self.phase]

    @property
    def alert_reason(self) -> str | None:
        """The rollback the alert names, while it holds."""
        return self.reason if self.phase is RolloutPhase.ROLLED_BACK else None

    @property
    def rolled_back_version(self) -> str | None:
        """The version a rollback in force took out (None: none is)."""
        return self.evidence.get("version") if self.phase is RolloutPhase.ROLLED_BACK else None

    def promoted_already(self, version: str) -> bool:
        """Whether `version` is the canary promoted in force (the rules keep watching it, the
        promotion is not repeated)."""
        return self.phase is RolloutPhase.PROMOTED and self.evidence.get("version") == version

    def weights_set(self, canary: bool, reason: str | None, now_s: float) -> None:
        """Weights from model.yaml or an admin are in force: a canary takes traffic, or none does."""
        self._move(RolloutPhase.CANARY if canary else RolloutPhase.STEADY, reason, {}, now_s)

    def rolled_back(self, reason: str, evidence: dict[str, Any], now_s: float) -> None:
        """The rules took a version out of traffic."""
        self._move(RolloutPhase.ROLLED_BACK, reason, evidence, now_s)

    def promoted(self, reason: str, evidence: dict[str, Any], now_s: float) -> None:
        """The rules gave a canary all the traffic."""
        self._move(RolloutPhase.PROMOTED, reason, evidence, now_s)

    def _move(self, to: RolloutPhase, reason: str | None, evidence: dict[str, Any], now_s: float) -> None:
        _check(ROLLOUT_TRANSITIONS, "traffic split", self.phase, to)
        self.phase, self.reason, self.evidence, self.changed_at = to, reason, evidence, now_s
