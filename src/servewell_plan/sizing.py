"""The recommendation `servewell plan` prints: replicas, pod size, batching, autoscaling targets, and
the reasoning behind each figure (`Plan.reasoning`).

The operating point comes from the fitted replica on the request-level simulator (the latency
table): the busiest load whose p99 still meets the SLO with a margin. Replicas then cover the peak at
that load with one replica (or zone) lost, and the autoscaler target sits lower by the growth the
load can show while a scale-up is under way (sync period, metric window, pod start, model load).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from servewell_plan.curve import MeasuredCurve
from servewell_plan.fit import FitResult
from servewell_plan.latency_table import LoadRow, highest_load_within, interpolate
from servewell_plan.model import LatencyTable, Trace

#: Share of the SLO the operating point keeps free for what the simulation does not see.
SLO_MARGIN = 0.1
#: The autoscaler target never sits under this share of the SLO-bound load: lower only buys idle pods.
MIN_TARGET_SHARE = 0.35
#: A fit error (root mean square of log ratios) above this is said to be rough.
ROUGH_FIT_ERROR = 0.25
#: What the HPA and KEDA components ship for a scale-up: a sync, then a pod start.
SYNC_S = 15.0
DEFAULT_POD_START_S = 10.0
#: Memory a replica needs besides its workers: the frontend, engine, buffers (measured RSS, about).
FRONTEND_MEMORY_MIB = 400
#: Steps (distinct concurrencies) a curve needs before a fit means anything: one step tells neither
#: how latency grows with load nor where throughput stops growing, and any replica reproduces it.
MIN_CURVE_POINTS = 2
#: Below this many steps the plan says its figures rest on little (a low step, the knee, saturation).
THIN_CURVE_POINTS = 4
#: A pod whose CPU at the autoscaler's target is under this share of its request is told of the
#: smaller pod (and of the thread settings that would use the cores).
LOW_CPU_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What the user asks for."""

    slo_s: float
    error_budget: float  # share of requests that may be refused or fail
    trace: Trace  # the load: steady (one step) or a trace file
    zones: int = 1
    pod_start_s: float = DEFAULT_POD_START_S
    worker_memory_mib: float | None = None  # measured resident memory of one worker, if known


@dataclass(slots=True)
class Plan:
    """The recommendation, with the figures it rests on."""

    fit: FitResult
    table: LatencyTable
    rows: list[LoadRow]
    inputs: PlanInputs
    operating: LoadRow | None
    target_utilization: float = 0.0
    growth_during_scale_up: float = 1.0
    scale_up_s: float = 0.0
    peak_rps: float = 0.0
    replicas_at_peak: int = 0
    replicas_with_failover: int = 0
    min_replicas: int = 2
    max_replicas: int = 2
    ideal_replica_hours: float = 0.0
    queue_depth_target: float = 0.0
    queue_wait_target_s: float = 0.0
    cpu_target: float = 0.0
    #: cores the pod keeps busy at the target and at the operating point (`ReplicaModel.cpu_share`)
    cpu_at_target_cores: float = 0.0
    cpu_at_operating_cores: float = 0.0
    #: the CPU request that covers the operating point, when it is well under `cores` (None: the pod uses them)
    smaller_pod_cores: float | None = None
    #: instances x threads that would fill `cores` beside the front's real use (None: nothing to gain)
    model_threads_to_fill: int | None = None
    reasoning: list[str] = field(default_factory=list)

    @property
    def capacity_rps(self) -> float:
        """One replica's saturation throughput."""
        return self.table.capacity_rps

    @property
    def target_rps(self) -> float:
        """Per-replica load the autoscaler holds."""
        return self.target_utilization * self.capacity_rps

    @property
    def cores(self) -> float:
        """CPU request per pod."""
        return self.fit.replica.cores

    @property
    def memory_mib(self) -> float | None:
        """Memory limit per pod, when a worker's memory is known."""
        worker = self.inputs.worker_memory_mib
        return None if worker is None else FRONTEND_MEMORY_MIB + self.fit.replica.instances * worker * 1.25


