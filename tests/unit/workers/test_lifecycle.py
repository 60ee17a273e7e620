"""A worker's lifecycle: the transitions a worker goes through are allowed, every other one is
refused loudly, and what users see (`alive`, `state`, `exit_reason`) follows the phase."""

from __future__ import annotations

import pytest

from servewell.workers.lifecycle import TRANSITIONS, InvalidTransition, WorkerLifecycle, WorkerPhase

P = WorkerPhase


def test_a_served_worker_that_dies_says_how():
    life = WorkerLifecycle()
    assert (life.phase, life.alive, life.phase.state) == (P.NEW, False, "starting")
    life.spawned()
    assert life.alive and life.phase.state == "starting"
    life.loaded()
    assert life.alive and life.phase.state == "ready" and life.exit_reason == ""
    life.exiting()
    assert not life.alive and life.ended and life.phase.state == "exiting"
    life.exited("exit code 3")
    assert (life.phase.state, life.exit_reason) == ("exited", "exit code 3")


def test_a_hung_worker_keeps_why():
    life = WorkerLifecycle()
    life.spawned()
    life.loaded()
    life.hung("no heartbeat for 2.1 s")
    assert not life.alive and life.hung_reason == "no heartbeat for 2.1 s"
    assert life.exit_reason == "hung (no heartbeat for 2.1 s); killed" and life.phase.state == "hung"


def test_a_worker_that_cannot_load_is_not_alive_and_then_exits():
    life = WorkerLifecycle()
    life.spawned()
    life.load_failed()
    assert not life.alive and not life.ended and life.phase.state == "starting"
    life.exited("exit code 1")
    assert life.ended


@pytest.mark.parametrize("final", [P.HUNG, P.EXITED, P.STOPPED])
def test_final_phases_allow_nothing(final):
    assert TRANSITIONS[final] == frozenset()


def test_every_phase_has_a_row_and_only_loading_or_ready_is_alive():
    assert set(TRANSITIONS) == set(WorkerPhase)
    assert {p for p in WorkerPhase if p.alive} == {P.LOADING, P.READY}


@pytest.mark.parametrize("moves", [
    ["loaded"],  # ready without ever being spawned
    ["spawned", "loaded", "loaded"],
    ["spawned", "exiting", "loaded"],  # a dead worker is never ready again
    ["spawned", "loaded", "stopped", "spawned"],  # a stopped handle is never restarted (the pool makes a new one)
    ["spawned", "loaded", "exiting", "stopped"],  # an exiting worker is reaped, then it has exited
    ["spawned", "loaded", "exiting", "exited", "exited"],
])
def test_transitions_outside_the_table_are_refused(moves):
    life = WorkerLifecycle()
    *allowed, refused = moves
    for move in allowed:
        getattr(life, move)(*(["why"] if move in ("hung", "exited") else []))
    before = (life.phase, life.exit_reason)
    with pytest.raises(InvalidTransition):
        getattr(life, refused)(*(["why"] if refused in ("hung", "exited") else []))
    assert (life.phase, life.exit_reason) == before


def test_a_worker_waits_for_its_turn_and_a_retry_waits_for_its_time_before_it_starts():
    retry = WorkerLifecycle()
    retry.backing_off()
    assert (retry.phase.state, retry.alive, retry.ended) == ("backoff", False, False)
    retry.queued()
    assert (retry.phase.state, retry.alive) == ("queued", False)
    retry.spawned()
    assert retry.alive and retry.phase.state == "starting"
    waiting = WorkerLifecycle()
    waiting.queued()
    waiting.stopped()  # the model stopped while it waited: it never started
    assert waiting.ended and waiting.phase.state == "stopped"
    with pytest.raises(InvalidTransition):
        WorkerLifecycle(phase=P.QUEUED).backing_off()  # a queued start does not go back to waiting out a backoff
