"""How long callers take to ask for the same inputs again, against the response cache's TTL
(engine/response_cache.py): a hit and a miss for inputs kept before are both repeats, counted
within or beyond the TTL and observed in `servewell_response_cache_reuse_interval_seconds`."""

from __future__ import annotations

import asyncio

import numpy as np

from fake_clock import FakeClock
from held_computations import HeldComputations as Model
from servewell.config.cache import ResponseCacheConfig
from servewell.engine.response_cache import GHOST_KEYS, ResponseCache
from servewell.observability.metrics import ServeMetrics

FAR = 1e18


def _inputs(value: float) -> dict[str, np.ndarray]:
    return {"x": np.full((1, 3), value, dtype=np.float32)}


def _reuses(metrics: ServeMetrics) -> dict[str, float]:
    return {vs: count for (model, vs), count in metrics.cache_reuses.snapshot() if model == "m"}


def _observed(metrics: ServeMetrics) -> tuple[float, float]:
    ((_, per_bucket, total),) = [row for row in metrics.cache_reuse_interval.snapshot() if row[0] == ("m",)]
    return float(sum(per_bucket)), total


def test_inputs_repeated_after_the_ttl_are_counted_beyond_it_and_their_interval_observed() -> None:
    clock, metrics = FakeClock(), ServeMetrics()

    async def run() -> None:
        cache, model = ResponseCache("m", ResponseCacheConfig(max_bytes=1 << 24, ttl_s=2.0), metrics, clock), Model()
        cache.serve(_inputs(1.0), FAR, model.submit)
        model.answer(0, 1.0)
        await asyncio.sleep(0)
        for n in range(1, 4):  # the callers repeat the input every 30 s: each time a miss
            clock.advance(30.0)
            assert not cache.serve(_inputs(1.0), FAR, model.submit).done()
            model.answer(n, 1.0)
            await asyncio.sleep(0)
        assert cache.counts["reused_beyond_ttl"] == 3 and cache.counts["reused_within_ttl"] == 0
        assert cache.counts["hit"] == 0 and cache.counts["miss"] == 4
        assert _reuses(metrics) == {"within": 0.0, "beyond": 3.0}
        assert _observed(metrics) == (3.0, 90.0)

    asyncio.run(run())


def test_a_hit_is_a_repeat_within_the_ttl() -> None:
    clock, metrics = FakeClock(), ServeMetrics()

    async def run() -> None:
        cache, model = ResponseCache("m", ResponseCacheConfig(max_bytes=1 << 24, ttl_s=60.0), metrics, clock), Model()
        cache.serve(_inputs(1.0), FAR, model.submit)
        model.answer(0, 1.0)
        await asyncio.sleep(0)
        clock.advance(5.0)
        assert (await cache.serve(_inputs(1.0), FAR, model.submit)).cache == "hit"
        clock.advance(7.0)
        assert (await cache.serve(_inputs(1.0), FAR, model.submit)).cache == "hit"
        assert _reuses(metrics) == {"within": 2.0, "beyond": 0.0}
        assert _observed(metrics) == (2.0, 12.0)  # 5 s, then 7 s since the last use

    asyncio.run(run())


def test_inputs_never_seen_are_no_repeat_and_remembered_keys_are_bounded() -> None:
    clock = FakeClock()

    async def run() -> None:
        cache, model = ResponseCache("m", ResponseCacheConfig(max_bytes=1 << 24, ttl_s=1.0), None, clock), Model()
        for i in range(GHOST_KEYS + 10):
            cache.serve(_inputs(float(i)), FAR, model.submit)
            model.answer(i, 1.0)
            await asyncio.sleep(0)
            clock.advance(0.0001)  # each expires after the one before
        clock.advance(5.0)
        cache.serve(_inputs(-1.0), FAR, model.submit)  # drops every kept answer (TTL), remembers the last keys
        assert cache.counts["reused_beyond_ttl"] == 0 and cache.entries == 0
        cache.serve(_inputs(0.0), FAR, model.submit)  # the oldest key was forgotten: not known as a repeat
        cache.serve(_inputs(float(GHOST_KEYS + 9)), FAR, model.submit)  # the newest is remembered
        assert cache.counts["reused_beyond_ttl"] == 1

    asyncio.run(run())
