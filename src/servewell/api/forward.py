"""An ingress's way to the engine's private HTTP app: every request it does not serve itself.

`EngineForwarder` is an ASGI app that sends one HTTP request (any method, path, query, headers,
a body streamed in the chunks the client sends) to the HTTP/1.1 server on a unix socket (the
engine's `RUN/engine-http.sock`) and streams the answer back: the status and headers, then each
body chunk as it arrives (a server-sent events stream flows event by event, nothing is
buffered whole). Answers are parsed by httptools (`api/forward_pool.py`); HEAD, 1xx, 204 and
304 answers carry no body, whatever their Content-Length says.

- **Connections** come from a keep-alive pool (`api/forward_pool.py`): at most `max_connections`
  at once, a request waiting at most `pool_timeout_s` for one, then 503. A connection serves
  again only after an answer read to its end that allowed keep-alive; one the client abandoned
  is closed. A GET, HEAD or OPTIONS without a streamed body whose reused connection turns out
  closed before any answer is sent once more on a new connection (the engine closes idle
  keep-alive connections; nothing else is retried, since the engine may have acted on it).
- **Headers**: hop-by-hop ones (Connection and what it names, Keep-Alive, Transfer-Encoding,
  TE, Trailer, Upgrade, Proxy-*) are dropped both ways and the framing set anew (the client's
  Content-Length kept, a streamed body sent chunked); Host is kept; `Expect` is dropped (the
  ingress's server has already answered `100 Continue` when the body is read). The client's
  address goes in `x-servewell-peer` (`api/peer.py`), always written here: a client's own is
  removed. The engine's `Date` and `Server` are dropped, as the ingress's server writes its own.
  Under the ingress's `RequestContextMiddleware` (a request id is set) the id travels as
  `x-request-id`, so the engine logs the same id, and the engine's `x-request-id` and
  `x-process-time` are dropped from the answer, where the ingress puts its own; when that
  middleware traces the request, `traceparent` names its span, so the engine's spans join it.
- **Failures**: the engine unreachable (no socket, refused, reset, no answer within
  `read_timeout_s`, an unreadable or oversized answer head) before the answer began: 503
  `engine_unavailable`, in the route's error shape, with `Retry-After: 1`. After it began the
  status cannot change: the client's connection is aborted (`EngineStreamBroken`), so a
  truncated body never looks complete. The client leaving while its request is forwarded
  closes that engine connection, which ends the work on the engine's side too.
- **Bounds**: the answer head is at most `max_response_header_bytes`; every read from and every
  wait to write to the engine ends within `read_timeout_s`; bodies pass one chunk at a time
  with back-pressure both ways, never buffered whole.

websocket scopes are closed (not supported); lifespan scopes are left to whoever mounts this.

Cost: forwarding a small GET (a 40-byte JSON answer) adds 197-212 us of CPU (two runs) to the
157-163 us the same request costs served directly (client, servers and app in one process on
uvloop, 2000 sequential keep-alive GETs per round, median of 5 rounds: `bench/forward_cost.py`), for the
ingress's HTTP parse and write, this module and the engine's side of the unix socket. With h11
instead of httptools it added 392 us; with the client watch started at once, 230 us.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote as url_quote

from opentelemetry import trace
from opentelemetry.context import Context
from starlette.types import Message, Receive, Scope, Send

from servewell.api.errors import serve_error_response
from servewell.api.forward_pool import UpstreamClosed, UpstreamConnection, UpstreamError, UpstreamPool
from servewell.api.peer import PEER_HEADER, format_peer
from servewell.errors import BadRequest, EngineUnavailable, ServeError
from servewell.observability.context import request_id_var, request_trace_var
from servewell.observability.refusal_log import RefusalDigest
from servewell.observability.tracing import traceparent_of

log = logging.getLogger("servewell.forward")

Headers = list[tuple[bytes, bytes]]

_HOP_BY_HOP = frozenset((b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade"))
_REQUEST_DROPPED = _HOP_BY_HOP | {b"content-length", b"expect", b"host", PEER_HEADER}
_REQUEST_DROPPED_UNDER_INGRESS = _REQUEST_DROPPED | {b"x-request-id"}
_RESPONSE_DROPPED = _HOP_BY_HOP | {b"date", b"server"}
_RESPONSE_DROPPED_UNDER_INGRESS = _RESPONSE_DROPPED | {b"x-request-id", b"x-process-time"}
# Safe methods: sending one again cannot repeat an action the engine took.
_REPLAYABLE_METHODS = frozenset(("GET", "HEAD", "OPTIONS"))
# What may not be written into a request head (the ingress's parser let none of it through;
# a caller building its own scope might): RFC 9110 tokens, no control bytes or spaces in the target.
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_TARGET = re.compile(rb"[\x00-\x20\x7f]")
_BAD_VALUE = re.compile(rb"[\x00\r\n]")
_END_OF_CHUNKS = b"0\r\n\r\n"
# The watch for the client leaving (a task awaiting `receive`) cost about 35 us of CPU per request
# (forwarding a small GET added 230 us with it, 194 us without: bench/forward_cost.py), and almost
# every answer comes sooner than this; so it starts only once the engine has taken this long.
_WATCH_AFTER_S = 0.05


class EngineStreamBroken(ConnectionError):
    """The engine failed after its answer had begun: raised to abort the client's connection."""


