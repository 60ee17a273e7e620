"""The ring buffer of recent slow and failed requests: bounded, newest first, no payloads."""

import pytest

from servewell.observability.recent_requests import RecentRequests, RequestRecord


def _record(i: int, status: int = 503) -> RequestRecord:
    return RequestRecord(f"id-{i}", "http", "/predict", "digits", status, "overloaded" if status >= 400 else "",
                         float(i), status < 400, {"queue": 1.5}, at=1000.0 + i)


def test_keeps_the_newest_and_drops_the_oldest():
    ring = RecentRequests(capacity=3)
    for i in range(5):
        ring.record(_record(i))
    assert [r.request_id for r in ring.latest()] == ["id-4", "id-3", "id-2"]
    assert [r.request_id for r in ring.latest(2)] == ["id-4", "id-3"]
    assert ring.latest(0) == [] and ring.recorded == 5 and ring.capacity == 3


def test_json_holds_the_breakdown_and_nothing_else():
    ring = RecentRequests()
    ring.record(_record(7, status=200))
    (doc,) = ring.to_json()
    assert doc == {"request_id": "id-7", "protocol": "http", "route": "/predict", "model": "digits", "status": 200,
                   "code": "", "total_ms": 7.0, "slow": True, "stages_ms": {"queue": 1.5}, "at": 1007.0}


def test_a_record_is_stamped_when_it_is_made():
    record = RequestRecord("x", "grpc", "grpc ModelInfer", "", 404, "not_found", 0.4, False)
    assert record.at > 1_600_000_000 and record.stages_ms == {}


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        RecentRequests(capacity=0)
