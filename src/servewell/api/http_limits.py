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
  the idle time before), a body within `body_timeout_s` of its head and, after
  `body_rate_grace_s`, at `min_body_rate_bytes_s` on average (408 and closed; a connection that
  sent nothing is closed silently);
- a slot in `ConnectionSlots` (bounded connections, eviction of waiting ones, a reserve that
  serves only the probe paths), with the process's open-file limit raised to fit them all (or,
  where the hard limit is too low, `max_connections` lowered to fit it, with a warning). A
  connection counts as waiting, and may be evicted, until its whole request (body included) is in;
- at most `max_pipelined_requests` requests queued behind the one being answered (past that, the
  queued ones and the next get 503 in their turn, nothing after it is read), and answers that
  wait for a client reading nothing dropped after `send_timeout_s` (uvicorn already stops
  writing past the transport's high-water mark);
- HTTP/1.0 and 1.1 only (505 otherwise), and exactly one Host header in HTTP/1.1 (400);
- once readiness turns false (`close_after_answers`), `Connection: close` on every answer.

Refusals answer with the JSON error body where a response is still possible, and are counted
into one aggregated log line per window (`LimitEventLog`), never one line per connection.
Malformed HTTP gets a JSON 400 instead of uvicorn's plain-text one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable
from typing import Any, ClassVar, Literal, Protocol

import httptools
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from servewell.api.body import GatheredBody
from servewell.api.connection_slots import ConnectionSlots, SlotKind
from servewell.api.fd_limits import fit_to_fd_limit
from servewell.api.http_limit_rules import HttpLimits as HttpLimits  # re-exported: tests and bench build limits here
from servewell.api.http_limit_rules import KeepAlivePolicy, body_deadline
from servewell.api.http_refusals import Refusal, StopParsing, connection_limit_app, error_head_and_body, unavailable_app
from servewell.api.limit_log import LimitEventLog
from servewell.api.response_writes import hold_heads
from servewell.config.server import ServerConfig
from servewell.engine.promised import Promise

log = logging.getLogger("servewell.http")

#: Paths a reserve connection may ask for: what keeps an orchestrator and Prometheus informed.
PROBE_PATHS = frozenset((b"/healthz", b"/v2/health/live", b"/v2/health/ready", b"/metrics"))

#: The uvicorn releases these subclasses were written and tested against: [first, end) as (major, minor).
#: pyproject.toml pins `uvicorn[standard]` to the same range; tests/unit/api/test_uvicorn_private_api.py
#: fails with a message naming the version when the installed one is outside it.
UVICORN_TESTED = ((0, 55), (0, 56))
#: Every private uvicorn name servewell relies on (this module, http_refusals.py, response_writes.py,
#: shutdown.py), by where it lives: methods we override or call, and attributes we read or replace.
#: The same test checks each still exists on the installed uvicorn, so an upgrade fails there, not in serving.
UVICORN_PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    "uvicorn.protocols.http.httptools_impl.HttpToolsProtocol": (
        "connection_made", "connection_lost", "data_received", "on_message_begin", "on_headers_complete",
        "on_body", "on_message_complete", "on_response_complete", "shutdown", "pause_writing", "resume_writing",
        "timeout_keep_alive_handler", "_start_asgi_task", "_unset_keepalive_if_required",
        "app", "loop", "parser", "transport", "flow", "cycle", "pipeline", "headers", "server_state",
        "timeout_keep_alive", "timeout_keep_alive_task",
    ),
    "uvicorn.protocols.http.httptools_impl.RequestResponseCycle": (
        "transport", "send", "body", "more_body", "keep_alive", "disconnected", "message_event",
        "response_started", "response_complete", "waiting_for_100_continue",
    ),
    "uvicorn.protocols.http.flow_control.FlowControl": ("pause_reading", "read_paused"),
    "uvicorn.server.ServerState": ("connections", "default_headers"),
    "uvicorn.server.Server": ("server_state", "should_exit", "on_tick", "shutdown", "capture_signals", "handle_exit"),
    "uvicorn.protocols.http.httptools_impl": ("STATUS_LINE",),
}

# Where a connection is in its request cycle.
_WAITING = 0  # no request yet, or idle between requests
_HEAD = 1  # some bytes of a request head have arrived
_BODY = 2  # the head is complete, the body is arriving
_BUSY = 3  # the whole request has arrived; the app is answering
_NEVER = float("inf")
#: At shutdown, how long a connection that has not yet sent its first request gets to send it.
FRESH_CONNECTION_GRACE_S = 1.0

