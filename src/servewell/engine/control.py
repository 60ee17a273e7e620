"""The control plane's operations: one typed message per admin, repository, metadata and view
operation, and the one table that answers them.

Every such operation, whichever protocol asked (HTTP, gRPC, the console), is one frozen, slotted
dataclass below, generic in its result type (`ControlOp[R]`). The caller hands it to a
`ControlPlane` (api/control_plane.py): in the single-process server the plane calls the engine's
handler directly; in an ingress process it crosses the door as `ControlCall(ask_id, op)`
(engine/envelope.py) and the engine answers `ControlReply` with the result or the `ServeError` the
handler raised. Either way the engine answers through one `ControlDispatch`: a table from an
operation's type to its handler (api/control_handlers.py builds it). No method names travel and
nothing is looked up by name: a type the table does not hold is refused, and a table that lacks a
handler for an operation declared here cannot be built (the server does not start, and the table's
unit test fails), so a new operation is one dataclass here and one handler there.

Views that sum every process (`/metrics`, the console's state, `/healthz`) are computed in the
engine, which pulls each ingress's counters first (observability/view_sources.py), and cross back
as the operation's result.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Generic, TypeVar, cast

from servewell.config.rollout import TrafficPatch
from servewell.engine.protocol import ModelView, Readiness
from servewell.errors import ServeError

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)  # an operation's result type: it only comes out

#: Longest an ingress waits for the engine's answer to an operation that only reads: the engine
#: answers in milliseconds; this bounds a lost answer (an engine that dies is noticed at once).
READ_WAIT_S = 30.0
#: Longest an ingress waits for a change: the engine bounds a load by --load-timeout-s and an
#: unload by its drain; this only makes sure a lost answer cannot hold a call for ever.
CHANGE_WAIT_S = 900.0


class ControlOp(Generic[R_co]):
    """One control operation whose answer is an `R_co` (the subclasses below are the only ones)."""

    __slots__ = ()

    def wait_s(self) -> float:
        """Longest the caller waits for the answer across the door (seconds)."""
        return READ_WAIT_S


class _Change(ControlOp[R_co]):
    """An operation that changes what the engine serves (it may take a load's time)."""

    __slots__ = ()

    def wait_s(self) -> float:
        """Longest the caller waits for the answer across the door (seconds)."""
        return CHANGE_WAIT_S


@dataclass(frozen=True, slots=True)
class AccessScope:
    """Who asked, as the ingress's access rule decided (api/access.py `Caller`): an operator, a
    tenant (the key it presented), or neither; `denial` says why it is not an operator."""

    operator: bool
    tenant: str | None = None
    key_id: str | None = None
    denial: str | None = None


@dataclass(frozen=True, slots=True)
class HealthReport:
    """`/healthz`'s document and whether the server is ready (its status: 200 or 503)."""

    document: dict[str, Any]
    ready: bool


# --- models and the repository ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ListModels(ControlOp[list[ModelView]]):
    """Every model of the repository, valid or not (the repository index, gRPC RepositoryIndex)."""


@dataclass(frozen=True, slots=True)
class DescribeModel(ControlOp[ModelView]):
    """One model's view (`NotFound` for an unknown name or version): metadata, config, readiness."""

    name: str
    version: str | None = None


@dataclass(frozen=True, slots=True)
class LoadModel(_Change[ModelView]):
    """(Re)load a model from its directory with zero failed requests."""

    name: str
    actor: str = ""  # who asked, for the audit trail (observability/audit.py `actor_name`)


@dataclass(frozen=True, slots=True)
class UnloadModel(_Change[ModelView]):
    """Stop serving a model once its queued and running requests finish."""

    name: str
    actor: str = ""  # who asked, for the audit trail (observability/audit.py `actor_name`)


# --- the model pool -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PinModel(ControlOp[ModelView]):
    """Never evict the model (until unpinned or the server restarts)."""

    name: str
    actor: str = ""  # who asked, for the audit trail (observability/audit.py `actor_name`)


@dataclass(frozen=True, slots=True)
class UnpinModel(ControlOp[ModelView]):
    """The model may be evicted again."""

    name: str
    actor: str = ""  # who asked, for the audit trail (observability/audit.py `actor_name`)


@dataclass(frozen=True, slots=True)
class PreloadModel(_Change[ModelView]):
    """Load the model now if it is not resident."""

    name: str
    actor: str = ""  # who asked, for the audit trail (observability/audit.py `actor_name`)


@dataclass(frozen=True, slots=True)
class EvictModel(_Change[ModelView]):
    """Unload the model now to free its memory."""

    name: str
    actor: str = ""  # who asked, for the audit trail (observability/audit.py `actor_name`)


# --- batching, traffic splits, response caches --------------------------------------------------


@dataclass(frozen=True, slots=True)
class GetBatching(ControlOp[dict[str, Any]]):
    """A model's live batching settings."""

    name: str


@dataclass(frozen=True, slots=True)
class UpdateBatching(ControlOp[dict[str, Any]]):
    """Change a model's batching settings while it serves (all or nothing; None: model.yaml's value)."""

    name: str
    changes: Mapping[str, Any]
    actor: str = ""  # who asked, for the audit trail (observability/audit.py `actor_name`)


@dataclass(frozen=True, slots=True)
class GetRollout(ControlOp[dict[str, Any]]):
    """A model's traffic split, shadow and rollback state (`NotFound` when it splits none)."""

    name: str


@dataclass(frozen=True, slots=True)
class UpdateRollout(ControlOp[dict[str, Any]]):
    """An admin's traffic weights and/or shadow share."""

    name: str
    patch: TrafficPatch
    actor: str = ""  # who asked, for the audit trail (observability/audit.py `actor_name`)


@dataclass(frozen=True, slots=True)
class GetCache(ControlOp[dict[str, Any]]):
    """A model's response cache: `{"model", "cache"}` (cache None: the model has none)."""

    name: str


@dataclass(frozen=True, slots=True)
class UpdateCache(ControlOp[dict[str, Any]]):
    """New bounds of a model's response cache (`max_bytes`, `ttl_s`; None: model.yaml's value)."""

    name: str
    changes: Mapping[str, float | int | None]
    actor: str = ""  # who asked, for the audit trail (observability/audit.py `actor_name`)


@dataclass(frozen=True, slots=True)
class ClearCache(ControlOp[dict[str, Any]]):
    """Drop every answer a model's response cache keeps."""

    name: str
    actor: str = ""  # who asked, for the audit trail (observability/audit.py `actor_name`)


# --- tenants -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ListTenants(ControlOp[list[dict[str, Any]]]):
    """Every tenant's weight, quotas, requests in progress and counts."""


@dataclass(frozen=True, slots=True)
class UpdateTenant(ControlOp[dict[str, Any]]):
    """Change a tenant's weight or quotas while serving (None: the keys file's value)."""

    tenant: str
    changes: Mapping[str, float | int | None]
    actor: str = ""  # who asked, for the audit trail (observability/audit.py `actor_name`)


# --- profiling ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProfileModel(ControlOp[bytes]):
    """A Chrome/Perfetto trace of one instance's batches over `seconds`."""

    name: str
    instance: int
    seconds: float

    def wait_s(self) -> float:
        """The capture itself, then as long as any read."""
        return self.seconds + READ_WAIT_S


# --- the server's views ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CheckLive(ControlOp[bool]):
    """Whether the engine answers (`/v2/health/live`: a server whose engine is gone is not live)."""


@dataclass(frozen=True, slots=True)
class GetReadiness(ControlOp[Readiness]):
    """The readiness verdict with its reason (`/v2/health/ready`, an ingress's fresh look)."""


@dataclass(frozen=True, slots=True)
class GetHealth(ControlOp[HealthReport]):
    """`/healthz`: the server's status and every model's health, memory, pool and alerts."""


@dataclass(frozen=True, slots=True)
class GetConfigReport(ControlOp[dict[str, Any]]):
    """The active configuration (`GET /admin/config`; secrets left out)."""


@dataclass(frozen=True, slots=True)
class GetMetricsText(ControlOp[bytes]):
    """Every metric family in the Prometheus text format, every process's series summed in."""


@dataclass(frozen=True, slots=True)
class GetAudit(ControlOp[list[dict[str, Any]]]):
    """The audit trail (`GET /admin/audit`): changes after Unix time `since`, of `target` only, the
    latest `limit`, oldest first."""

    since: float | None = None
    limit: int = 100
    target: str | None = None


@dataclass(frozen=True, slots=True)
class GetConsoleState(ControlOp[dict[str, Any]]):
    """The console's document for `scope` (`GET /console/api/state`): what it may see only."""

    model: str
    recent: int
    tenant: str | None
    scope: AccessScope


def declared_ops(module: ModuleType) -> tuple[type[ControlOp[Any]], ...]:
    """The operations `module` declares: its concrete `ControlOp` dataclasses, in their order."""
    return tuple(value for value in vars(module).values()
                 if isinstance(value, type) and issubclass(value, ControlOp) and value.__module__ == module.__name__
                 and "__dataclass_fields__" in vars(value))


#: Every control operation there is: the dispatch table must answer each of them.
CONTROL_OPS: tuple[type[ControlOp[Any]], ...] = declared_ops(sys.modules[__name__])

Handler = Callable[[Any], Awaitable[Any]]


class ControlDispatch:
    """The engine's one table from an operation's type to its handler (an async function of the
    operation returning its result, or raising the `ServeError` the caller gets)."""

    __slots__ = ("_handlers",)

    def __init__(self, handlers: Mapping[type[ControlOp[Any]], Handler],
                 ops: Iterable[type[ControlOp[Any]]] = CONTROL_OPS) -> None:
        ops = tuple(ops)
        missing = [op.__name__ for op in ops if op not in handlers]
        unknown = [kind.__name__ for kind in handlers if kind not in ops]
        if missing or unknown:
            raise ValueError(f"the control table must answer every operation and only those: no handler for "
                             f"{missing or 'none'}; handlers of unknown operations {unknown or 'none'}")
        self._handlers = dict(handlers)

    @property
    def ops(self) -> frozenset[type[ControlOp[Any]]]:
        """The operations this table answers."""
        return frozenset(self._handlers)

    async def run(self, op: ControlOp[R]) -> R:
        """`op`'s result from its handler; `ServeError` for what is not an operation of the table."""
        handler = self._handlers.get(type(op))
        if handler is None:
            raise ServeError(f"the engine has no control operation {type(op).__name__}")
        return cast(R, await handler(op))
