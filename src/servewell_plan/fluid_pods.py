"""The pods of a fluid fleet: one slot per pod, with its lifecycle state, zone, age and backlog.

A pod is created STARTING (pod start, then the replica's cold start), becomes READY, is DRAINING once
a scale-down removed it while it still held a backlog, and FREE when gone. Every change of state goes
through one method, so the counts and the cached list of ready pods stay consistent.

New pods go to the zone with the fewest live pods among the zones not lost. After a ZONE_LOST the
zone stays lost for the rest of the run (unless every zone is lost: a one-zone fleet restarts in
place).
"""

from __future__ import annotations

import math
from enum import IntEnum

import numpy as np


class PodState(IntEnum):
    """Where a pod slot is in its lifecycle."""

    FREE = 0
    STARTING = 1
    READY = 2
    DRAINING = 3


# Plain ints for the hot path (an IntEnum member lookup costs a Python call on 3.11).
_FREE, _STARTING, _READY, _DRAINING = (int(s) for s in PodState)


class PodPool:
    """Every pod slot of one fleet. Slots are reused; arrays grow when all are taken."""

    def __init__(self, zones: int, start_delay_s: float) -> None:
        self.zones = max(1, zones)
        self.start_delay_s = start_delay_s
        self.lost_zones: set[int] = set()
        size = 16
        self.state = np.zeros(size, dtype=np.int8)
        self.ready_at_s = np.full(size, np.inf)
        self.zone = np.zeros(size, dtype=np.intp)
        self.serial = np.zeros(size, dtype=np.int64)  # creation order: larger is newer
        self.backlog = np.zeros(size)  # requests waiting beyond what the pod serves per step
        self.inflight = np.zeros(size)  # requests inside the pod at its last step's load (Little's law)
        self.slo_share = np.zeros(size)  # share of its last step's requests answered within the SLO
        self.cpu = np.zeros(size)  # what it reported at the last sync's step: CPU utilization
        self.queue_depth = np.zeros(size)  # ... and servewell_queue_depth
        self._next_serial = 0
        self._ready: np.ndarray | None = None
        self.uniform = True  # every ready pod holds the same backlog
        self.next_ready_s = np.inf

    # -- queries -------------------------------------------------------------------------------

    def ready_slots(self) -> np.ndarray:
        """Slots of the ready pods, in slot order (cached until the next change)."""
        if self._ready is None:
            self._ready = np.flatnonzero(self.state == _READY)
        return self._ready

    def slots(self, state: int) -> np.ndarray:
        """Slots in `state` (a PodState)."""
        return np.flatnonzero(self.state == state)

    def count(self, state: int) -> int:
        """How many pods are in `state` (a PodState)."""
        return int(np.count_nonzero(self.state == state))

    def paid(self) -> int:
        """Pods that cost money: starting, ready or draining."""
        return int(np.count_nonzero(self.state != _FREE))

    def starting(self) -> int:
        """Pods created and not ready yet."""
        return int(np.count_nonzero(self.state == _STARTING))

    # -- transitions ---------------------------------------------------------------------------

    def create(self, count: int, now_s: float, *, ready: bool = False) -> None:
        """`count` new pods, STARTING until now + the start delay (READY at once with `ready`),
        spread over the zones still up (each to the least-filled one)."""
        if count <= 0:
            return
        free = np.flatnonzero(self.state == _FREE)
        while free.size < count:
            self._grow()
            free = np.flatnonzero(self.state == _FREE)
        slots = free[:count]
        self.zone[slots] = self._pick_zones(count)
        self.state[slots] = _READY if ready else _STARTING
        self.ready_at_s[slots] = now_s if ready else now_s + self.start_delay_s
        self.serial[slots] = np.arange(self._next_serial, self._next_serial + count)
        self._next_serial += count
        for per_slot in (self.backlog, self.inflight, self.cpu, self.queue_depth):
            per_slot[slots] = 0.0
        self.slo_share[slots] = 1.0
        if ready:
            self._changed()
        self._update_next_ready()

    def become_ready(self, now_s: float) -> None:
        """STARTING pods whose start delay has passed are READY."""
        due = (self.state == _STARTING) & (self.ready_at_s <= now_s)
        if due.any():
            self.state[due] = _READY
            self._changed()
        self._update_next_ready()

    def remove(self, count: int) -> None:
        """Scale down by `count`: the ReplicaSet deletes pods not ready yet first, then the newest
        ready ones; a ready pod keeps serving its backlog (DRAINING) and costs until it is empty."""
        starting = self.slots(_STARTING)
        ready = self.ready_slots()
        order = np.concatenate((starting[np.argsort(-self.serial[starting])], ready[np.argsort(-self.serial[ready])]))
        victims = order[:count]
        is_ready = self.state[victims] == _READY
        self.state[victims[~is_ready]] = _FREE
        self.state[victims[is_ready]] = _DRAINING
        self._changed()
        self._update_next_ready()

    def drain(self, served: float) -> None:
        """Every DRAINING pod serves up to `served` of its backlog this step; empty ones are FREE."""
        draining = self.slots(_DRAINING)
        if draining.size:
            left = np.maximum(self.backlog[draining] - served, 0.0)
            self.backlog[draining] = left
            self.state[draining[left <= 0.0]] = _FREE

    def kill(self, slots: np.ndarray) -> float:
        """The pods in `slots` die: returns the requests lost with them (backlog and in flight)."""
        lost = float(self.backlog[slots].sum() + self.inflight[slots].sum())
        self.state[slots] = _FREE
        self.backlog[slots] = 0.0
        self._changed()
        self._update_next_ready()
        return lost

    def lose_zone(self, zone: int) -> np.ndarray:
        """Zone `zone` is gone: new pods avoid it. Returns the slots of its live pods."""
        self.lost_zones.add(zone)
        return np.flatnonzero((self.state != _FREE) & (self.zone == zone))

    # -- internals -----------------------------------------------------------------------------

    def _changed(self) -> None:
        self._ready = None
        ready = self.ready_slots()
        self.uniform = bool(ready.size == 0 or np.ptp(self.backlog[ready]) == 0.0)

    def _grow(self) -> None:
        size = self.state.size
        self.state = np.concatenate((self.state, np.zeros(size, dtype=np.int8)))
        self.ready_at_s = np.concatenate((self.ready_at_s, np.full(size, np.inf)))
        self.zone = np.concatenate((self.zone, np.zeros(size, dtype=np.intp)))
        self.serial = np.concatenate((self.serial, np.zeros(size, dtype=np.int64)))
        self.backlog = np.concatenate((self.backlog, np.zeros(size)))
        self.inflight = np.concatenate((self.inflight, np.zeros(size)))
        self.slo_share = np.concatenate((self.slo_share, np.zeros(size)))
        self.cpu = np.concatenate((self.cpu, np.zeros(size)))
        self.queue_depth = np.concatenate((self.queue_depth, np.zeros(size)))

    def _update_next_ready(self) -> None:
        starting = self.state == _STARTING
        self.next_ready_s = float(self.ready_at_s[starting].min()) if starting.any() else math.inf

    def _pick_zones(self, count: int) -> list[int]:
        allowed = [z for z in range(self.zones) if z not in self.lost_zones] or list(range(self.zones))
        counts = np.bincount(self.zone[self.state != _FREE], minlength=self.zones).tolist()
        picked = []
        for _ in range(count):
            zone = min(allowed, key=lambda z: (counts[z], z))
            counts[zone] += 1
            picked.append(zone)
        return picked
