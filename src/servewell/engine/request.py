"""The one request object: built once where a request arrives, carried whole to the worker.

An `InferenceRequest` holds every fact about one inference request that any stage of serving
decides on: which model (and version, if the client named one), its lane, its tenant, the key
that keeps it on one version of a traffic split, its absolute deadline, its trace context, its
inputs and their row count, and the ids that name it (the server's and the client's). It is
immutable: a stage that needs another request (a pipeline's step, a shadow copy) derives one with
`step` or `shadow_copy`, never changes this one. Nothing about it travels as positional arguments or
context variables (the logging context variables aside, which only name it in log lines).

Times are absolute `time.monotonic()` seconds, one clock for every process of the machine, so
`deadline_at` means the same instant from the HTTP parser to the worker. A request's deadline is
always resolved where it is built: the client's timeout, or its model's default timeout, counted
from `arrived_at`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class InferenceRequest(NamedTuple):
    """One inference request, from the ingress to the worker (immutable: a named tuple, which a
    request costs 0.5 us to build and the door 2 us to read back, against 3-7 us for a frozen
    dataclass: every request crosses the door once)."""

    id: str  # the server's request id (X-Request-ID): logs, spans, the payload log
    model: str
    version: str | None  # the version the client named; None: the traffic split draws one
    lane: int  # index into the model's lanes (engine/lanes.py)
    deadline_at: float  # absolute monotonic seconds: answered 503 deadline_exceeded once passed
    arrived_at: float  # absolute monotonic seconds: when the request reached the server
    inputs: dict[str, np.ndarray]  # checked against the serving version's inputs by the chain
    tenant: str = ""  # the tenant id of the key presented ("" without keys: the anonymous tenant)
    key_id: str = ""  # the API key id presented ("" without keys); never the key itself
    route_key: str = ""  # keeps a client on one version of a traffic split (X-Route-Key)
    traceparent: str | None = None  # W3C trace context of the request's span where it arrived
    client_id: str | None = None  # the client's own request id (OIP `id`), echoed back
    parent: str | None = None  # a pipeline step's: the id of the pipeline request it serves
    shadow: bool = False  # a shadow copy: its answer is compared, never returned
    max_outputs: int = 0  # a generative model's: most parts its sequence may make (0: the model's generate.max_outputs)

    def step(self, model: str, inputs: dict[str, np.ndarray], version: str | None, lane: int) -> InferenceRequest:
        """The request one pipeline step makes of `model`: the same deadline, tenant, ids and
        trace, its own inputs and lane (the step model's lane of the same name); its tenant's
        quotas are counted once, for this request."""
        return self._replace(model=model, version=version, inputs=inputs, lane=lane, parent=self.parent or self.id)

    def shadow_copy(self, version: str, lane: int, deadline_at: float) -> InferenceRequest:
        """The copy of this request a shadow version gets (its own lane and deadline: spare
        capacity only): compared with the primary's answer, never returned."""
        return self._replace(version=version, lane=lane, deadline_at=deadline_at, shadow=True)

    @property
    def counted(self) -> bool:
        """Whether this request counts against its tenant's quotas (a step or a shadow counts in
        its parent's, or not at all)."""
        return self.parent is None and not self.shadow
