"""The engine's control table (api/control_handlers.py) in-process: it answers every operation
engine/control.py declares; the views it computes where the engine runs are the whole server's
(every ingress's share pulled first) and show each caller only what its access scope allows."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from servewell.api.control_handlers import control_table
from servewell.api.control_plane import LocalControlPlane
from servewell.api.engine_parts import EngineParts
from servewell.api.keys import InferenceAccess
from servewell.api.state import LiveKnobs
from servewell.config.server import ServerConfig
from servewell.engine.control import (
    CONTROL_OPS,
    AccessScope,
    ClearCache,
    GetConfigReport,
    GetConsoleState,
    GetHealth,
    GetMetricsText,
    ListTenants,
    UpdateTenant,
)
from servewell.engine.engine import InferenceEngine
from servewell.engine.tenants import Tenants
from servewell.errors import ModelNotReady, NotFound
from servewell.observability.console_feed import ConsoleFeed
from servewell.observability.metrics import ServeMetrics
from servewell.observability.recent_requests import RequestRecord
from servewell.tenancy.keys import KeyRing, parse_keys

T = TypeVar("T")
SECRET = "s3cret-key-for-the-control-table-0123456789"
KEYS = [f"a1:{SECRET}a tenant=acme", f"b1:{SECRET}b tenant=bolt", f"ops:{SECRET}o role=operator"]


def _with_table(tmp_path: Path, scenario: Callable[[LocalControlPlane, ConsoleFeed], Awaitable[T]]) -> T:
    """Run `scenario` against the real table of an engine with one invalid model and two tenants."""
    repository = tmp_path / "models"
    (repository / "broken").mkdir(parents=True)
    (repository / "broken" / "model.yaml").write_text("not: [valid\n")
    ring = KeyRing(parse_keys(KEYS, "keys"))
    metrics = ServeMetrics()

    async def run() -> T:
        engine = InferenceEngine(repository, load_timeout_s=5.0, tenants=Tenants(lambda: ring))
        await engine.start()
        feed = ConsoleFeed(metrics)
        settings = ServerConfig(model_repository=repository, cache_dir=tmp_path / "cache")
        table = control_table(EngineParts(engine, settings, InferenceAccess(ring), LiveKnobs(0.3, False), feed,
                                          metrics, lambda: {"server": {"file": None}},
                                          lambda: {"status": "ok", "rejected": []}))
        assert table.ops == set(CONTROL_OPS)  # every operation has its handler
        try:
            return await scenario(LocalControlPlane(table), feed)
        finally:
            await engine.stop(0.0)

    return asyncio.run(run())


def _failed(request_id: str, client: str) -> RequestRecord:
    return RequestRecord(request_id, "http", "/v2/models/{name}/infer", "broken", 503, "model_not_ready", 1.0,
                         False, client=client)


def test_a_tenant_s_console_shows_its_own_records_and_row_and_an_operator_everyone_s(tmp_path: Path) -> None:
    async def scenario(plane: LocalControlPlane, feed: ConsoleFeed) -> None:
        for request_id, client in (("r-acme", "a1"), ("r-bolt", "b1")):
            feed.recent.record(_failed(request_id, client))
        acme = await plane.run(GetConsoleState("*", 50, None, AccessScope(False, "acme", "a1", "not an operator")))
        assert [r["request_id"] for r in acme["recent"]] == ["r-acme"]
        assert [row["tenant"] for row in acme["tenants"]] == ["acme"]
        assert acme["server"]["admin"] is False and acme["server"]["admin_reason"] == "not an operator"
        assert acme["recent_recorded"] is None and all("batching" not in m for m in acme["models"])
        operator = await plane.run(GetConsoleState("*", 50, None, AccessScope(True, None, "ops")))
        assert {r["request_id"] for r in operator["recent"]} == {"r-acme", "r-bolt"}
        assert {row["tenant"] for row in operator["tenants"]} >= {"acme", "bolt"}
        only_bolt = await plane.run(GetConsoleState("*", 50, "bolt", AccessScope(True)))
        assert [r["request_id"] for r in only_bolt["recent"]] == ["r-bolt"]
        with pytest.raises(NotFound, match="unknown tenant"):
            await plane.run(GetConsoleState("*", 50, "nobody", AccessScope(True)))
        anonymous = await plane.run(GetConsoleState("*", 50, None, AccessScope(False, denial="needs a key")))
        assert anonymous["recent"] is None and anonymous["tenants"] is None and anonymous["refusals"] is None

    _with_table(tmp_path, scenario)


def test_the_metrics_text_pulls_every_process_s_share_before_it_renders(tmp_path: Path) -> None:
    async def scenario(plane: LocalControlPlane, feed: ConsoleFeed) -> bytes:
        pulls = 0

        async def pull_every_ingress() -> None:
            nonlocal pulls
            pulls += 1

        feed.view.set_refresher(pull_every_ingress)
        text = await plane.run(GetMetricsText())
        assert pulls == 1
        return text

    assert b"# TYPE servewell_request_duration_seconds histogram" in _with_table(tmp_path, scenario)


def test_health_tenants_and_config_are_the_engine_s(tmp_path: Path) -> None:
    async def scenario(plane: LocalControlPlane, feed: ConsoleFeed) -> None:
        report = await plane.run(GetHealth())
        assert report.ready is False and report.document["models"]["broken"]["state"] == "invalid"
        assert str(tmp_path) not in str(report.document)  # open to anyone: no absolute paths
        assert (await plane.run(GetConfigReport())) == {"server": {"file": None}}
        changed = await plane.run(UpdateTenant("acme", {"weight": 3.0}))
        assert changed["weight"] == 3.0
        assert {row["tenant"]: row["weight"] for row in await plane.run(ListTenants())}["acme"] == 3.0
        with pytest.raises(ModelNotReady):  # an invalid model has no cache to clear
            await plane.run(ClearCache("broken"))

    _with_table(tmp_path, scenario)
