"""Fit a `ReplicaModel` to a measured curve: the stage times that make the request-level simulator
reproduce the measured closed-loop ladder (throughput, p50 and p99 at each concurrency).

A curve says how fast a replica is, not why. Five things are not visible in it directly: which
stage saturates first (the frontend's event loop or the model's instances), how much a bigger batch
costs (a batch of b takes alpha + beta * b: beta * B / s(B) is the batch's "efficiency", 1 when
batching saves nothing), how much of the front's work is per wake-up of its loop rather than per
request (shared by requests that arrive together, so an open load at a lower rate costs more CPU per
request than a busy closed loop), how much of it is on the answer's way back, and how much service
times vary. The fit searches a small grid of those (ranked on short simulations first, the best of
each bottleneck calibrated again at full length; the jitter only for the best candidates), scales
every stage time so that the simulated peak matches the measured one, takes the latency the
replica does not explain as fixed overhead (network, client), and keeps the candidate with the
smallest error in log space over every point. A closed loop often cannot tell the stages apart (a
frontend that serves one request at a time, or a model that gains nothing by batching, give the same
ladder) while an open load tells them apart (a batch answers all its requests at its end): when
several candidates fit within TIE_ERROR, the fit first keeps those whose CPU per request is closest
to the server's measured one, over the steps that measured it (`servewell bench` of a model directory
and `servewell tune` record it; it is what tells the per-wake-up share apart), then the one with the
highest p99 under a Poisson load at half its capacity, so the plan errs towards more replicas. The error is
reported: a large one says the model does not describe this curve, and `plan` says so beside its
figures.

What a request costs when it finds the replica idle is not in a closed loop (its replica is never
idle): where the curve has idle points (one client waiting after each answer), `idle_cost` turns
them into `ReplicaModel.idle_cost`, after the fit and outside its error.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from servewell_plan.curve import CurvePoint, MeasuredCurve
from servewell_plan.des import ClosedLoad, OpenLoad, simulate
from servewell_plan.model import FleetSpec, ReplicaModel, Trace

#: Simulated answers per ladder point: enough for a stable p99 (10 above it), cheap enough for a grid.
REQUESTS_PER_POINT = 1200
#: Utilization of the stage that is not the bottleneck, and batch efficiencies, tried.
OTHER_STAGE_SHARES = (0.15, 0.4, 0.7, 0.95)
EFFICIENCIES = (0.2, 0.45, 0.7, 1.0)
#: Shares of a lone request's front time that are the loop's per-wake-up cost, tried: 0 (every
#: request costs the same) to most (requests that arrive together cost much less each).
FRONT_FIXED_SHARES = (0.0, 0.75)
#: Shares of the front's work done on the answer's way out (`ReplicaModel.front_out_share`), tried:
#: none (decoding an image is most of it), or half (the ingress encodes what it decoded, the engine
#: hands back what it admitted).
FRONT_OUT_SHARES = (0.0, 0.5)
#: Candidates (best first after calibration) whose jitter is searched: the rest are far off already.
JITTER_SEARCHED = 16
JITTERS = (0.05, 0.15, 0.3, 0.5, 0.8)
#: Weight of p99 in the error (throughput and p50 weigh 1): tails are noisier than medians.
P99_WEIGHT = 0.5
#: Scale and overhead move each other: rounds of calibrating both.
CALIBRATION_ROUNDS = 4
#: The grid is ranked first on cheaper simulations (fewer answers a point, fewer rounds); the best
#: REFINED_PER_BOTTLENECK candidates of each bottleneck are calibrated again from there at full size
#: (a fit took 30 to 50 s on 2 cores, now 15 to 20; the coarse rank only has to keep the good candidates in).
COARSE_REQUESTS_PER_POINT = 400
COARSE_CALIBRATION_ROUNDS = 2
REFINED_PER_BOTTLENECK = 16
REFINE_ROUNDS = 2
#: Candidates whose error is within this of the best one fit the curve equally well (a measured point
#: moves by about that much from run to run): among them the fit keeps the most pessimistic one.
TIE_ERROR = 0.05
#: ... judged by its p99 under a Poisson load at this share of its capacity.
TIE_LOAD_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class NodeContext:
    """The machine the curve was measured on, when the replica shared it (the load generator on the
    same cores): its cores and the client's CPU per request."""

    cores: float
    client_cpu_s: float = 0.0
    balancer_cpu_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PointFit:
    """One point: measured and simulated."""

    measured: CurvePoint
    throughput_rps: float
    p50_s: float
    p99_s: float
    cpu_s: float = math.inf  # the replica's CPU seconds per request


