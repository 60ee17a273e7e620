"""The bench engine: a prepared target, one measured step of load, and a sweep of steps.

Each step's statistics come from its measured window (after the warm-up): latencies and
status counts of the requests that *arrived* in it, throughput from the successful answers
*completed* in it (so an overloaded open loop cannot report more than the server answered).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from servewell.perf.inputs import ModelMeta
from servewell.perf.loop import Connection, LoadShape, Recorder, RoundRobin, run_load
from servewell.perf.progress import Progress
from servewell.perf.stats import summarize_ms

#: Server-Timing stages summarised per step when the server sends them (servewell does).
SERVER_STAGES = ("queue", "compute", "total")


class OipClient(Protocol):
    """What the sweep needs of a protocol client (HTTP or gRPC)."""

    def connection(self) -> Connection:
        """A new lazily connecting `Connection`."""

    async def close(self) -> None:
        """Release what the client holds."""


@dataclass(slots=True)
class PreparedTarget:
    """A model on a server, its prepared requests, and how they travel."""

    client: OipClient
    model: ModelMeta
    payloads: list[Any]
    protocol: str  # "http" or "grpc"
    fmt: str  # "json" or "binary" over HTTP; "protobuf" over gRPC
    url: str


@dataclass(slots=True)
class StepResult:
    """The measured window of one step: counts, throughput, latency percentiles (ms)."""

    mode: str
    level: float  # concurrency (closed) or offered rate (open)
    window_s: float
    sent: int
    arrived: int  # requests due in the window: answered + unfinished + client_saturated
    answered: int
    ok: int
    errors: int
    unfinished: int
    client_saturated: int
    offered_rps: float
    throughput_rps: float
    p50_ms: float | None
    p90_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    max_ms: float | None
    status_counts: dict[str, int] = field(default_factory=dict)
    error_codes: dict[str, int] = field(default_factory=dict)
    server_ms: dict[str, float | None] = field(default_factory=dict)  # median per Server-Timing stage
    warmup_dropped: bool = False
    #: CPU of every process of a local server per request sent in the step (warm-up included), if known
    server_cpu_ms_per_request: float | None = None

    @property
    def error_rate(self) -> float:
        """Failed or unanswered share of the requests that arrived in the window."""
        total = self.answered + self.unfinished + self.client_saturated
        return (self.errors + self.unfinished + self.client_saturated) / total if total else 0.0


def summarize_step(shape: LoadShape, recorder: Recorder) -> StepResult:
    """The `StepResult` of one recorded step."""
    window_s = max(1e-9, recorder.window_end - recorder.window_start)
    arrived = [o for o in recorder.outcomes if recorder.in_window(o.arrival)]
    ok = [o for o in arrived if o.ok]
    ok_done = sum(1 for o in recorder.outcomes if o.ok and recorder.in_window(o.done))
    latency = summarize_ms(o.latency_ms for o in ok)
    server: dict[str, float | None] = {}
    for stage in SERVER_STAGES:
        values = [o.timings[stage] for o in ok if o.timings and stage in o.timings]
        if values:
            server[stage] = summarize_ms(values)["p50"]
    statuses = Counter(o.status for o in arrived)
    codes = Counter(o.code for o in arrived if not o.ok and o.code)
    return StepResult(
        mode=shape.mode, level=shape.level, window_s=round(window_s, 3), sent=recorder.sent,
        arrived=recorder.arrivals_in_window, answered=len(arrived), ok=len(ok), errors=len(arrived) - len(ok),
        unfinished=recorder.arrivals_in_window - recorder.saturated_in_window - len(arrived),
        client_saturated=recorder.saturated_in_window,
        offered_rps=round(recorder.arrivals_in_window / window_s, 3),
        throughput_rps=round(ok_done / window_s, 3),
        p50_ms=_f(latency["p50"]), p90_ms=_f(latency["p90"]), p95_ms=_f(latency["p95"]),
        p99_ms=_f(latency["p99"]), mean_ms=_f(latency["mean"]), max_ms=_f(latency["max"]),
        status_counts=dict(sorted(statuses.items())), error_codes=dict(sorted(codes.items())),
        server_ms=server, warmup_dropped=recorder.warmup_dropped,
    )


def _f(value: float | int | None) -> float | None:
    return None if value is None else float(value)


def step_label(shape: LoadShape) -> str:
    """`concurrency 8` or `rate 120/s`."""
    return f"concurrency {shape.concurrency}" if shape.mode == "closed" else f"rate {shape.rate:g}/s"


def result_line(result: StepResult) -> str:
    """One line per finished step (what a log gets instead of a progress bar)."""
    p99 = "-" if result.p99_ms is None else f"{result.p99_ms:.1f}"
    p50 = "-" if result.p50_ms is None else f"{result.p50_ms:.1f}"
    errors = f", errors {result.status_counts}" if result.errors or result.unfinished else ""
    level = f"concurrency {result.level:g}" if result.mode == "closed" else f"rate {result.level:g}/s"
    return f"{level}: {result.throughput_rps:.1f} req/s, p50 {p50} ms, p99 {p99} ms{errors}"


async def measure(target: PreparedTarget, shape: LoadShape, tick: Callable[[Recorder, float], None] | None = None,
                  server_cpu_s: Callable[[], float] | None = None) -> StepResult:
    """Run one step of load against the target and summarise it; `server_cpu_s` reads the server's
    CPU seconds so far (a server started here), for its CPU per request in the step."""
    cpu_before = server_cpu_s() if server_cpu_s is not None else 0.0
    recorder = await run_load(shape, target.client.connection, RoundRobin(list(target.payloads)), tick)
    result = summarize_step(shape, recorder)
    if server_cpu_s is not None and result.sent:
        result.server_cpu_ms_per_request = round((server_cpu_s() - cpu_before) / result.sent * 1000, 4)
    return result


def _ticker(progress: Progress, prefix: str, shape: LoadShape) -> Callable[[Recorder, float], None]:
    def tick(recorder: Recorder, elapsed_s: float) -> None:
        elapsed_s = max(0.0, elapsed_s)  # the clock starts a moment after the step is set up
        ok = recorder.ok_answers
        failed = recorder.answered - ok
        rate = ok / elapsed_s if elapsed_s > 0.2 else 0.0
        progress.update(f"{prefix} {step_label(shape)}: {min(elapsed_s, shape.duration_s):.1f}/"
                        f"{shape.duration_s:g} s, {ok} ok, {failed} failed, ~{rate:.0f} req/s",
                        min(1.0, elapsed_s / shape.duration_s))
    return tick


async def run_sweep(target: PreparedTarget, shapes: Sequence[LoadShape], progress: Progress,
                    server_cpu_s: Callable[[], float] | None = None) -> list[StepResult]:
    """Every step in turn, with a progress line while each runs and a note when it ends (`server_cpu_s`:
    as `measure` takes it)."""
    results = []
    for index, shape in enumerate(shapes, start=1):
        prefix = f"step {index}/{len(shapes)}"
        result = await measure(target, shape, _ticker(progress, prefix, shape), server_cpu_s)
        progress.clear()  # the finished step's status line is replaced by its result
        progress.note(f"{prefix} {result_line(result)}")
        results.append(result)
    return results
