"""Which tenants a model's full lanes refuse, so that a request is refused before its body is read.

A model's scheduler is the one judge of a full lane (`BatchQueue`'s fair admission: the tenant
holding the most places beyond its share is refused). `FullLanes` watches its queue after every
change and publishes, per lane, the tenants a new request would be refused for now (with the places
each holds and the Retry-After), only when that set changes: an ingress process keeps the latest
of these (`LaneState`, engine/envelope.py) and refuses those tenants' requests at once, with the
same error (`lane_full`) the scheduler would answer after the request crossed to the engine. The
engine stays the judge: a request the ingress lets through is decided there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from servewell.errors import Overloaded


@dataclass(frozen=True, slots=True)
class LaneRefusals:
    """A full lane's refusals as published: tenant -> places it holds; the Retry-After they get."""

    held: dict[str, int]
    depth: int  # requests queued in the lane
    retry_after_s: float


#: (lane index, refusals now or None once the lane refuses nobody).
Publish = Callable[[int, LaneRefusals | None], None]


def lane_full(model: str, lane: str, depth: int, tenant: str, held: int, retry_after_s: float) -> Overloaded:
    """The refusal of `tenant`'s request by `model`'s full `lane` (`depth` queued, `held` of them its),
    wherever it is decided: the scheduler, or an ingress from the published board."""
    who = f"tenant '{tenant}'" if tenant else "the anonymous tenant"
    return Overloaded(f"model '{model}' has {depth} requests queued in lane '{lane}', its limit; {who} holds "
                      f"{held} of them, the most beyond its share", retry_after_s=retry_after_s, tenant=tenant)


class FullLanes:
    """Publishes the refusals of one scheduler's full lanes when they change."""

    __slots__ = ("_publish", "_published")

    def __init__(self, publish: Publish | None) -> None:
        self._publish = publish
        self._published: dict[int, frozenset[str]] = {}

    def refresh(self, queue: Any, lanes: int, retry_after_s: Callable[[], float]) -> None:
        """Look at `queue`'s lanes (a `BatchQueue`) after a change; publish what changed. Costs
        nothing while no lane is full and none was."""
        publish = self._publish
        if publish is None:
            return
        bound = queue.max_queue_size
        for lane in range(lanes):
            full = queue.depth(lane) >= bound
            if not full and lane not in self._published:
                continue
            refused = queue.refused_tenants(lane) if full else frozenset()
            if refused == self._published.get(lane, frozenset()):
                continue
            if refused:
                self._published[lane] = refused
                places = queue.places(lane)
                publish(lane, LaneRefusals({t: places.get(t, 0) for t in refused}, queue.depth(lane), retry_after_s()))
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
