"""A small progress display for long-running commands (bench, tune, example builds).

On a terminal, one status line is redrawn in place (a bar, a percentage, a short text) at
most ten times a second, and `note` lines scroll above it. Anywhere else (a log file, a
pipe, CI) nothing is redrawn: only `note` lines are written, one per finished step, so logs
never fill with progress bars; `quiet` drops those too. No dependencies.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

#: Fewest seconds between two redraws of the status line.
MIN_REDRAW_S = 0.1


def is_live(stream: TextIO) -> bool:
    """Whether `stream` is a terminal that can redraw a line (not a pipe, a file, or TERM=dumb)."""
    try:
        return stream.isatty() and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError):  # a closed or unusual stream
        return False


def bar(fraction: float, width: int = 20) -> str:
    """`[#####---------------]  25%` for a fraction in 0..1 (clamped)."""
    fraction = min(1.0, max(0.0, fraction))
    filled = int(round(fraction * width))
    return f"[{'#' * filled}{'-' * (width - filled)}] {fraction * 100:3.0f}%"


class Progress:
    """A status line on a terminal, and permanent note lines everywhere (unless quiet)."""

    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None, quiet: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.live = is_live(self.stream) if live is None else live
        self.quiet = quiet
        self._clock = clock
        self._last_draw = -1.0
        self._status = ""

    def update(self, text: str, fraction: float | None = None, *, force: bool = False) -> None:
        """Show `text` (and a bar when `fraction` is given) on the status line; a no-op off a terminal."""
        if not self.live:
            return
        now = self._clock()
        if not force and now - self._last_draw < MIN_REDRAW_S:
            return
        self._last_draw = now
        line = f"{bar(fraction)} {text}" if fraction is not None else text
        width = max(20, shutil.get_terminal_size((100, 20)).columns - 1)
        self._status = line[:width]
        self.stream.write("\r\x1b[2K" + self._status)
        self.stream.flush()

    def note(self, text: str) -> None:
        """A permanent line (one per finished step): above the status line on a terminal, else plain."""
        if self.quiet and not self.live:
            return
        if self.live:
            self.stream.write("\r\x1b[2K" + text + "\n" + self._status)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def clear(self) -> None:
        """Remove the status line (before printing results)."""
        if self.live and self._status:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
        self._status = ""

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.clear()


class LineSink:
    """A `progress(message)` callable for step-by-step work (building a model, training epochs).

    On a terminal each message replaces the previous one in place and `close` leaves the last
    one standing; elsewhere each message is one plain line, as a log expects.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self._progress = Progress(stream)
        self._shown = False

    def __call__(self, message: str) -> None:
        if self._progress.live:
            self._progress.update(message, force=True)
            self._shown = True
        else:
            self._progress.note(message)

    def close(self) -> None:
        """End the in-place line with a newline (a no-op off a terminal)."""
        if self._shown:
            self._progress.stream.write("\n")
            self._progress.stream.flush()
            self._shown = False
