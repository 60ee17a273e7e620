"""When a canary or shadow version is taken back, or a canary promoted: pure and clock-free.

engine/rollout.py reports every finished request of every version (`request_done`) and every
shadow comparison (`shadow_compared`), and asks `judge()` about once a second. The judge counts
only what it is told: the engine passes error=True for model failures and timeouts (5xx), not for
client errors (4xx), so a client sending bad inputs never takes a canary back.

Memory is bounded per version: a window is WINDOW_BUCKETS time buckets (1 s each for a 30 s
window), each holding counts and a sparse latency histogram with log-spaced bins. A report costs
O(1) (one log and a few dict updates); `judge()` merges at most WINDOW_BUCKETS + 1 buckets per
version. A sample leaves a window between window_s and window_s + one bucket after it was taken.

A rule fires only on a difference that is both large (its margin) and unlikely by chance
(engine/rollout_stats.py): the error rule tests the two versions' error counts (Fisher's exact
test); the latency rule compares a quantile that has at least TAIL_SAMPLES canary answers above it
(p99 from 1,000 answers, p90 from 100, the median from 20: never the slowest answer), and the
median, of the latency and of the batches' compute time, and tests whether the canary holds more
than its share of the answers above that quantile of both versions together. Measured before
(issue 45 W10): a byte-identical canary was rolled back on a busy host, its p99 over 92 requests
being its slowest answer (86.7 ms against 17.4 ms over 839).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from servewell.engine.rollout_stats import (
    LOWEST_QUANTILE,
    SIGNIFICANCE,
    binomial_upper_tail,
    compared_quantile,
    count_from,
    histogram_quantile_key,
    hypergeometric_upper_tail,
    quantile_label,
)

#: Time buckets per window: the window's edge is exact to 1/30 of it (1 s of 30 s).
WINDOW_BUCKETS = 30
#: Latency bins grow by 2 %; a bin reports its geometric middle, so a p99 is within ±1 % of the
#: exact nearest-rank p99 of the window's samples (sqrt(1.02) - 1 = 0.995 %).
LATENCY_BIN_GROWTH = 1.02
#: Latencies are clamped to this range before binning (1 µs to 1 day).
LATENCY_RANGE_S = (1e-6, 86_400.0)
_LOG_GROWTH = math.log(LATENCY_BIN_GROWTH)


@dataclass(frozen=True, slots=True)
class RollbackRules:
    """The rules of one model's rollout (config/rollout.py's RollbackConfig, as plain values)."""

    #: Sliding window the rates and p99 are computed over, in seconds.
    window_s: float = 30.0
    #: Requests a canary (and the stable version, for the p99 rule) needs in the window to be judged;
    #: also the shadow comparisons the agreement rule needs.
    min_requests: int = 20
    #: Roll back when canary error rate - stable error rate exceeds this (None: rule off).
    max_error_rate_increase: float | None = 0.05
    #: Roll back when the canary's p99 / the stable p99 exceeds this (None: rule off); with fewer than
    #: 1,000 canary requests a lower quantile is compared (see the module doc)...
    max_p99_ratio: float | None = 2.0
    #: ...and the difference is at least this (scheduling noise of a fast model is not a regression);
    #: both rules also need the difference to be unlikely by chance (rollout_stats.SIGNIFICANCE).
    min_p99_increase_s: float = 0.005
    #: Roll back the shadow version when its top-1 agreement (matches / rows) falls below this (None: off).
    min_shadow_agreement: float | None = None
    #: Promote a canary after this many requests in total with no rule broken (None: never).
    promote_after_requests: int | None = None


@dataclass(frozen=True, slots=True)
class WindowStats:
    """One version's requests over a window."""

    requests: int
    errors: int
    #: errors / requests; 0.0 when there were no requests.
    error_rate: float
    #: Nearest-rank 99th percentile latency within ±1 %; None when there were no requests.
    p99_s: float | None