class _Unforwardable(ValueError):
    """The request cannot be written as HTTP/1.1 (a control byte in a header, ...)."""


class _FailedBeforeAnswer(Exception):
    """The exchange failed before the answer's head was forwarded; `retryable`: on a new connection."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True, slots=True)
class _Request:
    """The request as written to the engine: its head, and how its body is framed."""

    head: bytes
    chunked: bool
    head_only: bool


class EngineForwarder:
    """ASGI app forwarding each HTTP request to the HTTP/1.1 server on the unix socket `uds_path`
    (the module docstring says how).

    - `connect_timeout_s`: longest wait to open a connection (a unix socket connects at once
      unless the engine's accept queue is full).
    - `read_timeout_s`: longest silence of the engine while an answer is due (its head included)
      and longest wait for it to take request bytes; above the slowest admin call (a model load
      with warm-up; a profile capture is at most 60 s).
    - `max_connections`: connections to the engine at once (each ingress forwards only the
      non-inference requests: admin, probes, metrics, console, docs).
    - `max_response_header_bytes`: largest answer head accepted from the engine.
    - `pool_timeout_s`: longest wait for a connection when all `max_connections` are busy.
    - `idle_timeout_s`: an idle connection older than this is not reused; keep it below the
      engine's uvicorn `timeout_keep_alive` (5 s by default).
    """

    def __init__(self, uds_path: str, *, connect_timeout_s: float = 1.0, read_timeout_s: float = 300.0,
                 max_connections: int = 64, max_response_header_bytes: int = 64 * 1024,
                 pool_timeout_s: float = 5.0, idle_timeout_s: float = 4.0) -> None:
        self.uds_path = uds_path
        self._pool = UpstreamPool(uds_path, max_connections=max_connections, pool_timeout_s=pool_timeout_s,
                                  connect_timeout_s=connect_timeout_s, idle_timeout_s=idle_timeout_s,
                                  io_timeout_s=read_timeout_s, max_header_bytes=max_response_header_bytes)
        self._refusals = RefusalDigest(log)

    @property
    def idle_connections(self) -> int:
        """Connections to the engine kept open for the next request."""
        return self._pool.idle_connections

    def close(self) -> None:
        """Close the idle connections and log pending refusals (at shutdown)."""
        self._pool.close_idle()
        self._refusals.flush_all()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._forward(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1000})  # before accept: the server answers 403

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        first = await receive()
        if first["type"] != "http.request":
            return  # the client left before its body began
        body: bytes = first.get("body", b"")
        more_body: bool = first.get("more_body", False)
        request_id = request_id_var.get()
        try:
            request = _request(scope, body, more_body, request_id)
        except _Unforwardable as exc:
            await self._refuse(scope, receive, send, BadRequest(f"the request cannot be forwarded: {exc}"))
            return
        replayable = not more_body and scope["method"] in _REPLAYABLE_METHODS
        for attempt in range(2):
            try:
                connection = await self._pool.acquire(new=attempt > 0)
            except UpstreamError as exc:
                await self._refuse(scope, receive, send, EngineUnavailable(str(exc)))
                return
            exchange = _Exchange(connection, receive, send, under_ingress=bool(request_id))
            try:
                await exchange.run(request, body, more_body)
            except _FailedBeforeAnswer as exc:
                failure = exc
            else:
                return
            finally:
                self._pool.release(connection)
            if not (failure.retryable and replayable and connection.reused and attempt == 0):
                break
            log.debug("a reused connection to the engine was closed (%s); sending again on a new one", failure)
        await self._refuse(scope, receive, send, EngineUnavailable(str(failure)))

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, error: ServeError) -> None:
        response = serve_error_response(error, self._refusals, path=scope.get("path", ""))
        await response(scope, receive, send)


class _Exchange:
    """One request and its answer over one connection (send, wait for the head, stream the body),
    with a watch for the client leaving while the engine is awaited."""

    def __init__(self, connection: UpstreamConnection, receive: Receive, send: Send, *, under_ingress: bool) -> None:
        self._connection = connection
        self._receive = receive
        self._send = send
        self._under_ingress = under_ingress
        self._client_gone = False
        self._watch_timer: asyncio.TimerHandle | None = None
        self._watch: asyncio.Task[None] | None = None

    async def run(self, request: _Request, body: bytes, more_body: bool) -> None:
        """Forward the exchange; returns when the answer was forwarded or the client left, raises
        `_FailedBeforeAnswer` or `EngineStreamBroken`."""
        self._connection.begin(head_only=request.head_only)
        try:
            if not await self._send_request(request, body, more_body):
                return
            if await self._answer_head():
                await self._forward_answer()
        finally:
            self._stop_watching()

    async def _send_request(self, request: _Request, body: bytes, more_body: bool) -> bool:
        """Send the head and the body as it comes; False when the client left meanwhile. A failed
        write is not yet a failure: the engine may have answered early (and closed)."""
        connection = self._connection
        try:
            await connection.write(request.head + _framed(body, request.chunked, more_body))
            while more_body:
                message = await self._receive()
                if message["type"] != "http.request":
                    connection.close()  # the client left mid-body: the engine sees its request end
                    return False
                body, more_body = message.get("body", b""), message.get("more_body", False)
                if body or not more_body:
                    await connection.write(_framed(body, request.chunked, more_body))
            connection.request_complete = True
        except (OSError, TimeoutError):
            pass
        return True

    async def _answer_head(self) -> bool:
        """Read up to the end of the answer's head; False when the client left meanwhile."""
        connection = self._connection
        try:
            while connection.head is None:
                self._watch_client()
                await connection.read()
        except TimeoutError:
            if self._client_gone:
                return False
            raise _FailedBeforeAnswer(f"the engine did not answer within {connection.io_timeout_s:g} s",
                                      retryable=False) from None
        except (OSError, UpstreamClosed) as exc:
            if self._client_gone:
                return False
            raise _FailedBeforeAnswer(f"the engine closed the connection without answering ({exc})",
                                      retryable=True) from None
        except UpstreamError as exc:
            raise _FailedBeforeAnswer(str(exc), retryable=False) from None
        return True

    async def _forward_answer(self) -> None:
        """Send the head, then the body as it is read (what one read brought goes as one message,
        and the last with the end: a small answer is one head and one body message)."""
        connection = self._connection
        head = connection.head
        assert head is not None
        status, headers = head
        await self._send({"type": "http.response.start", "status": status,
                          "headers": _response_headers(headers, status, self._under_ingress)})
        try:
            while True:
                chunk = connection.take_body()
                if connection.complete:
                    self._stop_watching()  # the connection is about to go back to the pool: nothing may close it now
                    await self._send({"type": "http.response.body", "body": chunk, "more_body": False})
                    return
                if chunk:
                    await self._send({"type": "http.response.body", "body": chunk, "more_body": True})
                self._watch_client()
                await connection.read()
        except (OSError, TimeoutError, UpstreamError) as exc:
            if self._client_gone:
                return
            reason = str(exc) or f"no data for {connection.io_timeout_s:g} s"
            log.warning("the engine's answer (status %d) broke off after it began: %s; aborting the client's "
                        "connection", status, reason)
            raise EngineStreamBroken(f"the engine's answer broke off: {reason}") from exc

    def _watch_client(self) -> None:
        """While the engine is awaited, close the connection to it if the client leaves (uvicorn
        only says so through `receive`): from `_WATCH_AFTER_S` after the whole request was sent."""
        if self._watch_timer is None and self._connection.request_complete:
            self._watch_timer = asyncio.get_running_loop().call_later(_WATCH_AFTER_S, self._start_watching)

    def _start_watching(self) -> None:
        self._watch = asyncio.ensure_future(self._until_client_leaves())

    def _stop_watching(self) -> None:
        if self._watch_timer is not None:
            self._watch_timer.cancel()
        if self._watch is not None:
            self._watch.cancel()

    async def _until_client_leaves(self) -> None:
        while True:
            message: Message = await self._receive()
            if message["type"] == "http.disconnect":
                self._client_gone = True
                self._connection.close()
                return


def _framed(body: bytes, chunked: bool, more_body: bool) -> bytes:
    """Request body bytes as written: as they are, or as one chunk (and the last one at the end)."""
    if not chunked:
        return body
    framed = b"%x\r\n%b\r\n" % (len(body), body) if body else b""
    return framed if more_body else framed + _END_OF_CHUNKS


def _connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    """Header names a `Connection` header lists: hop-by-hop too (RFC 9110 7.6.1)."""
    return {token.strip().lower() for name, value in headers if name == b"connection" for token in value.split(b",")}


def _kept(headers: Iterable[tuple[bytes, bytes]], dropped: frozenset[bytes]) -> Headers:
    headers = list(headers)
    also = _connection_tokens(headers)
    return [(name, value) for name, value in headers
            if name not in dropped and name not in also and not name.startswith(b"proxy-")]


def _request(scope: Scope, body: bytes, more_body: bool, request_id: str) -> _Request:
    """The request as the engine gets it (see the module docstring for what changes)."""
    raw: Headers = scope["headers"]
    host = next((value for name, value in raw if name == b"host"), None)
    length = next((value for name, value in raw if name == b"content-length"), None)
    chunked_in = any(name == b"transfer-encoding" for name, _ in raw)
    headers = _kept(raw, _REQUEST_DROPPED_UNDER_INGRESS if request_id else _REQUEST_DROPPED)
    if host is None:  # HTTP/1.0 may omit it; HTTP/1.1 (to the engine) may not
        server = scope.get("server")
        host = (f"{server[0]}:{server[1]}" if server and server[1] is not None else "localhost").encode()
    headers.insert(0, (b"host", host))
    chunked = False
    if length is not None:
        headers.append((b"content-length", length))
    elif more_body:
        headers.append((b"transfer-encoding", b"chunked"))
        chunked = True
    elif body or chunked_in:
        headers.append((b"content-length", b"%d" % len(body)))
    peer = format_peer(scope.get("client"))
    if peer is not None:
        headers.append((PEER_HEADER, peer))
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
    traceparent = _traceparent()
    if traceparent is not None:
        headers = [(name, value) for name, value in headers if name != b"traceparent"]
        headers.append((b"traceparent", traceparent))
    method = scope["method"].encode()
    target = scope.get("raw_path") or url_quote(scope["path"]).encode()
    if scope.get("query_string"):
        target += b"?" + scope["query_string"]
    if not _TOKEN.fullmatch(method) or not target or _BAD_TARGET.search(target):
        raise _Unforwardable("a method or target HTTP/1.1 cannot carry")
    lines = [method, b" ", target, b" HTTP/1.1\r\n"]
    for name, value in headers:
        if not _TOKEN.fullmatch(name) or _BAD_VALUE.search(value):
            raise _Unforwardable(f"header {name[:64]!r} cannot be written in HTTP/1.1")
        lines += (name, b": ", value, b"\r\n")
    lines.append(b"\r\n")
    return _Request(b"".join(lines), chunked, method == b"HEAD")


def _traceparent() -> bytes | None:
    """W3C traceparent of the current request's span in this process (None when it is not traced)."""
    context = request_trace_var.get()
    if not isinstance(context, Context):
        return None
    value = traceparent_of(trace.get_current_span(context).get_span_context())
    return value.encode() if value else None


def _response_headers(headers: Iterable[tuple[bytes, bytes]], status: int, under_ingress: bool) -> Headers:
    kept = _kept(headers, _RESPONSE_DROPPED_UNDER_INGRESS if under_ingress else _RESPONSE_DROPPED)
    if status in (204, 304):  # no body; uvicorn refuses a Content-Length it then does not see
        kept = [(name, value) for name, value in kept if name != b"content-length"]
    return kept
