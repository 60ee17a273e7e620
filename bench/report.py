"""The printed tables, the latency-vs-load plot, and the end of a benchmark of rounds."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servewell.perf.report import table


@dataclass(slots=True, frozen=True)
class TargetRow:
    """One target of the issue: what was measured, against what limit, and whether it held."""

    key: str
    name: str
    measured: str
    limit: str
    passed: bool | None  # None: could not be measured in this run
    note: str = ""

    @property
    def verdict(self) -> str:
        """PASS, FAIL or N/A."""
        return "N/A" if self.passed is None else ("PASS" if self.passed else "FAIL")


def targets_table(rows: list[TargetRow]) -> str:
    """The target table `make bench` prints."""
    body = [[r.key, r.name, r.measured, r.limit, r.verdict] for r in rows]
    text = table(["#", "target", "measured", "limit", "result"], body)
    notes = [f"  {r.key}: {r.note}" for r in rows if r.note]
    return text + ("\n\nnotes:\n" + "\n".join(notes) if notes else "")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def runs_table(runs: dict[str, dict]) -> str:
    """One line per load run: offered load, throughput, latency percentiles, errors, mean batch."""
    body = []
    for name, doc in runs.items():
        normal = doc["classes"].get("normal", {}).get("latency_ms", {})
        urgent = doc["classes"].get("urgent", {}).get("latency_ms", {})
        load = f"{doc['concurrency']} clients" if doc["mode"] == "closed" else f"{doc['rate']:.1f}/s"
        errors = ",".join(f"{k}:{v}" for k, v in doc["error_codes"].items()) or "-"
        if doc["client_saturated"]:
            errors += f" client_saturated:{doc['client_saturated']}"
        if doc["unfinished"]:
            errors += f" unfinished:{doc['unfinished']}"
        body.append([
            name, load, f"{doc['throughput_rps']:.1f}", _ms(normal.get("p50")), _ms(normal.get("p95")),
            _ms(normal.get("p99")), _ms(normal.get("max")),
            f"{_ms(urgent.get('p99'))} (n={urgent.get('n', 0)})" if urgent else "-",
            "-" if doc.get("mean_batch_size") is None else f"{doc['mean_batch_size']:.2f}", errors,
        ])
    return table(["run", "load", "ok/s", "p50 ms", "p95 ms", "p99 ms", "max ms", "urgent p99 ms", "batch", "errors"],
                 body)


def plot_latency_vs_load(sweep: dict[str, list[dict]], saturation_rps: float | None, title: str, path: Path) -> None:
    """p50/p95/p99 latency against offered load, one colour per policy (log latency axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    colours = {"idle": "tab:blue", "window": "tab:orange", "adaptive": "tab:green"}
    styles = {"p50": ":", "p95": "--", "p99": "-"}
    for policy, docs in sweep.items():
        points = sorted(docs, key=lambda d: d["offered_rps"])
        xs = [d["offered_rps"] for d in points]
        for q, style in styles.items():
            ys = [d["classes"]["normal"]["latency_ms"][q] for d in points]
            if all(y is None for y in ys):
                continue
            ax.plot(xs, ys, style, marker="o", markersize=3, color=colours.get(policy), label=f"{policy} {q}")
    if saturation_rps:
        ax.axvline(saturation_rps, color="grey", linewidth=1)
        ax.text(saturation_rps, 0.02, " closed-loop saturation", rotation=90, fontsize=8, color="grey",
                ha="right", va="bottom", transform=ax.get_xaxis_transform())
    ax.set_yscale("log")
    ax.set_xlabel("offered load (requests/s, open loop, Poisson arrivals)")
    ax.set_ylabel("latency from scheduled arrival (ms)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def median_over(rounds: list[dict[str, Any]]) -> Callable[[Callable[[dict[str, Any]], float]], float]:
    """`median(f)`: the median over `rounds` of `f(round)` (a benchmark's goal figures)."""
    def median(f: Callable[[dict[str, Any]], float]) -> float:
        return statistics.median(f(row) for row in rounds)

    return median


def finish_rounds(report: dict[str, Any], rounds: list[dict[str, Any]],
                  print_table: Callable[[dict[str, Any]], None], out: Path) -> None:
    """Keep the rounds beside their summary, print the goals table, write the JSON."""
    report["rounds"] = rounds
    print_table(report)
    out.write_text(json.dumps(report, indent=2))
    print(f"written to {out}")
