"""A model's diagnosis (observability/diagnosis.py): the reading order (a tenant holding most of a
lane, a cache TTL shorter than its inputs' reuse interval, worker replacements, host CPU, then the
stages), each reading naming its evidence, and a reading that cannot tell saying so."""

from __future__ import annotations

from typing import Any

from servewell.observability.diagnosis import (
    CacheFacts,
    CpuFacts,
    LaneHolding,
    ModelEvidence,
    ReplacementFact,
    diagnose,
)
from servewell.observability.latency_reading import latency_split


def summary(p99: float = 400.0, queue: float = 350.0, compute: float = 20.0, compute_p50: float = 18.0,
            rps: float = 10.0) -> dict[str, Any]:
    return {"latency_p99_ms": p99, "queue_p99_ms": queue, "compute_p99_ms": compute, "compute_p50_ms": compute_p50,
            "preprocess_p99_ms": 1.0, "postprocess_p99_ms": 1.0, "requests_per_s": rps}


def evidence(**given: Any) -> ModelEvidence:
    s = given.pop("summary", summary())
    fields: dict[str, Any] = {"model": "digits", "window_s": 30.0, "answered": 300.0, "split": latency_split(s),
                              "summary": s}
    fields.update(given)
    return ModelEvidence(**fields)


def flood(places: dict[str, int] | None = None, depth: int = 48, max_queue: int = 50) -> LaneHolding:
    places = places if places is not None else {"alpha": 45, "bravo": 3}
    return LaneHolding("normal", depth, max_queue, places, {"alpha": 0.25, "bravo": 0.25})


def test_a_queue_filled_by_one_tenant_is_read_as_that_tenant_never_as_capacity() -> None:
    assert latency_split(summary()).cause == "capacity"  # what the stages alone would say
    found = diagnose(evidence(holdings=[flood()], refusals={("normal", "alpha", "overloaded"): 210.0,
                                                            ("normal", "bravo", "overloaded"): 7.0}))
    assert found.cause == "tenant_holds_lane" and found.found
    assert "'alpha' holds most of lane 'normal'" in found.reading
    assert found.evidence[0].startswith("tenant 'alpha' holds 45 of 48 queued places of lane 'normal' (94%")
    assert "'alpha' 210, 'bravo' 7" in found.evidence[1]
    assert "PATCH /admin/tenants/alpha" in found.advice and "add instances" not in found.advice.replace(
        "adding instances", "")


def test_a_lane_held_in_the_window_but_not_now_still_names_the_tenant() -> None:
    found = diagnose(evidence(held_in_window={("normal", "alpha"): 0.4}))
    assert found.cause == "tenant_holds_lane" and "40% of the samples" in found.evidence[0]
    assert diagnose(evidence(held_in_window={("normal", "alpha"): 0.1})).cause == "capacity"


def test_a_tenant_within_its_weight_or_a_half_empty_lane_is_no_flood() -> None:
    heavy = LaneHolding("normal", 48, 50, {"alpha": 40, "bravo": 8}, {"alpha": 0.9, "bravo": 0.1})
    assert diagnose(evidence(holdings=[heavy])).cause == "capacity"
    assert diagnose(evidence(holdings=[flood(depth=20)])).cause == "capacity"
    anonymous = LaneHolding("normal", 50, 50, {"-": 50}, {"-": 1.0})
    assert diagnose(evidence(holdings=[anonymous])).cause == "capacity"  # no keys: cannot tell callers apart


def test_a_ttl_shorter_than_the_reuse_interval_is_named_with_its_figures() -> None:
    cache = CacheFacts(ttl_s=2.0, hits=1.0, coalesced=0.0, misses=60.0, reused_within=1.0, reused_beyond=38.0,
                       reuse_p50_s=29.0)
    growing = summary(p99=90.0, queue=10.0, compute=80.0, compute_p50=40.0)
    found = diagnose(evidence(cache=cache, summary=growing))
    assert found.cause == "cache_ttl_short"
    assert "38 of 39 repeated inputs" in found.evidence[0] and "29.0 s" in found.evidence[0]
    assert "hit ratio 2%" in found.evidence[1] and '"ttl_s": 58' in found.advice


