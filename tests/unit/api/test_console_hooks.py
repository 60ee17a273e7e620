"""The console's hooks in the API layer: which requests reach its ring buffer, which paths need
a key, and that the page refers only to files the package ships."""

import asyncio
import re

from starlette.responses import Response

from servewell.api.errors import error_response
from servewell.api.key_middleware import needs_key
from servewell.api.middleware import RequestContextMiddleware
from servewell.api.routes_console import ASSETS, asset
from servewell.api.state import LiveKnobs
from servewell.observability.context import placement_var, stages_var
from servewell.observability.metrics import ServeMetrics
from servewell.observability.recent_requests import RecentRequests


def _call(app, slow_request_s: float, request_id: str, metrics: ServeMetrics | None = None) -> RecentRequests:
    ring = RecentRequests()
    middleware = RequestContextMiddleware(app, LiveKnobs(slow_request_s, False), metrics=metrics, recent=ring)
    scope = {"type": "http", "method": "POST", "path": "/predict", "headers": [(b"x-request-id", request_id.encode())]}
    sent = []

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    asyncio.run(middleware(scope, receive, send))
    assert sent[0]["status"]  # the response went out
    return ring


async def overloaded(scope, receive, send):
    stages_var.get().update(preprocess=0.001, queue=0.25)
    await error_response(503, "overloaded", "the lane is full")(scope, receive, send)


async def fine(scope, receive, send):
    stages_var.get().update(preprocess=0.001, queue=0.002, compute=0.003, postprocess=0.0005)
    await Response(b"{}", media_type="application/json")(scope, receive, send)


def test_a_failed_request_is_recorded_with_its_code_and_stages():
    ring = _call(overloaded, 10.0, "req-1")
    (record,) = ring.latest()
    assert (record.request_id, record.protocol, record.status, record.code, record.slow) == (
        "req-1", "http", 503, "overloaded", False)
    assert record.stages_ms == {"preprocess": 1.0, "queue": 250.0} and record.total_ms > 0
    assert record.route == "unmatched"  # no router here: the template, never the raw path


def test_a_fast_success_costs_the_ring_nothing_and_a_slow_one_is_kept():
    assert _call(fine, 10.0, "req-2").latest() == []
    (record,) = _call(fine, 0.0, "req-3").latest()
    assert record.slow and record.status == 200 and record.code == ""
    assert set(record.stages_ms) == {"preprocess", "queue", "compute", "postprocess"}


async def batched(scope, receive, send):
    placement = placement_var.get()  # what the scheduler's telemetry fills in for a queued request
    placement.queue_position, placement.batch_id, placement.batch_size, placement.instance = 2, 41, 8, 1
    await Response(b"{}", media_type="application/json")(scope, receive, send)


def test_a_slow_request_s_record_names_its_batch_and_a_refusal_is_kept_apart():
    (record,) = _call(batched, 0.0, "req-4").latest()
    assert (record.batch_id, record.batch_size, record.instance, record.queue_position) == (41, 8, 1, 2)
    (plain,) = _call(fine, 0.0, "req-5").latest()  # every request has its own placement
    assert (plain.batch_id, plain.queue_position) == (None, None)
    ring = _call(overloaded, 10.0, "req-6")  # a 503 is the server's own failure: listed, not a refusal
    assert ring.latest() and not ring.latest_refusals()


def test_the_page_is_open_and_its_data_needs_a_key():
    assert not needs_key("/")
    assert not needs_key("/console/assets/console.js")
    assert needs_key("/console/api/state")
    assert needs_key("/console/other")
    # The operator's routes apply the access rule themselves (api/access.py): no tenant's key opens them.
    assert not needs_key("/metrics") and not needs_key("/admin/tenants")


def test_the_page_refers_only_to_shipped_assets():
    page = asset("index.html").decode()
    referenced = set(re.findall(r"\{\{asset:([^}]+)\}\}", page))
    assert referenced == set(ASSETS)
    for name in ASSETS:
        assert len(asset(name)) > 100
    assert b"MIT License" in asset("uPlot.LICENSE")
    assert b"<script>" not in asset("index.html")  # no inline script: the CSP allows only 'self'
