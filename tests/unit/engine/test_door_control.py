"""Control operations over the door (what an ingress's HTTP routes and gRPC servicer ask the engine
process): each typed operation is answered by the engine's dispatch table, its result or its
`ServeError` crossing as in-process; what the table does not hold, or what is no operation at all,
is refused and the connection keeps serving; a call waiting when the engine goes gets 503."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from servewell.api.control_handlers import control_table
from servewell.api.control_plane import DoorControlPlane, LocalControlPlane
from servewell.api.engine_parts import EngineParts
from servewell.api.keys import InferenceAccess
from servewell.api.remote_engine import RemoteEngine
from servewell.api.state import LiveKnobs
from servewell.config.server import ServerConfig
from servewell.engine.control import (
    CONTROL_OPS,
    ControlDispatch,
    ControlOp,
    DescribeModel,
    GetCache,
    GetHealth,
    GetReadiness,
    ListModels,
    LoadModel,
    UpdateCache,
)
from servewell.engine.door import EngineDoor
from servewell.engine.engine import InferenceEngine
from servewell.engine.envelope import ControlCall, ControlReply, FrameReader, FrameWriter, Hello, LiveSettings
from servewell.engine.model_pool import PoolSettings
from servewell.errors import EngineUnavailable, ModelLoading, NotFound, ServeError
from servewell.observability.console_feed import ConsoleFeed
from servewell.tenancy.keys import KeyRing

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class Unheard(ControlOp[int]):
    """An operation the engine's table does not hold."""


def _with_door(tmp_path: Path, scenario: Callable[[RemoteEngine, EngineDoor, InferenceEngine], Awaitable[T]],
               table: Callable[[InferenceEngine], ControlDispatch] | None = None,
               pool: PoolSettings | None = None) -> T:
    """Run `scenario` with an engine (one model whose model.yaml is invalid: no worker starts) behind
    a door answering with `table` (default: the engine's own), and an ingress's RemoteEngine."""
    repository = tmp_path / "models"
    (repository / "broken").mkdir(parents=True)
    (repository / "broken" / "model.yaml").write_text("not: [valid\n")

    async def run() -> T:
        engine = InferenceEngine(repository, load_timeout_s=5.0, pool=pool)
        await engine.start()
        dispatch = table(engine) if table is not None else engine_table(engine, tmp_path)
        door = EngineDoor(engine, str(tmp_path / "door.sock"), live=lambda: LiveSettings(None, KeyRing()),
                          control=dispatch)
        await door.start()
        remote = RemoteEngine(str(tmp_path / "door.sock"), 0, lambda live: None)
        stop = asyncio.Event()
        connection = asyncio.create_task(remote.run(stop))
        try:
            await asyncio.wait_for(remote.connected_once.wait(), 5.0)
            return await scenario(remote, door, engine)
        finally:
            stop.set()
            await door.stop()
            await asyncio.wait_for(connection, 5.0)
            await engine.stop(0.0)

    return asyncio.run(run())


def engine_table(engine: InferenceEngine, tmp_path: Path) -> ControlDispatch:
    """The engine's real table (api/control_handlers.py) over `engine`."""
    settings = ServerConfig(model_repository=tmp_path / "models", cache_dir=tmp_path / "cache")
    return control_table(EngineParts(engine, settings, InferenceAccess(KeyRing()), LiveKnobs(0.3, False),
                                     ConsoleFeed(None), None, lambda: {"server": {}},
                                     lambda: {"status": "ok", "rejected": []}))


async def raw_control_call(path: str, call: ControlCall) -> ControlReply:
    """Send `call` on a connection of its own (framed as an ingress frames it) and return the reply."""
    loop = asyncio.get_running_loop()
    replied: asyncio.Future[ControlReply] = loop.create_future()

    def received(message: Any) -> None:
        if isinstance(message, ControlReply) and not replied.done():
            replied.set_result(message)

    def opened(transport: asyncio.Transport) -> None:
        writer = FrameWriter(transport)
        writer.send(Hello("raw-test", 9, -1))
        writer.send(call)

    transport, _ = await loop.create_unix_connection(lambda: FrameReader(received, lambda exc: None, opened), path)
    try:
        return await asyncio.wait_for(replied, 5.0)
    finally:
        transport.close()


def test_every_operation_is_answered_across_the_door_as_in_process(tmp_path: Path) -> None:
    async def scenario(remote: RemoteEngine, door: EngineDoor, engine: InferenceEngine) -> None:
        local, across = LocalControlPlane(engine_table(engine, tmp_path)), DoorControlPlane(remote)
        reads: tuple[ControlOp[Any], ...] = (ListModels(), DescribeModel("broken"), GetReadiness())
        for op in reads:
            assert await across.run(op) == await local.run(op), op
        (view,) = await across.run(ListModels())
        assert (view.name, view.state) == ("broken", "invalid") and view.reason
        report = await across.run(GetHealth())
        assert report.document["models"]["broken"]["state"] == "invalid" and report.ready is False
        refused: tuple[ControlOp[Any], ...] = (DescribeModel("nope"), LoadModel("nope"), GetCache("broken"),
                                               UpdateCache("broken", {"ttl_s": 5}))
        for bad in refused:
            with pytest.raises(ServeError) as here:
                await local.run(bad)
            with pytest.raises(ServeError) as there:
                await across.run(bad)
            assert (type(there.value), there.value.message) == (type(here.value), here.value.message), bad

    _with_door(tmp_path, scenario)


