from servewell.engine.batch_policy import (
    ArrivalRate,
    BatchLatencyModel,
    BatchOpportunity,
    adaptive_wait,
    idle_wait,
    window_wait,
)


def op(now=1.0, oldest=1.0, ready=1, max_rows=16, instances=1):
    return BatchOpportunity(now, oldest, ready, max_rows, instances)


def test_latency_model_recovers_a_linear_curve():
    model = BatchLatencyModel()
    for rows in (1, 2, 4, 8, 16) * 5:
        model.observe(rows, 0.010 + 0.002 * rows)
    a, c = model.coefficients()
    assert abs(a - 0.010) < 1e-6 and abs(c - 0.002) < 1e-6
    assert abs(model.predict(32) - 0.074) < 1e-5


def test_idle_never_waits_and_window_waits_until_full_or_expired():
    assert idle_wait(op()) is None
    assert window_wait(op(now=1.0, oldest=1.0), max_wait_s=0.025) == 1.025
    assert window_wait(op(now=1.03, oldest=1.0), max_wait_s=0.025) is None
    assert window_wait(op(ready=16), max_wait_s=0.025) is None


def fitted(a=0.020, c=0.001):
    model = BatchLatencyModel()
    for rows in (1, 4, 8, 16):
        model.observe(rows, a + c * rows)
    return model


def rate(per_second, until=10.0):
    arrivals = ArrivalRate(alpha=1.0)
    t = until - 20 / per_second
    for _ in range(21):
        arrivals.observe(t)
        t += 1 / per_second
    return arrivals


def test_adaptive_does_not_wait_at_low_load():
    # 5 req/s against ~47 batches/s of capacity at batch 1: nothing to gain by waiting.
    assert adaptive_wait(op(now=10.0, oldest=10.0), fitted(), rate(5), slo_s=1.0, max_wait_s=0.1) is None


def test_adaptive_waits_for_the_batch_that_keeps_up_at_high_load():
    # 400 req/s, L(b) = 20 ms + 1 ms*b: b / L(b) >= 400 needs b >= 14.
    until = adaptive_wait(op(now=10.0, oldest=10.0, ready=2), fitted(), rate(400), slo_s=1.0, max_wait_s=0.5)
    assert until is not None and abs((until - 10.0) - 12 / 400) < 0.005


def test_adaptive_never_waits_past_the_latency_target():
    until = adaptive_wait(op(now=10.0, oldest=9.95, ready=2), fitted(), rate(400), slo_s=0.1, max_wait_s=0.5)
    # 0.8 * 100 ms target - 34 ms batch - 50 ms already waited < 0: start now.
    assert until is None


def test_arrival_rate_decays_when_traffic_stops():
    arrivals = rate(100, until=10.0)
    assert 90 < arrivals.per_second(10.0) < 110
    assert arrivals.per_second(12.0) < 2
