"""The fleet figure we publish: a day peaking at 100,000 req/s on the ResNet-50 curve measured on this
machine, each autoscaling policy's SLO attainment and replica-hours, and the autoscaling targets the
Kustomize components ship with, derived from the same plan.

    .venv/bin/python -m bench.fleet [--curve bench/data/resnet50-curve.json] [--quick]

Three parts:
1. `servewell plan`'s recommendation for the curve, the SLO and the 24-hour diurnal trace (with
   bursts), pods of --instances instances;
2. scenarios on the request-level simulator, with a fleet small enough to simulate request by
   request (peak --scenario-rps): a flash crowd (10x in 30 s), a replica lost and a zone lost (3
   zones) at the peak of a steady load, and the diurnal day compressed into two hours; each under a
   fixed fleet and the three autoscaling signals;
3. the day at 100,000 req/s on the fluid model (too many requests to simulate one by one), after a
   cross-check of the fluid model against the request-level one on the compressed day.
Writes bench/results/fleet.json and bench/results/fleet-*.png, prints the tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from servewell_plan import traces
from servewell_plan.command import outcomes_table, plan_from_curve, summary
from servewell_plan.curve import read_curves
from servewell_plan.fleet_run import POLICIES, FleetOutcome, run_policy
from servewell_plan.model import BalancerPolicy, Trace
from servewell_plan.plots import plot_outcomes
from servewell_plan.sizing import Plan, PlanInputs, make_plan

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DEFAULT_CURVE = ROOT / "bench" / "data" / "resnet50-curve.json"
SHIPPED = ROOT / "bench" / "data" / "fleet-targets.json"
BALANCER_REPLICAS = 1000
#: Multiples of the plan's target tried per policy on the request-level day.
TARGET_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)


def outcome_doc(o: FleetOutcome) -> dict[str, Any]:
    """An outcome without its bins (they go to the plots)."""
    return {k: v for k, v in asdict(o).items() if k != "bins"}


def scenario_traces(peak_rps: float, quick: bool) -> dict[str, Trace]:
    """The request-level scenarios at `peak_rps`."""
    hold = 300.0 if quick else 900.0
    steady = traces.steady(peak_rps, hold + 300.0)
    day = traces.compressed(traces.diurnal(peak_rps, seed=1), 1800.0 if quick else 7200.0)
    return {
        "flash crowd (10x in 30 s)": traces.flash_crowd(peak_rps / 10, hold_s=hold),
        "replica lost": traces.with_faults(steady, traces.replica_lost(300.0)),
        "zone lost (1 of 3)": traces.with_faults(steady, traces.zone_lost(300.0)),
        "day in 2 h": day,
    }


def with_target(plan: Plan, policy: str, value: float | None) -> Plan:
    """The plan with `policy`'s target set to `value` (None: unchanged)."""
    if value is None or policy == "fixed":
        return plan
    if policy == "cpu":
        return replace(plan, cpu_target=value)
    if policy == "queue_depth":
        return replace(plan, queue_depth_target=value)
    return replace(plan, queue_wait_target_s=value)


def target_of(plan: Plan, policy: str) -> float:
    return {"cpu": plan.cpu_target, "queue_depth": plan.queue_depth_target,
            "queue_wait": plan.queue_wait_target_s}[policy]


def target_search(plan: Plan, trace: Trace, args: argparse.Namespace, fidelity: str,
                  balancer: BalancerPolicy) -> tuple[list[dict[str, Any]], dict[str, float], list[FleetOutcome]]:
    """Each autoscaled policy at the plan's target x TARGET_FACTORS: the cheapest target whose SLO
    attainment meets the error budget (else the best attainment) is chosen. Rows, choices, and the
    chosen outcome of each policy (the fixed fleet first)."""
    rows, chosen = [], {}
    best = [run_policy(plan, trace, "fixed", balancer=balancer, seed=args.seed, fidelity=fidelity)]
    budget = plan.inputs.error_budget
    print(f"{'policy':12} {'target':>10} {'within SLO':>11} {'replica-hours':>14} {'max replicas':>13}")
    for policy in POLICIES[1:]:
        tried = []
        for factor in TARGET_FACTORS:
            value = target_of(plan, policy) * factor
            if policy == "cpu":
                value = min(0.95, value)
            o = run_policy(with_target(plan, policy, value), trace, policy, balancer=balancer, seed=args.seed,
                           fidelity=fidelity)
            tried.append((value, o))
            rows.append({"policy": policy, "target": value, "factor": factor, **outcome_doc(o)})
            print(f"{policy:12} {value:>10.4g} {o.slo_attainment:>11.4%} {o.replica_hours:>14.1f} "
                  f"{o.max_replicas:>13.0f}")
        meeting = [(o.replica_hours, value, o) for value, o in tried if o.slo_attainment >= 1 - budget]
        pick = min(meeting, key=lambda m: m[0])[1:] if meeting else max(tried, key=lambda t: t[1].slo_attainment)
        chosen[policy] = pick[0]
        best.append(pick[1])
    return rows, chosen, best


def balancers(plan: Plan, args: argparse.Namespace) -> list[dict[str, Any]]:
    """A steady load on a fixed fleet of BALANCER_REPLICAS at the plan's operating point (what each pod
    carries at the peak with every zone up), under each balancer."""
    assert plan.operating is not None
    rate = BALANCER_REPLICAS * plan.operating.utilization * plan.capacity_rps
    sized = replace(plan, replicas_with_failover=BALANCER_REPLICAS)
    trace = traces.steady(rate, 60.0 if args.quick else 180.0)
    outcomes = [run_policy(sized, trace, "fixed", balancer=b, seed=args.seed, fidelity="request")
                for b in BalancerPolicy]
    print(f"\n{BALANCER_REPLICAS} replicas, steady {rate:.0f} req/s (request level):")
    print(outcomes_table(outcomes))
    return [outcome_doc(o) for o in outcomes]


