"""The response cache (engine/response_cache.py) with a submit that counts its computations:
hits, in-flight sharing, errors never shared, deadlines, byte bound, TTL and the key. Tenants,
a leader that leaves and what an answer really costs: test_response_cache.py."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from fake_clock import FakeClock
from held_computations import HeldComputations as Model
from servewell.config.cache import ResponseCacheConfig
from servewell.config.model import ModelConfig
from servewell.engine.protocol import RequestResult
from servewell.engine.response_cache import ResponseCache, entry_bytes, input_key
from servewell.errors import DeadlineExceeded, Overloaded


def _cache(max_bytes: int = 1 << 20, ttl_s: float = 60.0, clock: Any = None) -> ResponseCache:
    return ResponseCache("m", ResponseCacheConfig(max_bytes=max_bytes, ttl_s=ttl_s), clock=clock)


def _inputs(value: float) -> dict[str, np.ndarray]:
    return {"x": np.full((1, 3), value, dtype=np.float32)}


FAR = 1e18  # a deadline that never passes


def test_a_repeat_is_answered_from_the_cache_with_a_copy_of_its_own() -> None:
    async def run() -> None:
        cache, model = _cache(), Model()
        first = cache.serve(_inputs(1.0), FAR, model.submit, model.count)
        batch = model.answer(0, 7.0)
        assert (await first).cache == ""
        await asyncio.sleep(0)  # the cache's done callback runs
        batch[:] = -1.0  # the batch's memory is reused or changed later: the kept answer is a copy
        again = await cache.serve(_inputs(1.0), FAR, model.submit, model.count)
        assert again.cache == "hit" and len(model.calls) == 1 and model.outcomes == {"success": 1}
        assert again.outputs["y"].tolist() == [[7.0] * 4]
        assert not again.outputs["y"].flags.writeable
        other = cache.serve(_inputs(2.0), FAR, model.submit)
        assert not other.done() and len(model.calls) == 2  # other inputs compute
        model.answer(1, 3.0)
        await other
        await asyncio.sleep(0)
        assert cache.counts["hit"] == 1 and cache.counts["miss"] == 2 and cache.entries == 2

    asyncio.run(run())


def test_identical_requests_in_flight_share_one_computation() -> None:
    async def run() -> None:
        cache, model = _cache(), Model()
        futures = [cache.serve(_inputs(1.0), FAR, model.submit) for _ in range(5)]
        await asyncio.sleep(0)
        assert len(model.calls) == 1
        model.answer(0, 4.0)
        results = await asyncio.gather(*futures)
        assert [r.cache for r in results] == ["", "coalesced", "coalesced", "coalesced", "coalesced"]
        assert all(r.outputs["y"].tolist() == [[4.0] * 4] for r in results)
        assert cache.counts["coalesced"] == 4 and cache.report()["in_flight"] == 0

    asyncio.run(run())


def test_an_error_of_the_first_request_is_its_own_and_the_others_share_one_new_computation() -> None:
    async def run() -> None:
        cache, model = _cache(), Model()
        first = cache.serve(_inputs(1.0), FAR, model.submit)
        others = [cache.serve(_inputs(1.0), FAR, model.submit) for _ in range(3)]
        await asyncio.sleep(0)
        model.calls[0].set_exception(DeadlineExceeded("the first request's own deadline"))
        with pytest.raises(DeadlineExceeded):
            await first
        assert len(model.calls) == 2  # one new computation for the three still waiting, not one each
        model.answer(1, 5.0)
        assert [r.outputs["y"].tolist() for r in await asyncio.gather(*others)] == [[[5.0] * 4]] * 3
        assert cache.entries == 1

    asyncio.run(run())


def test_a_waiting_request_that_is_cancelled_leaves_the_first_computing() -> None:
    async def run() -> None:
        cache, model = _cache(), Model()
        first = cache.serve(_inputs(1.0), FAR, model.submit)
        second = cache.serve(_inputs(1.0), FAR, model.submit)
        await asyncio.sleep(0)
        second.cancel()
        await asyncio.sleep(0)
        assert not model.calls[0].cancelled()
        model.answer(0, 1.0)
        assert (await first).outputs["y"].shape == (1, 4)
        assert len(model.calls) == 1

    asyncio.run(run())


def test_a_waiting_request_ends_at_its_own_deadline() -> None:
    async def run() -> None:
        clock = FakeClock()
        cache, model = _cache(clock=clock), Model()
        first = cache.serve(_inputs(1.0), FAR, model.submit, model.count)
        waiting = cache.serve(_inputs(1.0), clock.now() + 0.05, model.submit, model.count)
        clock.advance(0.049)
        assert not waiting.done()
        clock.advance(0.002)
        with pytest.raises(DeadlineExceeded):
            await waiting
        assert len(model.calls) == 1 and not first.done() and model.outcomes == {"deadline_exceeded": 1}

    asyncio.run(run())


def test_a_full_queue_is_raised_and_nothing_is_left_in_flight() -> None:
    def full() -> asyncio.Future[RequestResult]:
        raise Overloaded("lane full")

    async def run() -> None:
        cache, model = _cache(), Model()
        with pytest.raises(Overloaded):
            cache.serve(_inputs(1.0), FAR, full)
        cache.serve(_inputs(1.0), FAR, model.submit)  # the next identical one leads, it does not wait on nothing
        assert len(model.calls) == 1

    asyncio.run(run())


def test_a_full_queue_when_the_waiting_requests_compute_again_is_each_ones_own() -> None:
    def full() -> asyncio.Future[RequestResult]:
        raise Overloaded("lane full")

    async def run() -> None:
        cache, model = _cache(), Model()
        first = cache.serve(_inputs(1.0), FAR, model.submit)
        refused = cache.serve(_inputs(1.0), FAR, full)  # its own submit finds the lane full
        later = cache.serve(_inputs(1.0), FAR, model.submit)
        model.calls[0].set_exception(DeadlineExceeded("the first request's own deadline"))
        with pytest.raises(DeadlineExceeded):
            await first
        with pytest.raises(Overloaded):
            await refused
        assert len(model.calls) == 2 and not later.done()  # the next one in line leads the new computation
        model.answer(1, 2.0)
        assert (await later).outputs["y"].tolist() == [[2.0] * 4]
        assert cache.report()["in_flight"] == 0

    asyncio.run(run())


def test_bytes_stay_under_max_bytes_least_recently_used_first() -> None:
    size = entry_bytes(input_key(_inputs(0.0)), {"y": np.zeros((1, 4), np.float32)})  # one row of 4 float32

    async def run() -> None:
        cache, model = _cache(max_bytes=4 * size + 10), Model()
        for i in range(4):
            cache.serve(_inputs(float(i)), FAR, model.submit)
            model.answer(i, float(i))
            await asyncio.sleep(0)
        assert cache.entries == 4 and cache.bytes == 4 * size
        assert (await cache.serve(_inputs(0.0), FAR, model.submit)).cache == "hit"  # 0 is now the most recent
        cache.serve(_inputs(9.0), FAR, model.submit)
        model.answer(4, 9.0)
        await asyncio.sleep(0)
        assert cache.entries == 4 and cache.bytes <= cache.max_bytes and cache.counts["evicted_size"] == 1
        assert (await cache.serve(_inputs(0.0), FAR, model.submit)).cache == "hit"
        assert not cache.serve(_inputs(1.0), FAR, model.submit).done()  # 1 was the least recently used

    asyncio.run(run())


def test_an_answer_larger_than_a_quarter_of_the_cache_is_not_kept() -> None:
    async def run() -> None:
        cache, model = _cache(max_bytes=4096), Model()
        future = cache.serve(_inputs(1.0), FAR, model.submit)
        model.answer(0, 1.0, rows=64)  # 64 x 4 float32 = 1 KiB + overhead: over 1 KiB
        await future
        assert cache.entries == 0 and cache.bytes == 0

    asyncio.run(run())


def test_an_answer_older_than_the_ttl_is_computed_again() -> None:
    clock = FakeClock()

    async def run() -> None:
        cache, model = _cache(ttl_s=10.0, clock=clock), Model()
        cache.serve(_inputs(1.0), FAR, model.submit)
        model.answer(0, 1.0)
        await asyncio.sleep(0)
        clock.advance(9.0)
        assert cache.serve(_inputs(1.0), FAR, model.submit).done()
        clock.advance(2.0)
        assert not cache.serve(_inputs(1.0), FAR, model.submit).done()
        assert cache.counts["evicted_ttl"] == 1 and cache.bytes == 0

    asyncio.run(run())


def test_clear_drops_every_answer() -> None:
    async def run() -> None:
        cache, model = _cache(), Model()
        cache.serve(_inputs(1.0), FAR, model.submit)
        model.answer(0, 1.0)
        await asyncio.sleep(0)
        assert cache.clear() == 1 and cache.entries == 0 and cache.bytes == 0
        assert not cache.serve(_inputs(1.0), FAR, model.submit).done()

    asyncio.run(run())


def test_the_key_is_the_inputs_names_dtypes_shapes_and_bytes() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    base = input_key({"a": a, "b": a})
    assert input_key({"b": a.copy(), "a": a.copy()}) == base  # the names' order does not matter
    assert input_key({"a": np.asfortranarray(a), "b": a}) == base  # nor the memory layout
    assert input_key({"a": a.astype(np.float64), "b": a}) != base
    assert input_key({"a": a.reshape(3, 2), "b": a}) != base
    assert input_key({"a": a + 1, "b": a}) != base
    assert input_key({"c": a, "b": a}) != base
    strings = np.array([b"cat", b"dog"], dtype=object)
    assert input_key({"s": strings}) == input_key({"s": np.array([b"cat", b"dog"], dtype=object)})
    assert input_key({"s": strings}) != input_key({"s": np.array([b"ca", b"tdog"], dtype=object)})


def test_a_non_deterministic_model_cannot_be_cached() -> None:
    fields = {"name": "m", "runtime": "onnx", "artifact": "model.onnx",
              "inputs": [{"name": "x", "datatype": "FP32", "shape": [3]}],
              "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}]}
    assert ModelConfig(**fields, cache={"max_bytes": 1 << 20}).cache is not None
    with pytest.raises(ValidationError, match="never cached"):
        ModelConfig(**fields, deterministic=False, cache={"max_bytes": 1 << 20})
    with pytest.raises(ValidationError):
        ModelConfig(**fields, cache={"max_bytes": 0})


def test_new_bounds_apply_at_once() -> None:
    async def run() -> None:
        cache, model = _cache(max_bytes=1 << 20, ttl_s=60.0), Model()
        for i in range(4):
            cache.serve(_inputs(float(i)), FAR, model.submit)
            model.answer(i, float(i))
            await asyncio.sleep(0)
        size = cache.bytes // 4
        cache.resize(max_bytes=2 * size, ttl_s=5.0)
        assert cache.entries == 2 and cache.bytes == 2 * size and cache.counts["evicted_size"] == 2
        assert cache.serve(_inputs(3.0), FAR, model.submit).done()  # the most recent ones stay
        assert cache.report()["ttl_s"] == 5.0 and cache.report()["max_bytes"] == 2 * size

    asyncio.run(run())
