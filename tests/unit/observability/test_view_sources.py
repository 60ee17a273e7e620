"""One view of the whole server (issue 20): ServeMetrics and RecentRequests objects playing ingress
processes hand their snapshots (pickled, as over the socket) to one playing the engine, whose
readers (/metrics text, the console feed, alert signals, the recent rings) then show what one
process recording everything would have shown.

`MEASURE=1` also prints the cost figures quoted in observability/view_sources.py."""

from __future__ import annotations

import asyncio
import os
import pickle
import timeit
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from servewell.api.app import create_app
from servewell.api.control_handlers import control_table
from servewell.api.control_plane import LocalControlPlane
from servewell.api.engine_parts import EngineParts
from servewell.api.keys import InferenceAccess
from servewell.api.state import LiveKnobs
from servewell.config.alerting import AlertingConfig
from servewell.config.server import ServerConfig
from servewell.engine.engine import InferenceEngine
from servewell.observability.alerting import SignalSnapshot, run_alerting
from servewell.observability.console_feed import ConsoleFeed, read_metrics
from servewell.observability.metrics import ServeMetrics
from servewell.observability.recent_requests import RecentRequests, RequestRecord
from servewell.observability.signals import ModelFacts, SignalTracker
from servewell.observability.view_sources import ViewSnapshot, ViewSources
from servewell.tenancy.keys import KeyRing

# Exact binary fractions: sums come out the same whatever the order they are added in.
SECONDS = (0.0009765625, 0.00390625, 0.015625, 0.125, 0.5, 2.0, 16.0)


def record_ingress(metrics: ServeMetrics, seed: int) -> None:
    """What an ingress records: the HTTP side."""
    for i in range(5 + seed):
        seconds = SECONDS[(i + seed) % len(SECONDS)]
        metrics.observe_request("m", "/v2/models/{name}/infer", 200 if i % 3 else 503, seconds)
        metrics.observe_request("-", "/v2/models/{name}/infer", 404, seconds)
        metrics.preprocess.labels("m").observe(seconds)
        metrics.postprocess.labels("m").observe(seconds)
        metrics.count("m", "normal", "rejected")
        metrics.api_key_requests.labels(f"key{seed}", "allowed").inc()
        metrics.fast_path_requests.labels("/v2/models/{name}/infer").inc()
    metrics.auth_failures.labels("missing").inc(seed + 1)


def record_engine(metrics: ServeMetrics) -> None:
    """What the engine records: batches and their outcomes."""
    for i, seconds in enumerate(SECONDS):
        metrics.compute.labels("m").observe(seconds)
        metrics.compute_by_size.labels("m", "4").observe(seconds)
        metrics.batch_size.labels("m").observe(1 + i)
        metrics.queue_wait.labels("m", "normal").observe(seconds)
        metrics.count("m", "normal", "success")
    metrics.model_loads.labels("m", "success").inc()


def over_the_wire(view: ViewSources) -> ViewSnapshot:
    snapshot: ViewSnapshot = pickle.loads(pickle.dumps(view.snapshot()))
    return snapshot


def samples(metrics: ServeMetrics) -> set[str]:
    """The exposition's sample lines of servewell's families (the process_/python_ ones describe
    whichever process serves the text)."""
    return {line for line in generate_latest(metrics.registry).decode().splitlines()
            if line.startswith("servewell_")}


def view_of(metrics: ServeMetrics) -> ViewSources:
    return ViewSources(metrics, RecentRequests())


def test_metrics_text_is_what_one_process_would_have_shown():
    engine, ingress_a, ingress_b, alone = ServeMetrics(), ServeMetrics(), ServeMetrics(), ServeMetrics()
    record_engine(engine)
    record_ingress(ingress_a, 0)
    record_ingress(ingress_b, 1)
    for metrics, seed in ((alone, 0), (alone, 1)):
        record_ingress(metrics, seed)
    record_engine(alone)
    view = view_of(engine)
    assert view.absorb("ingress-0-100", over_the_wire(view_of(ingress_a)))
    assert view.absorb("ingress-1-101", over_the_wire(view_of(ingress_b)))

    assert samples(engine) == samples(alone)  # counters summed per label set, histograms bucket-wise
    assert 'servewell_auth_failures_total{reason="missing"} 3.0' in samples(engine)
    text = generate_latest(engine.registry).decode()
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))  # one family per name
    assert "servewell_request_duration_seconds" in types


