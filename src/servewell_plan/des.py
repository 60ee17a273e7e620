"""The request-level fleet simulator: a fleet of servewell replicas behind a load balancer, request
by request, under an open load (a trace of Poisson rates) or a closed one (clients that send again
when answered), with faults and an autoscaler.

What is modelled is `ReplicaModel`'s and `FleetSpec`'s docstrings; the parts are:
`des_engine` (the event loop and the request flow), `des_pod` (a replica's state), `des_fleet`
(pod lifecycle and the balancer's ready list), `des_node` (a shared machine, processor sharing
weighted by niceness), `des_control` (faults, autoscaler syncs, scrapes), `des_scaling` (what the
autoscaler reads) and `des_result` (what a run reports).

Conventions a caller must know:
- The load stops at its duration (no arrival, no closed-loop send at or after it); every request
  sent before is followed to its outcome, so none is unfinished: per window, arrivals = ok +
  rejected + failed. Bins, `replica_seconds`, syncs and faults cover [0, duration) only.
- A closed-loop client sends again when its answer arrives (latency + think_s later), when it is
  refused (after overhead_s + balancer_s + think_s) or when its request is lost (think_s).
- Bins' queue_depth is sampled (`des_control.SCRAPES_PER_BIN` instants per bin), not integrated;
  replicas_ready and replicas_total are exact time averages.
- Jitter: one lognormal factor (mean 1, CV jitter_cv) per front service and one per batch (the
  whole batch, not each request in it).
- Least-connections breaks ties round robin over the ready list; power-of-two draws two distinct
  ready replicas and keeps the first on a tie.
- On a shared node a request's client and balancer CPU is a 1-thread job started at its arrival.

What a request costs when it finds its replica idle is modelled from a table measured with one
client that waits after each answer (`ReplicaModel.idle_cost`): at 20 % of the peak the tiny MLP's
simulated CPU per request is 0.87x the measured with 1 to 3 replicas (0.60-0.81x without it).

On a shared node a model worker's batch weighs what its niceness weighs in Linux's fair
scheduler (`ReplicaModel.worker_nice`, from a curve that says its `settings.nice`; servewell's
default nice 5 weighs 335/1024 of a front), so when the cores are contended a batch runs slower and
the fronts faster than at equal weights. A curve that does not say is fitted at equal weights: on
`bench/data/resnet50-curve.json` nice 5 fitted a front of 28.8 ms instead of 11.6 with a larger error
(0.063 against 0.039), so the weights are not assumed where they were not measured.

Validated (`bench.plan_validation --ingress-processes 1`, 2026-12-06): 1, 2 and 3 replicas of the
tiny MLP and of ResNet-50 behind HAProxy on a 2-core VM, each replica with one ingress process, closed
loops and open loops at 50 % and 20 % of the peak: all 18 runs within 20 % on throughput and 30 % on
p99 with the weights (15 at equal weights: the MLP's open loops with 2 and 3 replicas miss).

Not modelled (where predictions and measurements part, `bench.plan_validation`): the rest of the
operating system's scheduling (wake-up order and time slices: on 2 cores running a replica's
sub-millisecond hops, HAProxy and the load generator, the tiny MLP's open-loop p99 at half the
node's capacity is underestimated 1.5x to 2.8x when each replica runs the default 2 ingress
processes); a replica's own processes apart (ingress, engine and worker are one front loop and the
batcher here: the front's per-wake-up cost and the answer's way back through it stand for the
hand-offs, which holds for one ingress process per replica); CPU per request that grows with the
number of processes taking turns on a node's cores beyond what the wake-ups explain (with 2 ingress
processes per replica, 3 replicas are 15 processes on 2 cores, and the tiny MLP's CPU per request in
a closed loop is 25-35 % above the simulated); a
replica kept busy whose processes are still evicted from the caches by the others' (the idle cost
applies only to a replica with nothing in flight); pauses of a whole process (garbage collection,
housekeeping threads); connection set-up; network time beyond `balancer_s` and `overhead_s`; a
client's own timeouts and retries (every request waits for its outcome).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from servewell_plan.des_engine import FleetRun, LoadInput
from servewell_plan.des_result import SimResult, WindowStats, build_bins
from servewell_plan.model import Fault, FleetSpec, Trace

__all__ = ["ClosedLoad", "OpenLoad", "SimResult", "WindowStats", "simulate"]


@dataclass(frozen=True, slots=True)
class OpenLoad:
    """Poisson arrivals at `trace.rate_at(t)` for the trace's duration; its faults happen at their
    times and `trace.urgent_share` of the requests use the urgent lane."""

    trace: Trace


@dataclass(frozen=True, slots=True)
class ClosedLoad:
    """`clients` clients, all starting at 0, each sending its next request as soon as the previous
    one is answered, refused or lost (+ `think_s`), until `duration_s`."""

    clients: int
    duration_s: float
    think_s: float = 0.0
    faults: tuple[Fault, ...] = ()


def poisson_arrivals(trace: Trace, gen: np.random.Generator) -> np.ndarray:
    """Sorted arrival times of a Poisson process at the trace's piecewise-constant rates."""
    rates = np.asarray(trace.rates_rps, dtype=float)
    counts = gen.poisson(np.maximum(rates, 0.0) * trace.step_s)
    steps = np.repeat(np.arange(rates.size), counts)
    return np.sort((steps + gen.random(steps.size)) * trace.step_s)


