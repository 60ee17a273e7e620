"""Connection and request limits, enforced in the HTTP/1.1 protocol before the app sees a request.

uvicorn's httptools protocol (what servewell ran before) enforces only the keep-alive idle
timeout: a request head may grow without bound (httptools buffers a header value until it ends,
re-copying it as it grows, so 200 MB cost 40 s of CPU), a connection may take forever to send
its head or body, and connections are accepted until the process runs out of file descriptors.
uvicorn's other knobs do not close these gaps: `h11_max_incomplete_event_size` bounds the head
only with the pure-Python h11 parser, and `limit_concurrency` answers 503 only after a whole head
has arrived, which a slow client never sends.

`LimitedHttpToolsProtocol` keeps the httptools parser and adds, per connection:

- a byte budget for the request head, checked *before* bytes reach the parser (431 and closed);
  a header-count and a URL-length limit, checked once the head is complete (431, 414);
- one lazily re-armed timer: a connection's first head must arrive within `header_timeout_s` of it opening,
  a later head within `header_timeout_s` of its first byte (uvicorn's keep-alive timer covers
  the idle time before), a body within `body_timeout_s` of its head (408 and closed; a
  connection that sent nothing is closed silently);
- a slot in `ConnectionSlots` (bounded connections, eviction of waiting ones, a reserve that
  serves only the probe paths), with the process's open-file limit raised to fit them all (or,
  where the hard limit is too low, `max_connections` lowered to fit it, with a warning).

Refusals answer with the JSON error body where a response is still possible, and are counted
into one aggregated log line per window (`LimitEventLog`), never one line per connection.
Malformed HTTP gets a JSON 400 instead of uvicorn's plain-text one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import resource
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
import orjson
from starlette.types import Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from servewell.api.connection_slots import ConnectionSlots, SlotKind
from servewell.api.errors import error_document
from servewell.api.limit_log import LimitEventLog
from servewell.api.response_writes import hold_heads
from servewell.config.server import ConfigFileError, ServerConfig

log = logging.getLogger("servewell.http")

#: Paths a reserve connection may ask for: what keeps an orchestrator and Prometheus informed.
PROBE_PATHS = frozenset((b"/healthz", b"/v2/health/live", b"/v2/health/ready", b"/metrics"))
#: Largest listen backlog passed to uvicorn (its default); smaller when fewer connections are allowed.
LISTEN_BACKLOG = 2048
#: Descriptors the frontend needs besides client sockets: listeners, worker pipes and shared
#: memory, model files, logs, gRPC and OTLP exporters (about 60 with four models; room to spare).
FD_OVERHEAD = 256

# Where a connection is in its request cycle.
_WAITING = 0  # no request yet, or idle between requests
_HEAD = 1  # some bytes of a request head have arrived
_BODY = 2  # the head is complete, the body is arriving
_BUSY = 3  # the whole request has arrived; the app is answering
_NEVER = float("inf")


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """The limits one server enforces (the matching `ServerConfig` fields)."""

    max_header_bytes: int
    max_header_count: int
    max_url_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    reserved_connections: int

    @classmethod
    def from_settings(cls, settings: ServerConfig) -> HttpLimits:
        """The limits configured in `settings`."""
        return cls(settings.max_header_bytes, settings.max_header_count, settings.max_url_bytes,
                   settings.header_timeout_s, settings.body_timeout_s, settings.max_connections,
                   settings.reserved_connections)


class _Refusal(Exception):
    """A limit crossed inside a parser callback: answer `status` with the JSON error and close."""

    def __init__(self, status: int, code: str, message: str, event: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.event = status, code, message, event


def error_head_and_body(status: int, code: str, message: str, retry_after_s: int | None = None,
                        extra_headers: list[tuple[bytes, bytes]] | None = None) -> bytes:
    """A complete `Connection: close` HTTP/1.1 response carrying the JSON error body."""
    request_id = uuid.uuid4().hex
    body = orjson.dumps({"error": {"code": code, "message": message, "request_id": request_id}})
    headers = list(extra_headers or [])
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"), (b"x-request-id", request_id.encode())]
    if retry_after_s is not None:
        headers.append((b"retry-after", str(retry_after_s).encode()))
    lines = [STATUS_LINE[status], *(name + b": " + value + b"\r\n" for name, value in headers), b"\r\n", body]
    return b"".join(lines)


async def _connection_limit_app(scope: Scope, receive: Receive, send: Send) -> None:
    """What a reserve connection gets for anything but a probe path."""
    request_id = uuid.uuid4().hex
    body = orjson.dumps(error_document(scope["path"], "unavailable",
                                       "the server is at its connection limit; retry shortly", request_id))
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"), (b"x-request-id", request_id.encode()), (b"x-error-code", b"unavailable")]})
    await send({"type": "http.response.body", "body": body})


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with servewell's limits; `limited_protocol` makes the bound class."""

    limits: ClassVar[HttpLimits]
    slots: ClassVar[ConnectionSlots]
    events: ClassVar[LimitEventLog]

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._phase = _WAITING
        self._head_bytes = 0  # bytes received since the current head began (an upper bound)
        self._heads_done = 0
        # One lazily armed timer per connection: each phase sets `_deadline`, and the timer, when it
        # fires early, re-arms for what is left. A keep-alive connection thus creates a timer about
        # once per `header_timeout_s`, not one per request (measured: 1-2 us a request otherwise).
        self._deadline = _NEVER
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = _NEVER
        self._slot = SlotKind.REFUSED

    # Connection lifecycle
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._slot = self.slots.admit(self)
        if self._slot is SlotKind.REFUSED:
            self.events.add("refused_connection")
            self._answer_and_close(503, "unavailable", "the server is at its connection limit; retry shortly", 1)
            return
        self._set_deadline(self.loop.time() + self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.slots.release(self)
        super().connection_lost(exc)

    def evict(self) -> None:
        """Close this waiting connection to give its slot to a newcomer (`ConnectionSlots`)."""
        self.events.add("evicted")
        if self._phase == _HEAD:
            self._answer_and_close(503, "unavailable", "the server is at its connection limit; retry shortly", 1)
        else:  # idle: closing it is an ordinary keep-alive close
            self._close()

    # Bytes in
    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        self._receive(data)

    def _receive(self, data: bytes | memoryview) -> None:
        if self._phase != _BODY:
            # Counted before the parser sees them: httptools buffers an unfinished header value
            # (re-copying it per chunk), so the bound must hold before parsing, not after.
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                self._receive_past_head_budget(memoryview(data))  # a view: a body in the same read is not copied
                return
        self._feed(data)

    def _receive_past_head_budget(self, data: memoryview) -> None:
        within = len(data) - (self._head_bytes - self.limits.max_header_bytes)
        heads_before = self._heads_done
        if within > 0:
            self._feed(data[:within])
            if self.transport.is_closing():
                return
        if self._heads_done == heads_before:
            self._refuse(_Refusal(431, "header_too_large", f"the request head exceeds {self.limits.max_header_bytes} "
                                  "bytes", "header_too_large"))
            return
        self._receive(data[within:])  # the head ended within budget: the rest is body or the next request

    def _feed(self, data: bytes | memoryview) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            refusal = exc.__context__
            if isinstance(refusal, _Refusal):
                self._refuse(refusal)
            else:
                self._refuse(_Refusal(400, "bad_request", "malformed HTTP request", "malformed"))
        except httptools.HttpParserUpgrade:
            # No protocol upgrades are served (uvicorn runs with ws="none"): the request was answered
            # as plain HTTP, and the connection closes after it, since the parser stops at the upgrade.
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.keep_alive = False
            else:
                self._close()
        except httptools.HttpParserError as exc:
            self._refuse(_Refusal(400, "bad_request", f"malformed HTTP request: {str(exc)[:100]}", "malformed"))

    # Parser callbacks (httptools calls them from feed_data)
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase = _HEAD
        if self._deadline == _NEVER:  # a later request's head; the first one's deadline runs from the connect
            self._set_deadline(self.loop.time() + self.limits.header_timeout_s)

    def on_headers_complete(self) -> None:
        # The head's byte budget already bounds the URL and the field count (and what parsing them
        # costs), so both are checked once here rather than in a callback per header.
        if len(self.url) > self.limits.max_url_bytes:
            raise _Refusal(414, "uri_too_long", f"the URL exceeds {self.limits.max_url_bytes} bytes", "url_too_long")
        if len(self.headers) > self.limits.max_header_count:
            raise _Refusal(431, "too_many_headers", f"the request has more than {self.limits.max_header_count} header "
                           "fields", "too_many_headers")
        self._head_bytes = 0
        self._heads_done += 1
        self._phase = _BODY
        self._set_deadline(self.loop.time() + self.limits.body_timeout_s)
        self.slots.busy(self)
        if self._slot is SlotKind.RESERVE:
            if httptools.parse_url(self.url).path not in PROBE_PATHS:
                self.events.add("reserve_refused")
                self.app = _connection_limit_app
            super().on_headers_complete()
            hold_heads(self.cycle)
            self.cycle.keep_alive = False  # a reserve slot serves one request, then frees up
            return
        super().on_headers_complete()
        hold_heads(self.cycle)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._phase = _BUSY
        self._deadline = _NEVER
        if self.cycle.response_complete and not self.transport.is_closing():
            # Answered before its body ended (a 413, say): uvicorn armed the keep-alive timer then,
            # and the body's bytes cancelled it; the connection waits for its next request from now.
            self._wait_for_next_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._phase == _BUSY and self.timeout_keep_alive_task is not None:
            self._phase = _WAITING
            self.slots.waiting(self)

    def _wait_for_next_request(self) -> None:
        self._phase = _WAITING
        self.slots.waiting(self)
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    # Timeouts
    def _set_deadline(self, deadline: float) -> None:
        self._deadline = deadline
        if self._timer is not None and self._timer_at <= deadline:
            return  # it fires first and re-arms for the rest
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = deadline
        self._timer = self.loop.call_later(deadline - self.loop.time(), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._deadline == _NEVER:  # the app is answering, or uvicorn's keep-alive timer is in charge
            return
        if self._deadline > self.loop.time():
            self._set_deadline(self._deadline)
            return
        self._deadline = _NEVER
        if self._phase == _BODY:
            self.events.add("body_timeout")
            self._answer_and_close(408, "request_timeout", f"the request body did not arrive within "
                                   f"{self.limits.body_timeout_s:g} s")
        elif self._phase == _HEAD:
            self.events.add("header_timeout")
            self._answer_and_close(408, "request_timeout", f"the request head did not arrive within "
                                   f"{self.limits.header_timeout_s:g} s")
        else:  # opened and sent nothing: there is no request to answer
            self.events.add("idle_timeout")
            self._close()

    def _cancel_timer(self) -> None:
        self._deadline = _NEVER
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # Answers
    def _refuse(self, refusal: _Refusal) -> None:
        self.events.add(refusal.event)
        self._answer_and_close(refusal.status, refusal.code, refusal.message)

    def _answer_and_close(self, status: int, code: str, message: str, retry_after_s: int | None = None) -> None:
        """Send the JSON error where the connection can still carry a response, then close."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started:  # half a response is out: closing is the only honest signal
                self._close()
                return
            cycle.disconnected = True  # the app's receive() sees a disconnect; its send() is dropped
            cycle.message_event.set()
        if not self.transport.is_closing():
            self.transport.write(error_head_and_body(status, code, message, retry_after_s,
                                                     self.server_state.default_headers))
        self._close()

    def _close(self) -> None:
        self._cancel_timer()
        self.slots.release(self)  # the slot frees now; the socket closes once its answer is flushed
        if not self.transport.is_closing():
            self.transport.close()


def limited_protocol(limits: HttpLimits) -> type[LimitedHttpToolsProtocol]:
    """A protocol class for uvicorn's `http=` bound to `limits`, with its own slots and event log."""
    slots = ConnectionSlots(limits.max_connections, limits.reserved_connections)
    events = LimitEventLog(log, state=lambda: {"open_connections": slots.open, "reserve_in_use": slots.reserve_in_use})

    class BoundLimitedHttpToolsProtocol(LimitedHttpToolsProtocol):
        pass

    BoundLimitedHttpToolsProtocol.limits = limits
    BoundLimitedHttpToolsProtocol.slots = slots
    BoundLimitedHttpToolsProtocol.events = events
    return BoundLimitedHttpToolsProtocol


def raise_fd_limit(wanted: int) -> int:
    """Raise the soft open-file limit towards `wanted` (never past the hard limit, never lower);
    the soft limit that results (`wanted` when it is unlimited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    if soft >= wanted:
        return soft
    target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft
    return target


def _descriptors_needed(connections: int) -> int:
    # A burst as large as the backlog can be accepted in one loop iteration before any refusal
    # closes its socket: the backlog's worth of descriptors must fit too.
    return connections + min(LISTEN_BACKLOG, connections) + FD_OVERHEAD


def fit_to_fd_limit(limits: HttpLimits) -> tuple[HttpLimits, int]:
    """`limits` with `max_connections` lowered (with a warning) if the open-file limit cannot hold
    them after raising it, and the listen backlog to use. Refuses to start (`ConfigFileError`)
    when not even 16 connections fit."""
    total = limits.max_connections + limits.reserved_connections
    available = raise_fd_limit(_descriptors_needed(total))
    if available >= _descriptors_needed(total):
        return limits, min(LISTEN_BACKLOG, total)
    fitting = (available - FD_OVERHEAD) // 2 - limits.reserved_connections  # below the backlog cap, both halves grow
    if fitting < 16:
        raise ConfigFileError(f"the open-file limit ({available}) leaves room for {max(fitting, 0)} connections "
                              f"(each needs a descriptor, as does the listen backlog, plus {FD_OVERHEAD} for the "
                              "server itself): raise `ulimit -n`")
    log.warning("the open-file limit (%d) holds %d connections, not the configured %d: max_connections lowered; raise "
                "`ulimit -n` to keep it", available, fitting, limits.max_connections,
                extra={"fd_limit": available, "max_connections": fitting})
    backlog = min(LISTEN_BACKLOG, fitting + limits.reserved_connections)
    return dataclasses.replace(limits, max_connections=fitting), backlog


def uvicorn_limit_options(settings: ServerConfig) -> dict[str, Any]:
    """Keyword arguments for `uvicorn.Config` that enforce the limits in `settings` (raising the
    open-file limit to fit them, or lowering `max_connections` to fit it)."""
    limits, backlog = fit_to_fd_limit(HttpLimits.from_settings(settings))
    return {
        "http": limited_protocol(limits),
        "timeout_keep_alive": settings.keep_alive_timeout_s,  # uvicorn's own idle timer after a response
        "backlog": backlog,
        # servewell serves no WebSocket routes; an upgraded connection would leave the slot accounting.
        "ws": "none",
    }
