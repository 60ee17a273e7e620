"""The control plane's operations and its one dispatch table (engine/control.py): every operation is
a frozen, slotted, picklable message; a table lacking a handler for any declared operation cannot
be built (so an operation added without one fails here and stops the server from starting); what
the table does not hold is refused; a handler's answer or `ServeError` comes back as it was."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import types
from typing import Any

import pytest

from servewell.config.rollout import TrafficPatch
from servewell.engine import control
from servewell.engine.control import (
    CHANGE_WAIT_S,
    CONTROL_OPS,
    READ_WAIT_S,
    AccessScope,
    ControlDispatch,
    ControlOp,
    DescribeModel,
    GetConsoleState,
    GetHealth,
    ListModels,
    LoadModel,
    ProfileModel,
    UpdateCache,
    UpdateRollout,
    declared_ops,
)
from servewell.errors import ModelLoading, ServeError


@dataclasses.dataclass(frozen=True, slots=True)
class Unheard(ControlOp[int]):
    """An operation no table holds (declared here, not in engine/control.py)."""

    name: str = "x"


def answering_all(answer: Any = "done") -> dict[type[ControlOp[Any]], Any]:
    """A handler for every declared operation, each answering `answer` (or the operation itself)."""
    async def handler(op: ControlOp[Any]) -> Any:
        return op if answer is None else answer

    return {op: handler for op in CONTROL_OPS}


def test_every_operation_is_a_frozen_slotted_message_that_crosses_a_pipe_unchanged() -> None:
    assert CONTROL_OPS == declared_ops(control) and len(CONTROL_OPS) >= 20
    for kind in CONTROL_OPS:
        assert dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen, kind
        assert "__slots__" in vars(kind), kind
    examples: list[ControlOp[Any]] = [
        ListModels(), DescribeModel("m", "2"), LoadModel("m"), UpdateCache("m", {"max_bytes": 4096, "ttl_s": None}),
        UpdateRollout("m", TrafficPatch.model_validate({"traffic": {"1": 90, "2": 10}})),
        GetConsoleState("*", 5, None, AccessScope(False, "acme", "k1", "not an operator")),
    ]
    for op in examples:
        assert pickle.loads(pickle.dumps(op)) == op
    with pytest.raises(dataclasses.FrozenInstanceError):
        DescribeModel("m").name = "other"  # type: ignore[misc]


def test_a_table_lacking_a_handler_cannot_be_built() -> None:
    handlers = answering_all()
    del handlers[GetHealth]
    with pytest.raises(ValueError, match="GetHealth"):
        ControlDispatch(handlers)
    assert ControlDispatch(answering_all()).ops == set(CONTROL_OPS)


def test_an_operation_declared_without_a_handler_fails_the_table_check() -> None:
    # What adding an operation to engine/control.py and forgetting its handler does: the module's
    # declared operations grow, and the table checked against them is refused, naming it.
    tomorrow = types.ModuleType("ops_of_tomorrow")

    @dataclasses.dataclass(frozen=True, slots=True)
    class Novel(ControlOp[str]):
        what: str

    Novel.__module__ = tomorrow.__name__
    tomorrow.Novel = Novel  # type: ignore[attr-defined]
    declared = (*CONTROL_OPS, *declared_ops(tomorrow))
    assert declared[-1] is Novel
    with pytest.raises(ValueError, match="Novel"):
        ControlDispatch(answering_all(), declared)


def test_a_handler_for_an_operation_that_does_not_exist_is_refused() -> None:
    handlers = answering_all()
    handlers[Unheard] = handlers[ListModels]
    with pytest.raises(ValueError, match="Unheard"):
        ControlDispatch(handlers)


def test_what_the_table_does_not_hold_is_refused() -> None:
    table = ControlDispatch(answering_all())
    with pytest.raises(ServeError, match="no control operation Unheard"):
        asyncio.run(table.run(Unheard()))
    with pytest.raises(ServeError, match="no control operation str"):
        asyncio.run(table.run("models"))  # type: ignore[arg-type]  # a method name is no operation


def test_a_handler_s_answer_and_its_serve_error_come_back_as_they_were() -> None:
    handlers = answering_all(answer=None)  # each answers with the operation it got
    refusal = ModelLoading("model 'm' is loading", retry_after_s=2.0)

    async def refuse(op: LoadModel) -> None:
        raise refusal

    handlers[LoadModel] = refuse
    table = ControlDispatch(handlers)
    op = DescribeModel("m", "3")
    answered: object = asyncio.run(table.run(op))  # this table's handlers answer with the operation itself
    assert answered is op
    with pytest.raises(ModelLoading) as raised:
        asyncio.run(table.run(LoadModel("m")))
    assert raised.value is refusal


def test_a_change_waits_longer_than_a_read_and_a_profile_as_long_as_its_capture() -> None:
    assert ListModels().wait_s() == READ_WAIT_S
    assert LoadModel("m").wait_s() == CHANGE_WAIT_S > READ_WAIT_S
    assert ProfileModel("m", 0, 60.0).wait_s() == 60.0 + READ_WAIT_S
