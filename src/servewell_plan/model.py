"""The vocabulary of fleet planning, shared by the request-level simulator (`plan.des`), the fluid
fleet model (`plan.fluid`), the autoscaler model (`plan.autoscaler`) and `servewell plan`: what a
replica is, where it runs, how traffic reaches it and how the fleet scales.

Every duration is in seconds (`_s`), every rate in requests per second (`_rps`). All types are
frozen: a simulation is a pure function of them and a seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum


@dataclass(frozen=True, slots=True)
class ReplicaModel:
    """One servewell replica (pod), fitted from a measured throughput/latency curve.

    A request passes two stages. The *front* (HTTP parsing, decoding, the engine's bookkeeping) is
    one event loop serving requests in FIFO order: each wake-up of the loop costs `front_fixed_s`
    (epoll, syscalls, the hand-offs between processes), then each request it found waiting costs
    `front_s`; requests that arrive during a wake-up wait for the next one. So a request alone pays
    both, and requests that arrive together share the fixed part: the front's CPU per request falls
    as the load rises (measured on the tiny MLP: 1.2 ms per request at one client, 0.47 ms at 32).
    With `front_fixed_s` 0 the front is a FIFO single server taking `front_s` per request. Answers
    cross the same loop on their way back: `front_out_share` of each request's front work is done
    after its batch, in the loop's FIFO with everything else (a whole batch's answers arrive at
    once, so they share a wake-up); 0 answers at the batch's end. Then the *batcher*: requests
    wait in a bounded queue (`max_queue` waiting; one more is refused with a 503), a batch of at most
    `max_batch_size` is formed when an instance is free and either the batch is full or the oldest
    request has waited `max_wait_s` (an urgent request dispatches at once), and one of `instances`
    workers runs it in `alpha_s + beta_s * batch_size`. `overhead_s` is latency outside the replica
    that costs no CPU here (the network, the client's own parsing).

    A replica that has been idle costs more: `idle_cost` is a table of (idle seconds, extra CPU
    seconds, extra delay seconds) that a request pays when it finds the replica with nothing in
    flight after that long (linear between the points, 0 at 0, flat after the last). The delay,
    which costs no CPU (halted cores and sleeping processes woken up), comes first: the request
    enters the replica after it, and the CPU is added to its front's first wake-up (work on the
    node). Measured on a 2-core VM with the tiny MLP: a lone request after
    20 ms idle takes 1.6 ms more and 1.3 ms more CPU than one sent as the last was answered (caches
    cold, every process of the chain woken from sleep), so a light open load costs far more per
    request than a busy closed loop. Empty: idleness costs nothing.

    On a node shared with other work (`FleetSpec.node_cores`), a batch's threads get the CPU weight
    of `worker_nice` (servewell runs model workers at nice 5 by default, model.yaml `nice`), the
    front's and everything else's that of nice 0: when the cores are contended, a batch runs at about
    a third of a front's share. 0: every thread at the same weight.
    """

    front_s: float
    alpha_s: float
    beta_s: float
    max_batch_size: int = 1
    max_wait_s: float = 0.0
    instances: int = 1
    threads: int = 1  # intra-op threads of a running batch: the cores it can use at once
    max_queue: int = 256
    overhead_s: float = 0.0
    jitter_cv: float = 0.0  # coefficient of variation of every service time (lognormal), 0: fixed
    cold_start_s: float = 0.0  # pod scheduled -> ready: container start, model load, warm-up
    front_fixed_s: float = 0.0  # the front's cost per wake-up of its loop, shared by the requests it finds
    front_out_share: float = 0.0  # of front_s and of each wake-up's cost, spent on the answer after the batch
    idle_cost: tuple[tuple[float, float, float], ...] = ()  # (idle_s, extra CPU s, extra delay s), idle_s rising
    worker_nice: int = 0  # the model workers' niceness: their batches' CPU weight on a shared node (des_node)

    def idle_extra(self, idle_s: float) -> tuple[float, float]:
        """(extra CPU seconds, extra delay seconds) of a request that finds the replica idle for
        `idle_s` (see `idle_cost`)."""
        table = self.idle_cost
        if not table or idle_s <= 0:
            return 0.0, 0.0
        last_s, last_cpu, last_delay = 0.0, 0.0, 0.0
        for at_s, cpu, delay in table:
            if idle_s <= at_s:
                w = (idle_s - last_s) / (at_s - last_s) if at_s > last_s else 1.0
                return last_cpu + w * (cpu - last_cpu), last_delay + w * (delay - last_delay)
            last_s, last_cpu, last_delay = at_s, cpu, delay
        return last_cpu, last_delay

    def batch_s(self, size: int) -> float:
        """Service time of one batch of `size` requests at full speed."""
        return self.alpha_s + self.beta_s * size

    @property
    def saturation_rps(self) -> float:
        """Requests per second this replica completes when every stage is busy (full batches, and
        wake-ups of the front that each find a full batch's worth of requests)."""
        model = self.instances * self.max_batch_size / self.batch_s(self.max_batch_size)
        return min(model, self.front_capacity_rps)

    @property
    def front_capacity_rps(self) -> float:
        """Requests per second the front completes when each wake-up finds a full batch's worth
        waiting (inf: no front)."""
        per_request = self.front_s + self.front_fixed_s / self.max_batch_size
        return 1.0 / per_request if per_request > 0 else math.inf

    @property
    def cores(self) -> float:
        """Cores the replica can keep busy: its front plus every instance's threads."""
        return 1.0 + self.instances * self.threads

    def cpu_share(self, rate_rps: float) -> float:
        """The CPU utilization (of `cores`) a pod reports at `rate_rps`, its front and its batches'
        threads: an upper bound that takes a wake-up and a batch of one per request (requests that
        arrive together cost less)."""
        per_request = self.front_fixed_s + self.front_s + self.batch_s(1) * self.threads
        return min(1.0, rate_rps * per_request / self.cores)

    def stage_cores(self, rate_rps: float) -> tuple[float, float]:
        """(front, model) cores busy at `rate_rps`, on the same upper bound as `cpu_share` (a wake-up
        and a batch of one per request), each at most what the stage can use."""
        front = min(1.0, rate_rps * (self.front_fixed_s + self.front_s))
        model = min(float(self.instances * self.threads), rate_rps * self.batch_s(1) * self.threads)
        return front, model


class BalancerPolicy(Enum):
    """How the load balancer picks a ready replica for each request."""

    ROUND_ROBIN = "round_robin"
    LEAST_CONNECTIONS = "least_connections"  # fewest requests in flight (HAProxy leastconn)
    POWER_OF_TWO = "power_of_two"  # two replicas at random, the one with fewer in flight


class ScalingSignal(Enum):
    """What the autoscaler scales on."""

    CPU = "cpu"  # HPA, resource metric: mean CPU utilization of ready pods vs target
    QUEUE_DEPTH = "queue_depth"  # HPA, Pods metric servewell_queue_depth, AverageValue
    QUEUE_WAIT = "queue_wait"  # KEDA prometheus trigger on the mean queue wait, Value


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    """One HPA `behavior` policy: change by at most `value` pods (or percent) per `period_s`."""

    kind: str  # "Pods" or "Percent"
    value: int
    period_s: float


@dataclass(frozen=True, slots=True)
class ScalingRules:
    """One direction of the HPA `behavior` (scaleUp or scaleDown)."""

    stabilization_s: float
    policies: tuple[ScalingPolicy, ...]
    select: str = "Max"  # "Max", "Min" or "Disabled"


@dataclass(frozen=True, slots=True)
class AutoscalerSpec:
    """The autoscaler as Kubernetes runs it (the HPA controller's defaults where not set).

    `target` is in the signal's unit: CPU utilization as a fraction of the pod's cores (0.7), queue
    depth in requests per pod, queue wait in seconds. KEDA polls Prometheus every `sync_s` and feeds
    the HPA, so both are this one loop; `metric_window_s` is how far back the signal averages (the
    1-minute `rate()` of the KEDA query; 0: the instant value the pods report at the sync).
    """

    signal: ScalingSignal
    target: float
    min_replicas: int = 2
    max_replicas: int = 10
    sync_s: float = 15.0
    tolerance: float = 0.1
    metric_window_s: float = 0.0
    scale_up: ScalingRules = ScalingRules(
        0.0, (ScalingPolicy("Percent", 100, 15.0), ScalingPolicy("Pods", 4, 15.0)), "Max")
    scale_down: ScalingRules = ScalingRules(300.0, (ScalingPolicy("Percent", 100, 15.0),), "Max")


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """A fleet: identical replicas behind one load balancer, spread over zones.

    `node_cores` > 0 puts every replica on one shared machine of that many cores (processor
    sharing), as `make replicas` does on this VM; 0 gives each replica its own cores (a pod with its
    CPU request, the Kubernetes case). `client_cpu_s` and `balancer_cpu_s` are CPU per request spent
    on that shared machine by the load generator and the load balancer (only with `node_cores`).
    """

    replica: ReplicaModel
    replicas: int
    balancer: BalancerPolicy = BalancerPolicy.ROUND_ROBIN
    zones: int = 1
    node_cores: float = 0.0
    client_cpu_s: float = 0.0
    balancer_cpu_s: float = 0.0
    balancer_s: float = 0.0  # latency the load balancer adds per request
    autoscaler: AutoscalerSpec | None = None
    pod_start_s: float = 0.0  # pod created -> container running (image cached), before cold_start_s


class FaultKind(Enum):
    """Something that happens to the fleet during a run."""

    REPLICA_LOST = "replica_lost"  # one pod killed (node failure): its requests fail, it is replaced
    ZONE_LOST = "zone_lost"  # every pod of zone 0: lost; replacements start in the other zones


@dataclass(frozen=True, slots=True)
class Fault:
    """A fault at `at_s` seconds into the run."""

    at_s: float
    kind: FaultKind


@dataclass(frozen=True, slots=True)
class Trace:
    """Offered load over time: `rates_rps[i]` is the Poisson arrival rate from `i * step_s` to
    `(i + 1) * step_s`. `urgent_share` of requests use the urgent lane."""

    step_s: float
    rates_rps: tuple[float, ...]
    faults: tuple[Fault, ...] = ()
    urgent_share: float = 0.0
    name: str = "trace"
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        """How long the trace lasts."""
        return self.step_s * len(self.rates_rps)

    def rate_at(self, t_s: float) -> float:
        """The offered rate at `t_s` (0 after the end)."""
        index = int(t_s // self.step_s)
        return self.rates_rps[index] if 0 <= index < len(self.rates_rps) else 0.0


@dataclass(frozen=True, slots=True)
class LatencyTable:
    """One replica's latency under Poisson load, from the request-level simulator (`plan.des`), for
    the fluid fleet model: at offered load `utilizations[i]` x `capacity_rps`, the latency (seconds,
    arrival at the balancer to answer) at probability `quantiles[j]` is `latency_s[i][j]`, and
    `rejected_share[i]` of the requests were refused (queue full)."""

    capacity_rps: float
    utilizations: tuple[float, ...]  # increasing, in (0, 1]
    quantiles: tuple[float, ...]  # increasing, in (0, 1)
    latency_s: tuple[tuple[float, ...], ...]
    rejected_share: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class BinStats:
    """One time bin of a simulated run (request-level or fluid): what a dashboard would show."""

    start_s: float
    arrivals: int  # requests offered in the bin
    ok: int  # answered
    rejected: int  # refused: 503 (queue full, no ready replica)
    failed: int  # lost with a replica (connection reset)
    p50_s: float | None  # of the answered requests that arrived in the bin
    p99_s: float | None
    within_slo: int  # answered within the SLO given to the run
    replicas_ready: float  # mean over the bin
    replicas_total: float  # mean over the bin: every pod that costs money (starting, ready, draining)
    queue_depth: float  # mean waiting requests per ready replica


@dataclass(frozen=True, slots=True)
class ScalingSample:
    """What the autoscaler reads at one sync."""

    current_replicas: int  # the Deployment's spec.replicas
    ready_values: tuple[float, ...]  # per ready pod: CPU utilization (fraction) or queue depth
    unready_pods: int  # created, not ready yet: no metrics
    fleet_value: float | None = None  # QUEUE_WAIT: the fleet-wide mean queue wait (the KEDA query), s
