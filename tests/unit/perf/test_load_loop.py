"""The load loops and the step summary, driven by a fake transport (no sockets)."""

from __future__ import annotations

import asyncio
import gc
import random

import pytest

from servewell.perf.loop import (
    ArrivalClock,
    LoadShape,
    Outcome,
    Recorder,
    Reply,
    RoundRobin,
    poisson_offsets,
    run_load,
)
from servewell.perf.sweep import summarize_step


class FakeConnection:
    """Answers after `delay_s`; payload 'fail' gets a 503, 'hang' never answers, 'boom' raises."""

    retries = 0

    def __init__(self, delay_s: float = 0.001) -> None:
        self.delay_s = delay_s
        self.closed = False

    async def connect(self) -> None:
        pass

    async def send(self, payload):
        if payload == "hang":
            await asyncio.sleep(3600)
        await asyncio.sleep(self.delay_s)
        if payload == "boom":
            raise ConnectionResetError("reset by peer")
        if payload == "fail":
            return Reply("503", False, "overloaded")
        return Reply("200", True, None, {"queue": 0.1, "compute": 0.5, "total": 0.7})

    def close(self) -> None:
        self.closed = True


def _run(shape, payloads, delay_s=0.001):
    connections: list[FakeConnection] = []

    def connect():
        connections.append(FakeConnection(delay_s))
        return connections[-1]

    recorder = asyncio.run(run_load(shape, connect, RoundRobin(payloads)))
    return recorder, connections


def test_a_request_cap_ends_the_step_and_its_window_at_the_last_answer():
    shape = LoadShape("closed", concurrency=3, duration_s=30.0, warmup_s=0.0, max_requests=60)
    recorder, connections = _run(shape, ["ok"])
    result = summarize_step(shape, recorder)
    assert recorder.capped and recorder.sent == 60
    assert result.answered == result.ok == 60 and result.errors == 0 and result.unfinished == 0
    assert result.status_counts == {"200": 60}
    assert result.window_s < 5.0  # closed at the last answer, not after 30 s
    assert result.throughput_rps == pytest.approx(60 / (recorder.window_end - recorder.window_start), rel=0.01)
    assert result.p50_ms <= result.p90_ms <= result.p99_ms <= result.max_ms
    assert result.server_ms["compute"] == 0.5
    assert len(connections) == 3 and all(c.closed for c in connections)


def test_errors_are_counted_by_status_and_code_and_kept_out_of_latency():
    shape = LoadShape("closed", concurrency=2, duration_s=30.0, warmup_s=0.0, max_requests=40)
    recorder, _ = _run(shape, ["ok", "fail", "boom", "ok"])
    result = summarize_step(shape, recorder)
    assert result.answered == 40
    assert sum(result.status_counts.values()) == result.answered == result.ok + result.errors
    assert result.status_counts["200"] == result.ok == 20
    assert result.status_counts["503"] == 10 and result.status_counts["client"] == 10
    assert result.error_codes == {"client:ConnectionResetError": 10, "overloaded": 10}
    assert result.error_rate == 0.5


def test_a_request_past_its_timeout_counts_as_timeout():
    shape = LoadShape("closed", concurrency=1, duration_s=30.0, warmup_s=0.0, max_requests=2, timeout_s=0.05)
    recorder, _ = _run(shape, ["hang"])
    result = summarize_step(shape, recorder)
    assert result.status_counts == {"timeout": 2}
    assert result.ok == 0 and result.p99_ms is None


def test_an_open_loop_without_a_free_connection_counts_arrivals_as_client_saturated():
    shape = LoadShape("open", rate=2000.0, duration_s=0.15, warmup_s=0.0, max_connections=1, grace_s=0.2)
    recorder, connections = _run(shape, ["ok"], delay_s=0.05)
    result = summarize_step(shape, recorder)
    assert len(connections) == 1
    assert result.client_saturated > 0
    assert result.arrived == result.answered + result.unfinished + result.client_saturated
    assert result.offered_rps > result.throughput_rps


def test_an_open_loop_counts_what_is_still_unanswered_at_the_end():
    shape = LoadShape("open", rate=200.0, duration_s=0.15, warmup_s=0.0, grace_s=0.05)
    recorder, _ = _run(shape, ["hang"])
    result = summarize_step(shape, recorder)
    assert result.answered == 0 and result.unfinished == result.arrived > 0


