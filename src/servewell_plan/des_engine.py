"""The request-level simulator's event loop: requests through the balancer, each replica's front
and batcher, and the fleet's faults, autoscaler syncs and scrapes.

One heap of events `(time, seq, kind, a, b)`; `seq` breaks ties in insertion order, so a run is a
pure function of its inputs and seed. Open-loop arrivals are drawn up front and merged with the
heap rather than pushed into it. A pod's pending events name the pod: once it is GONE they are
stale and skipped. On a shared node every CPU job goes through `SharedNode`, which announces one
wake-up at a time (`gen` marks the current one).

The hot path is plain on purpose (locals, ints for kinds and states, no per-request objects):
a run of 200,000 requests should take seconds.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from servewell_plan.des_control import handle_fleet_event, start_fleet_events
from servewell_plan.des_fleet import PodFleet
from servewell_plan.des_node import (
    BATCH,
    BATCH_CLASS,
    CLIENT,
    EXTRA,
    FRONT,
    NORMAL_CLASS,
    NodeJob,
    SharedNode,
    nice_weight,
)
from servewell_plan.des_pod import DRAINING, Pod
from servewell_plan.des_result import ANSWERED, FAILED, REFUSED
from servewell_plan.des_scaling import ScalingProbe
from servewell_plan.model import BalancerPolicy, Fault, FleetSpec

# Event kinds of the request flow, most frequent first (the fleet's are des_control's, from 6 up).
_FRONT_DONE, _BATCH_DONE, _ARRIVE, _TIMER, _NODE, _WOKEN = range(6)
#: A request still in flight (its status becomes one of des_result's outcomes), and one whose batch
#: is done and whose answer is crossing the front on its way out.
_IN_FLIGHT, _ANSWERING = -1, -2
#: A closed-loop client refused without any time passing (no ready replica, zero latency) waits
#: this long before it sends again, so a fleet with nothing ready does not spin at one instant.
RETRY_FLOOR_S = 1e-3
#: Random draws fetched from numpy at a time (a call per draw would dominate the run).
_DRAW_BLOCK = 4096


class RandomDraws:
    """A stream of floats from one numpy draw function, fetched in blocks."""

    __slots__ = ("_buf", "_draw", "_i")

    def __init__(self, draw: Callable[[int], np.ndarray]) -> None:
        self._draw = draw
        self._buf: list[float] = []
        self._i = 0

    def next(self) -> float:
        """The next draw."""
        i = self._i
        if i == len(self._buf):
            self._buf = self._draw(_DRAW_BLOCK).tolist()
            i = 0
        self._i = i + 1
        return self._buf[i]


def jitter_draws(gen: np.random.Generator, cv: float) -> RandomDraws | None:
    """Lognormal factors of mean 1 and coefficient of variation `cv` (None when cv is 0)."""
    if cv <= 0:
        return None
    sigma = math.sqrt(math.log1p(cv * cv))
    return RandomDraws(lambda n: gen.lognormal(-sigma * sigma / 2, sigma, n))


@dataclass(frozen=True, slots=True)
class LoadInput:
    """The load of one run, as the engine takes it: open-loop arrivals (sorted) with their urgent
    flags, or `clients` closed-loop clients; either way nothing is sent at or after `horizon_s`."""

    horizon_s: float
    arrivals_s: list[float]
    urgent: list[bool]
    clients: int
    think_s: float
    faults: tuple[Fault, ...]


@dataclass(slots=True)
class RunOutput:
    """What the engine hands back: per-request lists and per-bin integrals."""

    arrival_s: list[float]
    latency_s: list[float]
    status: list[int]
    ready_area: list[float]  # pod-seconds ready, per bin
    paid_area: list[float]  # pod-seconds starting, ready or draining, per bin
    depth_sum: list[float]  # per bin: sum over its scrapes of waiting requests per ready pod
    depth_n: list[int]  # per bin: scrapes with a ready pod
    replica_cpu_s: float  # CPU seconds of work the replicas started (fronts and batches)


class FleetRun:
    """One run of a fleet under one load (use once: `run()`)."""

    def __init__(self, fleet: FleetSpec, load: LoadInput, seeds: list[np.random.SeedSequence], bin_s: float) -> None:
        r = fleet.replica
        self.load = load
        self.horizon_s = load.horizon_s
        self.bin_s = bin_s
        bins = max(1, math.ceil(load.horizon_s / bin_s - 1e-9))
        self.fleet = PodFleet(fleet.zones, r.instances, bin_s, load.horizon_s, bins)
        self.policy = fleet.balancer
        self.start_delay_s = fleet.pod_start_s + r.cold_start_s
        self.front_s, self.alpha_s, self.beta_s, self.threads = r.front_s, r.alpha_s, r.beta_s, r.threads
        # the front's work per request and per wake-up, on the request's way in and its answer's way out
        out = r.front_out_share
        self.front_in_s, self.front_out_s = r.front_s * (1 - out), r.front_s * out
        self.wake_in_s, self.wake_out_s = r.front_fixed_s * (1 - out), r.front_fixed_s * out
        self.has_front = r.front_s > 0 or r.front_fixed_s > 0
        self.answers_cross_front = self.has_front and out > 0
        self.max_batch, self.max_wait_s, self.max_queue = r.max_batch_size, r.max_wait_s, r.max_queue
        self.extra_latency_s = r.overhead_s + fleet.balancer_s
        # a request that finds its replica idle pays extra CPU and delay (ReplicaModel.idle_cost)
        self.idle_cost, self.idle_extra = bool(r.idle_cost), r.idle_extra
        jitter_gen, balancer_gen, fault_gen = (np.random.default_rng(s) for s in seeds)
        self.front_jit = jitter_draws(jitter_gen, r.jitter_cv)
        self.batch_jit = self.front_jit
        self.balancer_draws = RandomDraws(balancer_gen.random)
        self.fault_gen = fault_gen
        self.node = SharedNode(fleet.node_cores, nice_weight(r.worker_nice)) if fleet.node_cores > 0 else None
        self.extra_cpu_s = fleet.balancer_cpu_s if self.node is not None else 0.0
        # the load generator on the same node is one process: each request waits for it to send
        self.client_cpu_s = fleet.client_cpu_s if self.node is not None else 0.0
        self.client_busy = False
        self.client_queue: deque[int] = deque()
        self.probe = ScalingProbe(fleet.autoscaler, r, fleet.replicas) if fleet.autoscaler is not None else None
        self.track_waits = self.probe is not None and self.probe.track_waits
        self.desired = fleet.replicas
        self.closed = load.clients > 0
        n = len(load.arrivals_s)
        self.arr_t: list[float] = list(load.arrivals_s)
        self.lat: list[float] = [math.nan] * n
        self.status: list[int] = [_IN_FLIGHT] * n
        self.enq: list[float] = [0.0] * n
        self.urgent: list[bool] = list(load.urgent)
        self.replica_cpu_s = 0.0
        self.rr = -1
        self.heap: list[tuple[float, int, int, Any, Any]] = []
        self.seq = itertools.count()
        self.depth_sum = [0.0] * bins
        self.depth_n = [0] * bins
        self.fleet.create(0.0, fleet.replicas, ready=True)

    def push(self, t: float, kind: int, a: Any = None, b: Any = None) -> None:
        """Schedule an event."""
        heapq.heappush(self.heap, (t, next(self.seq), kind, a, b))

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> RunOutput:
        """Simulate until every request sent before the horizon is answered, refused or lost."""
        horizon = self.horizon_s
        for _ in range(self.load.clients):
            self.push(0.0, _ARRIVE)
        start_fleet_events(self)
        heap, pop, node = self.heap, heapq.heappop, self.node
        times = self.arr_t if not self.closed else []
        count, i = len(times), 0
        next_arrival = times[0] if count else math.inf
        while True:
            if heap and heap[0][0] < next_arrival:
                t, _, kind, a, b = pop(heap)
                if kind == _FRONT_DONE:
                    if a.state:
                        self._front_done(a, t)
                elif kind == _BATCH_DONE:
                    if a.state:
                        self._batch_done(a, b, t)
                elif kind == _ARRIVE:
                    if t < horizon:
                        self._client_sends(t)
                elif kind == _TIMER:
                    if a.state and a.free:
                        self._dispatch(a, t)
                elif kind == _NODE:
                    if node is not None and b == node.gen:
                        self._node_wake(node, t)
                elif kind == _WOKEN:
                    self._woken(a, t, *b)
                else:
                    handle_fleet_event(self, kind, t, a)
            elif next_arrival < math.inf:
                self._arrive(next_arrival, i)
                i += 1
                next_arrival = times[i] if i < count else math.inf
            else:
                break
            if node is not None:
                self._reschedule(node)
        self.fleet.account(horizon)
        if _IN_FLIGHT in self.status or _ANSWERING in self.status:
            raise RuntimeError("the simulator ended with requests in flight")
        return RunOutput(
            self.arr_t, self.lat, self.status, self.fleet.ready_area, self.fleet.paid_area, self.depth_sum,
            self.depth_n, self.replica_cpu_s,
        )

    # -- requests ------------------------------------------------------------------------------

    def _client_sends(self, t: float) -> None:
        rid = len(self.arr_t)
        self.arr_t.append(t)
        self.lat.append(math.nan)
        self.status.append(_IN_FLIGHT)
        self.enq.append(0.0)
        self.urgent.append(False)
        self._arrive(t, rid)

    def _arrive(self, t: float, rid: int) -> None:
        if self.client_cpu_s > 0:
            if self.client_busy:
                self.client_queue.append(rid)
            else:
                self._start_client(t, rid)
            return
        self._send(t, rid)

    def _start_client(self, t: float, rid: int) -> None:
        assert self.node is not None
        self.client_busy = True
        self.node.add(t, NodeJob(CLIENT, None, [rid], 1), self.client_cpu_s)

    def _client_done(self, t: float, rid: int) -> None:
        self.client_busy = False
        if self.client_queue:
            self._start_client(t, self.client_queue.popleft())
        self._send(t, rid)

    def _send(self, t: float, rid: int) -> None:
        """The request leaves the client: the balancer picks its pod."""
        pod = self._pick()
        if pod is None:
            self._refuse(rid, t, None)
            return
        cold_cpu = delay = 0.0
        if self.idle_cost and pod.inflight == 0:
            cold_cpu, delay = self.idle_extra(t - pod.idle_since)
            if not self.has_front:
                cold_cpu, delay = 0.0, delay + cold_cpu  # no front to do the work: it is latency
        pod.inflight += 1
        self.fleet.ready_load[pod.pos] = pod.inflight
        if self.extra_cpu_s > 0 and self.node is not None:
            self.node.add(t, NodeJob(EXTRA, None, None, 1), self.extra_cpu_s)
        if delay > 0:  # the replica's processes wake up first (no CPU): the request enters after
            self.push(t + delay, _WOKEN, pod, (rid, cold_cpu))
        else:
            self._enter(pod, t, rid, cold_cpu)

    def _woken(self, pod: Pod, t: float, rid: int, cold_cpu: float) -> None:
        if pod.state:
            self._enter(pod, t, rid, cold_cpu)
        else:  # the pod died while waking: its requests were lost with it
            self.fail(rid, t)

    def _enter(self, pod: Pod, t: float, rid: int, cold_cpu: float) -> None:
        """The request reaches the replica's front (or its batcher, with no front)."""
        if self.has_front:
            if pod.front_rid < 0:
                self._start_front(pod, t, rid, self.wake_in_s + self.front_in_s + cold_cpu)
            else:  # another request got in while this one's replica woke: it shares that wake-up
                pod.front_queue.append(rid)
        else:
            self._to_batcher(pod, t, rid)

    def _pick(self) -> Pod | None:
        ready = self.fleet.ready
        n = len(ready)
        if n == 0:
            return None
        policy = self.policy
        if policy is BalancerPolicy.ROUND_ROBIN:
            i = self.rr + 1
            self.rr = i = i if i < n else 0
            return ready[i]
        if policy is BalancerPolicy.LEAST_CONNECTIONS:
            load = self.fleet.ready_load
            low = min(load)
            try:
                i = load.index(low, self.rr + 1)
            except ValueError:
                i = load.index(low)
            self.rr = i
            return ready[i]
        if n == 1:
            return ready[0]
        draws = self.balancer_draws
        i = min(int(draws.next() * n), n - 1)
        j = min(int(draws.next() * (n - 1)), n - 2)
        j += j >= i
        first, second = ready[i], ready[j]
        return second if second.inflight < first.inflight else first

    def _start_front(self, pod: Pod, t: float, rid: int, work: float) -> None:
        pod.front_rid = rid
        if self.front_jit is not None:
            work *= self.front_jit.next()
        self.replica_cpu_s += work
        node = self.node
        if node is None:
            pod.busy_base -= t
            pod.busy_threads += 1
            heapq.heappush(self.heap, (t + work, next(self.seq), _FRONT_DONE, pod, None))
        else:
            pod.busy_base -= node.add(t, NodeJob(FRONT, pod, None, 1), work)
            pod.busy_threads += 1

    def _front_done(self, pod: Pod, t: float) -> None:
        rid = pod.front_rid
        pod.busy_base += t if self.node is None else self.node.vtime(NORMAL_CLASS)
        pod.busy_threads -= 1
        queue = pod.front_queue
        if queue:
            # The loop's wake-up found these waiting: the next one is served in it; or a new
            # wake-up finds everything that arrived meanwhile and pays its fixed cost again.
            nxt = queue[0]
            out = self.status[nxt] == _ANSWERING
            work = self.front_out_s if out else self.front_in_s
            if pod.front_gate > 0:
                pod.front_gate -= 1
            else:
                pod.front_gate = len(queue) - 1
                work += self.wake_out_s if out else self.wake_in_s
            self._start_front(pod, t, queue.popleft(), work)
        else:
            pod.front_rid = -1
        if self.status[rid] == _ANSWERING:
            self._answer(pod, rid, t)
        else:
            self._to_batcher(pod, t, rid)

    def _to_batcher(self, pod: Pod, t: float, rid: int) -> None:
        if len(pod.normal) + len(pod.urgent) >= self.max_queue:
            self._refuse(rid, t, pod)
            return
        self.enq[rid] = t
        if self.urgent[rid]:
            pod.urgent.append(rid)
        else:
            pod.normal.append(rid)
        if pod.free:
            self._dispatch(pod, t)

    def _dispatch(self, pod: Pod, t: float) -> None:
        """servewell's window policy: while an instance is free, start a batch when it is full, the
        oldest request has waited max_wait_s, or an urgent request waits; otherwise set the timer."""
        urgent, normal, size = pod.urgent, pod.normal, self.max_batch
        while pod.free > 0 and (urgent or normal):
            if not urgent and len(normal) < size and self.max_wait_s > 0:
                due = self.enq[normal[0]] + self.max_wait_s
                if due > t:
                    if pod.timer_s != due:
                        pod.timer_s = due
                        self.push(due, _TIMER, pod)
                    return
            if size == 1:
                batch = [urgent.popleft() if urgent else normal.popleft()]
            else:
                batch = [urgent.popleft() for _ in range(min(size, len(urgent)))]
                if len(batch) < size and normal:
                    batch.extend(normal.popleft() for _ in range(min(size - len(batch), len(normal))))
            self._start_batch(pod, t, batch)

    def _start_batch(self, pod: Pod, t: float, batch: list[int]) -> None:
        pod.free -= 1
        pod.running.append(batch)
        work = self.alpha_s + self.beta_s * len(batch)
        if self.batch_jit is not None:
            work *= self.batch_jit.next()
        if self.track_waits and self.probe is not None:
            enq = self.enq
            self.probe.record_batch(t, sum(t - enq[r] for r in batch), len(batch))
        threads, node = self.threads, self.node
        self.replica_cpu_s += work * threads
        if node is None:
            pod.busy_base -= t * threads
            pod.busy_threads_batch += threads
            heapq.heappush(self.heap, (t + work, next(self.seq), _BATCH_DONE, pod, batch))
        else:
            pod.busy_base -= node.add(t, NodeJob(BATCH, pod, batch, threads), work) * threads
            pod.busy_threads_batch += threads

    def _batch_done(self, pod: Pod, batch: list[int], t: float) -> None:
        pod.running.remove(batch)
        pod.free += 1
        threads = self.threads
        pod.busy_base += (t if self.node is None else self.node.vtime(BATCH_CLASS)) * threads
        pod.busy_threads_batch -= threads
        if self.answers_cross_front:
            self._answers_to_front(pod, batch, t)
        else:
            arr, lat, status, extra = self.arr_t, self.lat, self.status, self.extra_latency_s
            for rid in batch:
                lat[rid] = t - arr[rid] + extra
                status[rid] = ANSWERED
            if self.closed:
                think = self.load.think_s
                for rid in batch:
                    self.push(arr[rid] + lat[rid] + think, _ARRIVE)
            self._release(pod, len(batch), t)
        if pod.state and (pod.normal or pod.urgent):
            self._dispatch(pod, t)

    def _answers_to_front(self, pod: Pod, batch: list[int], t: float) -> None:
        """A batch's answers reach the front together: one wake-up finds them all."""
        status, queue = self.status, pod.front_queue
        for rid in batch:
            status[rid] = _ANSWERING
        if pod.front_rid < 0:
            self._start_front(pod, t, batch[0], self.wake_out_s + self.front_out_s)
            pod.front_gate = len(batch) - 1
            queue.extend(batch[1:])
        else:
            queue.extend(batch)

    def _answer(self, pod: Pod, rid: int, t: float) -> None:
        """The answer to `rid` leaves the front."""
        self.lat[rid] = t - self.arr_t[rid] + self.extra_latency_s
        self.status[rid] = ANSWERED
        if self.closed:
            self.push(t + self.extra_latency_s + self.load.think_s, _ARRIVE)
        self._release(pod, 1, t)

    def _release(self, pod: Pod, requests: int, t: float) -> None:
        pod.inflight -= requests
        if pod.inflight == 0:
            pod.idle_since = t
        if pod.pos >= 0:
            self.fleet.ready_load[pod.pos] = pod.inflight
        elif pod.state == DRAINING and pod.inflight == 0:
            self.fleet.drained(pod, t)

    def _refuse(self, rid: int, t: float, pod: Pod | None) -> None:
        self.status[rid] = REFUSED
        if pod is not None:
            self._release(pod, 1, t)
        if self.closed:
            self._resend(t + self.extra_latency_s, rid)

    def _resend(self, t: float, rid: int) -> None:
        """A closed-loop client whose request `rid` was refused or lost at `t` sends again."""
        t += self.load.think_s
        self.push(max(t, self.arr_t[rid] + RETRY_FLOOR_S), _ARRIVE)

    # -- the shared node -----------------------------------------------------------------------

    def _node_wake(self, node: SharedNode, t: float) -> None:
        node.scheduled_s = math.inf
        for job in node.pop_done(t):
            pod = job.pod
            if pod is None:  # EXTRA: only contended; CLIENT: the request goes out
                if job.kind == CLIENT and job.batch is not None:
                    self._client_done(t, job.batch[0])
                continue
            if job.kind == FRONT:
                self._front_done(pod, t)
            elif job.batch is not None:
                self._batch_done(pod, job.batch, t)

    def _reschedule(self, node: SharedNode) -> None:
        wake = node.next_finish_s()
        if wake != node.scheduled_s:
            node.gen += 1
            node.scheduled_s = wake
            if wake < math.inf:
                self.push(wake, _NODE, None, node.gen)

    # -- the fleet -----------------------------------------------------------------------------

    def fail(self, rid: int, t: float) -> None:
        """Request `rid` is lost at `t` with its pod (the caller took it out of the pod)."""
        self.status[rid] = FAILED
        if self.closed:
            self._resend(t, rid)
