"""One replica (pod) of the request-level simulator: where it is in its lifecycle and which requests
it holds. The request flow through it lives in `des_engine`; this is the state only.

Requests are ints (their index in the run's per-request lists). A pod holds them in four places:
the one its front is serving (`front_rid`), the front's FIFO (`front_queue`, of which the first
`front_gate` were already waiting when the front's current wake-up began), the batcher's two
lanes (`urgent`, `normal`) and the batches its instances are running (`running`).
"""

from __future__ import annotations

from collections import deque
from enum import IntEnum


class PodState(IntEnum):
    """Where a pod is in its lifecycle. GONE is 0 so that `if pod.state:` reads "still alive"."""

    GONE = 0  # killed, or drained after a scale-down: costs nothing, its pending events are stale
    STARTING = 1  # created: pod start, then the replica's cold start
    READY = 2  # behind the balancer
    DRAINING = 3  # removed by a scale-down: out of the balancer, finishing what it holds


# Plain ints for the hot path (an IntEnum comparison costs a Python call on 3.11).
GONE, STARTING, READY, DRAINING = (int(s) for s in PodState)


class Pod:
    """One replica's state. `pos` is its index in the fleet's ready list (-1 when not ready)."""

    __slots__ = (
        "busy_base",
        "busy_threads",
        "busy_threads_batch",
        "cpu_marks",
        "depth_samples",
        "free",
        "front_gate",
        "front_queue",
        "front_rid",
        "idle_since",
        "inflight",
        "normal",
        "pos",
        "running",
        "serial",
        "state",
        "timer_s",
        "urgent",
        "zone",
    )

    def __init__(self, serial: int, zone: int, instances: int) -> None:
        self.serial = serial  # creation order: larger is newer
        self.zone = zone
        self.state = STARTING
        self.pos = -1
        self.inflight = 0  # requests the balancer sent here and that are not answered, refused or lost
        self.idle_since = 0.0  # when inflight last fell to 0 (or the pod became ready)
        self.front_rid = -1  # the request the front is serving, -1 when idle
        self.front_queue: deque[int] = deque()
        self.front_gate = 0  # requests at the head of front_queue served in the current wake-up
        self.urgent: deque[int] = deque()
        self.normal: deque[int] = deque()
        self.free = instances  # instances not running a batch
        self.running: list[list[int]] = []
        self.timer_s = -1.0  # when the batcher's window timer is due (-1: none pending)
        # CPU bookkeeping: busy CPU-seconds so far = busy_base + busy_threads * the front's clock
        # + busy_threads_batch * the batches' clock (see des_engine; on a shared node each weight
        # class has its own virtual clock, des_node).
        self.busy_base = 0.0
        self.busy_threads = 0
        self.busy_threads_batch = 0
        self.cpu_marks: deque[tuple[float, float]] = deque()  # (time, busy CPU-seconds) at syncs
        self.depth_samples: deque[tuple[float, int]] = deque()  # (time, waiting) at scrapes

    def waiting(self) -> int:
        """Requests waiting in the pod: the front's queue and the batcher's (servewell_queue_depth)."""
        return len(self.front_queue) + len(self.urgent) + len(self.normal)

    def busy_cpu_s(self, clock: tuple[float, float]) -> float:
        """Busy CPU-seconds since the pod was created, with the run's CPU clocks (front, batches) at
        `clock`."""
        return self.busy_base + self.busy_threads * clock[0] + self.busy_threads_batch * clock[1]

    def take_requests(self) -> list[int]:
        """Every request the pod holds, removed from it (the pod dies with them)."""
        rids = [] if self.front_rid < 0 else [self.front_rid]
        rids.extend(self.front_queue)
        rids.extend(self.urgent)
        rids.extend(self.normal)
        for batch in self.running:
            rids.extend(batch)
        self.front_rid = -1
        self.front_gate = 0
        self.front_queue.clear()
        self.urgent.clear()
        self.normal.clear()
        self.running.clear()
        self.inflight = 0
        return rids
