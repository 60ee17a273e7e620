"""The `plan` subcommand's flags. Only argparse here: `servewell`'s CLI imports this module to build
its parser, and the simulator is imported when the command runs (with the `plan` extra installed)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

PLAN_DESCRIPTION = (
    "Size a fleet from a model's measured curve (the results JSON of `servewell tune` or of a closed-loop "
    "`servewell bench`): fit a replica model to the curve on a request-level simulator, find the busiest load "
    "that meets the p99 SLO, and recommend replicas, pod size, batching and the autoscaling targets for the HPA "
    "and KEDA components, with the reasoning. --simulate runs the fleet through the load under each autoscaling "
    "policy (a fixed fleet, CPU, queue depth, queue wait) and reports SLO attainment, refusals and replica-hours."
)


def _run_plan(args: argparse.Namespace) -> int:
    from servewell_plan.extra import INSTALL_PLAN_EXTRA, missing_for_plan

    missing = missing_for_plan()
    if missing:
        print(f"servewell plan: needs the plan extra ({', '.join(missing)} not installed): {INSTALL_PLAN_EXTRA}",
              file=sys.stderr)
        return 2
    from servewell_plan.command import run_plan

    return run_plan(args)


def add_plan_parser(sub: Any) -> None:
    """Register `servewell plan` on the CLI's subparsers."""
    p = sub.add_parser("plan", help="size a fleet (replicas, pods, autoscaling targets) from a measured curve",
                       description=PLAN_DESCRIPTION)
    p.add_argument("curve", type=Path, help="tune-results.json of `servewell tune`, or results.json of "
                   "`servewell bench --concurrency ...`")
    p.add_argument("--slo-p99-ms", type=float, required=True, help="p99 latency target in milliseconds")
    p.add_argument("--error-budget", type=float, default=0.001,
                   help="share of requests that may be refused or fail (default: 0.001)")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--rps", type=float, help="peak load in requests per second (with --shape)")
    load.add_argument("--trace", type=Path, help="load over time: CSV `time_s,rate_rps` or JSON "
                      "{\"step_s\": s, \"rates_rps\": [...]}")
    p.add_argument("--shape", choices=("steady", "diurnal", "flash_crowd"), default="steady",
                   help="with --rps: steady for --duration-s, a day peaking at --rps with bursts, or a flash crowd "
                   "to --rps (10x in 30 s) (default: steady)")
    p.add_argument("--duration-s", type=float, default=3600.0, help="steady and flash crowd length (default: 3600)")
    p.add_argument("--zones", type=int, default=1, help="zones the replicas spread over: failover covers a "
                   "lost zone rather than one replica (default: 1)")
    p.add_argument("--pod-start-s", type=float, default=10.0, help="pod created -> container running (default: 10)")
    p.add_argument("--cold-start-s", type=float, default=None, help="container running -> ready: model load and "
                   "warm-up (default: what bench measured, else 30)")
    p.add_argument("--worker-memory-mib", type=float, default=None, help="one worker's resident memory, to size "
                   "the pod's memory")
    p.add_argument("--instances", type=int, default=None, help="instances per pod, if not the measured count: an "
                   "extrapolation (each instance with its own cores)")
    for flag, kind, text in (("--max-batch-size", int, "max_batch_size"), ("--max-wait-ms", float, "max_wait_ms"),
                             ("--threads", int, "threads")):
        p.add_argument(flag, type=kind, default=None, help=f"the {text} the curve was measured with, for a bench "
                       "result (bench does not record the server's settings)")
    p.add_argument("--simulate", action="store_true", help="run the fleet through the load under each policy")
    p.add_argument("--fault", action="append", default=[], metavar="KIND@SECONDS",
                   help="with --simulate: replica_lost@S or zone_lost@S (repeatable)")
    p.add_argument("--balancer", choices=("round_robin", "least_connections", "power_of_two"),
                   default="round_robin", help="with --simulate: the load balancer's policy (default: round_robin)")
    p.add_argument("--fidelity", choices=("auto", "request", "fluid"), default="auto",
                   help="with --simulate: request by request, the fluid model, or auto (request level up to 3 "
                   "million requests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write plan.json (and the simulation's JSON and plots)")
    p.add_argument("--no-plot", action="store_true", help="no PNG plots (they need matplotlib)")
    p.set_defaults(run=_run_plan)
