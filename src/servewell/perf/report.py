"""What `servewell bench` prints and writes: the step table, CSV, JSON, and the
latency-vs-throughput plot (matplotlib, from the `bench` extra, imported only to draw)."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from servewell.perf.sweep import StepResult

#: What to install when the plot is asked for and matplotlib is missing.
PLOT_EXTRA = "pip install 'servewell[bench]'"


class MissingDependency(RuntimeError):
    """An optional dependency a requested output needs is not installed."""


def require_matplotlib() -> None:
    """Fail early and clearly (before any measurement) when the plot cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingDependency(f"the PNG plot needs matplotlib: {PLOT_EXTRA} (or pass --no-plot)") from None


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain text table, columns left-aligned, one line of dashes under the header."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def ms(value: float | None) -> str:
    """A latency cell."""
    return "-" if value is None else f"{value:.1f}"


def _errors(result: StepResult) -> str:
    parts = [f"{status}:{n}" for status, n in result.status_counts.items() if status not in ("200", "OK")]
    parts += [f"code {code}:{n}" for code, n in result.error_codes.items()]
    if result.unfinished:
        parts.append(f"unfinished:{result.unfinished}")
    if result.client_saturated:
        parts.append(f"client_saturated:{result.client_saturated}")
    return " ".join(parts) or "-"


def steps_table(results: Sequence[StepResult]) -> str:
    """One row per step: load, answers, throughput, p50/p90/p99/max, errors by status."""
    mode = results[0].mode if results else "closed"
    rows = []
    for r in results:
        rows.append([f"{r.level:g}", f"{r.offered_rps:.1f}", str(r.ok), f"{r.throughput_rps:.1f}", ms(r.p50_ms),
                     ms(r.p90_ms), ms(r.p99_ms), ms(r.max_ms), _errors(r)])
    level = "concurrency" if mode == "closed" else "rate/s"
    return table([level, "offered/s", "ok", "ok/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "errors"], rows)


CSV_FIELDS = ("mode", "level", "window_s", "sent", "arrived", "answered", "ok", "errors", "unfinished",
              "client_saturated",
              "offered_rps", "throughput_rps", "p50_ms", "p90_ms", "p95_ms", "p99_ms", "mean_ms", "max_ms",
              "status_counts", "error_codes", "server_queue_ms", "server_compute_ms", "warmup_dropped")


def csv_row(result: StepResult) -> dict[str, Any]:
    """A step flattened for CSV: dict columns as `key=value;...`."""
    doc = asdict(result)
    doc["status_counts"] = ";".join(f"{k}={v}" for k, v in result.status_counts.items())
    doc["error_codes"] = ";".join(f"{k}={v}" for k, v in result.error_codes.items())
    server = doc.pop("server_ms")
    doc["server_queue_ms"] = server.get("queue")
    doc["server_compute_ms"] = server.get("compute")
    return {k: ("" if doc[k] is None else doc[k]) for k in CSV_FIELDS}


def write_csv(results: Sequence[StepResult], path: Path) -> None:
    """One row per step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(CSV_FIELDS))
        writer.writeheader()
        for result in results:
            writer.writerow(csv_row(result))


def write_json(doc: dict[str, Any], path: Path) -> None:
    """Pretty JSON, written whole (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def _pyplot() -> Any:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclass(frozen=True, slots=True)
class PlotPoint:
    """One measured step on the plot: throughput, latency percentiles (ms), and its load level."""

    throughput_rps: float
    latency_ms: dict[str, float | None]
    label: str


def step_points(results: Sequence[StepResult]) -> list[PlotPoint]:
    """The plot points of a sweep's steps (those with any successful answer)."""
    return [PlotPoint(r.throughput_rps, {"p50": r.p50_ms, "p90": r.p90_ms, "p99": r.p99_ms}, f"{r.level:g}")
            for r in results if r.ok]


def plot_latency_vs_throughput(series: dict[str, Sequence[PlotPoint]], title: str, path: Path,
                               slo_ms: float | None = None,
                               percentiles: Sequence[str] = ("p50", "p90", "p99")) -> None:
    """Latency percentiles against achieved throughput, one colour per series, points joined in
    the order given (rising load) and labelled with their load level; a horizontal line at the
    SLO when given (log latency axis)."""
    plt = _pyplot()
    from matplotlib.ticker import ScalarFormatter

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    styles = {"p50": ":", "p90": "--", "p95": "-.", "p99": "-"}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (name, points) in enumerate(series.items()):
        colour = colours[index % len(colours)]
        ordered = list(points)
        xs = [p.throughput_rps for p in ordered]
        for q in percentiles:
            ys = [p.latency_ms.get(q) for p in ordered]
            if any(y is not None for y in ys):
                ax.plot(xs, ys, styles.get(q, "-"), marker="o", markersize=3, color=colour,
                        label=f"{name} {q}".strip())
        tail = percentiles[-1]
        for point in ordered:
            y = point.latency_ms.get(tail)
            if y is not None:
                ax.annotate(point.label, (point.throughput_rps, y), fontsize=7, color=colour,
                            xytext=(3, 3), textcoords="offset points")
    if slo_ms is not None:
        ax.axhline(slo_ms, color="grey", linewidth=1)
        ax.text(0.01, slo_ms, f" p99 SLO {slo_ms:g} ms", fontsize=8, color="grey", va="bottom",
                transform=ax.get_yaxis_transform())
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel("throughput (successful answers/s); points labelled with their load level")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2 if len(series) > 1 else 3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
