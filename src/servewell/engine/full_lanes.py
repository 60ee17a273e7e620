"""Which tenants a model's full lanes refuse, so that a request is refused before its body is read.

A model's scheduler is the one judge of a full lane (`BatchQueue`'s fair admission: the tenant
holding the most places beyond its share is refused). `FullLanes` watches its queue after every
change and publishes, per lane that is full or nearly full (at most half its places free, or a
batch's), the tenants a request would be refused for once it is full (with the places each
holds), the places still free and the Retry-After, only when these change: an ingress process
keeps the latest of these (`LaneState`, engine/envelope.py) and refuses those tenants' requests
at once, with the same error (`lane_full`) the scheduler would answer after the request crossed
to the engine, when the lane is full or its share of the places still free is promised to
requests that it is still reading or decoding (engine/promised.py). The engine stays the judge:
a request the ingress lets through is decided there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from servewell.errors import Overloaded


@dataclass(frozen=True, slots=True)
class LaneRefusals:
    """A (nearly) full lane's refusals as published: tenant -> places it holds; the Retry-After they get."""

    held: dict[str, int]
    depth: int  # requests queued in the lane
    retry_after_s: float
    free: int = 0  # places left before it is full


#: (lane index, refusals now, or None once the lane is far from full).
Publish = Callable[[int, LaneRefusals | None], None]


def lane_full(model: str, lane: str, depth: int, tenant: str, held: int, retry_after_s: float,
              promised: int = 0) -> Overloaded:
    """The refusal of `tenant`'s request by `model`'s full `lane` (`depth` queued, `held` of them its,
    `promised` more places promised to requests on their way in: engine/promised.py), wherever it
    is decided: the scheduler, or an ingress from the published board."""
    who = f"tenant '{tenant}'" if tenant else "the anonymous tenant"
    taken = f"{depth} requests queued in lane '{lane}'" + (f" and {promised} on their way in" if promised else "")
    return Overloaded(f"model '{model}' has {taken}, its limit; {who} holds {held} of those queued, the most beyond "
                      "its share", retry_after_s=retry_after_s, tenant=tenant)


class FullLanes:
    """Publishes the refusals of one scheduler's full lanes when they change."""

    __slots__ = ("_publish", "_published")

    def __init__(self, publish: Publish | None) -> None:
        self._publish = publish
        self._published: dict[int, tuple[frozenset[str], int]] = {}  # lane -> (refused, free) as published

    def refresh(self, queue: Any, lanes: int, retry_after_s: Callable[[], float], batch: int = 1) -> None:
        """Look at `queue`'s lanes (a `BatchQueue`) after a change; publish what changed. A lane is
        nearly full with at most half its places free, or a batch's (`batch` rows): the places a
        batch leaving frees, which arrivals on their way in may take at once. Costs nothing while
        no lane is (nearly) full and none was."""
        publish = self._publish
        if publish is None:
            return
        bound = queue.max_queue_size
        near = max(batch, bound // 2)
        for lane in range(lanes):
            free = max(0, bound - queue.depth(lane))
            if free > near and lane not in self._published:
                continue
            refused = queue.refused_tenants(lane) if free <= near else frozenset()
            state = (refused, free)
            if state == self._published.get(lane, (frozenset(), free)):
                continue
            if refused:
                self._published[lane] = state
                places = queue.places(lane)
                publish(lane, LaneRefusals({t: places.get(t, 0) for t in refused}, queue.depth(lane), retry_after_s(),
                                           free))
            else:
                self._published.pop(lane, None)
                publish(lane, None)

    def clear(self) -> None:
        """The model takes no more requests here: nothing stays published."""
        if self._publish is not None:
            for lane in list(self._published):
                self._publish(lane, None)
        self._published.clear()


#: (model, version, lane index, refusals or None): what one scheduler published.
BoardChange = tuple[str, str, int, "LaneRefusals | None"]


class FullLaneBoard:
    """Every model's published full lanes, for the door to hand on to the ingress processes: the
    current state for one that connects, each change as it comes for the others."""

    def __init__(self) -> None:
        self.lanes: dict[tuple[str, str, int], LaneRefusals] = {}
        self.listeners: list[Callable[[BoardChange], None]] = []

    def publisher(self, model: str, version: str) -> Publish:
        """What the scheduler of `model`'s `version` publishes through."""
        def publish(lane: int, refusals: LaneRefusals | None) -> None:
            key = (model, version, lane)
            if refusals is None:
                if self.lanes.pop(key, None) is None:
                    return
            else:
                self.lanes[key] = refusals
            for listener in self.listeners:
                listener((model, version, lane, refusals))
        return publish
