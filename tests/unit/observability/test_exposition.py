"""`/metrics` is written in slices with the event loop served between them, and the text is
byte for byte what prometheus-client's `generate_latest` writes for the same registry."""

import asyncio
import re
import threading
import time

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from servewell.observability.exposition import SLICE_S, OrderedRegistry, family_chunks, render_text
from servewell.observability.loop_metrics import SERIES_PER_CHUNK, LoopCounter, LoopHistogram, MetricList
from servewell.observability.metrics import ModelSample, ServeMetrics, StateCollector, WorkerSample

# Label values a hostile client or an odd repository could bring: quotes, backslashes, newlines,
# braces, commas, non-ASCII, empty.
LABEL_VALUES = st.text(alphabet=st.sampled_from(['a', 'Z', '0', '"', '\\', '\n', '{', '}', ',', '=', ' ', 'é', '模']),
                       max_size=8)


class Gauges:
    """A collector that is not one of ours (written by the library, one family at a time)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def collect(self):
        depth = GaugeMetricFamily("t_depth", 'Waiting "now"\nper \\ model.', labels=["model"])
        for i, name in enumerate(self.names):
            depth.add_metric([name], float(i))
        yield depth
        up = GaugeMetricFamily("t_up", "Up.")
        up.add_metric([], 1.0)
        yield up


def registry_with(names: list[str], values: list[float]) -> OrderedRegistry:
    registry = OrderedRegistry()
    latency = LoopHistogram("t_latency_seconds", "Latency \\ of a request.\nSecond line.",
                            ["route", "model"], (0.001, 0.01, 0.1, 1.5e7), registry)
    registry.register(Gauges(names))
    requests = LoopCounter("t_requests", "Requests by outcome.", ["model", "outcome", "zone"], registry)
    LoopCounter("t_unlabelled", "No labels.", [], registry).labels().inc(2.5)
    for i, name in enumerate(names):
        for value in values:
            latency.labels("/v2", name).observe(value)
        requests.labels(name, "success" if i % 2 else "error", "a").inc(i)
    requests.labels("never", "used", "b")  # a series at 0
    return registry


@settings(max_examples=60, deadline=None)
@given(names=st.lists(LABEL_VALUES, min_size=0, max_size=40, unique=True),
       values=st.lists(st.floats(min_value=0, max_value=1e9, allow_nan=False), max_size=6))
def test_the_text_is_what_prometheus_client_writes(names, values):
    registry = registry_with(names, values)
    text = asyncio.run(render_text(registry))
    assert text == generate_latest(registry)
    assert asyncio.run(render_text(registry)) == text  # the second scrape, from the kept prefixes
    list(text_string_to_metric_families(text.decode()))  # and Prometheus' own parser reads it


def test_the_servers_own_registry_with_200_models_matches_too():
    metrics = ServeMetrics()
    for i in range(200):
        model = f"model-{i}"
        for family in metrics.families():
            series = family.labels(*([model] + ["x"] * (len(family.labelnames) - 1)))
            series.observe(0.003 * i) if isinstance(family, LoopHistogram) else series.inc(i)
    samples = [ModelSample(f"model-{i}", "ready", {"normal": i}, 1, 8,
                           (WorkerSample(f"model-{i}", 0, True, 1000 + i),
                            WorkerSample(f"model-{i}", 1, i % 3 > 0, None)),
                           residency="resident") for i in range(200)]

    def facts(pid: int) -> dict[str, float]:
        if pid % 7 == 0:
            return {}  # gone since the model was sampled
        return {"rss_bytes": pid * 4096.0, "private_bytes": pid * 1024.0, "file_bytes": 8192.0,
                "cpu_seconds": pid / 100, "threads": 3.0}

    metrics.registry.register(StateCollector(lambda: samples, facts, budget=lambda: (1000, 400)))

    def without_process(text: bytes) -> list[str]:  # the process's own figures move between two reads
        return [line for line in text.decode().splitlines()
                if not re.match(r"(# (HELP|TYPE) )?(process_|python_gc_)", line)]

    assert without_process(asyncio.run(render_text(metrics.registry))) == without_process(
        generate_latest(metrics.registry))


async def render_counting_turns(registry: OrderedRegistry, slice_s: float, pause_s: float) -> tuple[bytes, int]:
    """`render_text`'s text, and how often another task ran meanwhile (it sleeps `pause_s` a turn)."""
    turns = 0
    stop = asyncio.Event()

    async def other_work() -> None:
        nonlocal turns
        while not stop.is_set():
            turns += 1
            await asyncio.sleep(pause_s)

    task = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    turns = 0
    text = await render_text(registry, slice_s=slice_s)
    stop.set()
    await task
    return text, turns


