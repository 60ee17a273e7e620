"""A model's lifecycle (engine/model_lifecycle.py): every named transition from every phase is
allowed or refused as the design says, and what callers ask (does it take requests, is it
resident, would a request load it, may it be configured, does it hold memory, what users see)
follows the phases."""

from __future__ import annotations

from typing import Any

import pytest

from servewell.engine.model_lifecycle import (
    RESIDENCY_TRANSITIONS,
    ROLLOUT_TRANSITIONS,
    VERSION_TRANSITIONS,
    InvalidTransition,
    ResidencyLifecycle,
    ResidencyPhase,
    RolloutLifecycle,
    RolloutPhase,
    VersionLifecycle,
    VersionPhase,
    invalid_lifecycle,
    not_ready,
)
from servewell.errors import ModelLoading, ModelReloading, ModelUnloading, ShuttingDown

V = VersionPhase
R = ResidencyPhase
S = RolloutPhase  # a traffic split's
X = InvalidTransition  # refused


def version_at(phase: VersionPhase, shown: VersionPhase = V.READY) -> VersionLifecycle:
    """A version in `phase` (while draining, showing `shown`)."""
    if phase is V.INVALID:
        return invalid_lifecycle("bad model.yaml")
    life = VersionLifecycle(phase, shown=shown if phase is V.DRAINING else phase)
    if phase in (V.DRAINING, V.STOPPED):
        life.stop_cause = "unloading"
    return life


#: Each named transition of a version, from each phase: the phase it ends in, or X (refused).
#: Stopping again (`draining`, `stopped`) and a pool's repeated report move nothing, by design.
VERSION_MOVES: dict[str, dict[VersionPhase, Any]] = {
    "loading": {V.NEW: V.LOADING, V.LOADING: X, V.READY: X, V.RESTARTING: X, V.FAILED: V.LOADING,
                V.DRAINING: X, V.STOPPED: X, V.INVALID: X},
    "loaded": {V.NEW: X, V.LOADING: V.READY, V.READY: X, V.RESTARTING: V.READY, V.FAILED: X,
               V.DRAINING: X, V.STOPPED: X, V.INVALID: X},
    "load_failed": {V.NEW: X, V.LOADING: V.FAILED, V.READY: V.FAILED, V.RESTARTING: V.FAILED, V.FAILED: X,
                    V.DRAINING: V.FAILED, V.STOPPED: X, V.INVALID: X},
    "workers_lost": {V.NEW: X, V.LOADING: X, V.READY: V.RESTARTING, V.RESTARTING: V.RESTARTING, V.FAILED: X,
                     V.DRAINING: V.DRAINING, V.STOPPED: X, V.INVALID: X},
    "workers_back": {V.NEW: X, V.LOADING: V.READY, V.READY: V.READY, V.RESTARTING: V.READY, V.FAILED: X,
                     V.DRAINING: V.DRAINING, V.STOPPED: X, V.INVALID: X},
    "gave_up": {V.NEW: X, V.LOADING: V.FAILED, V.READY: V.FAILED, V.RESTARTING: V.FAILED, V.FAILED: X,
                V.DRAINING: V.FAILED, V.STOPPED: X, V.INVALID: X},
    "draining": {V.NEW: V.DRAINING, V.LOADING: V.DRAINING, V.READY: V.DRAINING, V.RESTARTING: V.DRAINING,
                 V.FAILED: V.FAILED, V.DRAINING: V.DRAINING, V.STOPPED: V.STOPPED, V.INVALID: X},
    "stopped": {V.NEW: V.NEW, V.LOADING: V.LOADING, V.READY: V.READY, V.RESTARTING: V.RESTARTING,
                V.FAILED: V.FAILED, V.DRAINING: V.STOPPED, V.STOPPED: V.STOPPED, V.INVALID: V.INVALID},
}
_ARGS = {"load_failed": ("why",), "workers_lost": ("why",), "gave_up": ("why",), "draining": ("unloading",),
         "stopped": ("done",)}


