"""Who waits to join a generative model's running batch, and who joins next: the sequences'
waiting room, as `BatchQueue` is the batcher's (pure: no clock, event loop or worker here).

`SequenceScheduler` (engine/sequences.py) drives it: it asks for the next joins whenever an
instance has free places and keeps the step loop, the parts and the endings. The join rules live
here alone:

- a lane holds at most `generate.max_waiting` sequences (a flood of one lane never shuts out
  another): past it, 503 `overloaded` naming the tenant;
- the first lane goes first and has `urgent_sequences` places of each instance the other lanes
  cannot take, so an urgent sequence joins at the next step however busy the model is;
- within a lane, the tenant with the fewest running sequences per unit of weight goes next
  (tenants share the steps by their weights), then the one whose head waited longest;
- one step's joins carry at most `MAX_STATE_BYTES` of inputs together (they cross the worker's
  pipe as one message); the rest join at the next step.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from servewell.config.generate import MAX_STATE_BYTES, GenerateSettings
from servewell.engine.request import InferenceRequest
from servewell.errors import Overloaded


class Waiting(Protocol):
    """What the waiting room reads of a sequence."""

    @property
    def request(self) -> InferenceRequest: ...

    @property
    def enqueued_at(self) -> float: ...

    @property
    def outcome(self) -> asyncio.Future[Any]: ...


S = TypeVar("S", bound=Waiting)


def input_bytes(request: InferenceRequest) -> int:
    """The bytes a sequence's inputs carry to the worker when it joins."""
    return sum(int(np.asarray(array).nbytes) for array in request.inputs.values())


class SequenceQueue(Generic[S]):
    """The waiting sequences of one generative model, per lane and tenant, and the running ones'
    count per tenant (what the join order weighs)."""

    def __init__(self, name: str, lanes: tuple[str, ...], settings: GenerateSettings,
                 weight_of: Callable[[str], float] | None = None) -> None:
        self.name = name
        self.lanes = lanes
        self.settings = settings
        self._weight_of = weight_of or (lambda tenant: 1.0)
        self._waiting: list[dict[str, deque[S]]] = [{} for _ in lanes]  # lane -> tenant -> queue
        self.count = 0  # waiting, all lanes
        self._running_by_tenant: dict[str, int] = {}

    @property
    def urgent_places(self) -> int:
        """Places of each instance's `max_sequences` only the first lane may take."""
        if len(self.lanes) < 2:
            return 0
        reserved = self.settings.urgent_sequences
        if reserved is None:
            reserved = max(1, self.settings.max_sequences // 8)
        return min(reserved, self.settings.max_sequences - 1)

    def lane_of(self, request: InferenceRequest) -> int:
        """The lane a request waits in (an unknown one: the last)."""
        return request.lane if 0 <= request.lane < len(self.lanes) else len(self.lanes) - 1

    def lane_depths(self) -> dict[str, int]:
        """Sequences waiting to join, per lane (the model's `servewell_queue_depth`)."""
        return {name: sum(len(queue) for queue in self._waiting[i].values()) for i, name in enumerate(self.lanes)}

    def tenant_depth(self, tenant: str) -> int:
        """Sequences of `tenant` waiting to join (the tenant's per-model queue quota counts them)."""
        return sum(len(lane.get(tenant, ())) for lane in self._waiting)

    def check_room(self, lane: int, tenant: str) -> None:
        """503 `overloaded` when `lane` already holds `generate.max_waiting` sequences."""
        waiting = sum(len(queue) for queue in self._waiting[lane].values())
        if waiting >= self.settings.max_waiting:  # per lane: a flood of one lane never shuts out another
            raise Overloaded(f"model '{self.name}' has {waiting} sequences waiting to join in lane "
                             f"'{self.lanes[lane]}', its generate.max_waiting", tenant=tenant)

    def add(self, seq: S) -> None:
        """`seq` waits in its request's lane (`check_room` first)."""
        self._waiting[seq.request.lane].setdefault(seq.request.tenant, deque()).append(seq)
        self.count += 1

    def waiting(self) -> Iterator[S]:
        """Every waiting sequence (a copy of the queues: the caller may end them)."""
        return iter([seq for lane in self._waiting for queue in lane.values() for seq in queue])

    def next_joins(self, free: int) -> list[S]:
        """Take the sequences that join now, up to `free` places, in join order (the module
        docstring); each is counted running for its tenant. Sequences whose outcome is already
        done are dropped on the way."""
        joins: list[S] = []
        if free <= 0 or self.count == 0:
            return joins
        urgent = self.urgent_places
        carried = 0  # bytes of inputs this step's message carries (bounded: it crosses the pipe whole)
        for lane, tenants in enumerate(self._waiting):
            room = free - len(joins) - (urgent if lane > 0 else 0)
            while room > 0 and tenants:
                tenant = self._tenant_next(tenants)
                size = input_bytes(tenants[tenant][0].request)
                if joins and carried + size > MAX_STATE_BYTES:
                    return joins  # the rest join at the next step
                carried += size
                seq = self._pop(tenants, tenant)
                if seq.outcome.done():
                    continue
                self._running_by_tenant[tenant] = self._running_by_tenant.get(tenant, 0) + 1
                joins.append(seq)
                room -= 1
        return joins

    def remove(self, seq: S) -> None:
        """`seq` ended while it waited."""
        lane = self._waiting[seq.request.lane]
        queue = lane.get(seq.request.tenant)
        if queue is not None and seq in queue:
            queue.remove(seq)
            self.count -= 1
            if not queue:
                del lane[seq.request.tenant]

    def stopped_running(self, tenant: str) -> None:
        """A running sequence of `tenant` ended."""
        left = self._running_by_tenant.get(tenant, 1) - 1
        if left:
            self._running_by_tenant[tenant] = left
        else:
            self._running_by_tenant.pop(tenant, None)

    def _tenant_next(self, tenants: dict[str, deque[S]]) -> str:
        """Whose sequence of one lane joins next: the tenant with the fewest running sequences per
        unit of weight, then the one whose head waited longest."""
        def share(tenant: str) -> tuple[float, float]:
            weight = max(self._weight_of(tenant), 1e-9)
            return (self._running_by_tenant.get(tenant, 0) / weight, tenants[tenant][0].enqueued_at)

        return min(tenants, key=share)

    def _pop(self, tenants: dict[str, deque[S]], tenant: str) -> S:
        queue = tenants[tenant]
        seq = queue.popleft()
        self.count -= 1
        if not queue:
            del tenants[tenant]
        return seq
