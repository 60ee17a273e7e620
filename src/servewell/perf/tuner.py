"""The tuner's decisions, pure and clock-free: the candidate settings, the order they are
measured in, the concurrency ladder of one measurement, and the recommendation.

Nothing here measures: the runner (`tune_command`) asks `Search.next` what to measure, drives a
`Climb` with real load steps, and stores each `Measurement`. Because the order is a function of
the measurements so far, a rerun with the stored measurements replays the same decisions and
measures only what is missing (resumable), and a unit test drives it with a fake function.

Order (most effect per second first, so a small budget still answers): the user's own settings
(the baseline); max batch size and batching policy, which are changed live without a restart;
instances x threads, which need one; dtype (torch runtimes); finally the two best are measured
again to show how far a repeat moves (this machine is shared and noisy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from servewell.perf.stats import relative_spread

POLICIES = ("idle", "window", "adaptive")
#: A step that does not raise throughput by this share over the best so far means saturation:
#: more clients would only queue.
SATURATION_GAIN = 0.05


@dataclass(frozen=True, slots=True)
class Candidate:
    """One setting to measure."""

    max_batch_size: int
    policy: str
    max_wait_ms: float  # window: the wait; adaptive: its cap; idle: unused (0)
    instances: int
    threads: int
    dtype: str | None = None  # None: as configured

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}")
        if self.policy == "idle" and self.max_wait_ms != 0:
            object.__setattr__(self, "max_wait_ms", 0.0)  # idle never waits: one key for all waits

    @property
    def key(self) -> str:
        """Stable identity in the state file."""
        wait = f"-{self.max_wait_ms:g}ms" if self.policy != "idle" else ""
        dtype = f"-{self.dtype}" if self.dtype else ""
        return f"i{self.instances}t{self.threads}{dtype}-b{self.max_batch_size}-{self.policy}{wait}"

    @property
    def server(self) -> tuple[int, int, str | None]:
        """The part that needs a server restart to change."""
        return self.instances, self.threads, self.dtype

    def batching_patch(self, slo_ms: float) -> dict[str, object]:
        """The live change (`PATCH /admin/models/{name}/batching`) that applies the rest."""
        patch: dict[str, object] = {"policy": self.policy}
        if self.max_batch_size > 0:  # 0: the model takes no batch dimension, nothing to change
            patch["max_batch_size"] = self.max_batch_size
        if self.policy != "idle":
            patch["max_wait_ms"] = self.max_wait_ms
        if self.policy == "adaptive":
            patch["latency_slo_ms"] = slo_ms
        return patch

    def describe(self) -> str:
        """`batch 16, window 5 ms, 1x2 threads` (what the table shows)."""
        policy = self.policy if self.policy == "idle" else f"{self.policy} {self.max_wait_ms:g} ms"
        dtype = f", {self.dtype}" if self.dtype else ""
        return f"batch {self.max_batch_size}, {policy}, {self.instances}x{self.threads} threads{dtype}"

    def replace(self, **changes: object) -> Candidate:
        """A copy with some fields changed."""
        fields = {"max_batch_size": self.max_batch_size, "policy": self.policy, "max_wait_ms": self.max_wait_ms,
                  "instances": self.instances, "threads": self.threads, "dtype": self.dtype}
        fields.update(changes)
        return Candidate(**fields)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class LadderPoint:
    """One closed-loop step of a measurement."""

    concurrency: int
    throughput_rps: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    errors: int  # failed, unanswered or timed-out requests
    server_cpu_ms_per_request: float | None = None  # the tuned server's processes, per request sent

    def within(self, slo_ms: float) -> bool:
        """Whether this step met the SLO: no failures and a p99 at or under it."""
        return self.errors == 0 and self.p99_ms is not None and self.p99_ms <= slo_ms


@dataclass(slots=True)
class Measurement:
    """Everything measured for one candidate: one ladder per run (the first, then repeats)."""

    candidate: Candidate
    runs: list[list[LadderPoint]] = field(default_factory=list)
    failure: str | None = None  # the server or the live change refused this setting

    def best_point(self, slo_ms: float, run: int | None = None) -> LadderPoint | None:
        """The highest-throughput point within the SLO (of one run, or of all)."""
        runs = self.runs if run is None else [self.runs[run]]
        ok = [p for points in runs for p in points if p.within(slo_ms)]
        return max(ok, key=lambda p: p.throughput_rps, default=None)

    def run_scores(self, slo_ms: float) -> list[float]:
        """Each run's best throughput within the SLO (0 when none met it)."""
        scores = []
        for index in range(len(self.runs)):
            best = self.best_point(slo_ms, index)
            scores.append(best.throughput_rps if best else 0.0)
        return scores

    def score(self, slo_ms: float) -> float:
        """The worst run's best throughput within the SLO; 0 when any run never met it.

        A setting is only as good as its worst repeat: a median of two runs averaged a run that
        met the SLO with one that did not, while the clients and p99 quoted came from the first."""
        scores = self.run_scores(slo_ms)
        return min(scores) if scores else 0.0

    def quoted_point(self, slo_ms: float) -> LadderPoint | None:
        """The point a recommendation quotes: the best point within the SLO of the worst run
        (of runs equally bad, the one with the higher p99); None when a run never met the SLO."""
        points = [self.best_point(slo_ms, run) for run in range(len(self.runs))]
        if not points or any(p is None for p in points):
            return None
        return min((p for p in points if p is not None),
                   key=lambda p: (p.throughput_rps, -(p.p99_ms or 0.0)))

    def spread(self, slo_ms: float) -> float | None:
        """How far repeated runs of this candidate differ, relative to their median."""
        return relative_spread(self.run_scores(slo_ms))