@dataclass(frozen=True, slots=True)
class FitResult:
    """The fitted replica, its error (root mean square of the log ratios) and every point."""

    replica: ReplicaModel
    error: float
    points: tuple[PointFit, ...]
    bottleneck: str  # "frontend" or "model"

    @property
    def worst_ratio(self) -> float:
        """The largest simulated/measured ratio (or its inverse) over throughput and p99."""
        ratios = [r for p in self.points for r in (p.throughput_rps / p.measured.throughput_rps,
                                                  p.p99_s / p.measured.p99_s)]
        return max(max(r, 1 / r) for r in ratios)


def simulate_point(replica: ReplicaModel, clients: int, node: NodeContext | None, *, seed: int = 0,
                   requests: int = REQUESTS_PER_POINT, rate_hint_rps: float | None = None,
                   replicas: int = 1, balancer_s: float = 0.0) -> tuple[float, float, float, float]:
    """(throughput, p50, p99, the replicas' CPU per answer) of `replicas` replicas under a closed loop
    of `clients`."""
    rate = rate_hint_rps or replica.saturation_rps * replicas
    lone_s = replica.overhead_s + replica.front_fixed_s + replica.front_s + replica.batch_s(1)
    duration = max(requests / max(rate, 1e-9), 20 * lone_s)
    fleet = FleetSpec(replica, replicas, node_cores=node.cores if node else 0.0,
                      client_cpu_s=node.client_cpu_s if node else 0.0,
                      balancer_cpu_s=node.balancer_cpu_s if node and replicas > 1 else 0.0, balancer_s=balancer_s)
    result = simulate(fleet, ClosedLoad(clients, duration), seed=seed)
    stats = result.window(0.15 * duration, duration)
    return stats.throughput_rps, stats.p50_s or math.inf, stats.p99_s or math.inf, result.cpu_per_answer_s


def open_p99_s(replica: ReplicaModel, node: NodeContext | None, seed: int,
               share: float = TIE_LOAD_SHARE) -> float:
    """The replica's p99 under a Poisson load at `share` of its capacity (alone on its node)."""
    rate = share * replica.saturation_rps
    duration = REQUESTS_PER_POINT * 2 / max(rate, 1e-9)
    fleet = FleetSpec(replica, 1, node_cores=node.cores if node else 0.0,
                      client_cpu_s=node.client_cpu_s if node else 0.0)
    stats = simulate(fleet, OpenLoad(Trace(duration, (rate,))), seed=seed).window(0.1 * duration, duration)
    return stats.p99_s or math.inf


def _candidate(curve: MeasuredCurve, bottleneck: str, other: float, efficiency: float, fixed_share: float,
               out_share: float, jitter: float, max_queue: int) -> ReplicaModel:
    s = curve.settings
    peak = curve.peak.throughput_rps
    batch = s.max_batch_size
    full_batch_s = s.instances * batch / peak * (other if bottleneck == "frontend" else 1.0)
    # the front's time per request at saturation (wake-ups that find a full batch's worth waiting)
    front_full_s = (1.0 if bottleneck == "frontend" else other) / peak
    fixed_per_request = fixed_share / (1.0 - fixed_share)  # of front_s, for a lone request
    front_s = front_full_s / (1.0 + fixed_per_request / batch)
    beta = efficiency * full_batch_s / batch if batch > 1 else full_batch_s
    alpha = full_batch_s - beta * batch if batch > 1 else 0.0
    return ReplicaModel(front_s=front_s, alpha_s=alpha, beta_s=beta, max_batch_size=batch,
                        max_wait_s=s.max_wait_s, instances=s.instances, threads=s.threads, max_queue=max_queue,
                        jitter_cv=jitter, front_fixed_s=front_s * fixed_per_request,
                        front_out_share=out_share, worker_nice=s.nice or 0)


