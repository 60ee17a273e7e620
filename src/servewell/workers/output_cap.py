"""How much of a worker's stdout and stderr reaches the server's log: a rate with a burst, and a
longest line (pure: no I/O, time passed in).

A python model's prints (and a library's chatter) used to reach the log unbounded: 20 requests of
a model printing 2 MiB each wrote 40 MiB (issue 45). Each worker's output is now read by the engine
(`worker_output.py`) and passed through one `OutputCap`: whole lines go on while the token bucket
holds their bytes (`rate_bytes_per_s`, refilled continuously, holding at most `burst_bytes`); the
others are dropped and counted, and the owner logs how many (`take_dropped`). A line longer than
`line_max_bytes` goes on cut at that length, marked, and the rest of it is counted as cut.

Every line costs at least `MIN_LINE_COST` bytes of the budget, so a flood of empty lines cannot
pass as a million one-byte records; and while the bucket cannot pay for any line, whole runs of
lines are dropped with two C-level scans (`rfind`, `count`), so a flood costs the engine a copy of
the bytes, not a Python step per line.
"""

from __future__ import annotations

from dataclasses import dataclass

from servewell.config.server import ServerConfig

#: What a line costs of the budget at least (a record's share of a log pipeline's overhead).
MIN_LINE_COST = 64


@dataclass(slots=True, frozen=True)
class OutputLimits:
    """The cap on one worker's output (config/server.py documents each)."""

    rate_bytes_per_s: int = 64 << 10
    burst_bytes: int = 1 << 20
    line_max_bytes: int = 16 << 10


@dataclass(slots=True, frozen=True)
class Dropped:
    """What was held back since the last report."""

    bytes: int
    lines: int
    cut_bytes: int  # of lines longer than the longest allowed

    def __bool__(self) -> bool:
        return bool(self.bytes or self.cut_bytes)


class OutputCap:
    """One worker's output stream, cut into lines and metered (see the module doc)."""

    def __init__(self, limits: OutputLimits, now: float) -> None:
        self.limits = limits
        self._tokens = float(limits.burst_bytes)
        self._at = now
        self._partial = b""  # the start of a line not yet ended (shorter than line_max_bytes)
        self._skipping = False  # inside a line already cut: its rest is counted, not forwarded
        self._dropped_bytes = 0
        self._dropped_lines = 0
        self._cut_bytes = 0
        self._cut_marker = f" [servewell: line cut at {limits.line_max_bytes} bytes]\n".encode()

    def feed(self, data: bytes, now: float) -> list[bytes]:
        """Take what the worker wrote; the whole lines to forward now, in order."""
        self._refill(now)
        out: list[bytes] = []
        if self._partial:
            data, self._partial = self._partial + data, b""
        n, pos = len(data), 0
        line_max = self.limits.line_max_bytes
        while pos < n:
            if self._skipping:
                nl = data.find(b"\n", pos)
                end = n if nl < 0 else nl + 1
                self._cut_bytes += end - pos
                pos = end
                self._skipping = nl < 0
                continue
            if self._tokens < MIN_LINE_COST:
                # Nothing can go on before time passes: drop every whole line at once.
                last = data.rfind(b"\n", pos)
                if last < 0:
                    break
                self._dropped_bytes += last + 1 - pos
                self._dropped_lines += data.count(b"\n", pos, last + 1)
                pos = last + 1
                continue
            nl = data.find(b"\n", pos, pos + line_max)
            if nl >= 0:
                self._offer(data[pos:nl + 1], out)
                pos = nl + 1
            elif n - pos < line_max:
                break  # a line not yet ended
            else:
                self._offer(data[pos:pos + line_max] + self._cut_marker, out)
                self._skipping = True
                pos += line_max
        if pos < n:
            rest = data[pos:]
            if len(rest) < line_max:
                self._partial = rest
            else:  # dropped while the budget was empty, and already too long to forward later
                self._dropped_bytes += len(rest)
                self._dropped_lines += 1
                self._skipping = True
        return out

    def finish(self, now: float) -> list[bytes]:
        """The stream ended: its last line, if it did not end with a newline."""
        partial, self._partial = self._partial, b""
        self._skipping = False
        return self.feed(partial + b"\n", now) if partial else []

    @property
    def dropping(self) -> bool:
        """Whether something was held back since the last `take_dropped`."""
        return bool(self._dropped_bytes or self._cut_bytes)

    def take_dropped(self) -> Dropped:
        """What was held back since the last call (and start counting again)."""
        dropped = Dropped(self._dropped_bytes, self._dropped_lines, self._cut_bytes)
        self._dropped_bytes = self._dropped_lines = self._cut_bytes = 0
        return dropped

    def _refill(self, now: float) -> None:
        limits = self.limits
        self._tokens = min(float(limits.burst_bytes), self._tokens + max(0.0, now - self._at) * limits.rate_bytes_per_s)
        self._at = now

    def _offer(self, line: bytes, out: list[bytes]) -> None:
        cost = max(len(line), MIN_LINE_COST)
        if self._tokens >= cost:
            self._tokens -= cost
            out.append(line)
        else:
            self._dropped_bytes += len(line)
            self._dropped_lines += 1


def output_limits_for(settings: ServerConfig) -> OutputLimits:
    """The cap on every worker's output, from the server's settings."""
    return OutputLimits(settings.worker_output_rate_bytes_per_s, settings.worker_output_burst_bytes,
                        settings.worker_output_line_max_bytes)