def test_a_cache_that_hits_or_sees_no_repeats_is_no_finding() -> None:
    hits = CacheFacts(2.0, hits=80.0, coalesced=0.0, misses=20.0, reused_within=80.0, reused_beyond=20.0)
    assert diagnose(evidence(cache=hits)).cause == "capacity"
    few = CacheFacts(2.0, hits=0.0, coalesced=0.0, misses=100.0, reused_within=0.0, reused_beyond=3.0)
    assert diagnose(evidence(cache=few)).cause == "capacity"


def test_a_replacement_gap_is_read_as_such_not_as_one_slow_batch() -> None:
    slow = summary(p99=3000.0, queue=2900.0, compute=200.0, compute_p50=20.0)
    assert latency_split(slow).cause == "slow_batch"  # what the stages alone would say
    replaced = ReplacementFact(0, "memory", "resident memory 612 MiB exceeds host_memory_limit_bytes 512 MiB",
                               1_700_000_000.0, 2.8, None, 0)
    found = diagnose(evidence(summary=slow, replacements=[replaced], memory_growth={0: (5 * 1024 * 1024 / 60, 41.0)}))
    assert found.cause == "worker_replaced"
    assert "instance #0, resident memory 612 MiB" in found.evidence[0]
    assert "its gap was 2.8 s; with no other instance serving, requests waited up to 2.8 s" in found.evidence[1]
    assert "grows 5.0 MiB/min, at its limit in 41 s" in found.evidence[2]
    assert "leak" in found.advice and "instances: 2" in found.advice


def test_a_replacement_under_way_says_so() -> None:
    open_one = ReplacementFact(1, "crash", "exit code -9 (SIGKILL)", 1.0, None, 1.5, 1)
    found = diagnose(evidence(replacements=[open_one]))
    assert found.cause == "worker_replaced" and "under way (1.5 s so far)" in found.evidence[1]
    assert "other instances kept serving" in found.evidence[1]


def test_cpu_contention_explains_a_slow_model_only() -> None:
    busy = CpuFacts(pressure=0.42, load1=5.2, cpus=2)
    found = diagnose(evidence(cpu=busy))
    assert found.cause == "cpu_contention" and "42%" in found.evidence[0] and "load 5.2 on 2 CPUs" in found.evidence[0]
    fast = summary(p99=10.0, queue=1.0, compute=2.0, compute_p50=2.0)
    assert diagnose(evidence(cpu=busy, summary=fast)).cause != "cpu_contention"
    steady = summary(p99=20.0, queue=2.0, compute=16.0, compute_p50=15.0)  # compute is most of it, and steady
    assert diagnose(evidence(cpu=busy, summary=steady)).cause == "compute"
    jitter = summary(p99=60.0, queue=2.0, compute=50.0, compute_p50=15.0)
    assert diagnose(evidence(cpu=busy, summary=jitter)).cause == "cpu_contention"
    assert diagnose(evidence(cpu=CpuFacts(None, 5.0, 2))).cause == "cpu_contention"  # no PSI: the load says it
    assert diagnose(evidence(cpu=CpuFacts(0.05, 5.0, 2))).cause == "capacity"  # PSI wins over load


def test_capacity_is_read_last_and_says_what_it_ruled_out() -> None:
    found = diagnose(evidence(cpu=CpuFacts(0.03, 0.5, 2), refusals={("normal", "alpha", "overloaded"): 4.0}))
    assert found.cause == "capacity"
    assert found.evidence[-1].startswith("ruled out: no tenant holds most of a lane; no worker replaced")
    assert "host CPU not contended" in found.evidence[-1] and "raise instances" in found.advice


def test_the_order_puts_the_tenant_before_the_cache_and_the_cache_before_replacements() -> None:
    cache = CacheFacts(2.0, 0.0, 0.0, 60.0, 0.0, 30.0)
    replaced = ReplacementFact(0, "crash", "x", 1.0, 1.0, None, 0)
    assert diagnose(evidence(holdings=[flood()], cache=cache, replacements=[replaced])).cause == "tenant_holds_lane"
    assert diagnose(evidence(cache=cache, replacements=[replaced])).cause == "cache_ttl_short"


def test_a_reading_that_cannot_tell_says_so() -> None:
    found = diagnose(evidence(answered=3.0))
    assert found.cause == "unknown" and found.reading.startswith("too few requests in the last 30 s to tell (3)")
    quiet = diagnose(evidence(summary=None, split=latency_split(None), answered=0.0))
    assert quiet.cause == "no_traffic"