def growth_within(trace: Trace, horizon_s: float) -> float:
    """The largest factor by which the offered load grows within `horizon_s` anywhere in the trace
    (1 for a steady load), over steps that carry at least a tenth of the peak."""
    rates = trace.rates_rps
    peak = max(rates, default=0.0)
    steps = max(1, math.ceil(horizon_s / trace.step_s))
    worst = 1.0
    for i, rate in enumerate(rates):
        if rate < 0.1 * peak or rate <= 0:
            continue
        ahead = max(rates[i : i + steps + 1])
        worst = max(worst, ahead / rate)
    return worst


def check_plannable(curve: MeasuredCurve, slo_s: float) -> None:
    """`ValueError` naming what is missing, before any fit (the fit and the latency table take
    minutes on a small machine): a curve of too few steps, or an SLO that even an unloaded replica misses."""
    if len(curve.points) < MIN_CURVE_POINTS:
        steps = ", ".join(str(p.concurrency) for p in curve.points)
        raise ValueError(
            f"the curve has {len(curve.points)} step(s) (concurrency {steps}); plan needs at least "
            f"{MIN_CURVE_POINTS} at different concurrencies, and {THIN_CURVE_POINTS} or more for figures to rely on: "
            "one step tells neither how the latency grows with the load nor where the throughput stops growing, "
            "and any replica reproduces it. Measure a ladder from 1 client past saturation, e.g. "
            "`servewell bench MODEL --concurrency 1,2,4,8,16,32` or `servewell tune`")
    floor_s = curve.unloaded_p99_s
    if floor_s is not None and slo_s * (1 - SLO_MARGIN) < floor_s:
        raise ValueError(
            f"--slo-p99-ms {slo_s * 1000:g} is below what this replica can meet at any load: its unloaded p99 "
            f"(the 1-client step) is {floor_s * 1000:.1f} ms, and the plan keeps {SLO_MARGIN:.0%} of the SLO as "
            f"margin, so the lowest SLO it can plan for is {floor_s / (1 - SLO_MARGIN) * 1000:.1f} ms. Faster "
            "hardware, a smaller model or fewer rows per batch first")