def test_the_loop_is_served_between_slices():
    registry = registry_with([f"m{i}" for i in range(10 * SERIES_PER_CHUNK)], [0.002])
    text, turns = asyncio.run(render_counting_turns(registry, 0.0, 0.0))  # yield after every chunk
    assert text == generate_latest(registry)
    # every family's header and each SERIES_PER_CHUNK series is a chunk: the other task ran between them
    assert turns >= 2 * 10 + 4, turns


def test_unregistered_collectors_leave_the_text_in_order():
    registry = OrderedRegistry()
    first = LoopCounter("t_first", "First.", [], registry)
    gauges = Gauges(["m"])
    registry.register(gauges)
    LoopCounter("t_last", "Last.", [], registry)
    first.labels().inc()
    registry.unregister(gauges)
    text = asyncio.run(render_text(registry))
    assert text == generate_latest(registry)
    assert text.index(b"t_first_total") < text.index(b"t_last_total") and b"t_depth" not in text


def test_a_series_that_moved_since_the_last_scrape_is_written_anew():
    """Unchanged series are written from the text kept at the last scrape; one that moved is not,
    even when only a bucket moved (an observation of 0 leaves the sum as it was)."""
    registry = OrderedRegistry()
    latency = LoopHistogram("t_seconds", "Latency.", ["model"], (0.001, 0.01), registry)
    for name in ("a", "b", "c"):
        latency.labels(name).observe(0.005)
    first = asyncio.run(render_text(registry))
    assert first == generate_latest(registry)
    latency.labels("b").observe(0.0)  # count and first bucket move, the sum does not
    latency.labels("c").observe(0.5)
    second = asyncio.run(render_text(registry))
    assert second == generate_latest(registry) and second != first
    assert b't_seconds_count{model="b"} 2.0' in second and b't_seconds_count{model="a"} 1.0' in second


@settings(max_examples=40, deadline=None)
@given(names=st.lists(LABEL_VALUES, max_size=30, unique=True), per=st.integers(1, 8))
def test_a_gauge_family_in_pieces_joins_to_the_same_text(names, per):
    gauge = GaugeMetricFamily("t_depth", 'Waiting "now"\nper \\ model.', labels=["model"])
    counter = CounterMetricFamily("t_done", "Done.", labels=["model"], created=1.7e9)
    for i, name in enumerate(names):
        gauge.add_metric([name], float(i))
        counter.add_metric([name], float(i), created=1.7e9 + i)
    pieces = list(family_chunks(gauge, per))
    assert len(pieces) == max(1, -(-len(names) // per))
    assert "".join(pieces) == generate_latest(MetricList([gauge])).decode()
    # a counter's `_created` lines follow all its series: never split
    assert list(family_chunks(counter, per)) == [generate_latest(MetricList([counter])).decode()]


def test_the_workers_proc_reads_run_off_the_event_loop():
    """Each read of a worker's /proc costs 0.6-2.4 ms (more for a bigger model): 200 of them on
    the loop held it about 200 ms. They run on a thread, and the loop is served meanwhile."""
    samples = [ModelSample(f"m{i}", "ready", {}, 0, 8, (WorkerSample(f"m{i}", 0, True, 100 + i),)) for i in range(5)]
    read_on: set[int] = set()

    def slow_facts(pid: int) -> dict[str, float]:
        read_on.add(threading.get_ident())
        time.sleep(0.02)  # a read the kernel takes long over (the GIL is free meanwhile)
        return {"rss_bytes": 1.0, "private_bytes": 1.0, "cpu_seconds": 1.0, "threads": 1.0}

    registry = OrderedRegistry()
    registry.register(StateCollector(lambda: samples, slow_facts))
    read_on.clear()  # registering collected once, to learn the names

    async def main() -> tuple[bytes, int, int]:
        text, turns = await render_counting_turns(registry, SLICE_S, 0.001)
        return text, turns, threading.get_ident()

    text, turns, loop_thread = asyncio.run(main())
    assert read_on and loop_thread not in read_on
    assert text == generate_latest(registry)  # (this one reads on the caller's thread)
    assert turns >= 20, turns  # 5 reads of 20 ms: the loop ran on through them
    assert text.count(b"servewell_worker_resident_memory_bytes{") == 5
