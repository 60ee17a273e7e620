"""Where the payload log's records go (observability/payload_log.py hands them over on its own
threads): their JSON forms, rotating JSONL files, and CloudEvents POSTed over keep-alive HTTP.

Nothing here runs on the event loop: encoding and I/O are the background threads' work.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import http.client
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import orjson

from servewell.config.payload_log import PayloadFileSink, PayloadHttpSink
from servewell.config.tensors import NUMPY_TO_OIP

log = logging.getLogger("servewell.payload_log")

REDACTED = "[redacted]"
CE_REQUEST = "org.kubeflow.serving.inference.request"  # KServe's logger (pkg/logger/worker.go)
CE_RESPONSE = "org.kubeflow.serving.inference.response"
_NUMPY = orjson.OPT_SERIALIZE_NUMPY
#: Shortest time between two warnings about one sink's failures (the rest are counted in /metrics):
#: a full disk under the file sink once logged one warning per failed batch, 82 in 10 s (issue 45, H8).
WARN_INTERVAL_S = 60.0
#: Mode of the files the file sink creates: requests and answers are the clients' data, for the
#: server's user only (issue 45, H12: they were created 0644, world-readable, under the umask).
FILE_MODE = 0o600


class SinkHealth:
    """Whether one sink ("file" or "http") fails now, for /healthz and
    `servewell_payload_log_sink_failing`, and its warnings: the first failure at once, then at
    most one a `WARN_INTERVAL_S` with what failed meanwhile, and one line when it works again.
    Written by the sink's own thread; read from the event loop (plain attributes: a reader may
    see one update late, never a torn value)."""

    def __init__(self, sink: str, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.sink = sink
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self.failing = False
        self.failing_since: float | None = None  # Unix time of the first failure of this spell
        self.problem: str | None = None  # the latest failure: an errno name or HTTP status, never a path or URL
        self.failed_records = 0  # in this spell
        self._warned_at: float | None = None  # monotonic
        self._unwarned = 0  # records failed since the last warning

    def failed(self, problem: str, records: int, where: str) -> None:
        """`records` could not be written (`problem`: what `describe` gives); `where` names the
        sink in the log line (the file's path; never the HTTP sink's URL, which may hold a secret)."""
        with self._lock:
            now = self._clock()
            if not self.failing:
                self.failing, self.failing_since, self.failed_records = True, self._wall_clock(), 0
            self.problem = problem
            self.failed_records += records
            self._unwarned += records
            if self._warned_at is not None and now - self._warned_at < WARN_INTERVAL_S:
                return
            first = self._warned_at is None or self._unwarned == self.failed_records
            self._warned_at, unwarned, self._unwarned = now, self._unwarned, 0
        metric = f'servewell_payload_log_records_total{{sink="{self.sink}",outcome="failed"}}'
        if first:
            log.warning("payload log: the %s sink (%s) failed: %s; its records are counted in %s, shown in /healthz "
                        "(payload_log), and warned about at most once a minute", self.sink, where, problem, metric)
        else:
            log.warning("payload log: the %s sink (%s) still fails: %s; %d records failed since the last warning",
                        self.sink, where, problem, unwarned)

    def succeeded(self, where: str) -> None:
        """A write went through: the sink works (again)."""
        if not self.failing:  # the common case: one attribute read, no lock
            return
        with self._lock:
            if not self.failing:
                return
            lost = self.failed_records
            self.failing, self.failing_since, self.problem, self.failed_records = False, None, None, 0
            self._warned_at, self._unwarned = None, 0
        log.warning("payload log: the %s sink (%s) writes again, after %d records failed", self.sink, where, lost)

    def reset(self) -> None:
        """The sink was removed or replaced: what its predecessor did no longer counts."""
        with self._lock:
            self.failing, self.failing_since, self.problem, self.failed_records = False, None, None, 0
            self._warned_at, self._unwarned = None, 0

    def to_json(self) -> dict[str, Any]:
        """`{failing, since, problem, failed_records}` for /healthz (no path, no URL)."""
        return {"failing": self.failing, "since": self.failing_since, "problem": self.problem,
                "failed_records": self.failed_records}


def describe(exc: BaseException) -> str:
    """A failure as /healthz may show it: the errno's name and text for an OS error
    ("ENOSPC: No space left on device"), else the exception's type; never its message (a path, a URL)."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{errno.errorcode.get(exc.errno, str(exc.errno))}: {os.strerror(exc.errno)}"
    return type(exc).__name__


