"""The statistics behind the rollback rules (engine/rollout_rules.py): exact one-sided tail
probabilities and quantiles of sparse latency histograms. Pure; no numpy, no scipy (the engine
imports neither).

Why tests rather than ratios: with `min_requests: 20` a canary's p99 is its slowest answer, and on
a busy host one answer that waited for a core made a byte-identical canary look 5x slower (86.7 ms
over 92 requests against 17.4 ms over 839: issue 45 W10). A rule now fires only when the
difference is both large (the rule's margin) and unlikely by chance (`SIGNIFICANCE`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

#: Largest chance, under "the canary is no worse", of data at least this bad for a rule to fire.
#: The judge looks about once a second at an overlapping window, and a busy host's noise comes in
#: bursts that hit the requests of one moment together (which a test of independent requests takes
#: for evidence), so a look's false alarm rate must be far below what one rollout can afford. On the
#: unit tests' simulated busy host (839 stable and 92 canary requests in 30 s, bursts of 3-10x
#: slowness with a fifth of the requests timing out): at 1e-3 an identical canary was rolled back in
#: 3 of 300 runs of 35 s, at 3e-4 in 2, at 1e-4 in none, while a canary 3x slower was still caught
#: in 200 of 200 (at worst 12 s) and one failing a fifth more in 198 of 200 within 30 s (median 10 s).
SIGNIFICANCE = 1e-4
#: Canary answers that must lie above the quantile a latency rule compares: p99 needs 1,000 answers
#: in the window, fewer answers compare a lower quantile (p90 for 100, p50 for 20), never the slowest.
TAIL_SAMPLES = 10
#: The lowest quantile a latency rule compares (a canary with few answers is compared at its median).
LOWEST_QUANTILE = 0.5


def compared_quantile(wanted: float, requests: int) -> float:
    """The quantile a latency rule compares over `requests` answers: `wanted` (0.99 for the p99
    rule) when at least TAIL_SAMPLES answers lie above it, else the highest that has that many
    (never below LOWEST_QUANTILE)."""
    if requests <= 0:
        return LOWEST_QUANTILE
    return max(LOWEST_QUANTILE, min(wanted, 1.0 - TAIL_SAMPLES / requests))


def quantile_label(quantile: float) -> str:
    """`p99`, `p90`, `p89.1`: how a reason names the quantile compared."""
    return f"p{quantile * 100:.3g}"


def histogram_quantile_key(bins: Mapping[int, int], total: int, quantile: float) -> int:
    """The bin holding the nearest-rank `quantile` of `total` samples counted in `bins`."""
    rank, seen = max(1, math.ceil(quantile * total)), 0
    key = 0
    for key in sorted(bins):
        seen += bins[key]
        if seen >= rank:
            return key
    return key


def count_from(bins: Mapping[int, int], key: int) -> int:
    """Samples in bin `key` and the bins above it."""
    return sum(count for k, count in bins.items() if k >= key)


def _log_choose(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def _sum_of_exps(log_terms: Iterator[float]) -> float:
    """exp-sum of a unimodal sequence of log terms, stopped once the terms past the peak are
    negligible (below e^-40 of the largest): a tail of 100,000 terms costs a few dozen."""
    total, top = 0.0, -math.inf
    for term in log_terms:
        if term > top:  # a new largest term: rescale what was summed (exp(-inf) is 0.0)
            total, top = total * math.exp(top - term) + 1.0, term
        else:
            total += math.exp(term - top)
            if term < top - 40.0:
                break
    return 0.0 if top == -math.inf else min(1.0, math.exp(top) * total)


def hypergeometric_upper_tail(hits: int, drawn: int, successes: int, population: int) -> float:
    """P(X >= hits) for X the successes among `drawn` of `population` items, `successes` of them
    successes, drawn without replacement: the one-sided p-value of Fisher's exact test that the
    drawn group (the canary) holds more of the successes (errors, slow answers) than chance."""
    if not 0 <= successes <= population or not 0 <= drawn <= population:
        raise ValueError(f"impossible draw: {drawn} and {successes} of {population}")
    low, high = max(hits, 0, drawn + successes - population), min(drawn, successes)
    if low > high:
        return 0.0
    whole = _log_choose(population, drawn)
    return _sum_of_exps(_log_choose(successes, x) + _log_choose(population - successes, drawn - x) - whole
                        for x in range(low, high + 1))


def binomial_upper_tail(hits: int, trials: int, rate: float) -> float:
    """P(X >= hits) for X ~ Binomial(trials, rate)."""
    if hits <= 0:
        return 1.0
    if hits > trials:
        return 0.0
    if rate <= 0.0:
        return 0.0
    if rate >= 1.0:
        return 1.0
    log_p, log_q = math.log(rate), math.log1p(-rate)
    return _sum_of_exps(_log_choose(trials, x) + x * log_p + (trials - x) * log_q for x in range(hits, trials + 1))
