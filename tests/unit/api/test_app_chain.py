"""The app's request chain: servewell's middleware outside FastAPI's (api/app.py, `ServewellApp`)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app_state import bare_state
from servewell.api.app import create_app


def get(app: object, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get(path, headers=headers)

    return asyncio.run(call())


def test_an_unexpected_error_in_a_route_fastapi_dispatches_is_the_json_500_with_the_request_id(caplog):
    app = create_app(bare_state())

    async def broken() -> None:
        raise RuntimeError("a bug in a route")

    app.add_api_route("/broken", broken)
    r = get(app, "/broken", {"X-Request-ID": "bug-1"})
    # Not Starlette's plain-text "Internal Server Error": FastAPI's server-error layer is not
    # inside ours, so the request context answers (and logs) it.
    assert r.status_code == 500 and r.headers["x-request-id"] == "bug-1"
    message = "internal server error; the request id is in this body"
    assert r.json() == {"error": {"code": "internal", "message": message, "request_id": "bug-1"}}
    assert any("unhandled error while serving 'GET' '/broken'" in m for m in caplog.messages)


def test_fastapi_adds_no_span_of_its_own_even_with_a_global_tracer_provider(monkeypatch: pytest.MonkeyPatch):
    # A user process with a global provider (auto-instrumentation, or model code) must not get
    # FastAPI's server span beside servewell's: servewell's middleware traces every request.
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    app = create_app(bare_state())  # type: ignore[arg-type]
    assert get(app, "/no-such-route").status_code == 404
    assert get(app, "/openapi.json").status_code == 200
    provider.force_flush()
    assert [span.name for span in exporter.get_finished_spans()] == []
