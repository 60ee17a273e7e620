"""Control calls over the door (what an ingress's gRPC servicer asks the engine process): the door
serves its whitelist of engine methods, each result or error crossing as it would in-process,
and refuses every other method name."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from servewell.api.remote_engine import RemoteEngine
from servewell.engine.door import CONTROL_METHODS, EngineDoor
from servewell.engine.engine import InferenceEngine
from servewell.engine.envelope import LiveSettings
from servewell.engine.model_pool import PoolSettings
from servewell.errors import EngineUnavailable, NotFound, ServeError

T = TypeVar("T")


def _with_door(tmp_path: Path, scenario: Callable[[RemoteEngine, EngineDoor], Awaitable[T]],
               engine_out: list[InferenceEngine] | None = None, pool: PoolSettings | None = None) -> T:
    """Run `scenario` with an engine (one model whose model.yaml is invalid: no worker starts)
    behind a door, and an ingress's RemoteEngine connected to it."""
    repository = tmp_path / "models"
    (repository / "broken").mkdir(parents=True)
    (repository / "broken" / "model.yaml").write_text("not: [valid\n")

    async def run() -> T:
        engine = InferenceEngine(repository, load_timeout_s=5.0, pool=pool)
        await engine.start()
        if engine_out is not None:
            engine_out.append(engine)
        door = EngineDoor(engine, str(tmp_path / "door.sock"), live=lambda: LiveSettings(None, None))
        await door.start()
        remote = RemoteEngine(str(tmp_path / "door.sock"), 0, lambda live: None)
        stop = asyncio.Event()
        connection = asyncio.create_task(remote.run(stop))
        try:
            await asyncio.wait_for(remote.connected_once.wait(), 5.0)
            return await scenario(remote, door)
        finally:
            stop.set()
            await door.stop()
            await asyncio.wait_for(connection, 5.0)
            await engine.stop(0.0)

    return asyncio.run(run())


def test_whitelisted_calls_answer_as_the_engine_would(tmp_path: Path) -> None:
    async def scenario(remote: RemoteEngine, door: EngineDoor) -> None:
        views = await remote.models_async()
        assert [(v.name, v.state) for v in views] == [("broken", "invalid")]
        view = await remote.model_async("broken")
        assert view.state == "invalid" and view.reason
        with pytest.raises(NotFound):
            await remote.model_async("nope")
        with pytest.raises(NotFound):
            await remote.load_model("nope")

    _with_door(tmp_path, scenario)


@pytest.mark.parametrize("method", ["stop", "profile", "update_batching", "__class__", "resolve"])
def test_a_method_off_the_whitelist_is_refused(tmp_path: Path, method: str) -> None:
    assert method not in CONTROL_METHODS

    async def scenario(remote: RemoteEngine, door: EngineDoor) -> str:
        with pytest.raises(ServeError) as refused:
            await remote.control(method, (), 5.0)
        # the connection still serves: a refusal is an answer, not a broken peer
        assert [v.name for v in await remote.models_async()] == ["broken"]
        return str(refused.value)

    assert "does not serve" in _with_door(tmp_path, scenario)


def test_a_call_waiting_when_the_door_closes_gets_engine_unavailable(tmp_path: Path) -> None:
    async def scenario(remote: RemoteEngine, door: EngineDoor) -> None:
        waiting = asyncio.ensure_future(remote.models_async())
        await door.stop()  # the engine goes away before the call's frame is even sent
        with pytest.raises(EngineUnavailable):
            await asyncio.wait_for(waiting, 5.0)

    _with_door(tmp_path, scenario)


def test_the_table_is_pushed_when_it_changes_and_its_key_is_stable_while_nothing_does(tmp_path: Path) -> None:
    engines: list[InferenceEngine] = []

    async def scenario(remote: RemoteEngine, door: EngineDoor) -> None:
        engine = engines[0]
        key = engine.table_key()
        assert engine.table_key() == key  # nothing changed: the door builds no table this tick
        assert remote.knows("broken") and not remote.knows("late")
        (tmp_path / "models" / "late").mkdir()
        (tmp_path / "models" / "late" / "model.yaml").write_text("also: [broken\n")
        for _ in range(100):  # the lazy pool's poll finds it; the door's next tick pushes it to the ingress
            if remote.knows("late"):
                break
            await asyncio.sleep(0.02)
        assert remote.knows("late") and engine.table_key() != key
        engine.accepting = False  # the head changes too: an ingress learns the engine stopped accepting
        for _ in range(100):
            try:
                remote.check_open()
            except ServeError:
                break
            await asyncio.sleep(0.02)
        with pytest.raises(ServeError):
            remote.check_open()

    _with_door(tmp_path, scenario, engines, PoolSettings(mode="lazy", poll_s=0.05))
