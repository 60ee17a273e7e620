"""Errors the engine and the API answer with: each has an HTTP status and a stable code."""

from __future__ import annotations

import reprlib

#: Longest client-supplied text echoed back in an error message or a log line.
ECHO_LIMIT = 64

_ECHO = reprlib.Repr()  # Python 3.11's Repr takes its limits as attributes
_ECHO.maxlevel, _ECHO.maxstring, _ECHO.maxother, _ECHO.maxlong = 2, ECHO_LIMIT, ECHO_LIMIT, ECHO_LIMIT
_ECHO.maxlist = _ECHO.maxtuple = _ECHO.maxdict = _ECHO.maxset = 4


def quote(value: object, limit: int = ECHO_LIMIT) -> str:
    """A short `repr` of a client-supplied value: strings, numbers and nesting are cut, so error
    bodies and log lines never grow with what a client sends (and deep nesting cannot recurse)."""
    text = _ECHO.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ServeError(Exception):
    """A failure the client is told about as `{"error": {"code", "message", "request_id"}}`."""

    status: int = 500
    code: str = "internal"
    #: The model version that answered with this error where a traffic split drew it: the answer
    #: says which (`X-Model-Version`, gRPC `x-model-version`), as a success does ("": not known).
    model_version: str = ""

    def __init__(self, message: str, *, retry_after_s: float | None = None, tenant: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        #: The tenant a refusal refused (None: not a refusal of one tenant's request, or not known).
        self.tenant = tenant

    @property
    def headers(self) -> dict[str, str]:
        """Extra response headers this error carries (a challenge, the version that answered, ...)."""
        return {"X-Model-Version": self.model_version} if self.model_version else {}


class BadRequest(ServeError):
    """Malformed JSON, bad base64, an undecodable image."""

    status, code = 400, "bad_request"


class NotFound(ServeError):
    """Unknown model, version or route."""

    status, code = 404, "not_found"


class PayloadTooLarge(ServeError):
    """Body or image above the configured limit."""

    status, code = 413, "payload_too_large"


class UnsupportedMediaType(ServeError):
    """Wrong Content-Type."""

    status, code = 415, "unsupported_media_type"


class InvalidInput(ServeError):
    """Well-formed request whose tensors or fields do not match the model."""

    status, code = 422, "invalid_input"


class LoadFailed(ServeError):
    """An operator's load request could not be carried out (bad config, load or warm-up failed)."""

    status, code = 422, "load_failed"


class Unauthorized(ServeError):
    """Missing or wrong admin token or API key; `challenge` is the `WWW-Authenticate` value."""

    status, code = 401, "unauthorized"

    def __init__(self, message: str, *, challenge: str = 'Bearer realm="servewell"') -> None:
        super().__init__(message)
        self.challenge = challenge

    @property
    def headers(self) -> dict[str, str]:
        """The `WWW-Authenticate` challenge."""
        return {"WWW-Authenticate": self.challenge}


class RateLimited(ServeError):
    """No longer answered: a key's rate is its tenant's quota now (429 `over_quota`). Kept as the
    base of `over_quota`, so code that catches this class still catches every 429."""

    status, code = 429, "rate_limited"


class OverQuota(RateLimited):
    """The caller's tenant is over one of its quotas (rate, concurrency, queued requests)."""

    code = "over_quota"


class Forbidden(ServeError):
    """The caller may not use this endpoint."""

    status, code = 403, "forbidden"


class Conflict(ServeError):
    """The request conflicts with work in progress (e.g. a profile already being captured)."""

    status, code = 409, "conflict"


class ClientClosed(ServeError):
    """The client went away before the answer was ready (nginx's 499); nobody reads this."""

    status, code = 499, "client_closed_request"


class StreamTooSlow(ServeError):
    """A stream's client read its parts more slowly than the model made them: the parts buffered
    for it reached the model's `generate.stream_buffer_parts`, so the stream was ended (its
    sequence freed) rather than the server's memory growing. Read faster, or ask for fewer parts."""

    status, code = 408, "stream_too_slow"


class Unavailable(ServeError):
    """The request cannot be served now; retrying later may succeed."""

    status, code = 503, "unavailable"

    def __init__(self, message: str, *, retry_after_s: float | None = 1.0, tenant: str | None = None) -> None:
        super().__init__(message, retry_after_s=retry_after_s, tenant=tenant)


class ModelNotReady(Unavailable):
    """The model is loading, failed or unloaded."""

    code = "model_not_ready"


class Overloaded(Unavailable):
    """The model's queue for this lane is full."""

    code = "overloaded"


class DeadlineExceeded(Unavailable):
    """The request's deadline passed before the model could run it."""

    code = "deadline_exceeded"


class WorkerLost(Unavailable):
    """The worker process running the request died; the request is safe to retry."""

    code = "worker_lost"


class WorkerHung(Unavailable):
    """The worker running the request stopped making progress (no heartbeat, or its batch overran
    the model's compute budget); it was killed and is being replaced. Safe to retry."""

    code = "worker_hung"


class ShuttingDown(Unavailable):
    """The server is draining and admits no new work."""

    code = "shutting_down"


class EngineUnavailable(Unavailable):
    """This ingress process cannot reach the engine process (down, restarting, or all its
    connections busy): nothing was served. Safe to retry."""

    code = "engine_unavailable"


class ModelUnloading(Unavailable):
    """The model is being unloaded by an operator: it finishes what it accepted and takes nothing
    new (it will not come back until loaded again). Not the server shutting down."""

    code = "model_unloading"


class ModelLoading(Unavailable):
    """The model is not resident and too many requests already wait for its load, or the load did
    not finish within the request's wait: retry after about one load time (Retry-After)."""

    code = "model_loading"


class ModelReloading(Unavailable):
    """This version of the model is being replaced by a reload and takes nothing new; the new
    version serves, so retrying at once succeeds."""

    code = "model_reloading"


class SharedMemoryFull(Unavailable):
    """The shared memory (/dev/shm) that carries a batch's tensors between the server's processes has
    no room for this one (a container's /dev/shm is often 64-256 MiB): smaller requests still go
    through what the server holds already; retrying once memory is freed succeeds."""

    code = "shared_memory_full"


class ModelError(ServeError):
    """The model itself raised while running the batch."""

    status, code = 500, "model_error"


class OutputTooLarge(ModelError):
    """The model's answer to one request is larger than its `max_output_bytes` (model.yaml, else the
    server's): refused in the worker before it is copied anywhere. The model's or its limit's
    problem, not the client's (a request with fewer rows may fit: the message says)."""

    code = "output_too_large"