def run_all(plan_inputs: PlanInputs, args: argparse.Namespace) -> dict[str, Any]:
    curve = read_curves(args.curve)[0]
    started = time.monotonic()
    plan = plan_from_curve(curve, plan_inputs, instances=args.instances, seed=args.seed)
    print("\n".join(plan.reasoning))
    doc: dict[str, Any] = {"curve": str(args.curve), "slo_p99_ms": args.slo_p99_ms, "plan": summary(plan),
                           "plan_s": round(time.monotonic() - started, 1), "scenarios": {}}
    if plan.operating is None:
        return doc
    # The scenarios: the same fitted pod, each sized by the plan for its own trace (its trough sets
    # minReplicas), a fleet small enough to simulate request by request.
    for name, trace in scenario_traces(args.scenario_rps, args.quick).items():
        zones = 3 if "zone" in name else 1
        scenario_plan = make_plan(plan.fit, plan.table, plan.rows, replace(plan_inputs, trace=trace, zones=zones))
        outcomes = [run_policy(scenario_plan, trace, policy, zones=zones, balancer=BalancerPolicy.LEAST_CONNECTIONS,
                               seed=args.seed, fidelity="request") for policy in POLICIES]
        print(f"\n{name} (peak {args.scenario_rps:g} req/s, request level):")
        print(outcomes_table(outcomes))
        doc["scenarios"][name] = [outcome_doc(o) for o in outcomes]
        plot_outcomes(outcomes, trace, plan_inputs.slo_s, RESULTS / f"fleet-{name.split()[0]}.png")
        if name == "day in 2 h":
            fluid = [run_policy(scenario_plan, trace, policy, seed=args.seed, fidelity="fluid") for policy in POLICIES]
            print("the same day on the fluid model (the cross-check):")
            print(outcomes_table(fluid))
            doc["cross_check_fluid"] = [outcome_doc(o) for o in fluid]
            print("\ntargets tried on the day in 2 h (request level, least connections):")
            doc["target_search_request"], doc["targets_request"], _ = target_search(
                scenario_plan, trace, args, "request", BalancerPolicy.LEAST_CONNECTIONS)
    doc["balancers"] = balancers(plan, args)
    # The day at full scale, on the fluid model (each pod's queue as the latency table has it: Poisson
    # arrivals, i.e. random routing, what a Kubernetes Service does by default); its targets searched
    # the same way: those are the ones to ship.
    print(f"\ntargets tried on the day peaking at {args.peak_rps:g} req/s (fluid model):")
    doc["target_search"], doc["targets"], outcomes = target_search(plan, plan_inputs.trace, args, "fluid",
                                                                   BalancerPolicy.ROUND_ROBIN)
    print(f"\nthe day peaking at {args.peak_rps:g} req/s (fluid model), each policy at its chosen target "
          f"{ {k: round(v, 4) for k, v in doc['targets'].items()} }:")
    print(outcomes_table(outcomes))
    doc["day"] = [outcome_doc(o) for o in outcomes]
    plot_outcomes(outcomes, plan_inputs.trace, plan_inputs.slo_s, RESULTS / "fleet-full-day.png")
    return doc


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--curve", type=Path, default=DEFAULT_CURVE)
    parser.add_argument("--slo-p99-ms", type=float, default=500.0)
    parser.add_argument("--peak-rps", type=float, default=100_000.0)
    parser.add_argument("--scenario-rps", type=float, default=1_000.0)
    parser.add_argument("--instances", type=int, default=None, help="instances per pod (default: as measured)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    started = time.time()
    inputs = PlanInputs(args.slo_p99_ms / 1000, 0.001, traces.diurnal(args.peak_rps, seed=args.seed), zones=3)
    doc = run_all(inputs, args)
    doc.update({"started_at": started, "elapsed_s": round(time.time() - started, 1), "args": vars(args)})
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fleet.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if not args.quick and "targets" in doc:
        SHIPPED.write_text(json.dumps(shipped_targets(doc), indent=1) + "\n")
        print(f"wrote {SHIPPED.relative_to(ROOT)}: the targets deploy/kubernetes ships")
    return 0


def shipped_targets(doc: dict[str, Any]) -> dict[str, Any]:
    """The targets the Kustomize components ship: each policy's choice on the full day (fluid model:
    each pod's queue as under random routing, what a Kubernetes Service does), with the choices under
    least connections (request level, the compressed day) beside them."""
    chosen, behind_lc = doc["targets"], doc.get("targets_request", {})
    curve = Path(doc["curve"]).resolve()
    shown = curve.relative_to(ROOT) if curve.is_relative_to(ROOT) else curve
    return {"from": "python -m bench.fleet", "curve": str(shown), "slo_p99_ms": doc["slo_p99_ms"],
            "queue_depth": round(chosen["queue_depth"], 3), "queue_wait_s": round(chosen["queue_wait"], 3),
            "cpu_utilization": round(chosen["cpu"], 3),
            "least_connections": {k: round(v, 4) for k, v in behind_lc.items()},
            "min_replicas": doc["plan"]["min_replicas"], "max_replicas": doc["plan"]["max_replicas"]}


if __name__ == "__main__":
    sys.exit(main())