@pytest.mark.parametrize("move", sorted(VERSION_MOVES))
@pytest.mark.parametrize("phase", list(VersionPhase))
def test_every_move_of_a_version_from_every_phase_is_as_designed(move: str, phase: VersionPhase) -> None:
    life = version_at(phase)
    expected = VERSION_MOVES[move][phase]
    if expected is X:
        before = (life.phase, life.reason, life.stop_cause, life.shown)
        with pytest.raises(InvalidTransition):
            getattr(life, move)(*_ARGS.get(move, ()))
        assert (life.phase, life.reason, life.stop_cause, life.shown) == before  # a refused move changes nothing
    else:
        getattr(life, move)(*_ARGS.get(move, ()))
        assert life.phase is expected


def test_the_version_table_has_a_row_per_phase_and_only_stopped_and_invalid_are_final() -> None:
    assert set(VERSION_TRANSITIONS) == set(VersionPhase)
    assert {p for p, to in VERSION_TRANSITIONS.items() if not to} == {V.STOPPED, V.INVALID}


def test_what_each_version_phase_allows() -> None:
    assert {p for p in V if p.serving} == {V.READY}
    assert {p for p in V if p.resident} == {V.READY, V.RESTARTING}
    assert {p for p in V if p.configurable} == {V.LOADING, V.READY, V.RESTARTING}
    assert {p for p in V if p.holds_memory} == {V.LOADING, V.READY, V.RESTARTING, V.DRAINING}
    assert {p for p in V if p.replaceable} == {V.NEW, V.LOADING, V.STOPPED}


def test_a_served_version_that_is_unloaded_shows_ready_while_it_drains_and_refuses_with_its_cause() -> None:
    life = VersionLifecycle()
    assert (life.state, life.serving, life.refusal("m")) == ("unloaded", False, None)
    life.loading()
    assert (life.state, life.configurable, life.holds_memory, life.serving) == ("loading", True, True, False)
    life.loaded()
    assert (life.state, life.serving, life.resident, life.supervised) == ("ready", True, True, True)
    assert life.draining("unloading")
    # Users still see it ready while its requests in flight finish; a new one gets the unload's 503.
    assert (life.state, life.serving, life.resident, life.drains_queue) == ("ready", False, False, True)
    assert not life.configurable and life.condition() == "unloading"
    refusal = life.refusal("model 'm' version '1'")
    assert isinstance(refusal, ModelUnloading) and refusal.retry_after_s == 5.0
    assert not life.draining("shutting_down")  # asked again: the first cause stays
    life.workers_lost("worker 12 exit code 9")  # its last worker died while it drained
    assert (life.state, life.reason, life.phase) == ("restarting", "worker 12 exit code 9", V.DRAINING)
    life.stopped("unloaded by an operator")
    assert (life.state, life.reason, life.stop_cause) == ("unloaded", "unloaded by an operator", "unloading")
    assert not life.holds_memory


def test_a_failed_version_stays_failed_when_stopped_and_is_not_checked_again() -> None:
    life = VersionLifecycle()
    life.loading()
    life.load_failed("step 'a' needs model 'x'")
    assert life.recheckable  # a pipeline is checked again when a step model loads
    assert not life.draining("unloading")
    life.stopped("unloaded by an operator")
    assert (life.state, life.reason) == ("failed", "step 'a' needs model 'x'")
    assert not life.recheckable  # stopped by an operator: it stays as it is


@pytest.mark.parametrize(("cause", "error", "retry_after_s"), [
    ("unloading", ModelUnloading, 5.0), ("reloading", ModelReloading, 1.0), ("removing", ModelUnloading, None),
    ("evicting", ModelLoading, 5.0), ("shutting_down", ShuttingDown, 1.0),
])
def test_each_stop_cause_has_its_own_refusal(cause: Any, error: type[Exception], retry_after_s: float | None) -> None:
    life = version_at(V.READY)
    life.draining(cause)
    refusal = life.refusal("model 'm' version '1'")
    assert type(refusal) is error and refusal.retry_after_s == retry_after_s


