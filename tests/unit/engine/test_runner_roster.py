"""The scheduler's runner bookkeeping: the phases a runner goes through, the reserved runner for the
first lane, runners removed while busy, and transitions outside the table refused loudly."""

from __future__ import annotations

import pytest

from servewell.engine.runner_roster import InvalidTransition, RunnerPhase, RunnerRoster

P = RunnerPhase


class Runner:
    """A stand-in with the one member the roster reads."""

    def __init__(self, name: str, alive: bool = True) -> None:
        self.name = name
        self.alive = alive

    def __repr__(self) -> str:
        return self.name


def test_a_runner_is_taken_released_and_the_last_freed_goes_first():
    roster: RunnerRoster[Runner] = RunnerRoster()
    a, b = Runner("a"), Runner("b")
    roster.add(a, reserve=False)
    roster.add(b, reserve=False)
    assert roster.registered == 2
    assert roster.take(1) is b and roster.phase(b) is P.BUSY
    assert roster.take(1) is a
    assert roster.take(1) is None
    roster.release(a, reserve=False)
    roster.release(b, reserve=False)
    assert roster.take(1) is b  # freed last: warm caches


def test_a_dead_runner_is_never_handed_a_batch():
    roster: RunnerRoster[Runner] = RunnerRoster()
    a = Runner("a")
    roster.add(a, reserve=False)
    a.alive = False
    assert roster.take(0) is None


def test_the_reserved_runner_serves_only_the_first_lane_until_unreserved():
    roster: RunnerRoster[Runner] = RunnerRoster()
    general, urgent = Runner("general"), Runner("urgent")
    roster.add(general, reserve=True)
    roster.add(urgent, reserve=True)  # the second runner becomes the reserved one
    assert roster.reserved is urgent
    assert roster.take(1) is general
    assert roster.take(1) is None  # the reserved one waits for urgent work
    assert roster.take(0) is urgent
    roster.release(urgent, reserve=True)
    roster.unreserve()
    assert roster.reserved is None and roster.take(1) is urgent


def test_a_runner_removed_while_busy_ends_its_batch_then_is_forgotten():
    roster: RunnerRoster[Runner] = RunnerRoster()
    a, b = Runner("a"), Runner("b")
    roster.add(a, reserve=False)
    roster.add(b, reserve=False)
    assert roster.take(1) is b
    roster.remove(b)
    assert roster.phase(b) is P.RETIRING and roster.registered == 1
    roster.release(b, reserve=False)
    assert roster.phase(b) is P.ABSENT
    assert roster.take(1) is a and roster.take(1) is None


def test_removing_the_reserved_runner_frees_the_role():
    roster: RunnerRoster[Runner] = RunnerRoster()
    a, b, c = Runner("a"), Runner("b"), Runner("c")
    for runner in (a, b):
        roster.add(runner, reserve=True)
    assert roster.reserved is b
    roster.remove(b)
    assert roster.reserved is None
    roster.add(c, reserve=True)
    assert roster.reserved is c


@pytest.mark.parametrize("moves", [
    ["release"],  # never taken
    ["add", "add"],  # registered twice
    ["add", "release"],  # free already
    ["add", "take", "release", "release"],
    ["add", "take", "remove", "release", "release"],  # forgotten after its last batch
])
def test_transitions_outside_the_table_are_refused(moves):
    roster: RunnerRoster[Runner] = RunnerRoster()
    a = Runner("a")
    *allowed, refused = moves

    def do(move: str) -> None:
        if move == "take":
            assert roster.take(1) is a
        elif move in ("add", "release"):
            getattr(roster, move)(a, reserve=False)
        else:
            getattr(roster, move)(a)

    for move in allowed:
        do(move)
    before = roster.phase(a)
    with pytest.raises(InvalidTransition):
        do(refused)
    assert roster.phase(a) is before
