"""The simulation's plot: offered load, replicas and p99 over time, one line per policy (matplotlib,
from the `plan` extra, imported only to draw)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from servewell_plan.model import Trace

if TYPE_CHECKING:
    from servewell_plan.fleet_run import FleetOutcome


def plot_outcomes(outcomes: Sequence[FleetOutcome], trace: Trace, slo_s: float, path: Path) -> None:
    """Three panels sharing the time axis (hours): load, replicas (all that cost), p99 per bin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (load, replicas, latency) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    hours = [i * trace.step_s / 3600 for i in range(len(trace.rates_rps))]
    load.plot(hours, trace.rates_rps, color="black", linewidth=1)
    load.set_ylabel("offered req/s")
    load.set_title(f"{trace.name}: each autoscaling policy")
    for o in outcomes:
        t = [b.start_s / 3600 for b in o.bins]
        replicas.plot(t, [b.replicas_total for b in o.bins], label=o.policy, linewidth=1)
        latency.plot(t, [None if b.p99_s is None else b.p99_s * 1000 for b in o.bins], label=o.policy, linewidth=1)
    replicas.set_ylabel("replicas")
    replicas.legend(loc="upper left")
    latency.axhline(slo_s * 1000, color="red", linestyle="--", linewidth=1, label="SLO")
    latency.set_ylabel("p99 ms (per bin)")
    latency.set_yscale("log")
    latency.set_xlabel("hours")
    latency.legend(loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