def _load_input(load: OpenLoad | ClosedLoad, gen: np.random.Generator) -> LoadInput:
    if isinstance(load, ClosedLoad):
        if load.clients < 1 or load.duration_s <= 0:
            raise ValueError(f"a closed load needs clients >= 1 and a duration > 0, got {load}")
        return LoadInput(load.duration_s, [], [], load.clients, load.think_s, load.faults)
    trace = load.trace
    arrivals = poisson_arrivals(trace, gen)
    urgent = gen.random(arrivals.size) < trace.urgent_share
    return LoadInput(trace.duration_s, arrivals.tolist(), urgent.tolist(), 0, 0.0, trace.faults)


def _check(fleet: FleetSpec, bin_s: float) -> None:
    r = fleet.replica
    if fleet.replicas < 1:
        raise ValueError(f"a fleet needs at least one replica, got {fleet.replicas}")
    if r.instances < 1 or r.max_batch_size < 1 or r.threads < 1 or r.max_queue < 0:
        raise ValueError(f"a replica needs instances, max_batch_size, threads >= 1 and max_queue >= 0: {r}")
    if min(r.front_s, r.front_fixed_s, r.alpha_s, r.beta_s, r.max_wait_s, r.jitter_cv) < 0 or r.batch_s(1) <= 0:
        raise ValueError(f"stage times must be >= 0 and a batch must take some time: {r}")
    if bin_s <= 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")


def simulate(
    fleet: FleetSpec,
    load: OpenLoad | ClosedLoad,
    *,
    seed: int = 0,
    bin_s: float = 10.0,
    slo_s: float | None = None,
) -> SimResult:
    """Run `fleet` under `load`, request by request. Same inputs and seed, same result."""
    _check(fleet, bin_s)
    arrival_seq, *engine_seqs = np.random.SeedSequence(seed).spawn(4)
    load_input = _load_input(load, np.random.default_rng(arrival_seq))
    out = FleetRun(fleet, load_input, engine_seqs, bin_s).run()
    arrival_s = np.asarray(out.arrival_s, dtype=np.float64)
    latency_s = np.asarray(out.latency_s, dtype=np.float64)
    status = np.asarray(out.status, dtype=np.int8)
    bins = build_bins(
        arrival_s,
        latency_s,
        status,
        bin_s=bin_s,
        horizon_s=load_input.horizon_s,
        slo_s=slo_s,
        ready_area=out.ready_area,
        paid_area=out.paid_area,
        depth_sum=out.depth_sum,
        depth_n=out.depth_n,
    )
    return SimResult(bin_s, slo_s, arrival_s, latency_s, status, bins, float(sum(out.paid_area)), out.replica_cpu_s)
