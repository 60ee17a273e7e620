"""The lifecycle of one worker process as one explicit state, with every allowed transition in one table.

`WorkerHandle` holds a `WorkerLifecycle` and changes it only through its transition methods; a
transition the table does not allow raises `InvalidTransition` (a bug in the handle, caught by the
tests), so `alive`, `state`, `exit_reason` and `hung_reason` can never disagree.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

#: What `/healthz` and the console show of a worker.
WorkerState = Literal["starting", "queued", "backoff", "ready", "hung", "exiting", "exited", "stopped"]


class WorkerPhase(enum.Enum):
    """Where a worker process is in its life."""

    NEW = "new"  # the handle exists, no process yet
    BACKOFF = "backoff"  # the instance's previous load attempt failed; this one waits before it starts
    QUEUED = "queued"  # waits for a load slot (`load_slots.LoadSlots`): other workers are loading
    LOADING = "loading"  # spawned; loading and warming up its model
    LOAD_FAILED = "load_failed"  # it said it cannot load; its pipe closes next
    READY = "ready"  # takes batches
    HUNG = "hung"  # stopped making progress; killed
    EXITING = "exiting"  # its pipe closed; its exit status is not known yet
    EXITED = "exited"  # gone, with its exit status
    STOPPED = "stopped"  # stopped by its owner

    @property
    def alive(self) -> bool:
        """Whether the process can take work (batches, profiling)."""
        return self in (WorkerPhase.LOADING, WorkerPhase.READY)

    @property
    def state(self) -> WorkerState:
        """The name users see."""
        return _STATE_OF[self]


_STATE_OF: Mapping[WorkerPhase, WorkerState] = {
    WorkerPhase.NEW: "starting",
    WorkerPhase.BACKOFF: "backoff",
    WorkerPhase.QUEUED: "queued",
    WorkerPhase.LOADING: "starting",
    WorkerPhase.LOAD_FAILED: "starting",
    WorkerPhase.READY: "ready",
    WorkerPhase.HUNG: "hung",
    WorkerPhase.EXITING: "exiting",
    WorkerPhase.EXITED: "exited",
    WorkerPhase.STOPPED: "stopped",
}

_P = WorkerPhase
#: Every allowed transition. HUNG, EXITED and STOPPED are final: a worker is never revived, its pool
#: starts a new handle.
TRANSITIONS: Mapping[WorkerPhase, frozenset[WorkerPhase]] = {
    _P.NEW: frozenset({_P.BACKOFF, _P.QUEUED, _P.LOADING, _P.STOPPED}),
    _P.BACKOFF: frozenset({_P.QUEUED, _P.LOADING, _P.STOPPED}),
    _P.QUEUED: frozenset({_P.LOADING, _P.STOPPED}),
    _P.LOADING: frozenset({_P.READY, _P.LOAD_FAILED, _P.HUNG, _P.EXITING, _P.EXITED, _P.STOPPED}),
    _P.LOAD_FAILED: frozenset({_P.EXITING, _P.EXITED, _P.STOPPED}),
    _P.READY: frozenset({_P.HUNG, _P.EXITING, _P.EXITED, _P.STOPPED}),
    _P.EXITING: frozenset({_P.EXITED}),
    _P.HUNG: frozenset(),
    _P.EXITED: frozenset(),
    _P.STOPPED: frozenset(),
}


class InvalidTransition(RuntimeError):
    """A worker was moved in a way `TRANSITIONS` does not allow (a bug, never a user's error)."""


def describe_exit(code: int | None) -> str:
    """A process's exit status in words: "exit code 3", "killed by SIGKILL (exit code -9)"."""
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (exit code {code})"
    return f"exit code {code}"


@dataclass(slots=True)
class WorkerLifecycle:
    """The phase of one worker and why it ended; changed only by the transition methods below."""

    phase: WorkerPhase = WorkerPhase.NEW
    #: How the process ended, in words ("exit code 3", "hung (...); killed"); empty while it runs.
    exit_reason: str = ""
    #: Why it was declared hung, if it was.
    hung_reason: str | None = None

    @property
    def alive(self) -> bool:
        """Whether the process can take work."""
        return self.phase.alive

    @property
    def ended(self) -> bool:
        """Whether its loss was already handled (or is being: `EXITING`)."""
        return self.phase in (WorkerPhase.EXITING, WorkerPhase.HUNG, WorkerPhase.EXITED, WorkerPhase.STOPPED)

    def backing_off(self) -> None:
        """The instance's last load attempt failed; this one waits for its retry time."""
        self._move(WorkerPhase.BACKOFF)

    def queued(self) -> None:
        """It waits for a load slot (no process yet)."""
        self._move(WorkerPhase.QUEUED)

    def spawned(self) -> None:
        """The process was started."""
        self._move(WorkerPhase.LOADING)

    def loaded(self) -> None:
        """It loaded and warmed up its model."""
        self._move(WorkerPhase.READY)

    def load_failed(self) -> None:
        """It reported that it cannot load its model."""
        self._move(WorkerPhase.LOAD_FAILED)

    def hung(self, reason: str) -> None:
        """It stopped making progress and was killed."""
        self._move(WorkerPhase.HUNG)
        self.hung_reason = reason
        self.exit_reason = f"hung ({reason}); killed"

    def exiting(self) -> None:
        """Its pipe closed before its exit status could be read."""
        self._move(WorkerPhase.EXITING)
        self.exit_reason = "exiting (exit status not yet known)"

    def exited(self, reason: str) -> None:
        """It is gone; `reason` says how (`describe_exit`)."""
        self._move(WorkerPhase.EXITED)
        self.exit_reason = reason

    def stopped(self) -> None:
        """Its owner stopped it."""
        self._move(WorkerPhase.STOPPED)

    def _move(self, to: WorkerPhase) -> None:
        if to not in TRANSITIONS[self.phase]:
            raise InvalidTransition(f"a worker cannot go from {self.phase.value} to {to.value}")
        self.phase = to