class Climb:
    """The concurrency ladder of one run, as a state machine (`next_level`, then `record`).

    Starts at `start`; while the SLO holds it doubles the clients until the SLO breaks, the
    throughput stops growing (saturation), or `max_concurrency`; if the first step already
    breaks the SLO it halves instead until one holds (or 1). A run is 2-4 steps typically.
    """

    def __init__(self, slo_ms: float, start: int, max_concurrency: int) -> None:
        self.slo_ms = slo_ms
        self.max_concurrency = max(1, max_concurrency)
        self.points: list[LadderPoint] = []
        self._next: int | None = min(max(1, start), self.max_concurrency)
        self._direction = 0  # +1 climbing, -1 descending, 0 before the first step

    def next_level(self) -> int | None:
        """The concurrency to measure next; None when the run is done."""
        return self._next

    def record(self, point: LadderPoint) -> None:
        """Take the measured step and decide the next one."""
        self.points.append(point)
        level = point.concurrency
        if self._direction == 0:
            self._direction = 1 if point.within(self.slo_ms) else -1
        if self._direction < 0:
            self._next = None if point.within(self.slo_ms) or level <= 1 else max(1, level // 2)
            return
        best_before = max((p.throughput_rps for p in self.points[:-1] if p.within(self.slo_ms)), default=0.0)
        saturated = len(self.points) > 1 and point.throughput_rps < best_before * (1 + SATURATION_GAIN)
        if not point.within(self.slo_ms) or saturated or level >= self.max_concurrency:
            self._next = None
        else:
            self._next = min(level * 2, self.max_concurrency)


def ladder_start(candidate: Candidate, previous: Measurement | None, slo_ms: float) -> int:
    """Where a run's ladder starts: at a repeat, the best level found before; otherwise enough
    clients to fill one batch per instance."""
    if previous is not None:
        best = previous.best_point(slo_ms)
        if best is not None:
            return best.concurrency
    return max(1, candidate.max_batch_size * candidate.instances)


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, ... up to and including `limit` (and `limit` itself when it is no power)."""
    values = [1 << k for k in range(0, max(0, int(math.log2(max(1, limit)))) + 1)]
    if limit not in values:
        values.append(limit)
    return sorted(v for v in values if v <= limit)


def server_shapes(cores: int, baseline: tuple[int, int]) -> list[tuple[int, int]]:
    """instances x threads to try: powers of two that use all or half of the cores, baseline excluded.

    More threads than cores only adds contention, and the frontend and the load generator need
    CPU as well, so nothing beyond `cores` is offered.
    """
    shapes = []
    for used in sorted({cores, max(1, cores // 2)}, reverse=True):
        for instances in powers_of_two(used):
            threads = used // instances
            if instances * threads == used and (instances, threads) != baseline:
                shapes.append((instances, threads))
    return list(dict.fromkeys(shapes))


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """What may be varied, derived from the model's config, the machine and the flags."""

    baseline: Candidate
    batch_sizes: tuple[int, ...]  # ascending; empty when the model takes no batch dimension
    waits_ms: tuple[float, ...]  # window waits to try (each well under the SLO)
    shapes: tuple[tuple[int, int], ...]  # instances x threads beyond the baseline's
    dtypes: tuple[str, ...]  # beyond the baseline's (torch runtimes)
    slo_ms: float
    repeats: int = 2  # runs of each of the two finalists

    @property
    def ceiling(self) -> int:
        """The max_batch_size a server is started with, so every batch size is a live change."""
        return max([self.baseline.max_batch_size, *self.batch_sizes])


def build_space(baseline: Candidate, slo_ms: float, cores: int, *, batch_sizes: Sequence[int] | None = None,
                waits_ms: Sequence[float] = (2.0, 5.0, 10.0), dtypes: Sequence[str] = (),
                tune_servers: bool = True, repeats: int = 2) -> SearchSpace:
    """The search space: batch sizes (default: powers of two up to the configured maximum),
    window waits under a quarter of the SLO, instance x thread shapes for `cores`, dtypes."""
    if baseline.max_batch_size <= 0:
        sizes: list[int] = []
    elif batch_sizes:
        sizes = sorted({int(b) for b in batch_sizes if b >= 1})
    else:
        sizes = powers_of_two(baseline.max_batch_size)
    waits = tuple(sorted({float(w) for w in waits_ms if 0 < w <= slo_ms / 4}))
    shapes = tuple(server_shapes(cores, (baseline.instances, baseline.threads))) if tune_servers else ()
    others = tuple(d for d in dtypes if d != baseline.dtype)
    return SearchSpace(baseline, tuple(sizes), waits, shapes, others, slo_ms, repeats)


class Search:
    """What to measure next, given what has been measured (keyed by `Candidate.key`)."""

    def __init__(self, space: SearchSpace) -> None:
        self.space = space

    def _best(self, results: dict[str, Measurement], among: Sequence[Candidate] | None = None) -> Candidate:
        pool = [results[c.key] for c in among] if among is not None else list(results.values())
        scored = [m for m in pool if m.failure is None and m.runs]
        if not scored:
            return self.space.baseline
        return max(scored, key=lambda m: (m.score(self.space.slo_ms), -m.candidate.max_batch_size)).candidate

    def _first_missing(self, results: dict[str, Measurement], plan: Sequence[Candidate]) -> Candidate | None:
        return next((c for c in plan if c.key not in results), None)

    def batch_plan(self, around: Candidate) -> list[Candidate]:
        """Coarse (every fourth power of two, largest first), to be refined around the best."""
        sizes = self.space.batch_sizes
        coarse = sorted({sizes[-1], *sizes[::2]}, reverse=True) if sizes else []
        return [around.replace(max_batch_size=b, policy="idle", max_wait_ms=0.0) for b in coarse]

    def refine_plan(self, best: Candidate) -> list[Candidate]:
        """The batch sizes next to the best one."""
        sizes = self.space.batch_sizes
        if best.max_batch_size not in sizes:
            return []
        i = sizes.index(best.max_batch_size)
        return [best.replace(max_batch_size=sizes[j]) for j in (i + 1, i - 1) if 0 <= j < len(sizes)]

    def policy_plan(self, best: Candidate) -> list[Candidate]:
        """window at each wait, and adaptive capped at the longest wait."""
        plan = [best.replace(policy="window", max_wait_ms=w) for w in self.space.waits_ms]
        if self.space.waits_ms:
            plan.append(best.replace(policy="adaptive", max_wait_ms=max(self.space.waits_ms)))
        return plan

    def next(self, results: dict[str, Measurement], explore: bool = True) -> tuple[str, Candidate] | None:
        """(phase, candidate) to measure next; None when the search is done.

        With `explore` False (the budget left is what the repeats need) only repeats of the
        finalists are proposed.
        """
        space = self.space
        if not explore:
            return self._repeat(results)
        if space.baseline.key not in results:
            return "baseline", space.baseline
        batches = self.batch_plan(space.baseline)
        if (missing := self._first_missing(results, batches)) is not None:
            return "batch size", missing
        best = self._best(results, [space.baseline, *batches])
        refine = self.refine_plan(best)
        if (missing := self._first_missing(results, refine)) is not None:
            return "batch size", missing
        best = self._best(results, [space.baseline, *batches, *refine])
        policies = self.policy_plan(best)
        if (missing := self._first_missing(results, policies)) is not None:
            return "batching policy", missing
        best = self._best(results)
        shapes = [best.replace(instances=i, threads=t) for i, t in space.shapes]
        if (missing := self._first_missing(results, shapes)) is not None:
            return "instances x threads", missing
        best = self._best(results)
        if best.server != space.baseline.server:  # batch sizes may want to move with the new shape
            if (missing := self._first_missing(results, self.refine_plan(best))) is not None:
                return "batch size", missing
        best = self._best(results)
        dtypes = [best.replace(dtype=d) for d in space.dtypes]
        if (missing := self._first_missing(results, dtypes)) is not None:
            return "dtype", missing
        return self._repeat(results)

    def _repeat(self, results: dict[str, Measurement]) -> tuple[str, Candidate] | None:
        for finalist in self.finalists(results):
            if len(results[finalist.key].runs) < self.space.repeats:
                return "repeat", finalist
        return None

    def finalists(self, results: dict[str, Measurement]) -> list[Candidate]:
        """The two best candidates so far (by score), which are measured again."""
        scored = sorted((m for m in results.values() if m.failure is None and m.runs),
                        key=lambda m: m.score(self.space.slo_ms), reverse=True)
        return [m.candidate for m in scored[:2] if m.score(self.space.slo_ms) > 0]


@dataclass(frozen=True, slots=True)
class Recommendation:
    """The candidate to use, the point quoted for it (its worst run's best), and how it compares
    with the baseline and the runner-up."""

    best: Measurement
    point: LadderPoint
    baseline_score: float | None
    runner_up: Measurement | None
    spread: float | None  # largest relative spread of repeated runs among the finalists
    within_noise: bool  # the runner-up is closer than the spread: the two are not told apart


def recommend(results: dict[str, Measurement], slo_ms: float, baseline: Candidate) -> Recommendation | None:
    """The highest-throughput candidate whose every run met the SLO, ranked by its worst run;
    None if none did."""
    scored = sorted((m for m in results.values() if m.failure is None and m.score(slo_ms) > 0),
                    key=lambda m: m.score(slo_ms), reverse=True)
    if not scored:
        return None
    best = scored[0]
    point = best.quoted_point(slo_ms)
    assert point is not None  # a positive score: every run has a point within the SLO
    runner_up = scored[1] if len(scored) > 1 else None
    spreads = [s for m in scored[:2] if (s := m.spread(slo_ms)) is not None]
    spread = max(spreads) if spreads else None
    within_noise = False
    if runner_up is not None and spread is not None:
        gap = (best.score(slo_ms) - runner_up.score(slo_ms)) / best.score(slo_ms)
        within_noise = gap <= spread
    base = results.get(baseline.key)
    return Recommendation(best, point, base.score(slo_ms) if base and base.failure is None else None,
                          runner_up, spread, within_noise)