def test_merged_exposition_parses_as_prometheus_text():
    engine, ingress = ServeMetrics(), ServeMetrics()
    record_engine(engine)
    record_ingress(ingress, 2)
    record_ingress(engine, 0)  # the same label sets recorded on both sides
    view = view_of(engine)
    view.absorb("ingress-0-1", over_the_wire(view_of(ingress)))
    families = list(text_string_to_metric_families(generate_latest(engine.registry).decode()))
    names = [f.name for f in families]
    assert len(names) == len(set(names))
    by_name = {f.name: f for f in families}
    counts = {s.labels["status_class"]: s.value for s in by_name["servewell_request_duration_seconds"].samples
              if s.name.endswith("_count") and s.labels["model"] == "m"}
    assert counts == {"2xx": 3 + 4, "5xx": 2 + 3}  # 5 requests (i % 3 == 0 twice) + 7 (three)
    (rejected,) = [s.value for s in by_name["servewell_requests"].samples
                   if s.name == "servewell_requests_total" and s.labels["outcome"] == "rejected"]
    assert rejected == 5 + 7


def requests_total(metrics: ServeMetrics, outcome: str) -> float:
    return sum(value for labels, value in metrics.requests.snapshot() if labels[2] == outcome)


def test_counts_never_go_down_across_retire_and_restarts():
    engine = ServeMetrics()
    view = view_of(engine)
    first = ServeMetrics()
    first_view = view_of(first)
    for _ in range(3):
        first.count("m", "normal", "rejected")
    view.absorb("ingress-0-100", first_view.snapshot())
    late = first_view.snapshot()  # taken before the process died, arrives after its retirement
    assert requests_total(engine, "rejected") == 3

    view.retire("ingress-0-100")  # it died; restarted under a new name (recommended)
    assert requests_total(engine, "rejected") == 3
    assert not view.absorb("ingress-0-100", late)  # not counted twice
    second = ServeMetrics()
    second.count("m", "normal", "rejected")
    view.absorb("ingress-0-200", view_of(second).snapshot())
    assert requests_total(engine, "rejected") == 4

    # Restarted under the same name: the new incarnation's counts add to the old one's.
    third = ServeMetrics()
    third.count("m", "normal", "rejected")
    view.absorb("ingress-0-200", view_of(third).snapshot())
    assert requests_total(engine, "rejected") == 5
    assert engine.sources() == ["ingress-0-200"]

    # A stale snapshot (a slower refresh finishing after a newer one) is dropped.
    third_view = view_of(third)
    older = third_view.snapshot()
    third.count("m", "normal", "rejected")
    assert view.absorb("ingress-0-200", third_view.snapshot())
    assert not view.absorb("ingress-0-200", older)
    assert requests_total(engine, "rejected") == 6
    assert 'servewell_requests_total{lane="normal",model="m",outcome="rejected"} 6.0' in samples(engine)


def test_sources_and_their_memory_are_the_live_ones():
    engine = view_of(ServeMetrics())
    assert engine.sources() == [] and engine.absorbed_rss_bytes() == 0
    a, b = view_of(ServeMetrics()).snapshot(), view_of(ServeMetrics()).snapshot()
    engine.absorb("ingress-0-1", a)
    engine.absorb("ingress-1-2", b)
    assert engine.sources() == ["ingress-0-1", "ingress-1-2"]
    assert engine.absorbed_rss_bytes() == a.rss_bytes + b.rss_bytes > 0
    engine.retire("ingress-0-1")
    assert engine.sources() == ["ingress-1-2"] and engine.absorbed_rss_bytes() == b.rss_bytes


