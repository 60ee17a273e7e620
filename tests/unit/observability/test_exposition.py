"""`/metrics` is written in slices with the event loop served between them, and the text is
byte for byte what prometheus-client's `generate_latest` writes for the same registry."""

import asyncio
import re

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from servewell.observability.exposition import OrderedRegistry, render_text
from servewell.observability.loop_metrics import SERIES_PER_CHUNK, LoopCounter, LoopHistogram
from servewell.observability.metrics import ModelSample, ServeMetrics, StateCollector

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
    samples = [ModelSample(f"model-{i}", "ready", {"normal": i}, 1, 8, residency="resident") for i in range(200)]
    metrics.registry.register(StateCollector(lambda: samples, lambda pid: {}, budget=lambda: (1000, 400)))

    def without_process(text: bytes) -> list[str]:  # the process's own figures move between two reads
        return [line for line in text.decode().splitlines()
                if not re.match(r"(# (HELP|TYPE) )?(process_|python_gc_)", line)]

    assert without_process(asyncio.run(render_text(metrics.registry))) == without_process(
        generate_latest(metrics.registry))


def test_the_loop_is_served_between_slices():
    registry = registry_with([f"m{i}" for i in range(10 * SERIES_PER_CHUNK)], [0.002])
    turns = 0

    async def main() -> bytes:
        nonlocal turns
        stop = asyncio.Event()

        async def other_work() -> None:
            nonlocal turns
            while not stop.is_set():
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(other_work())
        await asyncio.sleep(0)
        turns = 0
        text = await render_text(registry, slice_s=0.0)  # yield after every chunk
        stop.set()
        await task
        return text

    text = asyncio.run(main())
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