def _scaled(replica: ReplicaModel, factor: float, overhead_s: float) -> ReplicaModel:
    return replace(replica, front_s=replica.front_s * factor, front_fixed_s=replica.front_fixed_s * factor,
                   alpha_s=replica.alpha_s * factor, beta_s=replica.beta_s * factor, overhead_s=overhead_s)


def _error(points: list[PointFit]) -> float:
    """Root mean square of the log ratios: throughput, p50 and p99 (weighed P99_WEIGHT)."""
    total = 0.0
    for p in points:
        m = p.measured
        total += math.log(p.throughput_rps / m.throughput_rps) ** 2 if p.throughput_rps > 0 else 25.0
        total += math.log(p.p50_s / m.p50_s) ** 2 if math.isfinite(p.p50_s) else 25.0
        total += P99_WEIGHT * (math.log(p.p99_s / m.p99_s) ** 2 if math.isfinite(p.p99_s) else 25.0)
    return math.sqrt(total / (len(points) * (2 + P99_WEIGHT)))


def cpu_error(points: tuple[PointFit, ...] | list[PointFit]) -> float | None:
    """Root mean square of the log ratios of the replica's CPU per request, simulated / measured, over
    the points that measured it (None: none did). It is not part of `_error`: a model that waits (a
    GPU, a remote call, a sleep) spends batch time that is no host CPU, so the CPU only chooses among
    candidates that fit the latency equally well (see `fit_replica`)."""
    logs = [math.log(p.cpu_s / p.measured.server_cpu_s) if 0 < p.cpu_s < math.inf else 5.0
            for p in points if p.measured.server_cpu_s]
    return math.sqrt(sum(x * x for x in logs) / len(logs)) if logs else None


def _evaluate(replica: ReplicaModel, curve: MeasuredCurve, node: NodeContext | None, seed: int,
              requests: int = REQUESTS_PER_POINT) -> list[PointFit]:
    out = []
    for point in curve.points:
        x, p50, p99, cpu = simulate_point(replica, point.concurrency, node, seed=seed, requests=requests,
                                          rate_hint_rps=point.throughput_rps)
        out.append(PointFit(point, x, p50, p99, cpu))
    return out


def _calibrate(replica: ReplicaModel, curve: MeasuredCurve, node: NodeContext | None, seed: int,
               rounds: int = CALIBRATION_ROUNDS,
               requests: int = REQUESTS_PER_POINT) -> tuple[ReplicaModel, list[PointFit]]:
    """Scale the stage times so the simulated peak throughput is the measured one, and put the
    latency the replica does not explain at the lowest load into fixed overhead; `rounds` times,
    since each moves the other."""
    peak = curve.peak
    first = curve.points[0]
    for _ in range(rounds):
        fits = _evaluate(replica, curve, node, seed, requests)
        sim_peak = next(f for f in fits if f.measured is peak)
        sim_first = fits[0]
        factor = sim_peak.throughput_rps / peak.throughput_rps if sim_peak.throughput_rps > 0 else 1.0
        inside = max(0.0, sim_first.p50_s - replica.overhead_s)  # what the replica itself takes
        overhead = max(0.0, first.p50_s - inside * factor)
        replica = _scaled(replica, factor, overhead)
    return replica, _evaluate(replica, curve, node, seed, requests)


