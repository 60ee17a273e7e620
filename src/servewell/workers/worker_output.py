"""A worker's stdout and stderr, read by the engine and forwarded to the server's log, capped.

Each worker process (and each spare, which becomes one) writes both streams into one pipe of its
own (`child_main.run_child` puts it on fds 1 and 2 before anything else runs), so the order of its
lines is kept. The engine reads the pipe on its event loop (`add_reader`: no thread, no polling),
passes the bytes through an `OutputCap` and writes what it lets through to its own stderr, where
the worker's lines went before. Read here rather than in the worker: the last words of a worker
that crashes (a fatal error's stack, an abort message) are written as it dies, when no thread of
its own could forward them.

Whatever the cap holds back is counted and said in one warning per `NOTICE_EVERY_S` at most (event
`worker_output_dropped`, with the model, instance and pid), and once more when the stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

from servewell.workers.output_cap import OutputCap, OutputLimits

log = logging.getLogger("servewell.workers")

#: Bytes read per wake-up at most (a full pipe holds 64 KiB).
READ_BYTES = 256 << 10
#: Longest a drop waits to be reported.
NOTICE_EVERY_S = 1.0


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            return  # a non-blocking stderr that is full: dropped rather than spin the engine's loop
        except OSError:
            return  # nowhere to write (stderr closed): the lines are lost, as a print's would be
        view = view[written:]


class WorkerOutput:
    """The read end of one worker's output pipe: forwarded, capped, until the worker is gone."""

    def __init__(self, fd: int, limits: OutputLimits, label: str, sink: Callable[[bytes], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fd: int | None = fd
        self._cap = OutputCap(limits, clock())
        self._clock = clock
        self._sink = sink or (lambda data: _write_all(2, data))
        self.label = label
        self.facts: dict[str, object] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._notice: asyncio.TimerHandle | None = None
        self._dropped_since = 0.0
        # The pipe keeps the kernel's default size (64 KiB): a larger one counts against the user's
        # pipe-user-pages-soft, past which every new pipe of the user gets a single page.
        os.set_blocking(fd, False)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin forwarding (on `loop`, the engine's event loop)."""
        if self._fd is not None and self._loop is None:
            self._loop = loop
            loop.add_reader(self._fd, self._on_readable)

    def relabel(self, label: str, **facts: object) -> None:
        """Name the worker in what is said of its output from now on (a spare taken by a model)."""
        self.label, self.facts = label, dict(facts)

    def close(self) -> None:
        """Forward what is already in the pipe, then stop (the worker is gone; a process it left
        behind that still writes gets EPIPE)."""
        if self._fd is None:
            return
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
        with contextlib.suppress(OSError):
            while self._read_once():
                pass
        self._forward(self._cap.finish(self._clock()))
        os.close(self._fd)
        self._fd = None
        if self._notice is not None:
            self._notice.cancel()
            self._notice = None
        self._say_dropped()

    def _on_readable(self) -> None:
        try:
            if not self._read_once():  # EOF: the worker and whatever inherited its output are gone
                self.close()
        except OSError:
            self.close()

    def _read_once(self) -> bool:
        """Read and forward one chunk; False at EOF or when nothing is waiting."""
        assert self._fd is not None
        try:
            data = os.read(self._fd, READ_BYTES)
        except BlockingIOError:
            return False
        if not data:
            return False
        self._forward(self._cap.feed(data, self._clock()))
        if self._cap.dropping and self._notice is None and self._loop is not None:
            self._dropped_since = self._clock()
            self._notice = self._loop.call_later(NOTICE_EVERY_S, self._on_notice)
        return True

    def _forward(self, lines: list[bytes]) -> None:
        if lines:
            self._sink(b"".join(lines))

    def _on_notice(self) -> None:
        self._notice = None
        self._say_dropped()

    def _say_dropped(self) -> None:
        dropped = self._cap.take_dropped()
        if not dropped:
            return
        limits = self._cap.limits
        over_s = max(0.0, self._clock() - self._dropped_since) if self._dropped_since else 0.0
        cut = f"; {dropped.cut_bytes} bytes of lines over {limits.line_max_bytes} bytes cut" if dropped.cut_bytes \
            else ""
        log.warning("%s: %d bytes (%d lines) of its stdout/stderr dropped in the last %.1f s%s (cap: %d bytes/s "
                    "after bursts of %d bytes)", self.label, dropped.bytes, dropped.lines, over_s, cut,
                    limits.rate_bytes_per_s, limits.burst_bytes,
                    extra={"event": "worker_output_dropped", **self.facts, "dropped_bytes": dropped.bytes,
                           "dropped_lines": dropped.lines, "cut_bytes": dropped.cut_bytes})
        self._dropped_since = 0.0