def test_not_ready_retries_by_state_and_never_for_an_invalid_model() -> None:
    assert not_ready("m", "loading", None).retry_after_s == 2.0
    assert not_ready("m", "failed", "boom").retry_after_s == 5.0
    assert not_ready("m", "invalid", "bad").retry_after_s is None
    assert not_ready("m", "restarting", "gone").message == "model 'm' is restarting: gone"


# --- residency ------------------------------------------------------------------------------------

#: Each named transition of a model name, from each phase: the phase it ends in, or X (refused).
RESIDENCY_MOVES: dict[str, dict[ResidencyPhase, Any]] = {
    "loaded": {R.LISTED: R.LOADED, R.LOADED: R.LOADED, R.EVICTING: R.LOADED, R.EVICTED: R.LOADED,
               R.UNLOADED: R.LOADED, R.REMOVED: X},
    "evicting_now": {R.LISTED: X, R.LOADED: R.EVICTING, R.EVICTING: X, R.EVICTED: X, R.UNLOADED: X, R.REMOVED: X},
    "evicted": {R.LISTED: R.LISTED, R.LOADED: R.LOADED, R.EVICTING: R.EVICTED, R.EVICTED: R.EVICTED,
                R.UNLOADED: R.UNLOADED, R.REMOVED: R.REMOVED},
    "unloaded": {R.LISTED: R.UNLOADED, R.LOADED: R.UNLOADED, R.EVICTING: R.UNLOADED, R.EVICTED: R.UNLOADED,
                 R.UNLOADED: R.UNLOADED, R.REMOVED: R.REMOVED},
    "removed_now": {R.LISTED: R.REMOVED, R.LOADED: R.REMOVED, R.EVICTING: R.REMOVED, R.EVICTED: R.REMOVED,
                    R.UNLOADED: R.REMOVED, R.REMOVED: X},
}


@pytest.mark.parametrize("move", sorted(RESIDENCY_MOVES))
@pytest.mark.parametrize("phase", list(ResidencyPhase))
def test_every_move_of_a_model_name_from_every_phase_is_as_designed(move: str, phase: ResidencyPhase) -> None:
    life = ResidencyLifecycle(phase)
    expected = RESIDENCY_MOVES[move][phase]
    if expected is X:
        with pytest.raises(InvalidTransition):
            getattr(life, move)()
        assert life.phase is phase
    else:
        getattr(life, move)()
        assert life.phase is expected


def test_the_residency_table_has_a_row_per_phase_and_removed_is_final() -> None:
    assert set(RESIDENCY_TRANSITIONS) == set(ResidencyPhase)
    assert {p for p, to in RESIDENCY_TRANSITIONS.items() if not to} == {R.REMOVED}


@pytest.mark.parametrize(("residency", "version", "loads"), [
    (R.LISTED, V.NEW, True),  # never loaded: its first request loads it
    (R.LOADED, V.LOADING, True),  # a load under way: the request waits for it
    (R.LOADED, V.READY, False),  # resident: nothing to load
    (R.LOADED, V.FAILED, False),  # failed since its last change: a request would fail the same way
    (R.EVICTING, V.DRAINING, True),  # being evicted: waits for the eviction, then loads it
    (R.EVICTED, V.STOPPED, True),
    (R.UNLOADED, V.STOPPED, False),  # an operator unloaded it: only an operator loads it again
    (R.REMOVED, V.STOPPED, False),
    (R.LISTED, V.INVALID, False),
])
def test_a_request_loads_a_model_only_where_its_phases_allow(residency: ResidencyPhase, version: VersionPhase,
                                                           loads: bool) -> None:
    assert ResidencyLifecycle(residency).loads_on_request(version_at(version)) is loads


