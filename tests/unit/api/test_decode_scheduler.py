"""The decode queue's rule: urgent, then light, then heavy; one thread kept from heavy work;
a bounded backlog refused with 503 overloaded."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from servewell.api.decode_scheduler import (
    HEAVY,
    LIGHT,
    URGENT,
    DecodeJob,
    DecodeQueue,
    DecodeScheduler,
)
from servewell.errors import Overloaded
from servewell.threads import lower_priority_pool


def job(queue: DecodeQueue, pixels: int, urgent: bool = False, tag: str = "") -> DecodeJob:
    j = DecodeJob(lambda: tag, pixels, queue.kind(pixels, urgent))
    queue.push(j)
    return j


def test_urgent_then_light_then_heavy_first_come_first_served_within_each():
    q = DecodeQueue(threads=8, max_waiting=10, light_pixels=100)
    heavy1, light1, heavy2, urgent, light2 = (
        job(q, 1000),
        job(q, 10),
        job(q, 1000),
        job(q, 1000, urgent=True),
        job(q, 50),
    )
    assert [j.kind for j in (heavy1, light1, urgent)] == [HEAVY, LIGHT, URGENT]
    started = [q.pop_runnable() for _ in range(5)]
    assert started == [urgent, light1, light2, heavy1, heavy2]


def test_heavy_jobs_leave_one_thread_for_urgent_and_light_work():
    q = DecodeQueue(threads=2, max_waiting=10, light_pixels=100)
    first, second = job(q, 1000), job(q, 1000)
    assert q.pop_runnable() is first
    assert q.pop_runnable() is None  # the second heavy job waits: the last thread is kept
    light = job(q, 10)
    assert q.pop_runnable() is light
    q.finished(light, 0.001)
    urgent_heavy = job(q, 1000, urgent=True)
    assert q.pop_runnable() is urgent_heavy  # urgent work may use the kept thread, heavy or not
    assert q.pop_runnable() is None  # both threads busy
    q.finished(first, 0.1)
    assert q.pop_runnable() is second  # the urgent job holds the other thread
    assert q.pop_runnable() is None


def test_a_single_thread_still_runs_heavy_jobs():
    q = DecodeQueue(threads=1, max_waiting=10, light_pixels=100)
    heavy = job(q, 1000)
    assert q.pop_runnable() is heavy


def test_the_backlog_is_bounded_and_refused_with_a_retry_after():
    q = DecodeQueue(threads=1, max_waiting=2, light_pixels=100)
    job(q, 4_000_000), job(q, 4_000_000)
    with pytest.raises(Overloaded) as refused:
        job(q, 10)
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 0
    with pytest.raises(Overloaded):
        q.check(urgent=False)
    job(q, 10, urgent=True)  # urgent requests have their own bound
    assert q.waiting(urgent=True) == 1 and q.waiting() == 2


def test_a_discarded_job_no_longer_waits():
    q = DecodeQueue(threads=1, max_waiting=1, light_pixels=100)
    j = job(q, 10)
    assert q.discard(j) and not q.discard(j)
    job(q, 10)  # room again


def test_the_scheduler_runs_jobs_in_the_pool_in_queue_order():
    order: list[str] = []
    gate = threading.Event()

    async def main():
        with ThreadPoolExecutor(1) as pool:
            scheduler = DecodeScheduler(pool, threads=1, max_waiting=10, light_pixels=100)

            def work(tag: str):
                def run():
                    if tag == "blocker":
                        gate.wait(5)
                    order.append(tag)
                    return tag

                return run

            blocker = asyncio.ensure_future(scheduler.run(work("blocker"), pixels=1000, urgent=False))
            await asyncio.sleep(0.01)
            heavy = asyncio.ensure_future(scheduler.run(work("heavy"), pixels=1000, urgent=False))
            light = asyncio.ensure_future(scheduler.run(work("light"), pixels=10, urgent=False))
            urgent = asyncio.ensure_future(scheduler.run(work("urgent"), pixels=1000, urgent=True))
            gone = asyncio.ensure_future(scheduler.run(work("gone"), pixels=10, urgent=False))
            await asyncio.sleep(0.01)
            gone.cancel()
            gate.set()
            return await asyncio.gather(blocker, heavy, light, urgent)

    assert asyncio.run(main()) == ["blocker", "heavy", "light", "urgent"]
    assert order == ["blocker", "urgent", "light", "heavy"]  # the cancelled job never ran


def test_errors_of_the_work_reach_the_caller():
    async def main():
        with ThreadPoolExecutor(1) as pool:
            scheduler = DecodeScheduler(pool, threads=1, max_waiting=10)

            def boom():
                raise ValueError("bad pixels")

            with pytest.raises(ValueError, match="bad pixels"):
                await scheduler.run(boom, pixels=10, urgent=False)
            assert await scheduler.run(lambda: 7, pixels=10, urgent=False) == 7

    asyncio.run(main())


def test_heavy_decodes_run_in_their_own_lower_priority_threads():
    def where() -> tuple[str, int]:
        return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, 0)

    async def main():
        normal = os.getpriority(os.PRIO_PROCESS, 0)
        with ThreadPoolExecutor(2, thread_name_prefix="decode") as pool, \
                lower_priority_pool(1, 5, "decode-heavy") as heavy_pool:
            scheduler = DecodeScheduler(pool, threads=2, max_waiting=10, light_pixels=100, heavy_executor=heavy_pool)
            heavy = await scheduler.run(where, pixels=1000, urgent=False)
            light = await scheduler.run(where, pixels=10, urgent=False)
            urgent = await scheduler.run(where, pixels=1000, urgent=True)  # urgent work is never slowed down
        assert heavy[0].startswith("decode-heavy") and heavy[1] == min(19, normal + 5)
        for name, nice in (light, urgent):
            assert not name.startswith("decode-heavy") and nice == normal

    asyncio.run(main())
