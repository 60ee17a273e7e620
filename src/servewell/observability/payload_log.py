"""The payload log: a sampled, asynchronous log of requests and answers (issue 24).

The engine asks `wants(model)` for each request and hands each wanted one, finished, to
`record()`; both run on the event loop and stay cheap: `record()` copies the tensors it keeps
(the engine's arrays may be views into reused shared memory) and appends to a bounded queue.
One background thread encodes (orjson) and appends to the rotating JSONL file, and hands the
HTTP sink's events to a second bounded queue that a second thread POSTs from, so a slow sink
never holds up the file. A full queue drops the record and counts it; every record a sink was
meant to get ends in `servewell_payload_log_records_total{sink, outcome}` as written, failed or
dropped (why: `servewell_payload_log_drops_total{sink, reason}`).

A sink that fails (a full disk, an unreachable receiver) is shown while it fails: in /healthz
(`payload_log`, and status "degraded"), in `servewell_payload_log_sink_failing{sink}`, and in the
log at most once a minute (`payload_sinks.SinkHealth`). Files are created 0600.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from servewell.config.payload_log import PayloadLogConfig
from servewell.observability.payload_sinks import (
    EncodedRecord,
    HttpEventSender,
    PayloadRecord,
    RotatingFile,
    SinkHealth,
    TensorCapture,
    describe,
    encode,
)

log = logging.getLogger("servewell.payload_log")

SINKS = ("file", "http")
OUTCOMES = ("written", "dropped", "failed")
#: Why a record was dropped: its queue was full at `record()`, the HTTP sink's queue was full
#: (the sink is slower than the traffic), the sink was removed or the log turned off while it
#: waited, or it was still waiting when the server stopped.
DROP_REASONS = ("queue_full", "sink_backlog", "reconfigured", "shutdown")
#: How long a writer thread lets records gather after the first one before it writes them: one
#: wake-up (one GIL hand-over) per batch instead of per record.
LINGER_S = 0.05
#: How many nice steps below normal the writer threads run.
WRITER_NICE = 10
#: Longest `close()` waits for the queues to be written before it counts the rest as dropped.
CLOSE_TIMEOUT_S = 5.0
#: Longest error message a record keeps.
MAX_MESSAGE_CHARS = 500

T = TypeVar("T")


class PayloadLogCounts:
    """Records by sink and outcome, drops by sink and reason (written from several threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.records = {(s, o): 0 for s in SINKS for o in OUTCOMES}
        self.drops = {(s, r): 0 for s in SINKS for r in DROP_REASONS}

    def add(self, sink: str, outcome: str, n: int = 1, reason: str = "") -> None:
        """Count `n` records of `sink` ending in `outcome` (`reason`: why one was dropped)."""
        with self._lock:
            self.records[sink, outcome] += n
            if reason:
                self.drops[sink, reason] += n


class BoundedStage(Generic[T]):
    """A queue bounded by items and bytes, drained in batches by one daemon thread that calls
    `handle(batch)`. `offer` never blocks: False when full. Each counter has one writer (the
    producer or the thread), so none needs a lock."""

    def __init__(self, name: str, handle: Callable[[list[T]], None], max_items: int, max_bytes: int) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self._handle = handle
        self._items: deque[tuple[T, int]] = deque()
        self._bytes_in = 0  # written by the producer only
        self._bytes_out = 0  # written by the thread only
        self._wake = threading.Event()
        self._closing = False
        self._in_flight = 0  # items the thread took and has not finished with
        self.deadline = float("inf")  # monotonic: the thread writes nothing after it (set by `close`)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        """Items waiting or being written now."""
        return len(self._items) + self._in_flight

    def offer(self, item: T, nbytes: int) -> bool:
        """Queue `item` (holding `nbytes`); False, and nothing queued, when either bound is reached."""
        items = self._items
        if self._closing or len(items) >= self.max_items or self._bytes_in - self._bytes_out + nbytes > self.max_bytes:
            return False
        self._bytes_in += nbytes
        was_empty = not items
        items.append((item, nbytes))
        if was_empty:  # the thread drains until empty before it waits: only the first item wakes it
            self._wake.set()
        return True

    def _run(self) -> None:
        if WRITER_NICE and hasattr(os, "setpriority"):
            # The serving threads and processes get the CPU first: the log works on what they leave.
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                               os.getpriority(os.PRIO_PROCESS, 0) + WRITER_NICE)
        while not (self._closing and not self._items):
            self._wake.wait()
            if not self._closing:
                time.sleep(LINGER_S)
            self._wake.clear()
            while self._items and time.monotonic() < self.deadline:
                batch: list[T] = []
                while self._items and len(batch) < 1000:
                    item, nbytes = self._items.popleft()
                    self._bytes_out += nbytes
                    batch.append(item)
                self._in_flight = len(batch)
                try:
                    self._handle(batch)
                except Exception:  # a bug here must not end the thread: log it, keep writing
                    log.exception("payload log: writing a batch of %d records failed", len(batch))
                self._in_flight = 0
            if time.monotonic() >= self.deadline:
                return

    def close(self, deadline: float, grace_s: float = 0.0) -> list[T]:
        """Stop taking items, let the thread write until `deadline` (monotonic; the batch it is
        writing then gets `grace_s` more to be counted), and return what it left."""
        self.deadline = deadline
        self._closing = True
        self._wake.set()
        self._thread.join(max(0.0, deadline - time.monotonic()) + grace_s)
        left = []
        while self._items:
            try:
                left.append(self._items.popleft()[0])
            except IndexError:  # the thread, past its deadline, took the last one
                break
        return left