class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with servewell's limits; `limited_protocol` makes the bound class."""

    limits: ClassVar[HttpLimits]
    #: Whether a request (its ASGI scope) will be refused by the admission checks that need no body.
    refused_early: ClassVar[RefusedEarly | None] = None
    slots: ClassVar[ConnectionSlots]
    events: ClassVar[LimitEventLog]
    keep_alive_policy: ClassVar[KeepAlivePolicy]

    @classmethod
    def close_after_answers(cls, connections: Iterable[object]) -> None:
        """Readiness turned false: from now on every answer closes its connection, and so does the
        answer each of `connections` (uvicorn's open ones) is preparing or has queued. Idle ones are
        left to their keep-alive timer: closing one now would reset a request already on its way."""
        cls.keep_alive_policy.closing = True
        for connection in connections:
            if isinstance(connection, LimitedHttpToolsProtocol):
                connection.close_after_answer()

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
        self._body_started_at = 0.0
        self._body_bytes = 0
        self._pipeline_full = False  # the last request this connection may queue has been parsed
        # (cycle, app, its promise of a place) waiting for its body to be all in
        self._deferred: tuple[Any, Any, Promise | None] | None = None
        self._deferred_body = GatheredBody()  # its body so far, joined once when it is all in
        self._send_timer: asyncio.TimerHandle | None = None

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
        self._deferred = None  # a request whose body never came: its promise of a place goes now
        self._cancel_timer()
        self._cancel_send_timer()
        self.slots.release(self)
        super().connection_lost(exc)

    def evict(self) -> None:
        """Close this waiting connection to give its slot to a newcomer (`ConnectionSlots`)."""
        self.events.add("evicted")
        if self._phase in (_HEAD, _BODY):  # a request has begun: it gets its answer
            self._answer_and_close(503, "unavailable", "the server is at its connection limit; retry shortly", 1)
        else:  # idle: closing it is an ordinary keep-alive close
            self._close()

    # Bytes in
    def data_received(self, data: bytes) -> None:
        if self._pipeline_full:
            # Nothing after the last request it may queue is read: the connection closes after answering it.
            self.flow.pause_reading()
            return
        self._unset_keepalive_if_required()
        self._receive(data)

    def _receive(self, data: bytes | memoryview) -> None:
        if self._pipeline_full:
            return
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
            if self.transport.is_closing() or self._pipeline_full:
                return
        if self._heads_done == heads_before:
            self._refuse(Refusal(431, "header_too_large", f"the request head exceeds {self.limits.max_header_bytes} "
                                  "bytes", "header_too_large"))
            return
        self._receive(data[within:])  # the head ended within budget: the rest is body or the next request

    def _feed(self, data: bytes | memoryview) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            refusal = exc.__context__
            if isinstance(refusal, StopParsing):
                return
            if isinstance(refusal, Refusal):
                self._refuse(refusal)
            else:
                self._refuse(Refusal(400, "bad_request", "malformed HTTP request", "malformed"))
        except httptools.HttpParserUpgrade:
            # No protocol upgrades are served (uvicorn runs with ws="none"): the request was answered
            # as plain HTTP, and the connection closes after it, since the parser stops at the upgrade.
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.keep_alive = False
            else:
                self._close()
        except httptools.HttpParserError as exc:
            self._refuse(Refusal(400, "bad_request", f"malformed HTTP request: {str(exc)[:100]}", "malformed"))

    # Parser callbacks (httptools calls them from feed_data)
    def on_message_begin(self) -> None:
        if self._pipeline_full:
            raise StopParsing
        super().on_message_begin()
        self._phase = _HEAD
        if self._deadline == _NEVER:  # a later request's head; the first one's deadline runs from the connect
            self._set_deadline(self.loop.time() + self.limits.header_timeout_s)

    def on_headers_complete(self) -> None:
        # The head's byte budget already bounds the URL and the field count (and what parsing them
        # costs), so both are checked once here rather than in a callback per header.
        if len(self.url) > self.limits.max_url_bytes:
            raise Refusal(414, "uri_too_long", f"the URL exceeds {self.limits.max_url_bytes} bytes", "url_too_long")
        if len(self.headers) > self.limits.max_header_count:
            raise Refusal(431, "too_many_headers", f"the request has more than {self.limits.max_header_count} header "
                           "fields", "too_many_headers")
        self._check_version_and_host()
        self._head_bytes = 0
        self._heads_done += 1
        self._phase = _BODY
        # The slot stays evictable until the whole body is in (`on_message_complete`): a body that
        # trickles in cannot hold a slot that complete requests need (1,100 did, before).
        self._body_started_at = self.loop.time()
        self._body_bytes = 0
        self._set_deadline(body_deadline(self._body_started_at, 0, self.limits))
        if len(self.pipeline) >= self.limits.max_pipelined_requests:
            self._refuse_past_the_pipeline()
            return
        if self._slot is SlotKind.RESERVE:
            if httptools.parse_url(self.url).path not in PROBE_PATHS:
                self.events.add("reserve_refused")
                self.app = connection_limit_app
            super().on_headers_complete()
            hold_heads(self.cycle)
            self.cycle.keep_alive = False  # a reserve slot serves one request, then frees up
            return
        super().on_headers_complete()
        hold_heads(self.cycle)
        if self.keep_alive_policy.closing:
            self.cycle.keep_alive = False

    def shutdown(self) -> None:
        """uvicorn closed the listener. A connection whose first request may be on its way (none
        read yet, or a head half in) is not closed under it, which would reset that request: it
        gets `FRESH_CONNECTION_GRACE_S` to send it, answered with `Connection: close`."""
        if self._phase == _HEAD or (self._phase == _WAITING and self._heads_done == 0):
            if not self.transport.is_closing():
                self._set_deadline(min(self._deadline, self.loop.time() + FRESH_CONNECTION_GRACE_S))
            return
        super().shutdown()

    def _check_version_and_host(self) -> None:
        version = self.parser.get_http_version()
        if version not in ("1.1", "1.0"):
            raise Refusal(505, "http_version_not_supported", f"HTTP/{version[:8]} is not served on this port; use "
                           "HTTP/1.1 (gRPC runs over HTTP/2 on the gRPC port)", "bad_version")
        if version == "1.1" and sum(1 for name, _ in self.headers if name == b"host") != 1:
            # RFC 9112 section 3.2: an HTTP/1.1 request without exactly one Host field gets a 400.
            raise Refusal(400, "bad_request", "an HTTP/1.1 request must carry exactly one Host header", "malformed")

    def _refuse_past_the_pipeline(self) -> None:
        """This request is one more than the connection may queue behind the answer it waits for:
        it and the requests queued before it are answered 503 in their turn (the one running is
        answered as usual), nothing after it is read, and the connection closes then.
        Each queued request holds its parsed head (a few KB); 200,000 pipelined GETs on one
        connection took the process from 97 to 705 MB before this bound."""
        self.events.add("pipeline_full")
        self._pipeline_full = True
        self.app = unavailable_app(f"more than {self.limits.max_pipelined_requests} requests were sent on one "
                                    "connection ahead of their answers; send the rest after reading these")
        # A client this far ahead is not reading its answers: the requests queued behind the one running
        # are refused the same way instead of run through the app. Answering them cost the light
        # /predict load its p99 (bench.hostile --rounds 3, pipelining: 2.54x the baseline, now 1.21x).
        self.pipeline = deque((queued, self.app) for queued, _ in self.pipeline)
        self.slots.busy(self)  # its answers are queued: never evicted, which would answer out of turn
        super().on_headers_complete()
        hold_heads(self.cycle)
        self.cycle.keep_alive = False
        self.flow.pause_reading()
        self._deadline = _NEVER  # its answer waits for the ones before it; the body is not needed

    def close_after_answer(self) -> None:
        """The answer this connection prepares (and each it has queued) closes it."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            cycle.keep_alive = False
        for queued, _ in self.pipeline:
            queued.keep_alive = False

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        """Start the app on `cycle`, or, while a body of known size that fits `max_body_bytes` is still
        arriving, once it is all in: a body that trickles in then costs no task, no middleware, no
        log line and no metric, just its bytes (1,100 slow bodies each running the app until its
        408 slowed every other request 10-30x). Bodies without a length, or with
        `Expect: 100-continue` (the app's first read sends the 100), start the app at once; so does a
        request the admission checks will refuse (`refused_early`: a full lane its tenant holds most
        of), which is then answered before its body is read. A request that waits for its body
        holds its promise of a place in its model's lane meanwhile (dropped when the app starts,
        whose admission check promises again, or with this connection)."""
        if cycle.more_body and not cycle.waiting_for_100_continue and self._body_fits_buffer():
            early = self.refused_early(cycle.scope) if self.refused_early is not None else None
            if early is not True:
                self._deferred = (cycle, app, early)
                return
        super()._start_asgi_task(cycle, app)

    def _body_fits_buffer(self) -> bool:
        for name, value in self.headers:
            if name == b"content-length":
                return value.isdigit() and int(value) <= self.limits.max_body_bytes
        return False

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._deferred is not None and self._deferred[0] is self.cycle:
            self._deferred_body.add(body)  # bounded by its Content-Length (nobody reads it yet)
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        deferred = self._deferred is not None and self._deferred[0] is self.cycle
        if deferred:
            self.cycle.body += self._deferred_body.take()
        super().on_message_complete()
        if deferred and self._deferred is not None:
            cycle, app, _ = self._deferred
            self._deferred = None  # and its promise: the app's admission check promises again
            super()._start_asgi_task(cycle, app)
        if self._pipeline_full:
            return
        self._phase = _BUSY
        self._deadline = _NEVER
        self.slots.busy(self)
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
        if self._phase == _BODY:
            self._on_body_deadline()
            return
        self._deadline = _NEVER
        if self._phase == _HEAD:
            self.events.add("header_timeout")
            self._answer_and_close(408, "request_timeout", f"the request head did not arrive within "
                                   f"{self.limits.header_timeout_s:g} s")
        else:  # opened and sent nothing: there is no request to answer
            self.events.add("idle_timeout")
            self._close()

    def _on_body_deadline(self) -> None:
        now = self.loop.time()
        if now < self._body_started_at + self.limits.body_timeout_s:
            if self.flow.read_paused:
                # Unread because the app (or the answer before, when pipelined) has not taken what
                # came: the client is not the slow one. Checked again after the grace.
                self._set_deadline(now + max(self.limits.body_rate_grace_s, 0.1))
                return
            deadline = body_deadline(self._body_started_at, self._body_bytes, self.limits)
            if deadline > now:
                self._set_deadline(deadline)
                return
            self._deadline = _NEVER
            self.events.add("slow_body")
            self._answer_and_close(408, "request_timeout", f"the request body arrived slower than "
                                   f"{self.limits.min_body_rate_bytes_s:g} bytes/s")
            return
        self._deadline = _NEVER
        self.events.add("body_timeout")
        self._answer_and_close(408, "request_timeout", f"the request body did not arrive within "
                               f"{self.limits.body_timeout_s:g} s")

    # Answers nobody reads
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.limits.send_timeout_s, self._on_send_timeout)

    def resume_writing(self) -> None:
        self._cancel_send_timer()
        super().resume_writing()

    def _on_send_timeout(self) -> None:
        # The client has read nothing for send_timeout_s while answers wait: drop what is unsent.
        self._send_timer = None
        self.events.add("send_timeout")
        self._cancel_timer()
        self.slots.release(self)
        self.transport.abort()

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _cancel_timer(self) -> None:
        self._deadline = _NEVER
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # Answers
    def _refuse(self, refusal: Refusal) -> None:
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


class RefusedEarly(Protocol):
    """Looks at a request's head (its ASGI scope): True when it will be refused before its body is
    needed; otherwise what to hold while its body arrives (its promise of a place in its model's
    lane, engine/promised.py), or None."""

    def __call__(self, scope: Any) -> Literal[True] | Promise | None: ...


def limited_protocol(limits: HttpLimits,
                     refused_early: RefusedEarly | None = None) -> type[LimitedHttpToolsProtocol]:
    """A protocol class for uvicorn's `http=` bound to `limits`, with its own slots and event log;
    `refused_early(scope)`: whether a request will be refused before its body is needed."""
    slots = ConnectionSlots(limits.max_connections, limits.reserved_connections)
    events = LimitEventLog(log, state=lambda: {"open_connections": slots.open, "reserve_in_use": slots.reserve_in_use})

    class BoundLimitedHttpToolsProtocol(LimitedHttpToolsProtocol):
        pass

    BoundLimitedHttpToolsProtocol.limits = limits
    BoundLimitedHttpToolsProtocol.slots = slots
    BoundLimitedHttpToolsProtocol.events = events
    BoundLimitedHttpToolsProtocol.keep_alive_policy = KeepAlivePolicy()
    BoundLimitedHttpToolsProtocol.refused_early = refused_early
    return BoundLimitedHttpToolsProtocol


def uvicorn_limit_options(settings: ServerConfig, refused_early: RefusedEarly | None = None) -> dict[str, Any]:
    """Keyword arguments for `uvicorn.Config` that enforce the limits in `settings` (raising the
    open-file limit to fit them, or lowering `max_connections` to fit it); `refused_early`: see
    `LimitedHttpToolsProtocol._start_asgi_task`."""
    limits, backlog = fit_to_fd_limit(HttpLimits.from_settings(settings))
    return {
        "http": limited_protocol(limits, refused_early),
        "timeout_keep_alive": settings.keep_alive_timeout_s,  # uvicorn's own idle timer after a response
        "backlog": backlog,
        # servewell serves no WebSocket routes; an upgraded connection would leave the slot accounting.
        "ws": "none",
    }
