"""Context variables that carry the current request's identity into logs."""

from __future__ import annotations

import os
from contextvars import ContextVar
from dataclasses import dataclass

#: Id of the request being handled ("" outside a request).
request_id_var: ContextVar[str] = ContextVar("servewell_request_id", default="")


def new_request_id() -> str:
    """A request id for a request that brought none: 128 random bits as 32 hex digits, the form
    `uuid.uuid4().hex` gave, at a sixth of its cost (0.7 against 4.4 us; every request pays it)."""
    return os.urandom(16).hex()


#: Id of the API key the current request presented ("" without keys); never the key itself.
client_var: ContextVar[str] = ContextVar("servewell_client", default="")
#: What keeps the current request's client on one version of a traffic split: the X-Route-Key header
#: (gRPC metadata x-route-key), at most MAX_ROUTE_KEY_CHARS kept ("" when none was sent).
route_key_var: ContextVar[str] = ContextVar("servewell_route_key", default="")
#: Longest route key kept: the rest is cut (it is only hashed, never echoed nor logged).
MAX_ROUTE_KEY_CHARS = 256
#: The `id` the client gave its OIP request (None: it gave none): the payload log keeps it beside
#: the server's request id.
oip_id_var: ContextVar[str | None] = ContextVar("servewell_oip_id", default=None)
#: Model the current request is for ("" when unknown).
model_var: ContextVar[str] = ContextVar("servewell_model", default="")

#: Stable code of the error the current request was answered with ("" until one is), for the
#: console's list of failed requests; set where the error response is built.
error_code_var: ContextVar[str] = ContextVar("servewell_error_code", default="")

#: Stage durations (seconds) of the current request, filled by the route, read by the middleware.
stages_var: ContextVar[dict[str, float] | None] = ContextVar("servewell_stages", default=None)
#: OpenTelemetry context holding the request's `http` span (None when tracing is off); the
#: scheduler parents `queue` spans on it and links the `batch` span to it.
request_trace_var: ContextVar[object | None] = ContextVar("servewell_request_trace", default=None)


@dataclass(slots=True)
class BatchPlacement:
    """Where the current request ran, for its slow or failed record (log line, console list, span).

    Made empty per request by the HTTP middleware and the gRPC scope; the scheduler's telemetry
    fills it (`observability/batch_telemetry.py`): `queue_position` when the request is queued,
    the rest when the batch it runs in is formed. A request that never reached a batch (refused,
    expired in the queue) keeps None where it has no fact; one run again alone after its batch
    failed (`ModelError` isolation in the scheduler) keeps the batch it was formed in.
    """

    #: Serial of the batch, unique in this server process (the `batch` span's `servewell.batch.id`).
    batch_id: int | None = None
    #: Rows in that batch, all its requests together (as `servewell_batch_size` counts them).
    batch_size: int | None = None
    #: The model instance (worker index, 0-based) that ran the batch.
    instance: int | None = None
    #: Requests already waiting in the request's lane when it was queued (0: it found the lane empty).
    queue_position: int | None = None

    def __reduce__(self) -> tuple[type[BatchPlacement], tuple[int | None, ...]]:
        # It goes back with every outcome across the door: a tuple pickles several times faster.
        return (BatchPlacement, (self.batch_id, self.batch_size, self.instance, self.queue_position))

    def facts(self) -> dict[str, int]:
        """The facts known, by field name (empty before the request was queued)."""
        known = {"batch_id": self.batch_id, "batch_size": self.batch_size, "instance": self.instance,
                 "queue_position": self.queue_position}
        return {name: value for name, value in known.items() if value is not None}


#: The current request's `BatchPlacement` (None outside a request).
placement_var: ContextVar[BatchPlacement | None] = ContextVar("servewell_placement", default=None)