@dataclass(frozen=True, slots=True)
class _Policy:
    """What `wants` and `record` read: replaced whole by `apply`, never changed in place."""

    enabled: bool
    sample: float
    models: frozenset[str] | None
    digests: bool
    max_tensor_bytes: int
    redact: frozenset[str]


def _policy(settings: PayloadLogConfig) -> _Policy:
    return _Policy(settings.enabled, settings.sample, frozenset(settings.models) or None,
                   settings.content == "digests", settings.max_tensor_bytes, frozenset(settings.redact))


class PayloadLog:
    """The sampled request/answer log (see the module doc). Threads start with the first enabled
    settings; `apply` changes the settings live; `close` writes what it can in bounded time."""

    def __init__(self, settings: PayloadLogConfig) -> None:
        self.counts = PayloadLogCounts()
        self._policy = _policy(PayloadLogConfig())
        self.settings = PayloadLogConfig()
        self._file: RotatingFile | None = None  # what the encoder thread writes to next
        self._http: HttpEventSender | None = None  # what the HTTP thread sends with next
        self._records: BoundedStage[PayloadRecord] | None = None
        self._events: BoundedStage[EncodedRecord] | None = None
        self._random = random.random
        #: Whether each sink fails now (for /healthz and the metrics), across reconfigurations of its settings.
        self.sink_health = {sink: SinkHealth(sink) for sink in SINKS}
        self.apply(settings)

    # -- the event loop's side ---------------------------------------------------------------

    def wants(self, model: str) -> bool:
        """Whether this request of `model` is logged (sampled now: one draw per request)."""
        policy = self._policy
        if not policy.enabled or (policy.models is not None and model not in policy.models):
            return False
        return policy.sample >= 1.0 or self._random() < policy.sample

    def record(self, *, model: str, version: str, tenant: str | None, request_id: str,
               inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray] | None, latency_s: float,
               error: BaseException | None, oip_id: str | None = None) -> None:
        """Take one finished request the log wanted: copy what is kept, queue it, return. Never
        blocks and never raises (a full queue counts the record as dropped). `oip_id`: the `id` the
        client gave its OIP request, kept beside the server's `request_id`."""
        try:
            stage = self._records
            if stage is None:
                return
            policy = self._policy
            kept_inputs, held = _capture(inputs, policy)
            kept_outputs = None
            if outputs is not None:
                kept_outputs, held_out = _capture(outputs, policy)
                held += held_out
            status, code, message = 200, None, None
            if error is not None:
                status = getattr(error, "status", 500)
                status = status if isinstance(status, int) else 500
                code = str(getattr(error, "code", "internal"))
                message = str(getattr(error, "message", None) or error)[:MAX_MESSAGE_CHARS]
            record = PayloadRecord(time.time(), model, version, tenant, request_id, latency_s, status, code, message,
                                   kept_inputs, kept_outputs, held, oip_id)
            if not stage.offer(record, held):
                self._dropped(self._sinks(), "queue_full")
        except Exception:  # the log must never fail a request
            log.exception("payload log: a record could not be taken")

    # -- settings ----------------------------------------------------------------------------

    def apply(self, settings: PayloadLogConfig) -> None:
        """Use `settings` from now on. A sink that cannot be opened (the file's directory is
        missing, ...) raises `OSError` and the previous settings stay in force."""
        old = self.settings
        if settings.enabled:  # a disabled log keeps its sinks: records still queued are counted against them
            if settings.file != (self._file.settings if self._file is not None else None):
                # Opened here, so a path that cannot be written is refused now; the encoder thread
                # closes the file it wrote to when it sees a new one.
                self._file = RotatingFile(settings.file) if settings.file is not None else None
                self.sink_health["file"].reset()
            if settings.http != (self._http.settings if self._http is not None else None):
                self._http = (HttpEventSender(settings.http, self.sink_health["http"]) if settings.http is not None
                              else None)
                self.sink_health["http"].reset()
        if settings.enabled and self._records is None:
            self._events = BoundedStage("payload-log-http", self._send, settings.queue_records, settings.queue_bytes)
            self._records = BoundedStage("payload-log", self._write, settings.queue_records, settings.queue_bytes)
        for stage in (self._records, self._events):
            if stage is not None:
                stage.max_items, stage.max_bytes = settings.queue_records, settings.queue_bytes
        self.settings = settings
        self._policy = _policy(settings)
        if settings.enabled or old.enabled:
            sinks = ", ".join(s for s in SINKS if getattr(settings, s) is not None)
            log.info("payload log %s", f"on: {settings.sample:.0%} of requests to {sinks}" if settings.enabled
                     else "off")

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Write what is queued within `timeout_s`, count the rest as dropped, close the sinks.
        Blocking: from a thread (`asyncio.to_thread`) when a loop is running."""
        self._policy = _policy(PayloadLogConfig())
        deadline = time.monotonic() + timeout_s
        if self._records is not None:
            self._dropped(self._sinks(), "shutdown", len(self._records.close(deadline)))
        if self._events is not None:
            # A POST under way at the deadline is let finish (no retry): its record is counted.
            grace_s = 2 * self._http.settings.timeout_s if self._http is not None else 0.0
            self._dropped(("http",), "shutdown", len(self._events.close(deadline, grace_s)))
        for sink in (self._open_file, self._file, self._http):
            if sink is not None:
                sink.close()

    # -- the writer threads ------------------------------------------------------------------

    _open_file: RotatingFile | None = None  # the file the encoder thread writes (its own)

    def _sinks(self) -> tuple[str, ...]:
        return tuple(s for s, sink in (("file", self._file), ("http", self._http)) if sink is not None)

    def _dropped(self, sinks: Iterable[str], reason: str, n: int = 1) -> None:
        for sink in sinks:
            if n:
                self.counts.add(sink, "dropped", n, reason)

    def _write(self, batch: list[PayloadRecord]) -> None:
        """The encoder thread: JSONL to the file, events on to the HTTP thread."""
        if not self.settings.enabled:  # turned off while these waited
            self._dropped(self._sinks(), "reconfigured", len(batch))
            return
        file, http = self._file, self._http
        if file is not self._open_file:
            if self._open_file is not None:
                self._open_file.close()
            self._open_file = file
        encoded = []
        for record in batch:
            time.sleep(0)  # let the event loop have the GIL between two records, not after the switch interval
            try:
                encoded.append(encode(record, http is not None))
            except Exception:
                log.exception("payload log: a record could not be encoded")
                for sink in self._sinks():
                    self.counts.add(sink, "failed")
        if file is not None:
            health = self.sink_health["file"]
            try:
                file.write([e.line for e in encoded])
                self.counts.add("file", "written", len(encoded))
                health.succeeded(str(file.settings.path))
            except OSError as exc:  # once a minute in the log (a full disk once logged each batch)
                self.counts.add("file", "failed", len(encoded))
                health.failed(describe(exc), len(encoded), str(file.settings.path))
        events = self._events
        if http is not None and events is not None:
            for e in encoded:
                if not events.offer(e, len(e.request_body) + len(e.response_body)):
                    self.counts.add("http", "dropped", 1, "sink_backlog")

    def _send(self, batch: list[EncodedRecord]) -> None:
        """The HTTP thread: POST each record's events."""
        sender = self._http if self.settings.enabled else None
        if sender is None:
            self.counts.add("http", "dropped", len(batch), "reconfigured")
            return
        written, failed = sender.deliver(batch, self._events.deadline if self._events is not None else float("inf"))
        self.counts.add("http", "written", written)
        self.counts.add("http", "failed", failed)
        self.counts.add("http", "dropped", len(batch) - written - failed, "shutdown")

    def health(self) -> dict[str, Any]:
        """For /healthz: `{"enabled", "status": "ok" | "failing", "sinks": {sink: SinkHealth.to_json()}}`
        over the configured sinks (no path, no URL: /healthz is open to anyone)."""
        sinks = {sink: self.sink_health[sink].to_json() for sink in self._sinks()}
        failing = any(doc["failing"] for doc in sinks.values())
        return {"enabled": self.settings.enabled, "status": "failing" if failing else "ok", "sinks": sinks}

    def queue_depths(self) -> dict[str, int]:
        """Records waiting to be encoded ("records") and to be sent ("http")."""
        return {"records": len(self._records) if self._records is not None else 0,
                "http": len(self._events) if self._events is not None else 0}