@dataclass(slots=True)
class TensorCapture:
    """One tensor as taken at `record()`: its own copy (None when redacted), logged as values or digest."""

    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    values: np.ndarray | None
    as_digest: bool


@dataclass(slots=True)
class PayloadRecord:
    """One finished request, as the event loop handed it over (nothing encoded yet)."""

    time_s: float
    model: str
    version: str
    tenant: str | None
    request_id: str
    latency_s: float
    status: int
    code: str | None
    message: str | None
    inputs: dict[str, TensorCapture]
    outputs: dict[str, TensorCapture] | None
    nbytes: int
    oip_id: str | None = None  # the `id` the client gave its OIP request (None: none)


@dataclass(slots=True)
class EncodedRecord:
    """A record's JSONL line and, for the HTTP sink, its request and response event bodies."""

    line: bytes
    request_body: bytes
    response_body: bytes
    record: PayloadRecord


def sha256_of(values: np.ndarray) -> str:
    """The digest of a tensor: sha256 of its C-order bytes; BYTES tensors as the OIP binary
    extension lays them out (each element's 4-byte little-endian length, then its bytes)."""
    if values.dtype.kind == "O":
        digest = hashlib.sha256()
        for item in values.reshape(-1):
            raw = item if isinstance(item, bytes) else str(item).encode()
            digest.update(len(raw).to_bytes(4, "little"))
            digest.update(raw)
        return digest.hexdigest()
    return hashlib.sha256(np.ascontiguousarray(values).data).hexdigest()


def _data(values: np.ndarray) -> Any:
    flat = values.reshape(-1)
    if flat.dtype.kind in "OSU":
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in flat]
    if flat.dtype == np.float16:  # orjson serialises no float16
        return flat.astype(np.float32)
    return flat


@functools.cache
def oip_datatype(dtype: np.dtype[Any]) -> str:
    """The Open Inference Protocol name of a numpy dtype (BYTES for objects and strings)."""
    return "BYTES" if dtype.kind in "OSU" else NUMPY_TO_OIP.get(dtype.name, dtype.name.upper())


def tensor_doc(tensor: TensorCapture) -> dict[str, Any]:
    """`{datatype, shape, data | sha256}`; data "[redacted]" for a redacted tensor."""
    doc: dict[str, Any] = {"datatype": oip_datatype(tensor.dtype), "shape": tensor.shape}
    if tensor.values is None:
        doc["data"] = REDACTED
    elif tensor.as_digest:
        doc["sha256"] = sha256_of(tensor.values)
    else:
        doc["data"] = _data(tensor.values)
    return doc


