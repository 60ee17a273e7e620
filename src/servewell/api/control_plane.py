"""The control plane as the routes and the gRPC servicer see it: `ControlPlane.run(op)`.

Every admin, repository, metadata and view operation (engine/control.py) goes through this one
interface, so a route is the same code whatever `--ingress-processes` is:

- `LocalControlPlane`, in the single-process server: the engine's dispatch table, called directly;
- `DoorControlPlane`, in an ingress process: one `ControlCall` over the door to the engine
  process (api/remote_engine.py `control`), bounded in time, 503 `engine_unavailable` when the
  engine is gone or does not answer.

Either way the engine's one table answers (`ControlDispatch`), and a handler's `ServeError` reaches
the caller as it was raised.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from servewell.api.remote_engine import RemoteEngine
from servewell.engine.control import ControlDispatch, ControlOp

R = TypeVar("R")


class ControlPlane(Protocol):
    """Where a control operation is answered."""

    async def run(self, op: ControlOp[R]) -> R:
        """`op`'s result, or the `ServeError` that refused it."""
        ...


class LocalControlPlane:
    """The engine in this process: its table, called directly (no copy of the result)."""

    __slots__ = ("_table",)

    def __init__(self, table: ControlDispatch) -> None:
        self._table = table

    async def run(self, op: ControlOp[R]) -> R:
        """`op`'s result from the engine's handler."""
        return await self._table.run(op)


class DoorControlPlane:
    """The engine process behind this ingress's door."""

    __slots__ = ("_engine",)

    def __init__(self, engine: RemoteEngine) -> None:
        self._engine = engine

    async def run(self, op: ControlOp[R]) -> R:
        """`op` sent to the engine; its answer (`EngineUnavailable` when none comes)."""
        return await self._engine.control(op)
