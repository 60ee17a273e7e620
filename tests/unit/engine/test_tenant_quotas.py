"""Tenants from the keys file (api/keys.py) and their quotas in the engine (engine/tenants.py)."""

from __future__ import annotations

import pytest

from servewell.engine.tenants import Tenants
from servewell.errors import OverQuota
from servewell.tenancy.keys import KeyFormatError, KeyRing, parse_keys, policies_of

SECRET = "0123456789abcdef"


def ring(*lines: str) -> KeyRing:
    return KeyRing(parse_keys(lines, "keys"))


def test_keys_of_one_tenant_share_its_policy() -> None:
    keys = ring(f"web-1:{SECRET}a tenant=acme weight=2 concurrency=8", f"web-2:{SECRET}b tenant=acme queue=4",
                f"solo:{SECRET}c rate=5")
    policies = policies_of(keys)
    assert policies["web-1"] is policies["web-2"]
    acme = policies["web-1"]
    assert (acme.id, acme.weight, acme.max_concurrent, acme.max_queued, acme.rate_per_s) == ("acme", 2.0, 8, 4, None)
    solo = policies["solo"]
    assert (solo.id, solo.weight, solo.rate_per_s, solo.limited) == ("solo", 1.0, 5.0, True)


@pytest.mark.parametrize("fields, problem", [
    ("weight=0", "weight must be a positive number"),
    ("weight=1e9", "up to 1000"),
    ("concurrency=0", "whole number from 1"),
    ("queue=2.5", "whole number from 1"),
    ("tenant=a/b", "tenant must be"),
    ("color=red", "unexpected field"),
])
def test_bad_tenant_fields_are_refused(fields: str, problem: str) -> None:
    with pytest.raises(KeyFormatError, match=problem):
        parse_keys([f"k:{SECRET} {fields}"], "keys")


def test_keys_of_one_tenant_cannot_disagree() -> None:
    with pytest.raises(KeyFormatError, match="give its weight differently"):
        parse_keys([f"a:{SECRET}a tenant=t weight=1", f"b:{SECRET}b tenant=t weight=2"], "keys")


def test_concurrency_and_queue_quotas() -> None:
    tenants = Tenants(lambda: ring(f"k:{SECRET} concurrency=2 queue=3"))
    policy = tenants.of("k")
    tenants.admit(policy, 0, "m")
    tenants.admit(policy, 0, "m")
    with pytest.raises(OverQuota, match="concurrency quota") as over:
        tenants.admit(policy, 0, "m")
    assert over.value.status == 429 and over.value.code == "over_quota"
    tenants.release("k", 0.0)
    tenants.admit(policy, 2, "m")  # room again
    tenants.release("k", 0.0)
    with pytest.raises(OverQuota, match="3 requests queued for model 'm'"):
        tenants.admit(policy, 3, "m")
    assert tenants.counts["k"] == {"admitted": 3, "over_rate": 0, "over_concurrency": 1, "over_queue": 1, "failed": 0}


def test_the_rate_is_a_token_bucket_with_retry_after() -> None:
    now = [10.0]
    tenants = Tenants(lambda: ring(f"k:{SECRET} rate=2"), clock=lambda: now[0])
    policy = tenants.of("k")
    tenants.admit(policy, 0, "m")
    tenants.admit(policy, 0, "m")  # a burst of one second's worth
    with pytest.raises(OverQuota, match="rate of 2 requests per second") as over:
        tenants.admit(policy, 0, "m")
    assert over.value.retry_after_s == pytest.approx(0.5)
    now[0] += 0.5
    tenants.admit(policy, 0, "m")


def test_a_reload_keeps_the_counts_of_kept_tenants_and_drops_the_others() -> None:
    current = [ring(f"a:{SECRET}a", f"b:{SECRET}b weight=3")]
    tenants = Tenants(lambda: current[0])
    tenants.admit(tenants.of("a"), 0, "m")
    tenants.admit(tenants.of("b"), 0, "m")
    assert tenants.weight("b") == 3.0
    current[0] = ring(f"a:{SECRET}a weight=2")
    assert tenants.weight("a") == 2.0 and tenants.weight("b") == 1.0
    report = {t["tenant"]: t for t in tenants.report()}
    assert set(report) == {"a"} and report["a"]["admitted"] == 1 and report["a"]["inflight"] == 1


def test_without_keys_every_request_is_the_anonymous_tenant() -> None:
    tenants = Tenants()
    assert not tenants.enabled  # the engine skips tenants altogether without keys
    assert Tenants(lambda: ring(f"k:{SECRET}")).enabled
    policy = tenants.of("")
    assert policy.id == "" and not policy.limited
    for _ in range(100):
        tenants.admit(policy, 10_000, "m")
    assert tenants.report()[0]["tenant"] == "-" and tenants.report()[0]["inflight"] == 100
