"""SIGTERM and SIGINT end a `servewell bench` or `servewell tune` run the way an error does: as an
exception (`Stopped`) that unwinds every `with` block, so the server the run started is stopped
and its temporary directory removed. Left to their default, SIGTERM ended the process at once and
left both behind (the server in its own process group, which a Ctrl-C does not reach either).

A signal that arrives while a server is being started or stopped (`signals_held`) is raised when
that ends: a pid not yet recorded, or a stop cut short, would leak the server. Only the first
signal counts; later ones (a second Ctrl-C) do not cut the clean-up short.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(SystemExit):
    """The run was sent `signum`; its exit code is the shell's for that signal (128 + signum).

    A SystemExit, so that asyncio re-raises it from whichever task the signal interrupted instead
    of keeping it as that task's result."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum

    @property
    def name(self) -> str:
        """SIGTERM, SIGINT."""
        return signal.Signals(self.signum).name


class _StopState:
    """What the handler knows: the signal received (the first), whether it was raised, and how
    deep the sections that hold it are."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.raised = False
        self.holding = 0

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            return  # already stopping: let the clean-up finish
        self.received = signum
        if not self.holding:
            self.raised = True
            raise Stopped(signum)

    def release(self) -> None:
        """Raise the signal a held section kept back, once."""
        if not self.holding and self.received is not None and not self.raised:
            self.raised = True
            raise Stopped(self.received)


_state = _StopState()


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within it, the first SIGTERM or SIGINT raises `Stopped` (see the module docstring)."""
    global _state
    _state = _StopState()
    previous = {sig: signal.signal(sig, _state.on_signal) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def signals_held() -> Iterator[None]:
    """A stop signal that arrives within it is raised at its end (nothing without `stop_on_signals`)."""
    state = _state
    state.holding += 1
    try:
        yield
    finally:
        state.holding -= 1
    state.release()
