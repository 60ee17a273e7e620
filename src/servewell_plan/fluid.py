"""The fluid fleet model: a fleet of replicas behind a balancer as flows rather than requests, one step
of `dt_s` at a time, for fleets and traces too big to simulate request by request (1,000 replicas, a
day at 100,000 req/s).

Each step, the step's arrivals are split over the ready replicas by the balancer policy. A replica
serves up to `table.capacity_rps` x dt; what it cannot serve waits as its backlog, and backlog
beyond `replica.max_queue` is refused. The step's requests at a replica see the table's latency
distribution at the replica's utilization, delayed by the backlog they queue behind and by the
balancer's own latency; the table's refused share at that utilization is refused too.

Replicas with the same backlog behave the same, so each step computes once per distinct backlog
(a cohort) rather than once per replica: a steady fleet is one cohort whatever its size.

Approximations (the docs state them; `fluid_table` and `fluid_bins` add their own):
- Arrivals are the trace's rate integrated over the step, without noise: a replica's Poisson
  variability within a step is already inside its latency table; across steps it is not modelled.
- Utilization is offered / capacity, capped at 1. The table's last row (0.98) stands for every
  load above it; past capacity the growth of the backlog carries the extra delay.
- Backlog wait: the mean of the backlog at the start and at the end of the step, divided by the
  capacity (FIFO behind it). Requests are counted answered, and within the SLO, in the step they
  arrive (P(table latency <= SLO - backlog wait - balancer latency)); requests lost with a pod later
  move from answered to failed in the bin of the failure.
- Requests lost with a pod: its backlog plus its requests in flight by Little's law (answered rate x
  (table mean latency + backlog wait)). Replacements are created at once (a killed pod; a node
  failure's detection delay is not modelled) and are ready after pod_start_s + cold_start_s.
- The autoscaler's signals, read from the step before each sync:
  CPU per ready pod = served rate x `ReplicaModel.cpu_share` per request (capped at 1): its front's
  and its batches' threads' work over its cores, a batch of one per request (an upper bound; the
  request-level pod counts its real batches).
  QUEUE_DEPTH per ready pod = backlog + answered rate x (table mean latency at its utilization -
  mean latency at the table's lightest row) (Little's law, as `latency_table` defines queue depth).
  QUEUE_WAIT = the request-weighted mean over the last `metric_window_s` (one step if 0) of (that
  excess latency + backlog wait), the KEDA query's rate() ratio. Per-pod signals are the instant
  values at the sync: `metric_window_s` applies to QUEUE_WAIT only.
- Scale-down deletes pods not ready yet first, then the newest ready ones; a deleted ready pod stops
  receiving requests, serves its backlog and costs until it is empty (at least one more step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from servewell_plan.autoscaler import HorizontalAutoscaler
from servewell_plan.fluid_bins import BinAccumulator
from servewell_plan.fluid_pods import PodPool, PodState
from servewell_plan.fluid_table import DenseLatency
from servewell_plan.model import (
    BalancerPolicy,
    BinStats,
    FaultKind,
    FleetSpec,
    LatencyTable,
    ScalingSample,
    ScalingSignal,
    Trace,
)


@dataclass(slots=True)
class FluidResult:
    """What a fluid run predicts: per-bin stats and totals (requests as fractional counts)."""

    bins: list[BinStats]
    replica_seconds: float  # every pod that costs money (starting, ready, draining), integrated over time
    arrivals: float
    ok: float
    rejected: float
    failed: float
    within_slo: float

    @property
    def slo_attainment(self) -> float:
        """Share of the offered requests answered within the SLO."""
        return self.within_slo / self.arrivals if self.arrivals > 0 else 1.0

    @property
    def replica_hours(self) -> float:
        """Pod-hours paid for."""
        return self.replica_seconds / 3600.0


def balancer_shares(policy: BalancerPolicy, backlog: np.ndarray, pods: np.ndarray, arrivals: float) -> np.ndarray:
    """Requests per pod of each cohort (`backlog` ascending, `pods` in each) out of `arrivals`.

    - ROUND_ROBIN: equal shares whatever the backlog.
    - LEAST_CONNECTIONS: water-filling. Requests go to the least-loaded replicas until their backlog
      plus new requests levels up with the next ones, i.e. each gets max(0, level - backlog).
    - POWER_OF_TWO: each request samples two replicas (with replacement) and goes to the one with
      less backlog, against the backlog at the start of the step: the replica ranked r-th of R
      (0: least) gets (2 (R - r) - 1) / R^2 of the requests; tied replicas share their ranks
      equally. Softer than water-filling: a loaded replica still gets some requests.
    """
    total = float(pods.sum())
    if backlog.size == 1 or policy is BalancerPolicy.ROUND_ROBIN:
        return np.full(backlog.size, arrivals / total)
    if policy is BalancerPolicy.LEAST_CONNECTIONS:
        filled = np.cumsum(pods)
        level = (arrivals + np.cumsum(pods * backlog)) / filled
        next_backlog = np.append(backlog[1:], np.inf)
        first = int(np.argmax(level <= next_backlog))
        return np.maximum(level[first] - backlog, 0.0)
    ranks_after = np.cumsum(pods)
    ranks_before = ranks_after - pods
    return arrivals * (2 * total - ranks_before - ranks_after) / (total * total)


@dataclass(slots=True)
class _Step:
    """One step at the ready replicas, per cohort (arrays) and in total."""

    backlog: np.ndarray  # at the end of the step
    rows: np.ndarray  # dense utilization row
    shifts: np.ndarray  # latency added to the table's: backlog wait + balancer
    answered: np.ndarray  # requests accepted per pod (answered unless the pod dies)
    slo_share: np.ndarray
    inflight: np.ndarray
    cpu: np.ndarray
    depth: np.ndarray  # servewell_queue_depth per pod
    wait_excess: np.ndarray  # queue wait per request: table mean beyond the lightest load + backlog wait


class _FluidRun:
    def __init__(
        self, fleet: FleetSpec, trace: Trace, table: LatencyTable, slo_s: float, dt_s: float, bin_s: float, seed: int
    ) -> None:
        if not (dt_s > 0 and bin_s > 0 and math.isfinite(dt_s) and math.isfinite(bin_s)):
            raise ValueError(f"need dt_s > 0 and bin_s > 0, got {dt_s} and {bin_s}")
        if fleet.replicas < 0 or fleet.zones < 1:
            raise ValueError(f"need replicas >= 0 and zones >= 1, got {fleet.replicas} and {fleet.zones}")
        self.fleet = fleet
        self.dense = DenseLatency(table)
        self.slo_s = slo_s
        self.dt_s = dt_s
        self.capacity_step = table.capacity_rps * dt_s
        self.cpu_per_rps = fleet.replica.cpu_share(1.0)  # the pod's CPU at 1 req/s, as the DES pod reads it
        self.rng = np.random.default_rng(seed)
        self.pods = PodPool(fleet.zones, fleet.pod_start_s + fleet.replica.cold_start_s)
        self.pods.create(fleet.replicas, 0.0, ready=True)
        self.spec_replicas = fleet.replicas
        self.steps = max(1, math.ceil(trace.duration_s / dt_s - 1e-9))
        self.arrivals = _step_arrivals(trace, dt_s, self.steps)
        self.faults = sorted(trace.faults, key=lambda f: f.at_s)
        self.bins = BinAccumulator(self.dense, bin_s)
        self.hpa: HorizontalAutoscaler | None = None
        self.sync_steps = 0
        self.wait_window: np.ndarray = np.zeros((1, 2))
        self.wait_row = 0
        if fleet.autoscaler is not None:
            self.hpa = HorizontalAutoscaler(fleet.autoscaler, fleet.replicas)
            self.sync_steps = max(1, round(fleet.autoscaler.sync_s / dt_s))
            window_steps = max(1, round(fleet.autoscaler.metric_window_s / dt_s))
            self.wait_window = np.zeros((window_steps, 2))  # per step: sum of queue waits, requests
        self.totals = np.zeros(5)  # arrivals, ok, rejected, failed, within
        self.replica_seconds = 0.0

    def run(self) -> FluidResult:
        next_fault = 0
        for n in range(self.steps):
            now = n * self.dt_s
            self.bins.at(now)
            while next_fault < len(self.faults) and self.faults[next_fault].at_s < now + self.dt_s:
                self._fault(self.faults[next_fault].kind, now)
                next_fault += 1
            if now >= self.pods.next_ready_s:
                self.pods.become_ready(now)
            if self.hpa is not None and n > 0 and n % self.sync_steps == 0:
                self._sync(now)
            self._step(n, report=self.hpa is not None and (n + 1) % self.sync_steps == 0)
        arrivals, ok, rejected, failed, within = (float(v) for v in self.totals)
        return FluidResult(self.bins.finish(), self.replica_seconds, arrivals, ok, rejected, failed, within)

    def _step(self, n: int, *, report: bool) -> None:
        pods = self.pods
        arrivals = float(self.arrivals[n])
        ready = pods.ready_slots()
        paid = pods.paid()
        self.replica_seconds += paid * self.dt_s
        pods.drain(self.capacity_step)
        if ready.size == 0:
            self.totals += (arrivals, 0.0, arrivals, 0.0, 0.0)
            self.bins.add_step(
                arrivals=arrivals,
                ok=0.0,
                rejected=arrivals,
                within=0.0,
                ready=0,
                total=paid,
                depth=0.0,
                rows=_EMPTY_INT,
                shifts=_EMPTY,
                weights=_EMPTY,
            )
            self._record_wait(0.0, 0.0)
            return
        if pods.uniform:
            backlog = pods.backlog[ready[:1]]
            counts = np.array([float(ready.size)])
            inverse = None
        else:
            backlog, inverse, int_counts = np.unique(pods.backlog[ready], return_inverse=True, return_counts=True)
            counts = int_counts.astype(float)
        step = self._cohorts(backlog, counts, arrivals)
        per_pod = [(pods.backlog, step.backlog), (pods.inflight, step.inflight), (pods.slo_share, step.slo_share)]
        if report:  # the next step starts with a sync: what each pod reports to it
            per_pod += [(pods.cpu, step.cpu), (pods.queue_depth, step.depth)]
        for target, values in per_pod:
            target[ready] = values[0] if inverse is None else values[inverse]
        pods.uniform = inverse is None or bool(np.ptp(step.backlog) == 0.0)
        answered = float(counts @ step.answered)
        within = float(counts @ (step.answered * step.slo_share))
        refused = max(arrivals - answered, 0.0)
        self.totals += (arrivals, answered, refused, 0.0, within)
        self.bins.add_step(
            arrivals=arrivals,
            ok=answered,
            rejected=refused,
            within=within,
            ready=ready.size,
            total=paid,
            depth=float(counts @ step.depth) / ready.size,
            rows=step.rows,
            shifts=step.shifts,
            weights=counts * step.answered,
        )
        self._record_wait(float(counts @ (step.answered * step.wait_excess)), answered)

    def _cohorts(self, backlog: np.ndarray, counts: np.ndarray, arrivals: float) -> _Step:
        dense, dt, cap = self.dense, self.dt_s, self.capacity_step
        offered = balancer_shares(self.fleet.balancer, backlog, counts, arrivals)
        rows = dense.rho_index(offered / cap)
        refused = offered * dense.rejected[rows]
        queued = backlog + offered - refused
        left = np.maximum(queued - cap, 0.0)
        overflow = np.maximum(left - self.fleet.replica.max_queue, 0.0)
        left -= overflow
        answered = offered - refused - overflow
        wait = (backlog + left) / 2 / dense.capacity_rps
        shifts = wait + self.fleet.balancer_s
        slo_share = dense.cdf(rows, self.slo_s - shifts)
        served_rps = (queued - overflow - left) / dt
        rate_rps = answered / dt
        return _Step(
            backlog=left,
            rows=rows,
            shifts=shifts,
            answered=answered,
            slo_share=slo_share,
            inflight=rate_rps * (dense.mean[rows] + wait),
            cpu=np.minimum(served_rps * self.cpu_per_rps, 1.0),
            depth=left + rate_rps * dense.excess_mean[rows],
            wait_excess=dense.excess_mean[rows] + wait,
        )

    def _record_wait(self, wait_sum: float, answered: float) -> None:
        self.wait_row = (self.wait_row + 1) % self.wait_window.shape[0]
        self.wait_window[self.wait_row] = (wait_sum, answered)

    def _sync(self, now: float) -> None:
        assert self.hpa is not None and self.fleet.autoscaler is not None
        signal = self.fleet.autoscaler.signal
        ready = self.pods.ready_slots()
        fleet_value = None
        if signal is ScalingSignal.QUEUE_WAIT:
            wait_sum, answered = self.wait_window.sum(axis=0)
            fleet_value = float(wait_sum / answered) if answered > 0 else 0.0
            values: tuple[float, ...] = (0.0,) * ready.size
        else:
            # A pod that became ready at this very sync reports what it has served: nothing yet.
            values = tuple((self.pods.cpu if signal is ScalingSignal.CPU else self.pods.queue_depth)[ready].tolist())
        sample = ScalingSample(self.spec_replicas, values, self.pods.starting(), fleet_value)
        desired = self.hpa.sync(now, sample)
        if desired > self.spec_replicas:
            self.pods.create(desired - self.spec_replicas, now)
        elif desired < self.spec_replicas:
            self.pods.remove(self.spec_replicas - desired)
        self.spec_replicas = desired

    def _fault(self, kind: FaultKind, now: float) -> None:
        pods = self.pods
        if kind is FaultKind.REPLICA_LOST:
            ready = pods.ready_slots()
            if ready.size == 0:
                return
            victims = ready[self.rng.integers(ready.size)][None]
        else:
            victims = pods.lose_zone(0)
        lost_states = pods.state[victims]
        within_lost = float(((pods.backlog[victims] + pods.inflight[victims]) * pods.slo_share[victims]).sum())
        lost = pods.kill(victims)
        self.totals += (0.0, -lost, 0.0, lost, -within_lost)
        self.bins.add_failure(lost, within_lost)
        # The ReplicaSet replaces every pod that counted towards spec.replicas.
        replace = int(np.count_nonzero((lost_states == PodState.READY) | (lost_states == PodState.STARTING)))
        pods.create(replace, now)


_EMPTY = np.zeros(0)
_EMPTY_INT = np.zeros(0, dtype=np.intp)


def _step_arrivals(trace: Trace, dt_s: float, steps: int) -> np.ndarray:
    """Requests offered in each step of `dt_s`: the trace's rate integrated over the step."""
    rates = np.asarray(trace.rates_rps, dtype=float)
    edges = np.arange(rates.size + 1) * trace.step_s
    cumulative = np.concatenate(([0.0], np.cumsum(rates * trace.step_s)))
    return np.diff(np.interp(np.arange(steps + 1) * dt_s, edges, cumulative))


def simulate_fluid(
    fleet: FleetSpec,
    trace: Trace,
    table: LatencyTable,
    *,
    slo_s: float,
    dt_s: float = 1.0,
    bin_s: float = 300.0,
    seed: int = 0,
) -> FluidResult:
    """Run `fleet` through `trace` as a fluid, with one replica's latency from `table`.

    `seed` picks the replica a REPLICA_LOST fault kills; nothing else is random.
    """
    return _FluidRun(fleet, trace, table, slo_s, dt_s, bin_s, seed).run()
