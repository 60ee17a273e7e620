"""Worker loads take turns (at most `limit` at once, first come first served, a load timed from its
own turn) and a load that timed out or crashed is tried again after a growing wait, a bounded
number of times. An event loop and the fake clock; no process, no sleep."""

from __future__ import annotations

import asyncio

import pytest

from fake_clock import FakeClock
from servewell.workers.load_slots import MAX_RETRY_DELAY_S, LoadRetryPolicy, LoadSlots


async def settle() -> None:
    """Let every task that can run, run."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_at_most_limit_loads_run_and_the_others_go_in_the_order_they_came():
    async def main() -> None:
        slots = LoadSlots(2)
        began: list[str] = []

        async def load(name: str) -> None:
            await slots.acquire()
            began.append(name)

        tasks = [asyncio.create_task(load(n)) for n in "abcde"]
        await settle()
        assert began == ["a", "b"] and (slots.running, slots.waiting) == (2, 3)
        slots.release()
        await settle()
        assert began == ["a", "b", "c"] and (slots.running, slots.waiting) == (2, 2)
        slots.release()
        slots.release()
        await settle()
        assert began == ["a", "b", "c", "d", "e"] and (slots.running, slots.waiting) == (2, 0)
        slots.release()
        slots.release()
        assert slots.running == 0
        await asyncio.gather(*tasks)

    asyncio.run(main())


def test_a_load_is_timed_from_its_turn_not_from_when_it_asked():
    async def main() -> None:
        clock = FakeClock(start=1000.0)
        slots = LoadSlots(1, clock.now)
        first = await slots.acquire()
        second = asyncio.create_task(slots.acquire())
        await settle()
        assert not second.done()  # queued behind the first
        clock.advance(7.0)  # the first load takes 7 s
        slots.release()
        began = await second
        assert (first, began) == (1000.0, 1007.0)
        # With a 10 s load timeout, the second load has until 1017, not until 1010.
        assert began + 10.0 == 1017.0

    asyncio.run(main())


def test_a_waiter_that_gives_up_leaves_the_line_and_a_slot_handed_to_a_cancelled_one_passes_on():
    async def main() -> None:
        slots = LoadSlots(1)
        await slots.acquire()
        quitter = asyncio.create_task(slots.acquire())
        patient = asyncio.create_task(slots.acquire())
        await settle()
        quitter.cancel()
        await settle()
        assert slots.waiting == 1
        slots.release()  # goes to `patient`, not to the one that left
        await settle()
        assert patient.done() and slots.running == 1

        late = asyncio.create_task(slots.acquire())
        last = asyncio.create_task(slots.acquire())
        await settle()
        slots.release()  # handed to `late` ...
        late.cancel()  # ... which is cancelled before it runs: the slot goes on to `last`
        await settle()
        assert late.cancelled() and last.done() and slots.running == 1
        slots.release()
        assert (slots.running, slots.waiting) == (0, 0)
        # A free slot is taken at once.
        await asyncio.wait_for(slots.acquire(), 1.0)

    asyncio.run(main())


def test_no_slot_at_all_is_refused():
    with pytest.raises(ValueError):
        LoadSlots(0)


def test_retries_wait_longer_each_time_up_to_a_cap_and_stop_after_the_attempts():
    policy = LoadRetryPolicy(attempts=4, first_delay_s=2.0)
    assert [policy.delay_before(a) for a in (1, 2, 3, 4, 5)] == [0.0, 2.0, 4.0, 8.0, None]
    capped = LoadRetryPolicy(attempts=20, first_delay_s=2.0)
    assert capped.delay_before(20) == MAX_RETRY_DELAY_S
    assert LoadRetryPolicy(attempts=1).delay_before(2) is None  # one attempt: never retried