def make_plan(fit: FitResult, table: LatencyTable, rows: list[LoadRow], inputs: PlanInputs) -> Plan:
    """Size the fleet for `inputs` with the fitted replica (see the module docstring)."""
    plan = Plan(fit, table, rows, inputs, highest_load_within(rows, inputs.slo_s * (1 - SLO_MARGIN),
                                                              inputs.error_budget))
    r = fit.replica
    say = plan.reasoning.append
    s_full = r.batch_s(r.max_batch_size)
    say(f"1. Capacity. A batch of b takes {r.alpha_s * 1000:.2f} + {r.beta_s * 1000:.3f} x b ms; with "
        f"{r.instances} instance(s) and batches of {r.max_batch_size} the model stage completes "
        f"{r.instances * r.max_batch_size / s_full:.1f} req/s, the frontend (one event loop, "
        f"{r.front_s * 1000:.2f} ms a request + {r.front_fixed_s * 1000:.2f} ms a wake-up, shared by the requests "
        f"it finds) {r.front_capacity_rps:.1f}: the {fit.bottleneck} "
        f"saturates first. Simulated saturation: {plan.capacity_rps:.1f} req/s per replica "
        f"(fit error {fit.error:.2f} in log space; worst point {fit.worst_ratio:.2f}x)."
        + (" A request that finds the replica idle costs more (the curve's idle points): "
           + ", ".join(f"after {idle * 1000:g} ms +{cpu * 1000:.2f} ms CPU +{delay * 1000:.2f} ms delay"
                       for idle, cpu, delay in r.idle_cost) + "."
           if r.idle_cost else " The curve has no idle points (servewell bench --idle-ms): a replica that sits "
           "idle between requests is planned as if it were busy, which is optimistic at light loads.")
        + (f" The model describes this curve poorly (error above {ROUGH_FIT_ERROR}): read every figure below as "
           "rough, and measure again with more steps, longer windows or the load generator on other cores."
           if fit.error > ROUGH_FIT_ERROR else "")
        + (f" The curve has only {len(fit.points)} steps: few enough that several replicas reproduce it, so read "
           f"every figure below as rough; {THIN_CURVE_POINTS} or more, from 1 client past saturation, pin it down."
           if len(fit.points) < THIN_CURVE_POINTS else ""))
    if plan.operating is None:
        say(f"2. No load meets p99 <= {inputs.slo_s * 1000 * (1 - SLO_MARGIN):.0f} ms "
            f"({100 * (1 - SLO_MARGIN):.0f}% of the SLO): even an idle replica's p99 is "
            f"{rows[0].p99_s * 1000:.0f} ms. Faster hardware, a smaller model or fewer rows per batch first.")
        return plan
    op = plan.operating
    say(f"2. Operating point. p99 grows with load as queues form (M/G/1 with batch service: the wait "
        f"grows like rho / (1 - rho)); the busiest load whose simulated p99 meets "
        f"{inputs.slo_s * 1000 * (1 - SLO_MARGIN):.0f} ms (the SLO less {SLO_MARGIN:.0%}) with refusals under "
        f"{inputs.error_budget:.2%} is {op.utilization:.0%} of capacity: {op.utilization * plan.capacity_rps:.1f} "
        f"req/s per replica at p50 {op.p50_s * 1000:.0f} ms, p99 {op.p99_s * 1000:.0f} ms.")
    plan.scale_up_s = SYNC_S + inputs.pod_start_s + r.cold_start_s
    plan.growth_during_scale_up = growth_within(inputs.trace, plan.scale_up_s)
    share = max(MIN_TARGET_SHARE, 1 / plan.growth_during_scale_up)
    plan.target_utilization = op.utilization * share
    say(f"3. Scale-up delay. A new pod helps {plan.scale_up_s:.0f} s after the load rises (an autoscaler sync "
        f"{SYNC_S:.0f} s, pod start {inputs.pod_start_s:.0f} s, model load and warm-up {r.cold_start_s:.0f} s). "
        f"The load grows up to {plan.growth_during_scale_up:.2f}x within that time, so the autoscaler holds "
        f"{share:.0%} of the operating point: {plan.target_utilization:.0%} of capacity, "
        f"{plan.target_rps:.1f} req/s per replica."
        + (" The load grows faster than any autoscaler follows: min replicas must carry the jump."
           if share == MIN_TARGET_SHARE and 1 / plan.growth_during_scale_up < MIN_TARGET_SHARE else ""))
    plan.peak_rps = max(inputs.trace.rates_rps)
    per_replica = op.utilization * plan.capacity_rps
    plan.replicas_at_peak = max(1, math.ceil(plan.peak_rps / per_replica))
    if inputs.zones > 1:
        plan.replicas_with_failover = math.ceil(plan.replicas_at_peak * inputs.zones / (inputs.zones - 1))
        lost = f"one of {inputs.zones} zones lost ({math.ceil(plan.replicas_with_failover / inputs.zones)} replicas)"
    else:
        plan.replicas_with_failover = plan.replicas_at_peak + 1
        lost = "one replica lost"
    say(f"4. Replicas. The peak, {plan.peak_rps:.1f} req/s, at {per_replica:.1f} req/s per replica needs "
        f"{plan.replicas_at_peak}; with {lost} the rest must still carry it: {plan.replicas_with_failover}.")
    trough = min(inputs.trace.rates_rps)
    plan.min_replicas = max(2, math.ceil(trough / plan.target_rps) if plan.target_rps else 2)
    plan.max_replicas = max(plan.min_replicas, math.ceil(plan.replicas_with_failover * 1.25))
    plan.ideal_replica_hours = sum(max(plan.min_replicas, math.ceil(rate / plan.target_rps))
                                   for rate in inputs.trace.rates_rps) * inputs.trace.step_s / 3600
    say(f"5. Autoscaling range. minReplicas {plan.min_replicas} (the trough, {trough:.1f} req/s, at the target, "
        f"and never one: a pod may be draining); maxReplicas {plan.max_replicas} (the failover count and 25% "
        f"for error). Following the load exactly at the target would cost {plan.ideal_replica_hours:.1f} "
        f"replica-hours over the trace ({inputs.trace.duration_s / 3600:.2f} h); --simulate shows what each "
        "autoscaler really spends.")
    target = plan.target_utilization
    # milli-precision: a Kubernetes quantity ("85m") and KEDA's threshold both take fractions
    plan.queue_depth_target = max(0.01, round(interpolate(rows, target, "queue_depth"), 3))
    plan.queue_wait_target_s = max(0.001, interpolate(rows, target, "mean_s") - rows[0].mean_s)
    plan.cpu_target = min(0.95, r.cpu_share(plan.target_rps))
    say(f"6. Targets at {target:.0%} of capacity. Queue depth per pod {plan.queue_depth_target:.3g} "
        f"(Little's law: {plan.target_rps:.1f} req/s x the {plan.queue_wait_target_s * 1000:.0f} ms a request "
        f"waits beyond an idle replica's latency); mean queue wait {plan.queue_wait_target_s * 1000:.0f} ms; "
        f"CPU {plan.cpu_target:.0%} of the pod's {r.cores:g} cores (a batching server's CPU grows about linearly "
        "with load until it saturates, but says nothing of latency: the queue signals are the ones we ship).")
    cores = r.cores
    memory = plan.memory_mib
    say(f"7. Pod. {r.instances} instance(s) x {r.threads} thread(s) plus the frontend's event loop: "
        f"{cores:g} cores requested. Memory: "
        + (f"{memory:.0f} MiB (frontend {FRONTEND_MEMORY_MIB} MiB + 1.25 x the measured worker)."
           if memory is not None else "pass --worker-memory-mib (the worker's resident memory, from "
           "`servewell_worker_resident_memory_bytes` or the bench) to size it."))
    _cpu_request(plan, op.utilization * plan.capacity_rps)
    return plan