def test_latency_comes_from_arrivals_in_the_window_and_throughput_from_completions_in_it():
    recorder = Recorder(started=0.0, window_start=1.0, window_end=3.0)
    recorder.arrivals_in_window = 3
    recorder.sent = 4
    recorder.outcomes = [
        Outcome("normal", 0.5, 1.5, "200", True, None, None),   # arrived in warm-up, done in window
        Outcome("normal", 1.0, 1.01, "200", True, None, None),  # 10 ms
        Outcome("normal", 2.0, 2.03, "200", True, None, None),  # 30 ms
        Outcome("normal", 2.5, 3.5, "503", False, "overloaded", None),
    ]
    result = summarize_step(LoadShape("closed", concurrency=1, duration_s=3.0, warmup_s=1.0), recorder)
    assert result.answered == 3 and result.ok == 2 and result.errors == 1
    assert result.throughput_rps == 1.5  # three successful completions in a 2 s window
    assert result.p50_ms == pytest.approx(10.0) and result.max_ms == pytest.approx(30.0)
    assert result.status_counts == {"200": 2, "503": 1} and result.error_codes == {"overloaded": 1}


@pytest.mark.parametrize("kwargs", [
    {"mode": "closed", "concurrency": 0},
    {"mode": "open", "rate": 0.0},
    {"mode": "closed", "warmup_s": 5.0, "duration_s": 5.0},
    {"mode": "closed", "timeout_s": 0.0},
])
def test_a_load_shape_refuses_impossible_bounds(kwargs):
    with pytest.raises(ValueError):
        LoadShape(**kwargs)


def test_the_arrival_clock_hands_out_every_arrival_in_order_never_early_then_ends():
    async def take():
        loop = asyncio.get_running_loop()
        now = loop.time()
        arrivals = [now + 0.002 * i for i in range(1, 40)]
        clock = ArrivalClock(loop, arrivals)
        clock.start()
        seen = []
        try:
            while (arrival := await clock.next()) is not None:
                seen.append((arrival, loop.time()))
        finally:
            clock.stop()
        return arrivals, seen

    arrivals, seen = asyncio.run(take())
    assert [a for a, _ in seen] == arrivals
    assert all(handed >= arrival for arrival, handed in seen)


def test_stopping_the_arrival_clock_does_not_wait_for_a_far_arrival():
    async def stop_early():
        loop = asyncio.get_running_loop()
        clock = ArrivalClock(loop, [loop.time() + 3600.0])
        clock.start()
        await asyncio.sleep(0.01)
        return clock.stop()

    assert asyncio.run(stop_early())


def test_an_open_loop_sends_its_seeded_arrivals_and_a_cap_stops_it():
    shape = LoadShape("open", rate=500.0, duration_s=0.2, warmup_s=0.0, grace_s=0.5, max_requests=30)
    recorder, _ = _run(shape, ["ok"])
    assert recorder.sent == 30 and recorder.capped
    free = LoadShape("open", rate=500.0, duration_s=0.2, warmup_s=0.0, grace_s=0.5)
    again, _ = _run(free, ["ok"])
    assert again.sent == len(list(poisson_offsets(random.Random(free.seed + 1), free))) and not again.capped


def test_a_closed_loop_client_waits_its_think_time_after_each_answer():
    busy, _ = _run(LoadShape("closed", concurrency=1, duration_s=0.2, warmup_s=0.0), ["ok"])
    thinking, _ = _run(LoadShape("closed", concurrency=1, duration_s=0.2, warmup_s=0.0, think_s=0.02), ["ok"])
    assert thinking.sent <= 11 < busy.sent  # 0.2 s holds at most 10 waits of 20 ms
    with pytest.raises(ValueError, match="think_s"):
        LoadShape("closed", think_s=-1.0)


def test_the_cyclic_collector_is_off_while_load_runs_and_back_after():
    enabled_during: list[bool] = []

    class Watching(FakeConnection):
        async def send(self, payload):
            enabled_during.append(gc.isenabled())
            return await super().send(payload)

    shape = LoadShape("closed", concurrency=2, duration_s=30.0, warmup_s=0.0, max_requests=20)
    assert gc.isenabled()
    recorder = asyncio.run(run_load(shape, Watching, RoundRobin(["ok"])))
    assert recorder.sent == 20 and enabled_during == [False] * 20  # its pauses would count as latency
    assert gc.isenabled()