def _with_best_jitter(replica: ReplicaModel, fits: list[PointFit], curve: MeasuredCurve, node: NodeContext | None,
                      seed: int) -> tuple[float, ReplicaModel, list[PointFit]]:
    """The variance, once the means are right: the jitter of JITTERS with the smallest error."""
    best = (_error(fits), replica, fits)
    for jitter in JITTERS:
        candidate = replace(replica, jitter_cv=jitter)
        trial = _evaluate(candidate, curve, node, seed)
        if _error(trial) < best[0]:
            best = (_error(trial), candidate, trial)
    return best


def fit_replica(curve: MeasuredCurve, *, node: NodeContext | None = None, max_queue: int = 256,
                cold_start_s: float = 0.0, seed: int = 0) -> FitResult:
    """The replica model that best reproduces `curve` (see the module docstring)."""
    batch_options = EFFICIENCIES if curve.settings.max_batch_size > 1 else (1.0,)
    calibrated: list[tuple[float, ReplicaModel, list[PointFit], str]] = []
    for bottleneck in ("frontend", "model"):
        coarse: list[tuple[float, ReplicaModel]] = []
        for other in OTHER_STAGE_SHARES:
            for efficiency in batch_options:
                for fixed_share, out_share in itertools.product(FRONT_FIXED_SHARES, FRONT_OUT_SHARES):
                    candidate = _candidate(curve, bottleneck, other, efficiency, fixed_share, out_share, 0.3,
                                           max_queue)
                    replica, fits = _calibrate(candidate, curve, node, seed, COARSE_CALIBRATION_ROUNDS,
                                               COARSE_REQUESTS_PER_POINT)
                    coarse.append((_error(fits), replica))
        coarse.sort(key=lambda t: t[0])
        for _, rough in coarse[:REFINED_PER_BOTTLENECK]:  # each bottleneck keeps its best: they tie in closed loops
            replica, fits = _calibrate(rough, curve, node, seed, REFINE_ROUNDS)
            calibrated.append((_error(fits), replica, fits, bottleneck))
    calibrated.sort(key=lambda t: t[0])
    tried = [(*_with_best_jitter(replica, fits, curve, node, seed), bottleneck)
             for _, replica, fits, bottleneck in calibrated[:JITTER_SEARCHED]]
    lowest = min(t[0] for t in tried)
    ties = [t for t in tried if t[0] <= lowest + TIE_ERROR]
    cpu = [(cpu_error(t[2]), t) for t in ties]
    if all(e is not None for e, _ in cpu):  # the CPU per request tells the tied ones apart
        closest = min(e for e, _ in cpu if e is not None)
        ties = [t for e, t in cpu if e is not None and e <= closest + TIE_ERROR]
    error, replica, fits, bottleneck = max(ties, key=lambda t: (open_p99_s(t[1], node, seed), -t[0]))
    return FitResult(replace(replica, cold_start_s=cold_start_s, idle_cost=idle_cost(curve)), error, tuple(fits),
                     bottleneck)


def idle_cost(curve: MeasuredCurve) -> tuple[tuple[float, float, float], ...]:
    """`ReplicaModel.idle_cost` from the curve's idle points, against its one-client point (a client
    that sends again as soon as it is answered finds the server busy, never idle): at each idle time,
    the extra p50 split into the extra CPU per request (as far as both steps measured it; none where
    they did not) and the rest, a delay. The extra latency and the extra CPU are made non-decreasing
    with the idle time (a longer idle never costs less: what is left is run-to-run noise), and the
    CPU is at most the latency."""
    lone = next((p for p in curve.points if p.concurrency == 1), None)
    if lone is None or not curve.idle_points:
        return ()
    table = []
    most_extra, most_cpu = 0.0, 0.0
    for point in curve.idle_points:
        most_extra = max(most_extra, point.p50_s - lone.p50_s)
        if point.server_cpu_s is not None and lone.server_cpu_s is not None:
            most_cpu = max(most_cpu, point.server_cpu_s - lone.server_cpu_s)
        cpu = min(most_cpu, most_extra)
        table.append((point.idle_s, cpu, most_extra - cpu))
    return tuple(table)
