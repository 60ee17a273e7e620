"""Which runners a model's scheduler may hand a batch to: one explicit state per runner, with every
allowed transition in one table.

Pure and synchronous (no loop, no clock): the scheduler asks for a runner (`take`), gives it back
when its batch ends or was not started (`release`), and adds and removes runners as workers come
and go. A runner removed while it runs a batch stays `RETIRING` until that batch ends, then is
forgotten. With `reserve_instance_for_high`, one runner is kept for the first lane. A transition
outside `TRANSITIONS` raises `InvalidTransition` (a bug in the scheduler, caught by the tests).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Generic, Protocol, TypeVar


class _Runner(Protocol):
    @property
    def alive(self) -> bool: ...


R = TypeVar("R", bound=_Runner)


class RunnerPhase(enum.Enum):
    """Where a runner is, as the scheduler sees it."""

    ABSENT = "absent"  # not registered (before `add`, after `remove` of a free one)
    IDLE = "idle"  # registered and free
    BUSY = "busy"  # registered and taken for a batch
    RETIRING = "retiring"  # removed while taken: its batch still ends through `release`


_P = RunnerPhase
#: Every allowed transition, by the method that makes it.
TRANSITIONS: Mapping[str, Mapping[RunnerPhase, RunnerPhase]] = {
    "add": {_P.ABSENT: _P.IDLE},
    "take": {_P.IDLE: _P.BUSY},
    "release": {_P.BUSY: _P.IDLE, _P.RETIRING: _P.ABSENT},
    "remove": {_P.IDLE: _P.ABSENT, _P.BUSY: _P.RETIRING, _P.RETIRING: _P.RETIRING, _P.ABSENT: _P.ABSENT},
}


class InvalidTransition(RuntimeError):
    """A runner was moved in a way `TRANSITIONS` does not allow (a bug, never a user's error)."""


class RunnerRoster(Generic[R]):
    """The runners of one scheduler and the phase of each."""

    def __init__(self) -> None:
        # Insertion order is the order runners became free: the last one freed is taken first (its
        # caches are warm), as before this was one table.
        self._phases: dict[R, RunnerPhase] = {}
        self._reserved: R | None = None
        self._idle = 0  # runners in phase IDLE (kept by `_move`: asked on every submit)

    def phase(self, runner: R) -> RunnerPhase:
        """Where `runner` is now."""
        return self._phases.get(runner, RunnerPhase.ABSENT)

    @property
    def registered(self) -> int:
        """Runners that may be handed batches (free or busy; not those being retired)."""
        return sum(1 for p in self._phases.values() if p in (RunnerPhase.IDLE, RunnerPhase.BUSY))

    @property
    def any_idle(self) -> bool:
        """Whether some runner is free now (a batch could start)."""
        return self._idle > 0

    @property
    def reserved(self) -> R | None:
        """The runner kept for the first lane, if any."""
        return self._reserved

    def add(self, runner: R, reserve: bool) -> None:
        """Register a ready runner as free; with `reserve`, it may become the first lane's runner."""
        self._move(runner, "add")
        self._reserve_if(runner, reserve)

    def take(self, lane: int) -> R | None:
        """A free, live runner for a batch of `lane` (the reserved one serves only lane 0), or None."""
        reserved = self._reserved
        if lane == 0 and reserved is not None and self.phase(reserved) is RunnerPhase.IDLE and reserved.alive:
            self._move(reserved, "take")
            return reserved
        for runner in reversed(self._phases):  # a phase changes below, never the keys: no copy needed
            if runner is not reserved and self._phases[runner] is RunnerPhase.IDLE and runner.alive:
                self._move(runner, "take")
                return runner
        return None

    def release(self, runner: R, reserve: bool) -> None:
        """`runner`'s batch ended, or it was taken and not used: free it again (or forget it, if it was
        removed meanwhile)."""
        self._move(runner, "release")
        if self.phase(runner) is RunnerPhase.IDLE:
            self._phases[runner] = self._phases.pop(runner)  # now the most recently freed
            self._reserve_if(runner, reserve)

    def remove(self, runner: R) -> None:
        """Hand `runner` no more batches; one it is running still ends through `release`."""
        self._move(runner, "remove")
        if runner is self._reserved:
            self._reserved = None

    def unreserve(self) -> None:
        """`reserve_instance_for_high` was turned off: the reserved runner serves every lane."""
        reserved, self._reserved = self._reserved, None
        if reserved is not None and self.phase(reserved) is RunnerPhase.IDLE:
            self._phases[reserved] = self._phases.pop(reserved)  # freed now, for the other lanes

    def _reserve_if(self, runner: R, reserve: bool) -> None:
        if reserve and self._reserved is None and self.registered >= 2 and runner.alive:
            self._reserved = runner

    def _move(self, runner: R, transition: str) -> None:
        current = self.phase(runner)
        target = TRANSITIONS[transition].get(current)
        if target is None:
            raise InvalidTransition(f"a runner cannot {transition} while {current.value}")
        self._idle += (target is RunnerPhase.IDLE) - (current is RunnerPhase.IDLE)
        if target is RunnerPhase.ABSENT:
            self._phases.pop(runner, None)
        else:
            self._phases[runner] = target
