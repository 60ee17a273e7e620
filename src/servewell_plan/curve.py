"""A model's measured throughput/latency curve, read from what `servewell tune` or `servewell bench`
wrote, or from a plain curve file (`"tool": "servewell curve"`, what `bench.plan_validation` writes
and what any other load tool's figures can be put in): closed-loop points at rising concurrency, with
the server settings they were measured under.

The files are the user's own, but `servewell plan` still reads them as untrusted input: bounded
size, bounded number of points, finite positive figures, and a `ValueError` naming the problem.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

#: Larger curve files are refused: a tune run with every candidate repeated is well under 1 MiB.
MAX_CURVE_BYTES = 8 * 1024 * 1024
#: Points kept per curve (concurrency ladders are a few to a few dozen steps).
MAX_POINTS = 256
#: Idle points kept per curve (a handful of idle times).
MAX_IDLE_POINTS = 32
#: The batching defaults when the file does not say (`batching.policy` and `max_wait_ms`).
DEFAULT_POLICY = "idle"
DEFAULT_WAIT_MS = 25.0


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """One closed-loop step: `concurrency` clients, answers per second and latency percentiles."""

    concurrency: int
    throughput_rps: float
    p50_s: float
    p99_s: float
    errors: int = 0
    #: CPU seconds per request of the server's processes at this step (all of them), if measured
    server_cpu_s: float | None = None


@dataclass(frozen=True, slots=True)
class IdlePoint:
    """One client alone, waiting `idle_s` after each answer before sending again: the latency (and
    the server's CPU per request) of a request that finds the server idle for that long."""

    idle_s: float
    p50_s: float
    server_cpu_s: float | None = None


@dataclass(frozen=True, slots=True)
class CurveSettings:
    """The server settings the curve was measured under."""

    max_batch_size: int = 1
    max_wait_s: float = 0.0  # how long a batch waits for company (idle: 0)
    instances: int = 1
    threads: int = 1
    policy: str = DEFAULT_POLICY
    #: the model workers' niceness (model.yaml `nice`, 5 by default), when the curve says: the fit then
    #: weighs their batches by it on a shared node (`ReplicaModel.worker_nice`); None: every thread at
    #: the same weight, as before curves said it
    nice: int | None = None


@dataclass(frozen=True, slots=True)
class MeasuredCurve:
    """What `plan` builds on: points in rising concurrency, settings, and where they came from."""

    model: str
    source: str  # "servewell tune", "servewell bench", ...
    settings: CurveSettings
    points: tuple[CurvePoint, ...]
    machine_cores: int | None = None
    ready_s: float | None = None  # cold start measured by the tool (server start -> ready), if known
    #: the load generator's CPU per request when it shared `machine_cores` with the server, if known
    client_cpu_s: float | None = None
    #: lone requests after the server sat idle, rising idle time (none: not measured)
    idle_points: tuple[IdlePoint, ...] = ()

    @property
    def peak(self) -> CurvePoint:
        """The point with the highest throughput."""
        return max(self.points, key=lambda p: p.throughput_rps)

    @property
    def cores(self) -> float:
        """Cores a replica with these settings keeps busy: one per thread of every instance, plus its
        frontend's event loop."""
        return 1.0 + self.settings.instances * self.settings.threads

    @property
    def unloaded_p99_s(self) -> float | None:
        """The p99 of the one-client step (each request alone in the replica), or None when the curve
        has no such step: no load can give a replica a lower p99."""
        return next((p.p99_s for p in self.points if p.concurrency == 1), None)


def _number(value: object, what: str, *, low: float = 0.0, high: float = 1e9) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what}: {str(value)[:40]!r} is not a finite number")
    if not low <= value <= high:
        raise ValueError(f"{what}: {value:g} is outside [{low:g}, {high:g}]")
    return float(value)


