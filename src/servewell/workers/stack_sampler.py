"""Python stacks for a profile: one thread's stack sampled at a fixed rate, kept as Chrome trace
events (a flame chart on a track of its own) and added to the profiler's trace file.

Neither profiler's own Python recording fits serving: torch's `with_stack` multiplied the time
its profiler holds the GIL when it stops (2.6 s instead of 0.7 s after 3 s of a busy loop,
measured: the model answers nothing meanwhile), and onnxruntime records no Python at all.
Sampling costs about 0.1 ms of CPU per sample of a 34-frame stack (1.5% of a core at 100 Hz,
measured on a busy 2-core machine) and finds any wait of a few sample intervals (a `time.sleep`
in a forward, a lock, a slow pre-processing function) by name.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from types import CodeType
from typing import Any

#: Samples per second: a wait of 10 ms or more shows in the flame chart.
SAMPLE_HZ = 100.0
#: Innermost frames kept per sample, and events kept per capture (about 150 bytes each), so a
#: 60 s capture of deep stacks adds a few MB at most.
MAX_SAMPLE_DEPTH = 64
MAX_SAMPLE_EVENTS = 100_000
#: The Chrome trace "thread" the samples are drawn on: not a real thread id, so they get a track of
#: their own instead of overlapping the profiler's events on the sampled thread's track.
SAMPLE_TRACK = 1_000_000_001


def _frame_name(code: CodeType) -> str:
    return f"{code.co_qualname} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"


def _epoch_us() -> float:
    return time.time_ns() / 1000.0


class StackSampler:
    """Samples one thread's Python stack at `hz` from a thread of its own. A frame's event lasts
    while consecutive samples saw it at the same depth under the same callers; timestamps are
    microseconds since the Unix epoch (`add_to_trace` moves them to the trace's origin)."""

    def __init__(self, thread_id: int, hz: float = SAMPLE_HZ) -> None:
        self._thread_id = thread_id
        self._interval_s = 1.0 / hz
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._open: list[tuple[str, float]] = []  # (frame name, start), outermost first
        self._names: dict[CodeType, str] = {}  # a frame's name, made once per function
        self.started_us = 0.0
        self.events: list[dict[str, Any]] = []
        self.samples = 0
        self.truncated = False

    def start(self) -> None:
        """Begin sampling."""
        self.started_us = _epoch_us()
        self._thread = threading.Thread(target=self._run, name="servewell-stack-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop and close the frames still open."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._advance([], _epoch_us())

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            frame = sys._current_frames().get(self._thread_id)  # noqa: SLF001 - the documented way to sample
            names: list[str] = []
            while frame is not None and len(names) < MAX_SAMPLE_DEPTH:
                code = frame.f_code
                name = self._names.get(code)
                if name is None:
                    name = self._names[code] = _frame_name(code)
                names.append(name)
                frame = frame.f_back
            self.samples += 1
            self._advance(names[::-1], _epoch_us())
            if len(self.events) >= MAX_SAMPLE_EVENTS:
                self.truncated = True
                return

    def _advance(self, stack: list[str], now_us: float) -> None:
        """Close the open frames that `stack` does not continue; open its new ones."""
        keep = 0
        while keep < min(len(stack), len(self._open)) and self._open[keep][0] == stack[keep]:
            keep += 1
        for name, began_us in reversed(self._open[keep:]):
            self.events.append({"name": name, "cat": "python_sample", "ph": "X", "ts": began_us,
                                "dur": round(now_us - began_us, 1), "pid": os.getpid(), "tid": SAMPLE_TRACK})
        self._open = self._open[:keep] + [(name, now_us) for name in stack[keep:]]

    def trace_events(self, origin_us: float) -> list[dict[str, Any]]:
        """The samples with timestamps from `origin_us`, after the event that names their track."""
        label = f"Python stack, sampled at {1 / self._interval_s:g} Hz"
        if self.truncated:
            label += f" (stopped at {MAX_SAMPLE_EVENTS} events)"
        named = {"name": "thread_name", "ph": "M", "pid": os.getpid(), "tid": SAMPLE_TRACK, "args": {"name": label}}
        return [named, *({**e, "ts": round(e["ts"] - origin_us, 1)} for e in self.events)]


_TRACE_EVENTS = re.compile(rb'"traceEvents"\s*:\s*\[')
_BASE_TIME = re.compile(rb'"baseTimeNanoseconds"\s*:\s*(\d+)')
#: Where a kineto trace's header ends, at the latest (its base time comes before its events).
_HEAD_BYTES = 4096


def add_to_trace(path: str, sampler: StackSampler) -> None:
    """Insert the sampler's events at the start of a Chrome trace file's events, on the file's
    clock: kineto's (torch: `{..., "baseTimeNanoseconds", "traceEvents": [...]}`) counts from its
    base time; onnxruntime's (a bare array of events) from the profiled session's creation, which
    the sampler's start precedes by 0.3 ms (measured).

    Spliced into the bytes, not parsed and written again: `json` holds the GIL for the whole of a
    trace of several MB, and with it the worker's compute thread."""
    trace_path = Path(path)
    data = trace_path.read_bytes()
    head = data[:_HEAD_BYTES]
    events = _TRACE_EVENTS.search(head)
    if events is not None:
        base = _BASE_TIME.search(head)
        origin_us = int(base.group(1)) / 1000.0 if base is not None else 0.0
        at = events.end()
    elif data.lstrip().startswith(b"["):
        origin_us, at = sampler.started_us, data.index(b"[") + 1
    else:
        raise ValueError(f"{path} is not a Chrome trace file this profiler knows")
    inserted = b",\n".join(json.dumps(e).encode() for e in sampler.trace_events(origin_us))
    empty = data[at:].lstrip().startswith(b"]")
    trace_path.write_bytes(data[:at] + b"\n" + inserted + (b"\n" if empty else b",\n") + data[at:])
