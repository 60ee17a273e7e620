"""The fleet's own events in a request-level run: pods becoming ready, faults, autoscaler syncs, and
the scrapes behind the bins' queue depth. Rare next to requests, so they live apart from the hot
path in `des_engine`.

- REPLICA_LOST: one ready pod, drawn with the run's seed among the ready pods in creation order,
  dies; every request it holds (front, batcher, running batches) fails. ZONE_LOST: every live pod
  of zone 0 dies the same way, and zone 0 takes no new pods. The ReplicaSet replaces at once each
  dead pod that counted towards spec.replicas (starting or ready, not draining); a replacement is
  ready after pod_start_s + cold_start_s.
- Syncs: every sync_s from sync_s while the load lasts; spec.replicas is kept at 1 at least.
  Scale-up creates pods (ready after the same delay); scale-down is `PodFleet.remove`.
- Scrapes: SCRAPES_PER_BIN instants per bin, in the middle of equal slices (never on a bin edge);
  each adds the mean waiting requests per ready pod to its bin. With a QUEUE_DEPTH autoscaler
  averaging over metric_window_s, they also keep each ready pod's depth for it (10 per window at
  least).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from servewell_plan.des_pod import Pod
from servewell_plan.model import FaultKind

if TYPE_CHECKING:
    from servewell_plan.des_engine import FleetRun

# Event kinds of the fleet (des_engine's request events use 0-5).
POD_READY, SCRAPE, SYNC, FAULT = range(6, 10)
#: Queue-depth scrapes per bin (the bins' queue_depth is the mean of these instants).
SCRAPES_PER_BIN = 10


def start_fleet_events(run: FleetRun) -> None:
    """Schedule the faults, the first sync and the first scrape."""
    horizon = run.horizon_s
    for fault in run.load.faults:
        if fault.at_s < horizon:
            run.push(fault.at_s, FAULT, fault.kind)
    scrape_s = run.bin_s / SCRAPES_PER_BIN
    probe = run.probe
    if probe is not None:
        if probe.sync_s < horizon:
            run.push(probe.sync_s, SYNC)
        if probe.scrape_depths:
            scrape_s = min(scrape_s, probe.depth_window_s / 10)
    run.push(scrape_s / 2, SCRAPE, scrape_s)


def handle_fleet_event(run: FleetRun, kind: int, t: float, a: Any) -> None:
    """One fleet event at `t` (`a`: the event's argument)."""
    if kind == POD_READY:
        run.fleet.make_ready(a, t)
    elif kind == SCRAPE:
        _scrape(run, t, a)
    elif kind == SYNC:
        _sync(run, t)
    elif kind == FAULT:
        _fault(run, t, a)
    else:
        raise ValueError(f"unknown event kind {kind}")


def create_pods(run: FleetRun, t: float, count: int) -> None:
    """`count` new pods at `t`, ready after the fleet's start delay."""
    delay = run.start_delay_s
    pods = run.fleet.create(t, count, ready=delay <= 0)
    if delay > 0:
        for pod in pods:
            run.push(t + delay, POD_READY, pod)


def _scrape(run: FleetRun, t: float, scrape_s: float) -> None:
    ready = run.fleet.ready
    if ready:
        depths = [pod.waiting() for pod in ready]
        index = int(t // run.bin_s)
        if index < len(run.depth_sum):
            run.depth_sum[index] += sum(depths) / len(depths)
            run.depth_n[index] += 1
        if run.probe is not None and run.probe.scrape_depths:
            for pod, depth in zip(ready, depths, strict=True):
                pod.depth_samples.append((t, depth))
    if t + scrape_s < run.horizon_s:
        run.push(t + scrape_s, SCRAPE, scrape_s)


def _sync(run: FleetRun, t: float) -> None:
    probe = run.probe
    assert probe is not None
    clock = (t, t) if run.node is None else run.node.clock(t)
    desired = max(1, probe.sync(t, clock, run.fleet, run.desired))
    if desired > run.desired:
        create_pods(run, t, desired - run.desired)
    elif desired < run.desired:
        run.fleet.remove(t, run.desired - desired)
    run.desired = desired
    if t + probe.sync_s < run.horizon_s:
        run.push(t + probe.sync_s, SYNC)


def _fault(run: FleetRun, t: float, kind: FaultKind) -> None:
    fleet = run.fleet
    victims: list[Pod]
    if kind is FaultKind.REPLICA_LOST:
        if not fleet.ready:
            return
        ready = sorted(fleet.ready, key=lambda pod: pod.serial)
        victims = [ready[int(run.fault_gen.integers(len(ready)))]]
    else:
        victims = fleet.lose_zone(0)
    replace = 0
    for pod in victims:
        rids = pod.take_requests()
        replace += fleet.kill(pod, t)
        if run.node is not None:
            run.node.cancel_pod(t, pod)
        for rid in rids:
            run.fail(rid, t)
    create_pods(run, t, replace)
