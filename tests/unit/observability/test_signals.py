from servewell.observability.metrics import ServeMetrics
from servewell.observability.signals import ModelFacts, SignalTracker


def test_snapshots_cover_only_the_window_since_the_previous_one():
    metrics = ServeMetrics()
    facts = [ModelFacts("m", queue_fill_ratio=0.5, restarts=0, memory_headroom_ratio=None)]
    tracker = SignalTracker(metrics, lambda: facts)
    for _ in range(98):
        metrics.observe_request("m", "/predict", 200, 0.004)
    metrics.observe_request("m", "/predict", 503, 0.004)
    metrics.observe_request("m", "/predict", 200, 2.0)
    for _ in range(95):
        metrics.count("m", "normal", "success")
    for _ in range(5):
        metrics.count("m", "normal", "rejected")
    (first,) = tracker.snapshots()
    assert first.error_ratio == 0.01 and first.rejected_ratio == 0.05
    assert 0.0025 < first.p99_latency_s <= 2.5
    assert first.queue_fill_ratio == 0.5 and first.worker_restarts == 0

    metrics.observe_request("m", "/predict", 200, 0.003)
    facts[0] = ModelFacts("m", 0.0, restarts=2, memory_headroom_ratio=0.3)
    (second,) = tracker.snapshots()
    assert second.error_ratio == 0.0 and second.p99_latency_s <= 0.005  # the slow request was last window's
    assert second.worker_restarts == 2 and second.memory_headroom_ratio == 0.3
    (third,) = tracker.snapshots()
    assert third.p99_latency_s is None and third.worker_restarts == 0


def test_a_standing_rollback_reaches_the_snapshot():
    facts = [ModelFacts("m", None, 0, None, rollback="canary version '2' failed 40.0% of 52 requests"),
             ModelFacts("n", None, 0, None)]
    first, second = SignalTracker(ServeMetrics(), lambda: facts).snapshots()
    assert first.rollback == "canary version '2' failed 40.0% of 52 requests" and second.rollback is None


def test_each_model_reads_only_its_own_series():
    metrics = ServeMetrics()
    facts = [ModelFacts(name, None, 0, None) for name in ("fast", "failing", "idle")]
    tracker = SignalTracker(metrics, lambda: facts)
    for _ in range(10):
        metrics.observe_request("fast", "/predict", 200, 0.002)
        metrics.observe_request("failing", "/predict", 500, 1.5)
        metrics.count("fast", "normal", "success")
        metrics.count("failing", "normal", "rejected")
    fast, failing, idle = tracker.snapshots()
    assert fast.error_ratio == 0.0 and fast.rejected_ratio == 0.0 and fast.p99_latency_s <= 0.0025
    assert failing.error_ratio == 1.0 and failing.rejected_ratio == 1.0 and failing.p99_latency_s > 1.0
    assert idle.error_ratio is None and idle.rejected_ratio is None and idle.p99_latency_s is None
