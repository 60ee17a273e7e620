"""The ring buffer of recent slow and failed requests: bounded, newest first, no payloads, and
refusals kept apart so a flood of them cannot push out what an operator needs."""

import pytest

from servewell.observability.recent_requests import RecentRequests, RequestRecord, is_refusal


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
                   "code": "", "total_ms": 7.0, "slow": True, "stages_ms": {"queue": 1.5}, "at": 1007.0,
                   "batch_id": None, "batch_size": None, "instance": None, "queue_position": None,
                   "client": ""}  # the key id (never the key), for the tenant filter


def test_a_record_is_stamped_when_it_is_made():
    record = RequestRecord("x", "grpc", "grpc ModelInfer", "", 404, "not_found", 0.4, False)
    assert record.at > 1_600_000_000 and record.stages_ms == {}


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        RecentRequests(capacity=0)
    with pytest.raises(ValueError):
        RecentRequests(refusal_capacity=0)


def test_a_flood_of_refusals_does_not_evict_a_real_failure():
    ring = RecentRequests(capacity=5, refusal_capacity=3)
    ring.record(RequestRecord("real", "http", "/predict", "digits", 500, "model_error", 3.0, False,
                              batch_id=7, batch_size=4, instance=1, queue_position=2))
    for i in range(250):
        ring.record(RequestRecord(f"anon-{i}", "http", "/predict", "", 401, "unauthorized", 0.2, False))
    ring.record(RequestRecord("limited", "grpc", "grpc ModelInfer", "", 429, "rate_limited", 0.1, False))
    ring.record(RequestRecord("slow-401", "http", "/predict", "", 401, "unauthorized", 900.0, True))
    assert [r.request_id for r in ring.latest()] == ["real"] and ring.recorded == 1
    refusals = ring.refusals_json()
    assert refusals["counts"] == {"unauthorized": 251, "rate_limited": 1}
    assert [r["request_id"] for r in refusals["recent"]] == ["slow-401", "limited", "anon-249"]  # bounded
    assert ring.to_json()[0] | {"at": 0} == {
        "request_id": "real", "protocol": "http", "route": "/predict", "model": "digits", "status": 500,
        "code": "model_error", "total_ms": 3.0, "slow": False, "stages_ms": {}, "at": 0,
        "batch_id": 7, "batch_size": 4, "instance": 1, "queue_position": 2, "client": ""}


@pytest.mark.parametrize(("status", "model", "refusal"), [
    (401, "", True), (403, "digits", True), (429, "digits", True),  # credentials and rate: always
    (404, "", True), (405, "", True), (413, "", True),  # named no model of ours: anyone can send these
    (400, "digits", False), (422, "digits", False), (404, "digits", False),  # reached a model
    (500, "", False), (503, "digits", False), (200, "digits", False),  # the server's own failures, slow ones
])
def test_which_requests_are_refusals(status, model, refusal):
    assert is_refusal(status, model) is refusal


def test_a_tenants_view_holds_its_own_records_and_refusals_and_no_server_counts():
    # Issue 45, H2: the console shows a tenant's key its own tenant's records only (clients: its key ids).
    ring = RecentRequests()
    for i, (client, status) in enumerate((("a-key", 503), ("b-key", 503), ("a-key", 429), ("b-key", 401))):
        ring.record(RequestRecord(f"id-{i}", "http", "/predict", "digits", status, "x", 1.0, False, client=client,
                                  at=1000.0 + i))
    assert [r["request_id"] for r in ring.to_json(10, frozenset({"b-key"}))] == ["id-1"]
    own = ring.refusals_json(10, frozenset({"b-key"}))
    assert own["counts"] is None and [r["request_id"] for r in own["recent"]] == ["id-3"]
    assert ring.refusals_json(10)["counts"] == {"x": 2}  # the operator's: every caller's