@dataclass(frozen=True, slots=True)
class ShadowStats:
    """One shadow version's comparisons over a window."""

    comparisons: int
    rows: int
    top1_matches: int
    #: top1_matches / rows; None when no rows were compared.
    agreement: float | None


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the judge wants done, and why."""

    action: Literal["rollback", "promote"]
    version: str
    #: "error_rate", "p99", "shadow_agreement" or "promote".
    rule: str
    #: One sentence with the numbers, for the log line and the alert.
    reason: str
    #: The numbers, for the alert and the console.
    evidence: dict[str, float | int | str]


class _Bucket:
    __slots__ = ("compute_bins", "errors", "latency_bins", "matches", "requests", "rows")

    def __init__(self) -> None:
        self.requests = self.errors = self.rows = self.matches = 0
        self.latency_bins: dict[int, int] = {}
        self.compute_bins: dict[int, int] = {}


class _BucketRing:
    """WINDOW_BUCKETS + 1 consecutive time buckets, newest last; older ones are dropped (and handed
    to `on_drop`)."""

    def __init__(self, span_s: float, on_drop: Callable[[_Bucket], None] | None = None) -> None:
        self._bucket_s = span_s / WINDOW_BUCKETS
        self._buckets: deque[tuple[int, _Bucket]] = deque()
        self._on_drop = on_drop

    def at(self, now: float) -> _Bucket | None:
        """The bucket to count `now` in (None when `now` is not finite)."""
        if not math.isfinite(now):
            return None
        index, ring = math.floor(now / self._bucket_s), self._buckets
        if ring and index <= ring[-1][0]:
            return ring[-1][1]  # a report that raced the clock: at most one bucket off
        ring.append((index, _Bucket()))
        while ring[0][0] <= index - WINDOW_BUCKETS - 1:
            _, dropped = ring.popleft()
            if self._on_drop is not None:
                self._on_drop(dropped)
        return ring[-1][1]

    def recent(self, now: float, window_s: float) -> list[_Bucket]:
        """Buckets that end after now - window_s and start by now."""
        start, size = now - window_s, self._bucket_s
        return [b for i, b in self._buckets if (i + 1) * size > start and i * size <= now]

    def outside(self, now: float, window_s: float) -> list[_Bucket]:
        """The ring's other buckets (`recent`'s complement)."""
        start, size = now - window_s, self._bucket_s
        return [b for i, b in self._buckets if not ((i + 1) * size > start and i * size <= now)]


class VersionWindow:
    """One version's recent requests: counts and latency and compute histograms per time bucket,
    and their sum over the ring, so that a window costs a copy of the sum less the few buckets the
    ring holds outside it (merging 31 buckets each second was most of a judge's time)."""

    def __init__(self, span_s: float = 30.0) -> None:
        self._ring = _BucketRing(span_s, self._forget)
        self._total = _Bucket()

    def add(self, now: float, latency_s: float, error: bool, compute_s: float | None = None) -> None:
        """Count a request that finished at `now` after `latency_s`, `compute_s` of it its batch's
        compute (None: not computed for it, as a cache hit)."""
        if (bucket := self._ring.at(now)) is None:
            return
        latency_key = _bin_of(latency_s)
        compute_key = None if compute_s is None else _bin_of(compute_s)
        for counted in (bucket, self._total):
            counted.requests += 1
            counted.errors += bool(error)
            counted.latency_bins[latency_key] = counted.latency_bins.get(latency_key, 0) + 1
            if compute_key is not None:
                counted.compute_bins[compute_key] = counted.compute_bins.get(compute_key, 0) + 1

    def _forget(self, bucket: _Bucket) -> None:
        total = self._total
        total.requests -= bucket.requests
        total.errors -= bucket.errors
        _subtract(total.latency_bins, bucket.latency_bins)
        _subtract(total.compute_bins, bucket.compute_bins)

    def stats(self, now: float, window_s: float) -> WindowStats:
        """Requests, errors and p99 over the last `window_s` (at most the span it was made with)."""
        return self.measure(now, window_s).stats

    def measure(self, now: float, window_s: float) -> Measured:
        """`stats`, and the window's latency and compute histograms."""
        total = self._total
        latency, compute = Counter(total.latency_bins), Counter(total.compute_bins)  # copies (C speed)
        requests, errors = total.requests, total.errors
        for bucket in self._ring.outside(now, window_s):
            requests -= bucket.requests
            errors -= bucket.errors
            _subtract(latency, bucket.latency_bins)
            _subtract(compute, bucket.compute_bins)
        if not requests:
            return Measured(WindowStats(0, 0, 0.0, None), latency, compute)
        p99 = latency_of_bin(histogram_quantile_key(latency, requests, 0.99))
        return Measured(WindowStats(requests, errors, errors / requests, p99), latency, compute)


def _subtract(bins: dict[int, int], less: dict[int, int]) -> None:
    """`bins` less `less`, bins that reach 0 removed."""
    for key, count in less.items():
        left = bins[key] - count
        if left:
            bins[key] = left
        else:
            del bins[key]


def _bin_of(seconds: float) -> int:
    low, high = LATENCY_RANGE_S
    clamped = min(max(seconds, low), high) if seconds == seconds else high  # nan: worst
    return math.floor(math.log(clamped) / _LOG_GROWTH)


def latency_of_bin(key: int) -> float:
    """The latency a histogram bin stands for: its geometric middle, in seconds."""
    return float(LATENCY_BIN_GROWTH ** (key + 0.5))


class RolloutJudge:
    """Applies RollbackRules to the versions of one model's rollout."""

    def __init__(self, stable: str, rules: RollbackRules) -> None:
        self.stable = stable
        self.rules = rules
        self._windows: dict[str, VersionWindow] = {}
        self._shadows: dict[str, _BucketRing] = {}  # a bucket's requests are comparisons here
        self._totals: dict[str, int] = {}

    def request_done(self, version: str, now: float, latency_s: float, error: bool,
                     compute_s: float | None = None) -> None:
        """A request of `version` finished; `error` only for failures that count against a version;
        `compute_s`: its batch's compute time (None when it was not computed for it)."""
        if (window := self._windows.get(version)) is None:
            window = self._windows[version] = VersionWindow(self.rules.window_s)
        window.add(now, latency_s, error, compute_s)
        self._totals[version] = self._totals.get(version, 0) + 1

    def shadow_compared(self, version: str, now: float, rows: int, top1_matches: int) -> None:
        """The shadow `version` answered a copied request; `top1_matches` of `rows` agreed."""
        if (ring := self._shadows.get(version)) is None:
            ring = self._shadows[version] = _BucketRing(self.rules.window_s)
        if (bucket := ring.at(now)) is not None:
            bucket.requests += 1
            bucket.rows += rows
            bucket.matches += top1_matches

    def window_stats(self, version: str, now: float) -> WindowStats:
        """A version's requests over the rules' window (for the console)."""
        window = self._windows.get(version)
        return window.stats(now, self.rules.window_s) if window else WindowStats(0, 0, 0.0, None)

    def shadow_stats(self, version: str, now: float) -> ShadowStats:
        """A shadow version's comparisons over the rules' window (for the console)."""
        ring = self._shadows.get(version)
        buckets = ring.recent(now, self.rules.window_s) if ring else []
        rows, matches = sum(b.rows for b in buckets), sum(b.matches for b in buckets)
        return ShadowStats(sum(b.requests for b in buckets), rows, matches, matches / rows if rows else None)

    def reset(self, version: str) -> None:
        """Forget a version's history (after a rollback or a promotion, or when weights change)."""
        self._windows.pop(version, None)
        self._shadows.pop(version, None)
        self._totals.pop(version, None)

    def judge(self, now: float, canaries: Iterable[str], shadow: str | None) -> Verdict | None:
        """The first broken rule (canaries in the given order, then the shadow), else a promotion;
        None when all is well or there is too little data to say."""
        rules, judged = self.rules, [c for c in dict.fromkeys(canaries) if c != self.stable]
        stable, window = self._measured(self.stable, now), f"in the last {rules.window_s:g} s"
        for canary in judged:
            if (verdict := self._canary_rollback(canary, self._measured(canary, now), stable, window)) is not None:
                return verdict
        least = rules.min_shadow_agreement
        if shadow is not None and least is not None:
            s = self.shadow_stats(shadow, now)
            if s.comparisons >= rules.min_requests and s.agreement is not None and s.agreement < least:
                return Verdict("rollback", shadow, "shadow_agreement", (
                    f"shadow version '{shadow}' agreed on the top-1 of {s.agreement:.1%} of {s.rows} rows "
                    f"({s.comparisons} requests) {window} (required {least:.1%})"), {
                    "agreement": s.agreement, "rows": s.rows, "top1_matches": s.top1_matches,
                    "comparisons": s.comparisons, "min_shadow_agreement": least, "window_s": rules.window_s})
        after = rules.promote_after_requests
        for canary in judged:
            total = self._totals.get(canary, 0)
            # Only a canary the rules just looked at and passed (enough requests in the window).
            if after is not None and total >= after and self.window_stats(canary, now).requests >= rules.min_requests:
                return Verdict("promote", canary, "promote", f"canary version '{canary}' served {total} requests "
                               f"within the rules (promotion after {after})",
                               {"requests": total, "promote_after_requests": after})
        return None

    def _measured(self, version: str, now: float) -> Measured:
        window = self._windows.get(version)
        if window is None:
            return Measured(WindowStats(0, 0, 0.0, None), Counter(), Counter())
        return window.measure(now, self.rules.window_s)

    def _canary_rollback(self, canary: str, c: Measured, s: Measured, window: str) -> Verdict | None:
        rules = self.rules
        if c.stats.requests < rules.min_requests:
            return None
        evidence: dict[str, float | int | str] = {
            "canary_requests": c.stats.requests, "canary_errors": c.stats.errors,
            "stable_requests": s.stats.requests, "stable_errors": s.stats.errors, "window_s": rules.window_s,
            "stable": self.stable}
        known = s.stats.requests >= rules.min_requests
        verdict = self._error_rollback(canary, c.stats, s.stats, known, window, evidence)
        if verdict is None and known:
            verdict = self._latency_rollback(canary, c, s, window, evidence)
        return verdict

    def _error_rollback(self, canary: str, c: WindowStats, s: WindowStats, known: bool, window: str,
                        evidence: dict[str, float | int | str]) -> Verdict | None:
        rules, stable = self.rules, self.stable
        margin = rules.max_error_rate_increase
        # A stable version with too few requests is taken to fail nothing: a canary failing more
        # than the margin on its own is still taken back (unlike latency, errors need no baseline),
        # when that many failures are unlikely at the margin's rate itself.
        if margin is None or c.error_rate - (s.error_rate if known else 0.0) <= margin:
            return None
        if known:
            p_value = hypergeometric_upper_tail(c.errors, c.requests, c.errors + s.errors, c.requests + s.requests)
        else:
            p_value = binomial_upper_tail(c.errors, c.requests, margin)
        if p_value >= SIGNIFICANCE:
            return None
        against = (f"{s.error_rate:.1%} of {s.requests} for stable version '{stable}'" if known
                   else f"0% assumed (stable version '{stable}' had only {s.requests} requests)")
        return Verdict("rollback", canary, "error_rate", (
            f"canary version '{canary}' failed {c.error_rate:.1%} of {c.requests} requests {window} against "
            f"{against} (allowed +{margin * 100:.1f} points; p = {p_value:.1g})"), evidence | {
            "canary_error_rate": c.error_rate, "stable_error_rate": s.error_rate,
            "max_error_rate_increase": margin, "p_value": p_value})

    def _latency_rollback(self, canary: str, c: Measured, s: Measured, window: str,
                          evidence: dict[str, float | int | str]) -> Verdict | None:
        rules, stable = self.rules, self.stable
        most, least_s = rules.max_p99_ratio, rules.min_p99_increase_s
        if most is None:
            return None
        # Latency as the clients see it, and the compute time of the batches: a canary with a tenth of
        # the traffic queues less than the stable version, which hides a slower model in its latency
        # (bench.rollout's 3x slower canary measured less than 2x the stable's latency on a busy host)
        # but not in its compute time, which is what it will cost once it takes all the traffic.
        for what, c_bins, s_bins in (("latency", c.latency_bins, s.latency_bins),
                                     ("compute time", c.compute_bins, s.compute_bins)):
            n_c, n_s = sum(c_bins.values()), sum(s_bins.values())
            if n_c < rules.min_requests or n_s < rules.min_requests:
                continue
            # The tail (p99, or the highest quantile with TAIL_SAMPLES canary answers above it), and
            # the median too: a canary slower throughout is plain at the median, where a host's bursts
            # of slowness (which fill the tail of both versions) hide little (at the tail alone, a 3x
            # slower canary was missed in 1 of 50 busy-host runs).
            for quantile in dict.fromkeys((compared_quantile(0.99, min(n_c, n_s)), LOWEST_QUANTILE)):
                c_q = latency_of_bin(histogram_quantile_key(c_bins, n_c, quantile))
                s_q = latency_of_bin(histogram_quantile_key(s_bins, n_s, quantile))
                if c_q / s_q <= most or c_q - s_q < least_s:
                    continue
                # Both versions' answers together: does the canary hold more than its share of those in
                # or above the bin of their common quantile? Exact under "no worse" whatever the shape
                # (the bin is chosen from both together, so any answer is as likely the canary's).
                threshold = histogram_quantile_key(c_bins + s_bins, n_c + n_s, quantile)
                c_above, s_above = count_from(c_bins, threshold), count_from(s_bins, threshold)
                p_value = hypergeometric_upper_tail(c_above, n_c, c_above + s_above, n_c + n_s)
                if p_value >= SIGNIFICANCE:
                    continue
                name = quantile_label(quantile)
                return Verdict("rollback", canary, "p99", (
                    f"canary version '{canary}' answered with a {name} {what} of {c_q * 1000:.1f} ms over {n_c} "
                    f"requests {window}, {c_q / s_q:.1f}x the {s_q * 1000:.1f} ms of stable version '{stable}' over "
                    f"{n_s} (allowed up to {most:g}x, or up to {least_s * 1000:g} ms more; {c_above} of the canary's "
                    f"and {s_above} of the stable's at or above both's {name}: p = {p_value:.1g})"), evidence | {
                    "measure": what, "quantile": quantile, "canary_quantile_s": c_q, "stable_quantile_s": s_q,
                    "quantile_ratio": c_q / s_q, "max_p99_ratio": most, "min_p99_increase_s": least_s,
                    "canary_above": c_above, "stable_above": s_above, "p_value": p_value})
        return None


@dataclass(frozen=True, slots=True)
class Measured:
    """One version's window: its counts, and its latency and compute-time histograms (bin key ->
    requests; `latency_of_bin`)."""

    stats: WindowStats
    latency_bins: Counter[int]
    compute_bins: Counter[int]