def test_a_handler_s_serve_error_crosses_intact_and_a_bug_becomes_a_serve_error(tmp_path: Path) -> None:
    calls: list[ControlOp[Any]] = []

    def fake(engine: InferenceEngine) -> ControlDispatch:
        async def answer(op: ControlOp[Any]) -> Any:
            calls.append(op)
            if isinstance(op, LoadModel):
                raise ModelLoading(f"model '{op.name}' is loading (3 s so far)", retry_after_s=2.0)
            if isinstance(op, DescribeModel) and op.name == "bug":
                raise KeyError("a bug in a handler")
            if isinstance(op, DescribeModel) and op.name == "lock":
                return threading.Lock()  # cannot be pickled: must not take the connection with it
            return {"echo": op}

        return ControlDispatch({kind: answer for kind in CONTROL_OPS})

    async def scenario(remote: RemoteEngine, door: EngineDoor, engine: InferenceEngine) -> None:
        with pytest.raises(ModelLoading) as refused:
            await remote.control(LoadModel("m"))
        assert (refused.value.status, refused.value.code, refused.value.retry_after_s) == (503, "model_loading", 2.0)
        assert refused.value.message == "model 'm' is loading (3 s so far)"
        with pytest.raises(ServeError, match="the engine failed") as failed:
            await remote.control(DescribeModel("bug"))
        assert type(failed.value) is ServeError and failed.value.status == 500
        with pytest.raises(ServeError, match="the engine failed"):
            await remote.control(DescribeModel("lock"))
        echoed: object = await remote.control(DescribeModel("m", "2"))  # this table answers {"echo": op}
        assert echoed == {"echo": DescribeModel("m", "2")}
        assert calls[-1] == DescribeModel("m", "2")  # the op arrived typed and whole

    _with_door(tmp_path, scenario, fake)


def test_an_operation_the_engine_does_not_hold_or_no_operation_at_all_is_refused(tmp_path: Path) -> None:
    async def scenario(remote: RemoteEngine, door: EngineDoor, engine: InferenceEngine) -> list[str]:
        said = []
        with pytest.raises(ServeError) as refused:
            await remote.control(Unheard())
        said.append(str(refused.value))
        # What an ingress of before sent: a method name. The door looks nothing up by name.
        reply = await raw_control_call(str(tmp_path / "door.sock"), ControlCall(7, "models"))  # type: ignore[arg-type]
        assert reply.ask_id == 7 and reply.result is None and reply.error is not None
        said.append(str(reply.error))
        # the connection still serves: a refusal is an answer, not a broken peer
        assert [v.name for v in await remote.control(ListModels())] == ["broken"]
        return said

    unheard, raw = _with_door(tmp_path, scenario)
    assert "no control operation Unheard" in unheard
    assert "answers no control operation 'str'" in raw


def test_a_call_waiting_when_the_door_closes_gets_engine_unavailable(tmp_path: Path) -> None:
    async def scenario(remote: RemoteEngine, door: EngineDoor, engine: InferenceEngine) -> None:
        waiting = asyncio.ensure_future(remote.control(ListModels()))
        await door.stop()  # the engine goes away before the call's frame is even sent
        with pytest.raises(EngineUnavailable):
            await asyncio.wait_for(waiting, 5.0)
        with pytest.raises(EngineUnavailable):  # and while it is gone, at once
            await remote.control(ListModels())

    _with_door(tmp_path, scenario)


def test_the_table_is_pushed_when_it_changes_and_its_key_is_stable_while_nothing_does(tmp_path: Path) -> None:
    async def scenario(remote: RemoteEngine, door: EngineDoor, engine: InferenceEngine) -> None:
        key = engine.views.table_key()
        assert engine.views.table_key() == key  # nothing changed: the door builds no table this tick
        assert remote.knows("broken") and not remote.knows("late")
        (tmp_path / "models" / "late").mkdir()
        (tmp_path / "models" / "late" / "model.yaml").write_text("also: [broken\n")
        for _ in range(100):  # the lazy pool's poll finds it; the door's next tick pushes it to the ingress
            if remote.knows("late"):
                break
            await asyncio.sleep(0.02)
        assert remote.knows("late") and engine.views.table_key() != key
        engine.gate.close()  # the head changes too: an ingress learns the engine stopped accepting
        for _ in range(100):
            try:
                remote.check_open()
            except ServeError:
                break
            await asyncio.sleep(0.02)
        with pytest.raises(ServeError):
            remote.check_open()

    _with_door(tmp_path, scenario, pool=PoolSettings(mode="lazy", poll_s=0.05))


def test_not_found_names_what_was_asked(tmp_path: Path) -> None:
    async def scenario(remote: RemoteEngine, door: EngineDoor, engine: InferenceEngine) -> str:
        with pytest.raises(NotFound) as missing:
            await DoorControlPlane(remote).run(DescribeModel("nope"))
        return missing.value.message

    assert "nope" in _with_door(tmp_path, scenario)
