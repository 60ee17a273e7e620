"""servewell's lock-free histograms and counters expose exactly what prometheus-client's own
would for the same observations."""

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from servewell.observability.metrics import LATENCY_BUCKETS, LoopCounter, LoopHistogram, ServeMetrics

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
