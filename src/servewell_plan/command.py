"""`servewell plan`: read the curve, fit the replica, size the fleet, print the reasoning, and with
--simulate run the fleet through the load under each autoscaling policy."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from typing import Any

from servewell.perf.report import table, write_json
from servewell_plan import traces
from servewell_plan.curve import CurveSettings, MeasuredCurve, read_curves
from servewell_plan.extra import INSTALL_PLAN_EXTRA
from servewell_plan.fit import NodeContext, fit_replica
from servewell_plan.fleet_run import POLICIES, FleetOutcome, run_policy
from servewell_plan.latency_table import build_table
from servewell_plan.model import BalancerPolicy, Fault, FaultKind, Trace
from servewell_plan.plots import plot_outcomes
from servewell_plan.sizing import Plan, PlanInputs, check_plannable, make_plan, quantity

#: Cold start assumed when neither the curve nor --cold-start-s says.
DEFAULT_COLD_START_S = 30.0


def _settings(args: argparse.Namespace, curve: MeasuredCurve) -> CurveSettings:
    s = curve.settings
    wait = s.max_wait_s if args.max_wait_ms is None else args.max_wait_ms / 1000
    return CurveSettings(args.max_batch_size or s.max_batch_size, wait, s.instances, args.threads or s.threads,
                         "window" if wait > 0 else s.policy)


def _faults(specs: list[str]) -> tuple[Fault, ...]:
    faults = []
    for spec in specs[:16]:
        kind, _, at = spec.partition("@")
        try:
            faults.append(Fault(float(at), FaultKind(kind)))
        except ValueError:
            raise ValueError(f"--fault {spec!r}: expected replica_lost@SECONDS or zone_lost@SECONDS") from None
    return tuple(faults)


def load_of(args: argparse.Namespace) -> Trace:
    """The load the user asked for, with its faults."""
    if args.trace is not None:
        trace = traces.load_trace(args.trace)
    elif args.shape == "diurnal":
        trace = traces.diurnal(args.rps, seed=args.seed)
    elif args.shape == "flash_crowd":
        trace = traces.flash_crowd(args.rps / 10, hold_s=max(60.0, args.duration_s - 930.0))
    else:
        trace = traces.steady(args.rps, args.duration_s)
    faults = _faults(args.fault)
    return traces.with_faults(trace, *faults) if faults else trace


def _check(args: argparse.Namespace) -> None:
    if not 0 < args.slo_p99_ms <= 3_600_000:
        raise ValueError("--slo-p99-ms must be in (0, 3600000]")
    if not 0 <= args.error_budget < 1:
        raise ValueError("--error-budget must be in [0, 1)")
    if args.rps is not None and not 0 < args.rps <= 1e8:
        raise ValueError("--rps must be in (0, 1e8]")
    if not 1 <= args.zones <= 16:
        raise ValueError("--zones must be 1 to 16")
    if args.instances is not None and not 1 <= args.instances <= 256:
        raise ValueError("--instances must be 1 to 256")
    for name in ("pod_start_s", "cold_start_s", "duration_s"):
        value = getattr(args, name)
        if value is not None and not 0 <= value <= 86_400 * 7:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 604800]")


def plan_from_curve(curve: MeasuredCurve, inputs: PlanInputs, *, instances: int | None = None,
                    cold_start_s: float | None = None, seed: int = 0) -> Plan:
    """Fit `curve`, optionally give each pod `instances` instances, tabulate its latency, size the fleet;
    `ValueError` at once for a curve too thin to fit or an SLO under its unloaded p99."""
    check_plannable(curve, inputs.slo_s)
    cold = cold_start_s if cold_start_s is not None else (curve.ready_s or DEFAULT_COLD_START_S)
    # a load generator that shared the server's cores slowed it: the fit takes that out
    node = NodeContext(curve.machine_cores, curve.client_cpu_s) if curve.machine_cores and curve.client_cpu_s else None
    fit = fit_replica(curve, node=node, cold_start_s=cold, seed=seed)
    if instances is not None and instances != fit.replica.instances:
        fit = replace(fit, replica=replace(fit.replica, instances=instances))
    table_, rows = build_table(fit.replica, seed=seed)
    return make_plan(fit, table_, rows, inputs)


def build_plan(args: argparse.Namespace) -> tuple[MeasuredCurve, Plan]:
    """Everything up to the recommendation."""
    _check(args)
    curve = read_curves(args.curve)[0]
    curve = replace(curve, settings=_settings(args, curve))
    inputs = PlanInputs(args.slo_p99_ms / 1000, args.error_budget, load_of(args), args.zones, args.pod_start_s,
                        args.worker_memory_mib)
    return curve, plan_from_curve(curve, inputs, instances=args.instances, cold_start_s=args.cold_start_s,
                                  seed=args.seed)


def fit_table(plan: Plan) -> str:
    """Measured against simulated, point by point."""
    rows = [[str(p.measured.concurrency), f"{p.measured.throughput_rps:.1f}", f"{p.throughput_rps:.1f}",
             f"{p.measured.p50_s * 1000:.1f}", f"{p.p50_s * 1000:.1f}", f"{p.measured.p99_s * 1000:.1f}",
             f"{p.p99_s * 1000:.1f}"] for p in plan.fit.points]
    return table(["clients", "req/s measured", "simulated", "p50 ms measured", "simulated", "p99 ms measured",
                  "simulated"], rows)


def summary(plan: Plan) -> dict[str, Any]:
    """The recommendation as data (plan.json)."""
    r = plan.fit.replica
    return {
        "replica_model": asdict(r), "fit_error": plan.fit.error, "bottleneck": plan.fit.bottleneck,
        "capacity_rps": plan.capacity_rps, "operating_point": asdict(plan.operating) if plan.operating else None,
        "target_utilization": plan.target_utilization, "target_rps_per_replica": plan.target_rps,
        "peak_rps": plan.peak_rps, "replicas_at_peak": plan.replicas_at_peak,
        "replicas_with_failover": plan.replicas_with_failover, "min_replicas": plan.min_replicas,
        "max_replicas": plan.max_replicas, "scale_up_s": plan.scale_up_s,
        "growth_during_scale_up": plan.growth_during_scale_up, "ideal_replica_hours": plan.ideal_replica_hours,
        "targets": {"queue_depth": plan.queue_depth_target, "queue_wait_s": plan.queue_wait_target_s,
                    "cpu_utilization": plan.cpu_target},
        "pod": {"cpu": r.cores, "memory_mib": plan.memory_mib, "instances": r.instances, "threads": r.threads,
                "max_batch_size": r.max_batch_size, "max_wait_ms": r.max_wait_s * 1000},
        "cpu_cores_used": {"at_target": plan.cpu_at_target_cores, "at_operating_point": plan.cpu_at_operating_cores},
        "smaller_pod": None if plan.smaller_pod_cores is None else {
            "cpu": plan.smaller_pod_cores, "cpu_limit": r.cores,
            "cpu_utilization_target": plan.cpu_target * r.cores / plan.smaller_pod_cores},
        "model_threads_to_fill": plan.model_threads_to_fill,
        "reasoning": plan.reasoning,
    }


def manifests_text(plan: Plan) -> str:
    """The values to put in the HPA / KEDA components."""
    wait = plan.queue_wait_target_s
    return "\n".join([
        "components/hpa/hpa.yaml:",
        f"  minReplicas: {plan.min_replicas}", f"  maxReplicas: {plan.max_replicas}",
        f"  servewell_queue_depth averageValue: {quantity(plan.queue_depth_target)}",
        f"  servewell_queue_wait_seconds_mean averageValue: {wait * 1000:.0f}m",
        "components/keda/scaledobject.yaml:",
        f"  minReplicaCount: {plan.min_replicas}", f"  maxReplicaCount: {plan.max_replicas}",
        f"  queue-depth threshold: \"{plan.queue_depth_target:.3g}\"", f"  queue-wait threshold: \"{wait:.3f}\"",
        "the Deployment's container (base/deployment.yaml):",
        f"  resources.requests.cpu: \"{plan.cores:g}\""
        + (f", memory: {math.ceil(plan.memory_mib)}Mi" if plan.memory_mib else ""),
        *([f"  or the smaller pod (reasoning 8): resources.requests.cpu: \"{quantity(plan.smaller_pod_cores)}\", "
           f"limits.cpu: \"{plan.cores:g}\""] if plan.smaller_pod_cores is not None else []),
        f"  model.yaml: instances {plan.fit.replica.instances}, threads {plan.fit.replica.threads}, "
        f"max_batch_size {plan.fit.replica.max_batch_size}",
    ])


def outcomes_table(outcomes: list[FleetOutcome]) -> str:
    """One row per policy."""
    rows = [[o.policy, o.balancer, o.fidelity, f"{o.slo_attainment:.4%}", f"{o.rejected_share:.4%}",
             f"{o.failed_share:.4%}", "-" if o.worst_bin_p99_s is None else f"{o.worst_bin_p99_s * 1000:.0f}",
             f"{o.replica_hours:.1f}", f"{o.max_replicas:.0f}"] for o in outcomes]
    return table(["policy", "balancer", "model", "within SLO", "refused", "failed", "worst p99 ms (bin)",
                  "replica-hours", "max replicas"], rows)


def simulate_policies(plan: Plan, args: argparse.Namespace) -> list[FleetOutcome]:
    """Each policy through the plan's load."""
    return [run_policy(plan, plan.inputs.trace, policy, balancer=BalancerPolicy(args.balancer), zones=args.zones,
                       pod_start_s=args.pod_start_s, seed=args.seed, fidelity=args.fidelity)
            for policy in POLICIES]


