"""The shared machine of `FleetSpec.node_cores`: every replica's CPU work on one node of that many
cores, processor sharing.

Each job is W seconds of work at full speed on `threads` threads. While the runnable threads of all
jobs add up to T, every job progresses at rate min(1, cores / T): W is done after W / rate seconds
of wall time at a constant rate. Since every job progresses at the same rate, the node keeps one
virtual clock V (dV/dt = rate): a job started at V0 ends when V reaches V0 + W. Jobs wait in a heap
by that virtual end, so a change of load costs O(log n), not a pass over every job.
"""

from __future__ import annotations

import heapq
import math
from enum import IntEnum

from servewell.plan.des_pod import Pod

#: Jobs whose virtual end is within this of the clock finish together (float rounding).
_EPS = 1e-12


class JobKind(IntEnum):
    """What a node job is, so the simulator knows what its end means."""

    FRONT = 0  # a replica's front serving one request
    BATCH = 1  # one instance running one batch
    EXTRA = 2  # the balancer's CPU per request: only contends
    CLIENT = 3  # the load generator sending one request (`batch` holds its id): one process, in its path


FRONT, BATCH, EXTRA, CLIENT = (int(k) for k in JobKind)


class NodeJob:
    """One job on the node: whose it is (`pod`, None for EXTRA) and, for a BATCH, its requests."""

    __slots__ = ("batch", "cancelled", "kind", "pod", "threads", "v_end")

    def __init__(self, kind: int, pod: Pod | None, batch: list[int] | None, threads: int) -> None:
        self.kind = kind
        self.pod = pod
        self.batch = batch
        self.threads = threads
        self.v_end = 0.0
        self.cancelled = False


class SharedNode:
    """The node's jobs and its virtual clock. The simulator asks `next_finish_s` after each change
    and calls `pop_done` at that time (`gen` tells a current wake-up from a stale one)."""

    __slots__ = ("_heap", "_seq", "cores", "gen", "last_t", "scheduled_s", "speed", "threads", "vtime")

    def __init__(self, cores: float) -> None:
        self.cores = cores
        self.vtime = 0.0
        self.last_t = 0.0
        self.threads = 0
        self.speed = 1.0
        self._heap: list[tuple[float, int, NodeJob]] = []
        self._seq = 0
        self.gen = 0  # bumped each time the simulator schedules a new wake-up
        self.scheduled_s = math.inf  # the wake-up currently scheduled

    def clock(self, t: float) -> float:
        """The virtual clock at `t` (not before the last change)."""
        return self.vtime + (t - self.last_t) * self.speed

    def _advance(self, t: float) -> None:
        self.vtime += (t - self.last_t) * self.speed
        self.last_t = t

    def _rescale(self) -> None:
        threads = self.threads
        self.speed = 1.0 if threads <= self.cores else self.cores / threads

    def add(self, t: float, job: NodeJob, work_s: float) -> float:
        """Start `job` at `t` with `work_s` of work; returns the virtual clock at its start."""
        self._advance(t)
        start = self.vtime
        job.v_end = start + work_s
        self._seq += 1
        heapq.heappush(self._heap, (job.v_end, self._seq, job))
        self.threads += job.threads
        self._rescale()
        return start

    def cancel_pod(self, t: float, pod: Pod) -> None:
        """Every job of `pod` stops (the pod died): they no longer take CPU."""
        self._advance(t)
        for _, _, job in self._heap:
            if job.pod is pod and not job.cancelled:
                job.cancelled = True
                self.threads -= job.threads
        self._rescale()

    def next_finish_s(self) -> float:
        """When the next job finishes if nothing changes (inf: no job)."""
        heap = self._heap
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)
        if not heap:
            return math.inf
        return self.last_t + max(0.0, heap[0][0] - self.vtime) / self.speed

    def pop_done(self, t: float) -> list[NodeJob]:
        """The jobs finished at `t`, the wake-up `next_finish_s` announced: the first one is taken
        even if float rounding left a sliver of its work."""
        self._advance(t)
        heap = self._heap
        done: list[NodeJob] = []
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)
        if heap:
            self.vtime = max(self.vtime, heap[0][0])
        limit = self.vtime + _EPS * max(1.0, self.vtime)
        while heap and heap[0][0] <= limit:
            job = heapq.heappop(heap)[2]
            if not job.cancelled:
                done.append(job)
                self.threads -= job.threads
        self._rescale()
        return done