def _cpu_request(plan: Plan, operating_rps: float) -> None:
    """Step 8, when the pod's CPU at the target is well under its request: say so, and offer the
    smaller pod and (for a model-bound pod whose front idles) the threads that would use the cores."""
    r = plan.fit.replica
    cores = r.cores
    plan.cpu_at_target_cores = r.cpu_share(plan.target_rps) * cores
    plan.cpu_at_operating_cores = r.cpu_share(operating_rps) * cores
    if plan.cpu_at_target_cores >= LOW_CPU_SHARE * cores:
        return
    smaller = max(0.1, math.ceil(plan.cpu_at_operating_cores * 10 - 1e-9) / 10)  # a tenth of a core, rounded up
    if smaller < cores:
        plan.smaller_pod_cores = smaller
    front_cores, _ = r.stage_cores(operating_rps)
    fill = round(cores - front_cores)  # the front keeps what it uses; the rest can run batches
    ways = [f"threads {fill // r.instances} (faster batches)"] if fill // r.instances > r.threads else []
    ways += [f"instances {fill // r.threads} (more batches at once)"] if fill // r.threads > r.instances else []
    if plan.fit.bottleneck == "model" and ways:
        plan.model_threads_to_fill = fill
    text = (f"8. CPU request. At the target the pod keeps about {plan.cpu_at_target_cores:.2f} of its {cores:g} "
            f"requested cores busy ({plan.cpu_at_target_cores / cores:.0%}), and {plan.cpu_at_operating_cores:.2f} "
            "at the operating point, the busiest load a pod is planned for: most of the request would be reserved "
            "and idle.")
    if plan.smaller_pod_cores is not None:
        text += (f" The smaller pod: requests.cpu \"{quantity(smaller)}\" (the operating point's use, rounded up to "
                 f"a tenth of a core) with limits.cpu \"{cores:g}\" (or none), so that a burst still finds a core for "
                 "the front and each thread, as the fitted latencies assume; a CPU autoscaling target is then "
                 f"{plan.cpu_target * cores / smaller:.0%} of that request.")
    if plan.model_threads_to_fill is not None:
        text += (f" Or keep the {cores:g} cores and let the model use what the front leaves (it needs "
                 f"{front_cores:.2f} of its core at the operating point): {fill} model threads in all instead of "
                 f"{r.instances} x {r.threads}, as " + " or ".join(ways) + f"; the curve was measured at "
                 f"{r.instances} x {r.threads}, so measure that setting (servewell tune) and plan from its curve.")
    elif plan.fit.bottleneck == "frontend":
        text += " The front is the bottleneck: more model threads would not carry more load per pod."
    plan.reasoning.append(text)


def quantity(value: float) -> str:
    """A Kubernetes CPU quantity: "4.5", or "850m" below one core."""
    return f"{value:g}" if value >= 1 else f"{round(value * 1000)}m"