def _point(raw: object, where: str, *, latency_unit_s: float = 0.001) -> CurvePoint | None:
    """One point from a tune ladder step or a bench step; None for a step that answered nothing."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: not an object")
    level = raw.get("concurrency", raw.get("level"))
    throughput = _number(raw.get("throughput_rps"), f"{where}.throughput_rps")
    if throughput == 0 or raw.get("p50_ms") is None or raw.get("p99_ms") is None:
        return None
    p50 = _number(raw.get("p50_ms"), f"{where}.p50_ms", high=1e8) * latency_unit_s
    p99 = _number(raw.get("p99_ms"), f"{where}.p99_ms", high=1e8) * latency_unit_s
    if p99 < p50:
        raise ValueError(f"{where}: p99 is below p50")
    errors = raw.get("errors", 0)
    cpu = raw.get("server_cpu_ms_per_request")
    return CurvePoint(int(_number(level, f"{where}.concurrency", low=1, high=1e6)), throughput, p50, p99,
                      int(_number(errors, f"{where}.errors")),
                      None if cpu is None else _number(cpu, f"{where}.server_cpu_ms_per_request", high=1e6) / 1000)


def _idle_points(raw_points: object, where: str) -> tuple[IdlePoint, ...]:
    """`[{"idle_ms", "p50_ms", "server_cpu_ms_per_request"?}, ...]`: absent or empty is none."""
    if raw_points is None:
        return ()
    if not isinstance(raw_points, list):
        raise ValueError(f"{where}: not a list")
    if len(raw_points) > MAX_IDLE_POINTS:
        raise ValueError(f"{where}: {len(raw_points)} points (at most {MAX_IDLE_POINTS})")
    points: dict[float, IdlePoint] = {}
    for i, raw in enumerate(raw_points):
        at = f"{where}[{i}]"
        if not isinstance(raw, dict):
            raise ValueError(f"{at}: not an object")
        idle = _number(raw.get("idle_ms"), f"{at}.idle_ms", low=0.001, high=60_000) / 1000
        p50 = _number(raw.get("p50_ms"), f"{at}.p50_ms", low=1e-6, high=1e8) / 1000
        cpu = raw.get("server_cpu_ms_per_request")
        points[idle] = IdlePoint(idle, p50, None if cpu is None else _number(
            cpu, f"{at}.server_cpu_ms_per_request", high=1e6) / 1000)
    return tuple(points[k] for k in sorted(points))


def _settings(raw: dict[str, Any], where: str) -> CurveSettings:
    policy = raw.get("policy", DEFAULT_POLICY)
    if policy not in ("window", "adaptive", "idle"):
        raise ValueError(f"{where}.policy: {policy!r} is not window, adaptive or idle")
    # adaptive waits only while the latency target allows, and never when a lone request could miss
    # it: planned as idle (no wait), the optimistic side for latency, the pessimistic for batch sizes.
    wait_ms = 0.0 if policy != "window" else _number(raw.get("max_wait_ms", DEFAULT_WAIT_MS), f"{where}.max_wait_ms",
                                                   high=60_000)
    return CurveSettings(
        max_batch_size=int(_number(raw.get("max_batch_size", 1), f"{where}.max_batch_size", low=1, high=65536)),
        max_wait_s=wait_ms / 1000,
        instances=int(_number(raw.get("instances", 1), f"{where}.instances", low=1, high=1024)),
        threads=int(_number(raw.get("threads", 1), f"{where}.threads", low=1, high=1024)),
        policy=str(policy),
        nice=None if raw.get("nice") is None else int(_number(raw["nice"], f"{where}.nice", high=19)),
    )


def _ladder(raw_points: object, where: str) -> tuple[CurvePoint, ...]:
    if not isinstance(raw_points, list) or not raw_points:
        raise ValueError(f"{where}: no measured points")
    if len(raw_points) > MAX_POINTS:
        raise ValueError(f"{where}: {len(raw_points)} points (at most {MAX_POINTS})")
    points = [p for i, raw in enumerate(raw_points) if (p := _point(raw, f"{where}[{i}]")) is not None]
    if not points:
        raise ValueError(f"{where}: no point answered a request")
    best: dict[int, CurvePoint] = {}
    for p in points:  # a repeated concurrency keeps its slower run: plan on the pessimistic figure
        if p.concurrency not in best or p.throughput_rps < best[p.concurrency].throughput_rps:
            best[p.concurrency] = p
    return tuple(best[c] for c in sorted(best))


def tune_curves(doc: dict[str, Any]) -> list[MeasuredCurve]:
    """Every measured candidate of a `servewell tune` result, the recommended one first."""
    candidates = doc.get("candidates")
    if not isinstance(candidates, list):
        raise ValueError("tune result: 'candidates' is not a list")
    recommended = (doc.get("recommendation") or {}).get("key")
    cores = doc.get("cores")
    curves = []
    for index, cand in enumerate(candidates[:MAX_POINTS]):
        where = f"candidates[{index}]"
        if not isinstance(cand, dict) or cand.get("failure") or not cand.get("runs"):
            continue
        runs = cand["runs"]
        if not isinstance(runs, list):
            raise ValueError(f"{where}.runs: not a list")
        flat = [p for run in runs[:16] if isinstance(run, list) for p in run]
        settings = cand.get("candidate")
        if not isinstance(settings, dict):
            raise ValueError(f"{where}.candidate: not an object")
        curve = MeasuredCurve(str(doc.get("model", "model"))[:128], "servewell tune", _settings(settings, where),
                              _ladder(flat, f"{where}.runs"),
                              int(cores) if isinstance(cores, int) and 0 < cores < 100_000 else None)
        curves.append((cand.get("key") != recommended, index, curve))
    if not curves:
        raise ValueError("tune result: no candidate was measured")
    return [c for _, _, c in sorted(curves, key=lambda x: (x[0], x[1]))]


def bench_curve(doc: dict[str, Any], settings: CurveSettings | None = None) -> MeasuredCurve:
    """The closed-loop steps of a `servewell bench` result. bench does not know the server's batching
    settings beyond the model's max_batch_size: pass them when they differ from the defaults."""
    if (doc.get("settings") or {}).get("mode") != "closed":
        raise ValueError("bench result: plan needs a closed-loop run (servewell bench --concurrency ...)")
    found = doc.get("model")
    model: dict[str, Any] = found if isinstance(found, dict) else {}
    if settings is None:
        batch = model.get("max_batch_size") or 1
        settings = _settings({"max_batch_size": batch}, "model")
    ready = doc.get("local_server_ready_s")
    cpus = (doc.get("machine") or {}).get("cpus")
    client = doc.get("client_cpu_s_per_request") if doc.get("local_server") is True else None
    return MeasuredCurve(str(model.get("name", "model"))[:128], "servewell bench", settings,
                         _ladder(doc.get("steps"), "steps"),
                         int(cpus) if isinstance(cpus, int) and 0 < cpus < 100_000 else None,
                         _number(ready, "local_server_ready_s", high=86_400) if ready is not None else None,
                         _client_cpu(client, "client_cpu_s_per_request"), _idle_points(doc.get("idle"), "idle"))


