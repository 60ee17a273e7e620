"""One lane rule for every protocol (engine/lanes.py)."""

from __future__ import annotations

import pytest

from servewell.engine.lanes import default_lane, resolve_lane
from servewell.errors import InvalidInput

DEFAULT = ["high", "normal"]
RENAMED = ["urgent", "standard", "bulk"]


def test_default_lanes() -> None:
    assert resolve_lane(DEFAULT) == 1
    assert resolve_lane(DEFAULT, urgency="high") == 0
    assert resolve_lane(DEFAULT, urgency="HIGH ") == 0
    assert resolve_lane(DEFAULT, urgency="normal") == 1
    assert resolve_lane(DEFAULT, urgency="low") == 1
    assert resolve_lane(DEFAULT, priority=0) == 1
    assert resolve_lane(DEFAULT, priority=1) == 0
    assert resolve_lane(DEFAULT, priority=2) == 1


def test_urgency_high_goes_to_the_first_lane_when_a_model_renames_its_lanes() -> None:
    # The old /predict rule sent "high" to the lowest lane of such a model.
    assert resolve_lane(RENAMED, urgency="high") == 0
    assert resolve_lane(RENAMED, priority=1) == 0
    assert default_lane(RENAMED) == 2  # no lane called "normal": the last one
    assert resolve_lane(RENAMED, urgency="normal") == 2
    assert resolve_lane(RENAMED, urgency="low") == 2
    assert resolve_lane(RENAMED, urgency="standard") == 1
    assert resolve_lane(RENAMED, priority="standard") == 1
    assert resolve_lane(RENAMED, priority=3) == 2  # the last of its three lanes


def test_urgency_wins_over_priority() -> None:
    assert resolve_lane(DEFAULT, urgency="high", priority=0) == 0
    assert resolve_lane(DEFAULT, urgency="normal", priority=1) == 1


@pytest.mark.parametrize("urgency", ["asap", "x" * 100_000])
def test_unknown_urgency_is_a_client_error_with_a_bounded_message(urgency: str) -> None:
    with pytest.raises(InvalidInput) as info:
        resolve_lane(DEFAULT, urgency=urgency)
    assert len(info.value.message) < 300


@pytest.mark.parametrize("priority", [-1, True, 1.5, "nope", [1], {"a": 1}, 3, 99, 2**40])
def test_bad_priority_is_a_client_error(priority: object) -> None:
    with pytest.raises(InvalidInput):
        resolve_lane(DEFAULT, priority=priority)


def test_a_priority_past_the_last_lane_is_refused_naming_the_range() -> None:
    with pytest.raises(InvalidInput, match=r"0\.\.2 "):
        resolve_lane(DEFAULT, priority=3)
    assert resolve_lane(["a", "b", "c"], priority=3) == 2  # a model with three lanes has a priority 3