def test_the_engine_alone_reads_as_before():
    engine = ServeMetrics()
    record_engine(engine)
    assert engine.requests.snapshot() == engine.requests.own_snapshot()
    assert engine.compute.snapshot() == engine.compute.own_snapshot()
    assert engine.snapshot().histograms["servewell_batch_compute_seconds"].series[("m",)][1] == sum(SECONDS)


def test_a_snapshot_holds_only_its_own_series():
    engine, ingress = ServeMetrics(), ServeMetrics()
    record_ingress(ingress, 0)
    view = view_of(engine)
    view.absorb("ingress-0-1", view_of(ingress).snapshot())
    own = view.snapshot().metrics
    assert own is not None and engine.requests.snapshot()  # the engine reads the ingress's counts
    assert all(not c.series for c in own.counters.values())  # and hands on none of them


def test_console_and_alert_readers_see_the_sum():
    engine, ingress = ServeMetrics(), ServeMetrics()
    feed = ConsoleFeed(engine)
    tracker = SignalTracker(engine, lambda: [ModelFacts("m", None, 0, None)])
    tracker.snapshots()
    record_engine(engine)
    record_ingress(ingress, 1)  # 6 requests: 2 answered 503, 4 answered 200
    feed.view.absorb("ingress-0-1", over_the_wire(view_of(ingress)))

    reading = read_metrics(engine)
    assert reading.outcomes["m"] == {"success": 7.0, "rejected": 6.0}
    assert reading.latency["m"].count == 6 and reading.client_errors["*"] == 6
    assert reading.preprocess["m"].count == 6 and reading.compute["m"].count == 7
    (signals,) = tracker.snapshots()
    assert signals.error_ratio == pytest.approx(2 / 6)
    assert signals.rejected_ratio == pytest.approx(6 / 13)
    assert [row["count"] for row in feed.compute_by_batch_size("m")] == [7]


def record(at: float, status: int = 500, model: str = "m", code: str = "internal") -> RequestRecord:
    return RequestRecord(f"r{at}", "http", "/predict", model, status, code, 1.0, False, at=at)


def test_recent_rings_merge_by_time_newest_first_and_bounded():
    engine, ingress_a, ingress_b = RecentRequests(capacity=4), RecentRequests(), RecentRequests()
    for at in (1.0, 5.0):
        engine.record(record(at))
    for at in (2.0, 6.0, 7.0):
        ingress_a.record(record(at))
    ingress_b.record(record(3.0))
    ingress_b.record(record(4.0, 401, "", "unauthenticated"))
    ingress_a.record(record(8.0, 404, "", "not_found"))
    view = ViewSources(None, engine)
    view.absorb("ingress-0-1", over_the_wire(ViewSources(None, ingress_a)))
    view.absorb("ingress-1-2", over_the_wire(ViewSources(None, ingress_b)))
    assert [r.at for r in engine.latest()] == [7.0, 6.0, 5.0, 3.0]  # capacity 4, as before
    assert [r.at for r in engine.latest(2)] == [7.0, 6.0]
    assert engine.recorded == 6
    assert engine.refusals_json()["counts"] == {"not_found": 1, "unauthenticated": 1}
    assert [r["at"] for r in engine.refusals_json()["recent"]] == [8.0, 4.0]

    view.retire("ingress-0-1")  # what it sent stays
    engine.record(record(9.0))
    assert [r.at for r in engine.latest()] == [9.0, 7.0, 6.0, 5.0]
    assert engine.recorded == 7 and engine.refusal_counts["not_found"] == 1