def plain_curve(doc: dict[str, Any]) -> MeasuredCurve:
    """A curve written by hand or by another load tool (format `servewell curve`): `model`,
    `settings` (max_batch_size, policy, max_wait_ms, instances, threads) and `points`, each with
    concurrency, throughput_rps, p50_ms, p99_ms (and errors, and `server_cpu_ms_per_request`: the CPU
    of all the server's processes per request at that step); optionally `ready_s`, `cores`, when
    the load generator ran on those cores beside the server, `client_cpu_s_per_request`, and `idle`:
    one client waiting `idle_ms` after each answer, `[{"idle_ms", "p50_ms",
    "server_cpu_ms_per_request"?}]` (what a request that finds the server idle costs)."""
    settings = doc.get("settings", {})
    if not isinstance(settings, dict):
        raise ValueError("settings: not an object")
    ready = doc.get("ready_s")
    cores = doc.get("cores")
    return MeasuredCurve(str(doc.get("model", "model"))[:128], "servewell curve", _settings(settings, "settings"),
                         _ladder(doc.get("points"), "points"),
                         int(cores) if isinstance(cores, int) and 0 < cores < 100_000 else None,
                         _number(ready, "ready_s", high=86_400) if ready is not None else None,
                         _client_cpu(doc.get("client_cpu_s_per_request"), "client_cpu_s_per_request"),
                         _idle_points(doc.get("idle"), "idle"))


def _client_cpu(value: Any, where: str) -> float | None:
    """A load generator's CPU seconds per request: absent, or a number in [0, 1)."""
    return None if value is None else _number(value, where, high=1.0)


def read_curves(path: Path, settings: CurveSettings | None = None) -> list[MeasuredCurve]:
    """The curves in a tune or bench result file (tune: one per candidate, the recommended first)."""
    size = path.stat().st_size
    if size > MAX_CURVE_BYTES:
        raise ValueError(f"{path}: {size} bytes (at most {MAX_CURVE_BYTES})")
    try:
        doc = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a JSON object")
    tool = doc.get("tool")
    if tool == "servewell tune":
        curves = tune_curves(doc)
        return curves if settings is None else [_with(c, settings) for c in curves[:1]]
    if tool == "servewell bench":
        return [bench_curve(doc, settings)]
    if tool == "servewell curve":
        curve = plain_curve(doc)
        return [curve if settings is None else _with(curve, settings)]
    raise ValueError(f"{path}: not a servewell tune, servewell bench or servewell curve file "
                     f"(tool: {str(tool)[:40]!r})")


def _with(curve: MeasuredCurve, settings: CurveSettings) -> MeasuredCurve:
    return replace(curve, settings=settings)
