"""servewell's lock-free histograms and counters expose exactly what prometheus-client's own
would for the same observations."""

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from servewell.observability.loop_metrics import LoopCounter, LoopHistogram
from servewell.observability.metrics import (
    LATENCY_BUCKETS,
    ModelSample,
    ServeMetrics,
    StateCollector,
)

# On a bound (le is inclusive), between bounds, below the first, above the last, zero.
VALUES = [0.001, 0.0025, 0.0004, 0.003, 0.3, 10.0, 12.5, 0.0, 0.001]


def _lines(registry: CollectorRegistry) -> set[str]:
    return {line for line in generate_latest(registry).decode().splitlines()
            if not line.startswith("#") and "_created" not in line}


def test_histogram_and_counter_match_prometheus_client():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    h_ours = LoopHistogram("t_seconds", "doc", ["model", "route"], LATENCY_BUCKETS, ours)
    h_theirs = Histogram("t_seconds", "doc", ["model", "route"], buckets=LATENCY_BUCKETS, registry=theirs)
    c_ours = LoopCounter("t_requests", "doc", ["outcome"], ours)
    c_theirs = Counter("t_requests", "doc", ["outcome"], registry=theirs)
    for i, value in enumerate(VALUES):
        route = "/a" if i % 2 else "/b"
        h_ours.labels("m", route).observe(value)
        h_theirs.labels("m", route).observe(value)
        c_ours.labels("success" if i % 3 else "error").inc(i)
        c_theirs.labels("success" if i % 3 else "error").inc(i)
    c_ours.labels("cancelled")  # a series that exists before its first event is exposed at 0
    c_theirs.labels("cancelled")
    assert _lines(ours) == _lines(theirs)
    assert 't_seconds_bucket{le="0.001",model="m",route="/b"} 3.0' in _lines(ours)  # 0.0, 0.0004, 0.001


def test_label_values_are_strings_and_counted_once():
    registry = CollectorRegistry()
    histogram = LoopHistogram("t_size", "doc", ["n"], (1, 2, 4), registry)
    histogram.labels(2).observe(2)
    histogram.labels("2").observe(3)
    (family,) = histogram.collect()
    counts = [s for s in family.samples if s.name == "t_size_count"]
    assert [(s.labels, s.value) for s in counts] == [({"n": "2"}, 2.0)]
    with pytest.raises(ValueError):
        histogram.labels("a", "b")
    with pytest.raises(ValueError):
        LoopCounter("t_c", "doc", ["x"], registry).labels("y").inc(-1)


def test_serve_metrics_register_every_family_once():
    metrics = ServeMetrics()
    metrics.observe_request("m", "/predict", 200, 0.004)
    metrics.count("m", "normal", "success")
    text = generate_latest(metrics.registry).decode()
    assert 'servewell_request_duration_seconds_count{model="m",route="/predict",status_class="2xx"} 1.0' in text
    assert 'servewell_requests_total{lane="normal",model="m",outcome="success"} 1.0' in text


def _scrape(samples: list[ModelSample], device: tuple[int | None, int] | None) -> set[str]:
    registry = CollectorRegistry()
    registry.register(StateCollector(lambda: samples, lambda pid: {}, budget=lambda: (1000, 400),
                                     device_budget=None if device is None else (lambda: device)))
    return _lines(registry)


def test_the_model_pool_gauges_follow_each_models_sample():
    samples = [
        ModelSample("hot", "ready", {}, 0, 8, residency="resident", pinned=True, last_used_at=1700000000.5,
                    estimated_bytes=300),
        ModelSample("cold", "unloaded", {}, 0, 0, residency="evicted", estimated_bytes=100),
        ModelSample("new", "unloaded", {}, 0, 0, residency="not_loaded"),
    ]
    lines = _scrape(samples, (None, 0))
    assert {'servewell_model_resident{model="hot"} 1.0', 'servewell_model_resident{model="cold"} 0.0',
            'servewell_model_pinned{model="hot"} 1.0', 'servewell_model_pinned{model="cold"} 0.0',
            'servewell_model_last_used_timestamp_seconds{model="hot"} 1.7000000005e+09',
            'servewell_model_estimated_bytes{model="hot"} 300.0',
            'servewell_model_estimated_bytes{model="cold"} 100.0',
            'servewell_model_pool_models{residency="resident"} 1.0',
            'servewell_model_pool_models{residency="evicted"} 1.0',
            'servewell_model_pool_models{residency="not_loaded"} 1.0',
            'servewell_model_pool_models{residency="loading"} 0.0',
            'servewell_memory_budget_bytes{kind="device_reserved"} 0.0'} <= lines
    # Never used, or no estimate: no series rather than a made-up 0; no device limit: no total.
    assert not any('model="cold"' in line for line in lines if "last_used" in line)
    assert not any('model="new"' in line for line in lines if "estimated_bytes" in line)
    assert not any("device_total" in line for line in lines)
    assert 'servewell_memory_budget_bytes{kind="device_total"} 2048.0' in _scrape(samples, (2048, 512))


def test_a_sample_without_pool_fields_counts_as_resident():
    lines = _scrape([ModelSample("eager", "ready", {}, 0, 4)], None)
    assert 'servewell_model_resident{model="eager"} 1.0' in lines
    assert not any("device_" in line for line in lines)