def rfc3339(time_s: float) -> str:
    """`2025-01-31T12:00:00.123Z`."""
    return datetime.fromtimestamp(time_s, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _encoded_docs(tensors: dict[str, TensorCapture]) -> dict[str, bytes]:
    # Each tensor is serialised once (its values are most of the work) and the bytes reused by the
    # JSONL line and the HTTP bodies.
    return {name: orjson.dumps(tensor_doc(t), option=_NUMPY) for name, t in tensors.items()}


def _oip_list(docs: dict[str, bytes]) -> orjson.Fragment:
    """`[{"name": ..., "datatype": ...}, ...]` from serialised docs (each one a non-empty object)."""
    return orjson.Fragment(b"[" + b",".join(b'{"name":' + orjson.dumps(name) + b"," + doc[1:]
                                            for name, doc in docs.items()) + b"]")


def encode(record: PayloadRecord, for_http: bool) -> EncodedRecord:
    """The JSONL line and (`for_http`) the OIP-shaped bodies of its two CloudEvents."""
    inputs = _encoded_docs(record.inputs)
    outputs = None if record.outputs is None else _encoded_docs(record.outputs)
    error = None if record.code is None else {"code": record.code, "message": record.message}
    latency_ms = round(record.latency_s * 1000.0, 3)
    line = orjson.dumps({
        "time": rfc3339(record.time_s), "model": record.model, "version": record.version, "tenant": record.tenant,
        "request_id": record.request_id, "id": record.oip_id, "latency_ms": latency_ms, "status": record.status,
        "error": error,
        "inputs": {name: orjson.Fragment(doc) for name, doc in inputs.items()},
        "outputs": None if outputs is None else {name: orjson.Fragment(doc) for name, doc in outputs.items()}},
        option=orjson.OPT_APPEND_NEWLINE)
    if not for_http:
        return EncodedRecord(line, b"", b"", record)
    oip_id = record.oip_id if record.oip_id is not None else record.request_id  # as the client sent it and got it
    request = orjson.dumps({"id": oip_id, "inputs": _oip_list(inputs)})
    response: dict[str, Any] = {"model_name": record.model, "model_version": record.version, "id": oip_id}
    if outputs is not None:
        response["outputs"] = _oip_list(outputs)
    if error is not None:
        response["error"] = record.message
    response["parameters"] = {"status": record.status, "latency_ms": latency_ms,
                              **({"code": record.code} if record.code is not None else {}),
                              **({"tenant": record.tenant} if record.tenant else {})}
    return EncodedRecord(line, request, orjson.dumps(response), record)


class RotatingFile:
    """A JSONL file rotated by size: PATH -> PATH.1 -> ... -> PATH.KEEP (the oldest removed).
    Opened at construction, so an unwritable path is refused when the settings are applied."""

    def __init__(self, settings: PayloadFileSink) -> None:
        self.settings = settings
        self._path = settings.path
        self._file = _open_private(self._path)
        self._size = self._file.tell()

    def write(self, lines: list[bytes]) -> None:
        """Append `lines` (whole lines, rotating between two of them when the file is full)."""
        chunk: list[bytes] = []
        size = self._size
        for line in lines:
            if size and size + len(line) > self.settings.max_bytes:
                self._write(chunk)
                chunk = []
                self._rotate()
                size = 0
            chunk.append(line)
            size += len(line)
        self._write(chunk)

    def _write(self, chunk: list[bytes]) -> None:
        if chunk:
            data = b"".join(chunk)
            view = memoryview(data)
            try:
                while view:  # an unbuffered write may be short
                    view = view[self._file.write(view) or 0:]
            except OSError:
                # A full disk may take part of the chunk: cut the file back to its last whole line, so
                # that the lines written once space is free again do not follow half a line.
                with contextlib.suppress(OSError):
                    self._file.truncate(self._size)
                raise
            self._size += len(data)

    def _rotate(self) -> None:
        self._file.close()
        keep = self.settings.keep
        path = self._path
        if keep == 0:
            path.unlink(missing_ok=True)
        else:
            Path(f"{path}.{keep}").unlink(missing_ok=True)
            for i in range(keep - 1, 0, -1):
                older = Path(f"{path}.{i}")
                if older.exists():
                    os.replace(older, f"{path}.{i + 1}")
            os.replace(path, f"{path}.1")
        self._file = _open_private(path)
        self._size = 0

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._file.close()


def _open_private(path: Path) -> Any:
    """`path` opened to append, unbuffered; created `FILE_MODE` (0600) whatever the umask. An
    existing file keeps its mode: the operator may have chosen it (a log shipper's group)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        return os.fdopen(fd, "ab", buffering=0)
    except BaseException:
        os.close(fd)
        raise


class HttpEventSender:
    """POSTs CloudEvents to one URL over one keep-alive connection (one thread uses it)."""

    def __init__(self, settings: PayloadHttpSink, health: SinkHealth | None = None) -> None:
        self.settings = settings
        self.health = health if health is not None else SinkHealth("http")
        url = urlsplit(settings.url.get_secret_value())
        self._https = url.scheme == "https"
        self._host = url.hostname or ""
        self._port = url.port
        self._path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        self._extra = {name: value.get_secret_value() for name, value in settings.headers.items()}
        self._conn: http.client.HTTPConnection | None = None
        self._problem = ""  # why the last POST that failed did

    def deliver(self, records: list[EncodedRecord], until: float) -> tuple[int, int]:
        """Send the records' events, none after `until` (monotonic; no retry either): how many
        records had every event taken (2xx) and how many failed; the rest were not tried."""
        written = failed = 0
        if self.settings.mode == "batch":
            step = max(1, self.settings.batch_events // 2)
            for start in range(0, len(records), step):
                if time.monotonic() >= until:
                    break
                part = records[start:start + step]
                ok = self._post(self._batch_body(part),
                                {**self._extra, "Content-Type": "application/cloudevents-batch+json"}, until)
                written, failed = (written + len(part), failed) if ok else (written, failed + len(part))
                self._report(ok, len(part))
            return written, failed
        for r in records:
            if time.monotonic() >= until:
                break
            ok = (self._post(r.request_body, self._binary_headers(r, CE_REQUEST), until)
                  and self._post(r.response_body, self._binary_headers(r, CE_RESPONSE), until))
            written, failed = (written + 1, failed) if ok else (written, failed + 1)
            self._report(ok, 1)
        return written, failed

    def _report(self, ok: bool, records: int) -> None:
        # The URL may hold a secret: the log line and /healthz never name it.
        if ok:
            self.health.succeeded("its URL is in the config")
        else:
            self.health.failed(self._problem, records, "its URL is in the config")

    def _attributes(self, record: PayloadRecord, kind: str) -> dict[str, str]:
        # KServe's extensions: inferenceservicename (the model), component, endpoint (here: the
        # version that answered, as KServe's default/canary), namespace when configured.
        attributes = {"specversion": "1.0", "id": record.request_id, "type": kind, "source": self.settings.source,
                      "time": rfc3339(record.time_s), "inferenceservicename": record.model,
                      "component": "predictor", "endpoint": record.version}
        if self.settings.namespace:
            attributes["namespace"] = self.settings.namespace
        if record.tenant:
            attributes["tenant"] = record.tenant
        return attributes

    def _binary_headers(self, encoded: EncodedRecord, kind: str) -> dict[str, str]:
        headers = {f"ce-{k}": v for k, v in self._attributes(encoded.record, kind).items()}
        return {**self._extra, **headers, "Content-Type": "application/json"}

    def _batch_body(self, records: list[EncodedRecord]) -> bytes:
        events = []
        for r in records:
            for kind, body in ((CE_REQUEST, r.request_body), (CE_RESPONSE, r.response_body)):
                events.append({**self._attributes(r.record, kind), "datacontenttype": "application/json",
                               "data": orjson.Fragment(body)})
        return orjson.dumps(events)

    def _post(self, body: bytes, headers: dict[str, str], until: float) -> bool:
        problem = ""
        for attempt in range(self.settings.retries + 1):
            if attempt and time.monotonic() >= until:
                break
            if attempt:
                time.sleep(min(1.0, 0.05 * 2 ** attempt))
            try:
                conn = self._conn or self._connect()
                conn.request("POST", self._path, body, headers)
                response = conn.getresponse()
                response.read()
                if 200 <= response.status < 300:
                    return True
                problem = f"HTTP {response.status}"
                if response.status != 429 and response.status < 500:
                    break  # the sink refuses this event: trying again would not help
            except (OSError, http.client.HTTPException) as exc:
                problem = describe(exc)
                self._disconnect()
        self._problem = problem
        return False

    def _connect(self) -> http.client.HTTPConnection:
        timeout = self.settings.timeout_s
        self._conn = (http.client.HTTPSConnection(self._host, self._port, timeout=timeout) if self._https
                      else http.client.HTTPConnection(self._host, self._port, timeout=timeout))
        return self._conn

    def _disconnect(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        """Close the connection."""
        self._disconnect()