def run_plan(args: argparse.Namespace) -> int:
    """The command."""
    try:
        curve, plan = build_plan(args)
    except (OSError, ValueError) as exc:
        print(f"servewell plan: {exc}", file=sys.stderr)
        return 2
    s = curve.settings
    print(f"{curve.model}: {len(curve.points)} points from {curve.source}, batch {s.max_batch_size}, "
          f"{s.instances}x{s.threads} threads, {s.policy}" + (f" {s.max_wait_s * 1000:g} ms" if s.max_wait_s else ""))
    print(fit_table(plan))
    print()
    print("\n".join(plan.reasoning))
    if plan.operating is None:
        return 1
    print()
    print(manifests_text(plan))
    doc: dict[str, Any] = {"tool": "servewell plan", "curve": str(args.curve), "slo_p99_ms": args.slo_p99_ms,
                           "trace": {"name": plan.inputs.trace.name, "step_s": plan.inputs.trace.step_s,
                                     "steps": len(plan.inputs.trace.rates_rps)}, "plan": summary(plan)}
    if args.simulate:
        outcomes = simulate_policies(plan, args)
        print()
        print(outcomes_table(outcomes))
        doc["simulation"] = [{k: v for k, v in asdict(o).items() if k != "bins"} | {
            "bins": [asdict(b) for b in o.bins]} for o in outcomes]
        if args.out is not None and not args.no_plot:
            try:
                plot_outcomes(outcomes, plan.inputs.trace, plan.inputs.slo_s, args.out / "simulation.png")
            except ImportError:
                print(f"servewell plan: the plot needs matplotlib ({INSTALL_PLAN_EXTRA})", file=sys.stderr)
    if args.out is not None:
        write_json(json.loads(json.dumps(doc, default=str)), args.out / "plan.json")
        print(f"\nwrote {args.out / 'plan.json'}")
    return 0