def full_view(models: int = 3) -> ViewSources:
    """An ingress after a while of traffic: every family populated, both rings full."""
    metrics = ServeMetrics()
    recent = RecentRequests()
    lanes = ("high", "normal", "low")
    outcomes = ("success", "rejected", "deadline_exceeded", "cancelled", "error")
    for m in range(models):
        model = f"model-{m}"
        for route in ("/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer", "/predict",
                      "/v2/models/{name}", "/v2/models/{name}/ready", "/v2/models/{name}/config"):
            for status in (200, 400, 503):
                metrics.observe_request(model, route, status, 0.01)
        for lane in lanes:
            metrics.queue_wait.labels(model, lane).observe(0.01)
            for outcome in outcomes:
                metrics.count(model, lane, outcome)
        for histogram in (metrics.preprocess, metrics.postprocess, metrics.compute, metrics.transport):
            histogram.labels(model).observe(0.01)
        metrics.batch_size.labels(model).observe(8)
        for size in ("1", "2", "4", "8", "16"):
            metrics.compute_by_size.labels(model, size).observe(0.01)
    for key in range(4):
        metrics.api_key_requests.labels(f"key-{key}", "allowed").inc()
        metrics.api_key_requests.labels(f"key-{key}", "rate_limited").inc()
    metrics.auth_failures.labels("missing").inc()
    for i in range(1000):
        stages = {"preprocess": 1.5, "queue": 2.5, "compute": 30.25, "postprocess": 0.5}
        recent.record(RequestRecord(f"{i:032x}", "http", "/v2/models/{name}/infer", f"model-{i % models}", 503,
                                    "overloaded", 123.456, True, stages, batch_id=i, batch_size=8, instance=0,
                                    queue_position=3))
        recent.record(RequestRecord(f"{i:031x}r", "http", "/v2/models/{name}/infer", "", 401,
                                    "unauthenticated", 0.25, False))
    return ViewSources(metrics, recent)


def test_a_snapshot_round_trips_through_pickle_and_is_bounded():
    view = full_view()
    snapshot = view.snapshot()
    data = pickle.dumps(snapshot)
    assert pickle.loads(data) == snapshot
    assert len(snapshot.recent.records) == 200 and len(snapshot.recent.refusals) == 50  # the rings' bounds
    assert len(data) < 150_000  # whatever the traffic: rings full, every label set of 3 models
    if os.environ.get("MEASURE"):
        engine = ServeMetrics()
        record_engine(engine)
        sources = ViewSources(engine, RecentRequests())
        n = 200
        assert view.metrics is not None and snapshot.metrics is not None
        take = timeit.timeit(view.metrics.snapshot, number=n) / n
        dump = timeit.timeit(lambda: pickle.dumps(view.snapshot()), number=n) / n
        alone = timeit.timeit(lambda: generate_latest(engine.registry), number=n) / n
        other = full_view()
        sources.absorb("a", view.snapshot())
        sources.absorb("b", other.snapshot())
        absorb = timeit.timeit(lambda: sources.absorb("a", pickle.loads(pickle.dumps(view.snapshot()))),
                               number=n) / n
        merged = timeit.timeit(lambda: generate_latest(engine.registry), number=n) / n
        absorb_collect = timeit.timeit(lambda: (sources.absorb("a", view.snapshot()),
                                                generate_latest(engine.registry)), number=n) / n
        series = sum(len(h.series) for h in snapshot.metrics.histograms.values()) + sum(
            len(c.series) for c in snapshot.metrics.counters.values())
        one_process = timeit.timeit(lambda: generate_latest(view.metrics.registry), number=n) / n
        print(f"\nseries {series}; snapshot() {take * 1e3:.2f} ms; view snapshot+pickle {dump * 1e3:.2f} ms, "
              f"{len(data)} B (metrics alone {len(pickle.dumps(snapshot.metrics))} B); "
              f"snapshot+pickle+unpickle+absorb {absorb * 1e3:.2f} ms; generate_latest alone {alone * 1e3:.2f} ms, "
              f"with 2 sources {merged * 1e3:.2f} ms (one process holding one source's series: "
              f"{one_process * 1e3:.2f} ms); absorb+generate_latest {absorb_collect * 1e3:.2f} ms")