def _capture(arrays: dict[str, np.ndarray], policy: _Policy) -> tuple[dict[str, TensorCapture], int]:
    """What `record` keeps of each tensor, and the bytes it holds: a C-order copy (the caller's
    may be a view into a buffer reused after the request), none for a redacted one."""
    kept = {}
    held = 0
    for name, array in arrays.items():
        if name in policy.redact:
            kept[name] = TensorCapture(array.dtype, array.shape, None, False)
            continue
        copy = array.copy()  # C order; measured 0.2 us for the tiny MLP's 2 KiB input
        held += copy.nbytes
        kept[name] = TensorCapture(array.dtype, array.shape, copy,
                                   policy.digests or copy.nbytes > policy.max_tensor_bytes)
    return kept, held


class PayloadLogCollector(Collector):
    """The payload log's families for /metrics (no label comes from a client)."""

    def __init__(self, payload_log: PayloadLog) -> None:
        self._log = payload_log

    def collect(self) -> Iterable[Metric]:
        records = CounterMetricFamily(
            "servewell_payload_log_records", "Payload log records by sink and outcome (written, dropped, failed).",
            labels=["sink", "outcome"])
        for (sink, outcome), count in self._log.counts.records.items():
            records.add_metric([sink, outcome], count)
        drops = CounterMetricFamily(
            "servewell_payload_log_drops", "Payload log records dropped, by sink and reason (queue_full, "
            "sink_backlog, reconfigured, shutdown).", labels=["sink", "reason"])
        for (sink, reason), count in self._log.counts.drops.items():
            drops.add_metric([sink, reason], count)
        depth = GaugeMetricFamily("servewell_payload_log_queue_depth",
                                  "Payload log records waiting: to be encoded (records) or sent (http).",
                                  labels=["queue"])
        for queue, n in self._log.queue_depths().items():
            depth.add_metric([queue], n)
        failing = GaugeMetricFamily("servewell_payload_log_sink_failing",
                                    "1 while a payload log sink fails (its latest write did: a full disk, an "
                                    "unreachable receiver), else 0.", labels=["sink"])
        for sink, health in self._log.sink_health.items():
            failing.add_metric([sink], 1 if health.failing else 0)
        return [records, drops, depth, failing]
