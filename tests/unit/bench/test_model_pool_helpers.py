"""The pure parts of bench.model_pool: the Zipf sampler, the repository layout, the readers of
/proc, of /metrics and of the engine's log lines, the histogram quantile and the pooled p99 ratio."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))  # bench/ is a folder of the repository, not an installed package
from bench.model_pool import bootstrap_interval, pairs, pooled_ratio  # noqa: E402
from bench.pool_repository import HOT_PINNED_MODEL, PROBE_MODEL, SIZE_CLASSES, hidden_width, layout  # noqa: E402
from bench.pool_traffic import (  # noqa: E402
    TreeMemorySampler,
    ZipfSampler,
    histogram_quantile,
    lru_hit_rate,
    machine_cpu_ticks,
    parse_pool_metrics,
    read_log_events,
    rollup_pss_bytes,
    status_rss_bytes,
    zipf_weights,
)


def test_zipf_weights_follow_one_over_rank_to_the_s_and_sum_to_one():
    weights = zipf_weights(200, 1.1)
    assert math.isclose(sum(weights), 1.0)
    assert math.isclose(weights[0] / weights[1], 2 ** 1.1)
    assert math.isclose(weights[9] / weights[99], 10 ** 1.1)
    assert weights == sorted(weights, reverse=True)


def test_zipf_sampler_draws_the_popular_items_in_their_share_and_is_seeded():
    items = [f"m{i}" for i in range(50)]
    sampler = ZipfSampler(items, 1.1, seed=7)
    draws = Counter(sampler.draw() for _ in range(20_000))
    share = zipf_weights(50, 1.1)
    assert abs(draws["m0"] / 20_000 - share[0]) < 0.02  # ~0.22; binomial sd ~0.003
    assert draws["m0"] > draws["m1"] > draws["m9"]
    assert set(draws) <= set(items)
    first, second = ZipfSampler(items, 1.1, seed=3), ZipfSampler(items, 1.1, seed=3)
    assert [first.draw() for _ in range(100)] == [second.draw() for _ in range(100)]
    assert math.isclose(sampler.share_of_top(2), share[0] + share[1])


def test_zipf_weights_refuse_an_empty_population():
    with pytest.raises(ValueError):
        zipf_weights(0, 1.1)


def test_layout_has_the_two_pinned_models_and_the_size_classes_in_proportion():
    models = layout(200)
    assert [m.name for m in models[:2]] == [PROBE_MODEL, HOT_PINNED_MODEL]
    assert [m.name for m in models if m.pinned] == [PROBE_MODEL, HOT_PINNED_MODEL]
    assert len({m.name for m in models}) == 200
    assert Counter(m.weight_mib for m in models) == dict(SIZE_CLASSES)
    assert layout(200) == models  # seeded
    assert len(layout(7)) == 7


def test_hidden_width_makes_the_weights_the_size_asked_for():
    for mib in (2, 40):
        weights = 4 * hidden_width(mib) * (64 + 1 + 16) + 4 * 16
        assert abs(weights - mib * (1 << 20)) < 4 * (64 + 1 + 16)


def test_proc_readers_take_the_kilobyte_lines():
    status = "Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nThreads:\t3\n"
    assert status_rss_bytes(status) == 1024 * 1024
    assert status_rss_bytes("Name:\tzombie\n") is None
    rollup = "00400000-7fff [rollup]\nRss:            9000 kB\nPss:             300 kB\nPss_Anon:  100 kB\n"
    assert rollup_pss_bytes(rollup) == 300 * 1024


def test_tree_memory_sampler_reads_a_process_tree():
    # A child of its own as the root: this pytest process may hold a spares' fork server (a worker,
    # by its command line) that an in-process test started.
    root = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
                            stdout=subprocess.PIPE)
    try:
        # Sampled right after the fork, the child is not yet an interpreter (CI once read 0.7 MiB).
        assert root.stdout is not None and root.stdout.readline() == b"up\n"
        peak = TreeMemorySampler(root.pid, interval_s=0.01).start().stop()
    finally:
        root.kill()
        root.wait()
        if root.stdout is not None:
            root.stdout.close()
    assert peak.samples >= 2
    assert peak.all_rss > 1 << 20  # a Python interpreter
    assert peak.workers_rss == 0  # the root of the tree is never a model worker


METRICS = """\
# HELP servewell_model_evictions_total Models unloaded by the pool.
# TYPE servewell_model_evictions_total counter
servewell_model_evictions_total{model="m001",reason="memory"} 3.0
servewell_model_evictions_total{model="m002",reason="memory"} 2.0
servewell_model_evictions_total{model="m002",reason="idle"} 1.0
# HELP servewell_model_cold_start_seconds Wait for a model's load.
# TYPE servewell_model_cold_start_seconds histogram
servewell_model_cold_start_seconds_bucket{le="0.5",model="m001"} 1.0
servewell_model_cold_start_seconds_bucket{le="1.0",model="m001"} 3.0
servewell_model_cold_start_seconds_bucket{le="+Inf",model="m001"} 4.0
servewell_model_cold_start_seconds_count{model="m001"} 4.0
servewell_model_cold_start_seconds_sum{model="m001"} 5.5
servewell_model_cold_start_seconds_bucket{le="0.5",model="m002"} 0.0
servewell_model_cold_start_seconds_bucket{le="1.0",model="m002"} 0.0
servewell_model_cold_start_seconds_bucket{le="+Inf",model="m002"} 0.0
servewell_model_cold_start_seconds_count{model="m002"} 0.0
servewell_model_cold_start_seconds_sum{model="m002"} 0.0
"""


def test_pool_metrics_are_summed_over_models_and_reasons():
    metrics = parse_pool_metrics(METRICS)
    assert metrics.evictions == {"memory": 5.0, "idle": 1.0}
    assert metrics.evictions_by_model == {"m001": 3.0, "m002": 3.0}
    assert metrics.cold_start_count == 4.0 and metrics.cold_start_sum_s == 5.5
    assert metrics.cold_start_buckets == {0.5: 1.0, 1.0: 3.0, math.inf: 4.0}


def test_histogram_quantile_interpolates_inside_the_bucket_like_prometheus():
    buckets = {0.5: 1.0, 1.0: 3.0, math.inf: 4.0}
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.75)  # rank 2: halfway through (0.5, 1.0]
    assert histogram_quantile(buckets, 0.25) == pytest.approx(0.5)
    assert histogram_quantile(buckets, 0.99) == 1.0  # in +Inf: the largest finite bound
    assert histogram_quantile({0.5: 0.0, math.inf: 0.0}, 0.5) is None


def test_log_events_are_read_from_the_engine_messages():
    lines = [
        json.dumps({"level": "info", "logger": "servewell.engine",
                    "message": "cold start of m007: 1.25 s (waited by 3 requests)", "event": "cold_start"}),
        json.dumps({"level": "info", "message": "evicted m002 (memory): least recently used, idle 12 s"}),
        json.dumps({"level": "info", "message": "model m003 ready"}),
        "not json, but says cold start of m009: 1 s (waited by 1 requests)",
    ]
    starts, evictions = read_log_events(lines)
    assert [(s.model, s.seconds, s.waiters) for s in starts] == [("m007", 1.25, 3)]
    assert evictions == [("m002", "memory")]


def test_machine_cpu_ticks_count_all_but_idle_and_iowait():
    stat = "cpu  100 5 50 800 40 3 2 0 0 0\ncpu0 50 2 25 400 20 1 1 0 0 0\nintr 1\n"
    assert machine_cpu_ticks(stat) == (160, 1000)


def test_lru_hit_rate_evicts_the_least_recently_used_until_the_new_model_fits():
    cost = {"a": 2, "b": 2, "c": 2, "big": 4, "pin": 1}
    # room for 4 after the pinned model: a, b fit; c evicts b (a was used since); big evicts c and a
    requests = ["pin", "a", "b", "a", "c", "a", "big", "c", "pin"]
    #            hit   miss miss hit  miss hit  miss   miss hit
    assert lru_hit_rate(requests, cost, budget=5, pinned={"pin"}) == pytest.approx(4 / 9)
    assert lru_hit_rate([], cost, budget=5, pinned=set()) is None
    assert lru_hit_rate(["big", "big"], cost, budget=3, pinned=set()) == 0.0  # never fits: never resident


def _sleep_forever() -> None:
    time.sleep(60)


def test_the_fork_server_is_not_a_worker_but_what_it_forks_is():
    import multiprocessing

    from bench.processes import OTHER, WORKER, role_of

    context = multiprocessing.get_context("forkserver")
    child = context.Process(target=_sleep_forever, daemon=True)
    child.start()
    try:
        assert child.pid is not None
        fork_server = int(Path(f"/proc/{child.pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
        assert fork_server != os.getpid()
        assert role_of(fork_server, os.getpid()) == OTHER
        assert role_of(child.pid, os.getpid()) == WORKER
    finally:
        child.kill()
        child.join(10)


def test_the_p99_ratio_pools_every_block_of_each_condition():
    quiet = [[5.0] * 99 + [10.0], [5.0] * 100]
    churn = [[5.0] * 100, [6.0] * 97 + [30.0] * 3]
    # pooled, nearest rank: the p99 of 200 answers is the 198th; quiet's is 5.0 (its one 10 ms is
    # above it), churn's is 30.0 (its three slow answers are the 198th to the 200th)
    assert pooled_ratio(quiet, churn, 99) == 6.0
    assert pooled_ratio(quiet, churn, 50) == 1.0
    assert pooled_ratio([[]], churn, 99) is None


def test_the_bootstrap_interval_resamples_pairs_and_brackets_the_ratio():
    quiet = [[float(5 + i % 3)] * 50 for i in range(12)]
    churn = [[float(6 + i % 3)] * 50 for i in range(12)]
    low, high = bootstrap_interval(quiet, churn, 99, draws=300, seed=1)
    assert low <= round(pooled_ratio(quiet, churn, 99), 3) <= high
    assert 1.0 < low <= high < 1.5
    same = bootstrap_interval([[5.0] * 10] * 4, [[5.0] * 10] * 4, 99, draws=50)
    assert same == (1.0, 1.0)
    assert bootstrap_interval([[5.0]], [[6.0]], 99) is None  # one pair says nothing about the spread


def test_pairs_split_the_minutes_into_blocks():
    import argparse
    assert pairs(argparse.Namespace(minutes=10.0, block_s=20.0)) == 30
    assert pairs(argparse.Namespace(minutes=0.1, block_s=20.0)) == 1