async def _refreshed_metrics_text(engine: ServeMetrics, feed: ConsoleFeed, repository: Path) -> str:
    # /metrics is rendered where the engine runs (its control table); here, in this one process.
    access, knobs = InferenceAccess(KeyRing()), LiveKnobs(0.3, False)
    table = control_table(EngineParts(InferenceEngine(repository, load_timeout_s=5.0), ServerConfig(), access, knobs,
                                      feed, engine, dict, dict))
    state = SimpleNamespace(metrics=engine, console=feed, settings=SimpleNamespace(slow_request_ms=300.0),
                            access=access, knobs=knobs, control=LocalControlPlane(table))
    app = create_app(state)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
        response = await client.get("/metrics")
        assert response.status_code == 200
        return response.text


def test_get_metrics_refreshes_before_it_reads(tmp_path: Path):
    engine, ingress = ServeMetrics(), ServeMetrics()
    feed, ingress_view = ConsoleFeed(engine), view_of(ingress)
    calls = 0

    async def ask_every_ingress() -> None:
        nonlocal calls
        calls += 1
        ingress.auth_failures.labels("invalid").inc()
        feed.view.absorb("ingress-0-1", over_the_wire(ingress_view))

    feed.view.set_refresher(ask_every_ingress)
    text = asyncio.run(_refreshed_metrics_text(engine, feed, tmp_path))
    assert calls == 1
    assert 'servewell_auth_failures_total{reason="invalid"} 1.0' in text


def test_a_hung_or_broken_refresher_does_not_hang_the_reader(caplog):
    engine, ingress = ServeMetrics(), ServeMetrics()
    view = view_of(engine)
    ingress.auth_failures.labels("missing").inc()
    view.absorb("ingress-0-1", view_of(ingress).snapshot())
    started, release = 0, asyncio.Event()

    async def hung() -> None:
        nonlocal started
        started += 1
        await release.wait()

    async def main() -> None:
        view.set_refresher(hung, timeout_s=0.05)
        await asyncio.wait_for(asyncio.gather(view.refresh(), view.refresh()), 5)  # both give up waiting
        assert started == 1  # joined the one running, never two at once
        release.set()
        await asyncio.sleep(0)

        async def broken() -> None:
            raise ConnectionError("ingress gone")

        view.set_refresher(broken)
        await view.refresh()

    asyncio.run(main())
    assert 'servewell_auth_failures_total{reason="missing"} 1.0' in samples(engine)  # what was absorbed stays
    assert "view refresh took over" in caplog.text


def test_without_a_refresher_refresh_returns_at_once():
    asyncio.run(asyncio.wait_for(view_of(ServeMetrics()).refresh(), 1))


def test_the_feed_tick_and_alerting_refresh_first():
    engine, ingress = ServeMetrics(), ServeMetrics()
    feed, ingress_view = ConsoleFeed(engine, interval_s=0.01, window_s=1.0), view_of(ingress)
    refreshed = asyncio.Event()

    async def ask() -> None:
        ingress.count("m", "normal", "rejected")
        feed.view.absorb("ingress-0-1", ingress_view.snapshot())
        refreshed.set()

    feed.view.set_refresher(ask)
    seen: list[float] = []

    def signals() -> list[SignalSnapshot]:
        seen.append(requests_total(engine, "rejected"))
        return []

    before: list[float] = []

    async def main() -> None:
        ticking = asyncio.create_task(feed.run())
        await asyncio.wait_for(refreshed.wait(), 5)
        ticking.cancel()
        before.append(requests_total(engine, "rejected"))
        stop = asyncio.Event()
        alerting = asyncio.create_task(run_alerting(AlertingConfig(evaluation_interval_s=0.01), signals, stop,
                                                    active=feed.alerts, refresh=feed.view.refresh))
        while not seen:
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(alerting, 5)

    asyncio.run(main())
    assert before[0] >= 1  # the feed's tick refreshed
    assert seen[0] == before[0] + 1  # the alert evaluation refreshed before it read
