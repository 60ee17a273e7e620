"""What `servewell tune` prints and writes: the candidate table, the recommendation with its
noise caveat, the model.yaml block, CSV/JSON and the plot."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from servewell.perf.report import PlotPoint, ms, plot_latency_vs_throughput, table
from servewell.perf.tuner import Candidate, Measurement, Recommendation

#: Candidates drawn on the plot (the best ones and the baseline): more is unreadable.
PLOT_SERIES = 6


def ranked(results: dict[str, Measurement], slo_ms: float) -> list[Measurement]:
    """Measured candidates, best score first; failures last."""
    return sorted(results.values(), key=lambda m: (m.failure is None, m.score(slo_ms)), reverse=True)


def candidates_table(results: dict[str, Measurement], slo_ms: float, baseline: Candidate,
                     chosen: Candidate | None) -> str:
    """One row per candidate: its worst run's best point within the SLO, its peak throughput, runs
    and spread."""
    rows = []
    for m in ranked(results, slo_ms):
        mark = "*" if chosen is not None and m.candidate.key == chosen.key else " "
        note = "current settings" if m.candidate.key == baseline.key else ""
        if m.failure is not None:
            rows.append([mark, m.candidate.describe(), "-", "-", "-", "-", "-", "-", "0", "-",
                         f"failed: {m.failure[:60]}"])
            continue
        best = m.quoted_point(slo_ms)
        peak = max((p for run in m.runs for p in run), key=lambda p: p.throughput_rps, default=None)
        spread = m.spread(slo_ms)
        scores = m.run_scores(slo_ms)
        rows.append([
            mark, m.candidate.describe(),
            f"{m.score(slo_ms):.1f}" if best else "none",
            str(best.concurrency) if best else "-",
            ms(best.p50_ms) if best else "-", ms(best.p90_ms) if best else "-", ms(best.p99_ms) if best else "-",
            f"{peak.throughput_rps:.1f} (p99 {ms(peak.p99_ms)})" if peak else "-",
            str(len(m.runs)),
            "-" if spread is None else f"{spread * 100:.0f}% ({'/'.join(f'{s:.0f}' for s in scores)})",
            note,
        ])
    return table(["", "setting", "ok/s in SLO (worst run)", "clients", "p50 ms", "p90 ms", "p99 ms", "peak ok/s",
                  "runs", "spread", "note"], rows)


def recommendation_text(rec: Recommendation | None, slo_ms: float, results: dict[str, Measurement]) -> str:
    """The verdict, the comparison with the current settings, and how much of it is noise."""
    if rec is None:
        lows = [(p.p99_ms, m.candidate) for m in results.values() for run in m.runs for p in run
                if p.p99_ms is not None and p.errors == 0]
        lowest = min(lows, key=lambda x: x[0], default=None)
        seen = f"; the lowest p99 measured was {lowest[0]:.1f} ms ({lowest[1].describe()})" if lowest else ""
        return f"no setting met p99 <= {slo_ms:g} ms without errors in every run{seen}"
    best, point = rec.best, rec.point
    score = best.score(slo_ms)
    runs = len(best.runs)
    worst = f"its worst of {runs} runs, " if runs > 1 else ""
    lines = [f"recommended: {best.candidate.describe()}: {score:.1f} req/s within the SLO "
             f"({worst}at {point.concurrency} clients: p50 {ms(point.p50_ms)}, p99 {ms(point.p99_ms)} ms; "
             f"SLO p99 <= {slo_ms:g} ms)"]
    if rec.baseline_score:
        lines.append(f"  {score / rec.baseline_score:.2f}x the current settings ({rec.baseline_score:.1f} req/s "
                     "within the SLO)")
    elif rec.baseline_score == 0:
        lines.append("  the current settings did not meet the SLO at any measured load")
    if rec.runner_up is not None:
        other = rec.runner_up.score(slo_ms)
        gap = (score - other) / score * 100
        lines.append(f"  runner-up: {rec.runner_up.candidate.describe()}: {other:.1f} req/s ({gap:.1f}% lower)")
    if rec.spread is not None:
        verdict = ("within that noise: the two are not told apart on this machine, either will do"
                   if rec.within_noise else "larger than that noise")
        lines.append(f"  repeated runs of the finalists differed by up to {rec.spread * 100:.0f}%; "
                     f"the gap to the runner-up is {verdict}")
    else:
        lines.append("  each setting was measured once: on a shared machine a repeat can differ by 10% or more; "
                     "a larger --budget-s repeats the two best")
    return "\n".join(lines)


def plot(results: dict[str, Measurement], slo_ms: float, baseline: Candidate, title: str, path: Path) -> None:
    """p99 against throughput along each ladder (in rising concurrency) of the best candidates
    and the baseline; a repeated run is its own line."""
    chosen = [m for m in ranked(results, slo_ms) if m.failure is None and m.runs][:PLOT_SERIES]
    base = results.get(baseline.key)
    if base is not None and base not in chosen and base.runs:
        chosen.append(base)
    series: dict[str, Sequence[PlotPoint]] = {}
    for m in chosen:
        for index, run in enumerate(m.runs):
            name = m.candidate.describe() + (f" (run {index + 1})" if index else "")
            series[name] = [PlotPoint(p.throughput_rps, {"p99": p.p99_ms}, str(p.concurrency))
                            for p in sorted(run, key=lambda p: p.concurrency) if p.throughput_rps > 0]
    plot_latency_vs_throughput(series, title, path, slo_ms=slo_ms, percentiles=("p99",))


CSV_FIELDS = ("key", "setting", "max_batch_size", "policy", "max_wait_ms", "instances", "threads", "dtype",
              "score_rps", "best_concurrency", "best_p50_ms", "best_p90_ms", "best_p99_ms", "runs", "spread",
              "failure")


def write_csv(results: dict[str, Measurement], slo_ms: float, path: Path) -> None:
    """One row per candidate."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(CSV_FIELDS))
        writer.writeheader()
        for m in ranked(results, slo_ms):
            best = m.quoted_point(slo_ms)
            spread = m.spread(slo_ms)
            writer.writerow({
                "key": m.candidate.key, "setting": m.candidate.describe(), **asdict(m.candidate),
                "dtype": m.candidate.dtype or "", "score_rps": round(m.score(slo_ms), 3),
                "best_concurrency": best.concurrency if best else "", "best_p50_ms": best.p50_ms if best else "",
                "best_p90_ms": best.p90_ms if best else "", "best_p99_ms": best.p99_ms if best else "",
                "runs": len(m.runs), "spread": "" if spread is None else round(spread, 4), "failure": m.failure or "",
            })


def results_json(results: dict[str, Measurement], slo_ms: float) -> list[dict[str, Any]]:
    """Every candidate with its runs and derived figures (`quoted_point`: its worst run's best
    point within the SLO, what the recommendation quotes)."""
    out = []
    for m in ranked(results, slo_ms):
        best = m.quoted_point(slo_ms)
        out.append({"key": m.candidate.key, "setting": m.candidate.describe(), "candidate": asdict(m.candidate),
                    "score_rps": m.score(slo_ms), "run_scores_rps": m.run_scores(slo_ms), "spread": m.spread(slo_ms),
                    "quoted_point": asdict(best) if best else None, "failure": m.failure,
                    "runs": [[asdict(p) for p in run] for run in m.runs]})
    return out