@pytest.mark.parametrize(("residency", "version", "pending", "shown"), [
    (R.LISTED, V.NEW, False, "not_loaded"),
    (R.LISTED, V.NEW, True, "loading"),  # a lazy load was asked for
    (R.LOADED, V.LOADING, False, "loading"),
    (R.LOADED, V.READY, False, "resident"),
    (R.LOADED, V.RESTARTING, False, "resident"),
    (R.LOADED, V.FAILED, False, "failed"),
    (R.EVICTING, V.DRAINING, False, "evicted"),
    (R.EVICTING, V.DRAINING, True, "loading"),  # a request waits to load it again
    (R.EVICTED, V.STOPPED, False, "evicted"),
    (R.UNLOADED, V.STOPPED, False, "not_loaded"),
    (R.LISTED, V.INVALID, False, "invalid"),
])
def test_the_residency_users_see(residency: ResidencyPhase, version: VersionPhase, pending: bool, shown: str) -> None:
    assert ResidencyLifecycle(residency).residency(version_at(version), pending) == shown


# --- traffic splits -------------------------------------------------------------------------------

#: Each named transition of a split, from each phase: the phase it ends in, or X (refused).
ROLLOUT_MOVES: dict[str, dict[RolloutPhase, Any]] = {
    "steady": {S.STEADY: S.STEADY, S.CANARY: S.STEADY, S.ROLLED_BACK: S.STEADY, S.PROMOTED: S.STEADY},
    "canary": {S.STEADY: S.CANARY, S.CANARY: S.CANARY, S.ROLLED_BACK: S.CANARY, S.PROMOTED: S.CANARY},
    "rolled_back": {S.STEADY: S.ROLLED_BACK, S.CANARY: S.ROLLED_BACK, S.ROLLED_BACK: S.ROLLED_BACK,
                    S.PROMOTED: S.ROLLED_BACK},
    "promoted": {S.STEADY: X, S.CANARY: S.PROMOTED, S.ROLLED_BACK: S.PROMOTED, S.PROMOTED: X},
}


def _rollout_move(life: RolloutLifecycle, move: str) -> None:
    if move in ("steady", "canary"):
        life.weights_set(move == "canary", None, 2.0)
    elif move == "rolled_back":
        life.rolled_back("error rate", {"version": "2"}, 2.0)
    else:
        life.promoted("served 100 requests", {"version": "2"}, 2.0)


@pytest.mark.parametrize("move", sorted(ROLLOUT_MOVES))
@pytest.mark.parametrize("phase", list(RolloutPhase))
def test_every_move_of_a_split_from_every_phase_is_as_designed(move: str, phase: RolloutPhase) -> None:
    life = RolloutLifecycle(phase, changed_at=1.0)
    expected = ROLLOUT_MOVES[move][phase]
    if expected is X:
        with pytest.raises(InvalidTransition):
            _rollout_move(life, move)
        assert (life.phase, life.changed_at) == (phase, 1.0)
    else:
        _rollout_move(life, move)
        assert (life.phase, life.changed_at) == (expected, 2.0)


def test_the_rollout_table_has_a_row_per_phase() -> None:
    assert set(ROLLOUT_TRANSITIONS) == set(RolloutPhase)


def test_a_rollback_holds_its_evidence_and_alert_until_new_weights() -> None:
    life = RolloutLifecycle()
    life.weights_set(True, None, 1.0)
    assert (life.state, life.alert_reason, life.rolled_back_version) == ("canary", None, None)
    life.rolled_back("error rate 30% over the stable's 0%", {"version": "2", "rule": "error_rate"}, 2.0)
    assert (life.state, life.alert_reason, life.rolled_back_version) == (
        "rolled_back", "error rate 30% over the stable's 0%", "2")
    life.weights_set(True, "weights set by an admin", 3.0)
    assert (life.state, life.alert_reason, life.evidence, life.reason) == (
        "canary", None, {}, "weights set by an admin")
    life.promoted("served 100 requests", {"version": "2"}, 4.0)
    assert life.promoted_already("2") and not life.promoted_already("3")
