"""An admin's live batching change is checked as a whole: a valid one comes back applied to the
current settings, each invalid one is refused naming the problem."""

from __future__ import annotations

from typing import Any

import pytest

from servewell.config.batching import BatchingConfig
from servewell.engine.batch_settings import validated_update
from servewell.errors import InvalidInput

CURRENT = BatchingConfig(max_wait_ms=10.0)


def update(changes: dict[str, Any], instances: int = 1) -> tuple[BatchingConfig, int]:
    return validated_update(CURRENT, 8, 16, instances, changes)


def test_a_valid_change_keeps_every_other_setting() -> None:
    batching, size = update({"max_wait_ms": 3.0, "max_batch_size": 16})
    assert (batching.max_wait_ms, size) == (3.0, 16)
    assert batching.model_dump() == {**CURRENT.model_dump(), "max_wait_ms": 3.0}
    assert update({})[1] == 8  # no size given: the current one


@pytest.mark.parametrize(("changes", "instances", "message"), [
    ({"lanes": ["a"]}, 1, "lanes are fixed while the model is loaded"),
    ({"max_batch_size": 17}, 1, "max_batch_size must be an integer from 1 to 16"),
    ({"max_batch_size": 0}, 1, "from 1 to 16"),
    ({"max_batch_size": True}, 1, "from 1 to 16"),
    ({"max_batch_size": 4.0}, 1, "from 1 to 16"),
    ({"max_wait_ms": -1}, 1, "invalid batching settings"),
    ({"no_such_setting": 1}, 1, "invalid batching settings"),
    ({"reserve_instance_for_high": True}, 1, "reserve_instance_for_high needs instances >= 2"),
])
def test_each_invalid_change_is_refused_by_name(changes: dict[str, Any], instances: int, message: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        update(changes, instances)
    assert message in refused.value.message


def test_reserving_an_instance_is_allowed_with_two() -> None:
    assert update({"reserve_instance_for_high": True}, instances=2)[0].reserve_instance_for_high
