"""The body of a live batching change: BatchingConfig's fields (bar lanes) plus max_batch_size, all optional."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from servewell.config.batching import LANES_FIXED, BatchingConfig, BatchingPatch
from servewell.config.problems import field_problems


def problems(body: Any) -> dict[str, str]:
    with pytest.raises(ValidationError) as caught:
        BatchingPatch.model_validate(body)
    return {p.field: p.reason for p in field_problems(caught.value)}


def test_the_patch_has_every_live_setting_of_the_config_and_nothing_else() -> None:
    assert set(BatchingPatch.model_fields) == (set(BatchingConfig.model_fields) - {"lanes"}) | {"max_batch_size"}


def test_changes_are_only_what_the_client_sent() -> None:
    patch = BatchingPatch.model_validate({"policy": "window", "max_wait_ms": 5})
    assert patch.changes() == {"policy": "window", "max_wait_ms": 5.0}


@pytest.mark.parametrize("field", sorted(set(BatchingConfig.model_fields) - {"lanes"}))
def test_each_field_has_the_bounds_of_the_config(field: str) -> None:
    bad = {"policy": "fastest", "max_wait_ms": -1, "latency_slo_ms": 0, "max_queue_size": 0,
           "default_timeout_ms": 0, "max_consecutive_high": 0, "reserve_instance_for_high": "maybe",
           "compute_timeout_ms": 0}[field]
    assert set(problems({field: bad})) == {field}
    with pytest.raises(ValidationError):
        BatchingConfig.model_validate({field: bad})


def test_max_batch_size_is_at_least_one() -> None:
    assert set(problems({"max_batch_size": 0})) == {"max_batch_size"}


def test_an_empty_patch_is_refused() -> None:
    assert problems({})["(top level)"].startswith("send at least one setting to change: max_batch_size, policy")


def test_unknown_fields_are_refused() -> None:
    assert set(problems({"max_wait": 5})) == {"max_wait"}


def test_null_is_not_a_setting() -> None:
    assert problems({"max_wait_ms": None}) == {"max_wait_ms": "null is not a setting; give a value or leave the "
                                                              "field out"}


def test_lanes_are_refused_with_the_reason() -> None:
    assert problems({"lanes": ["urgent", "bulk"], "max_wait_ms": 5}) == {"lanes": LANES_FIXED}


def test_the_schema_comes_from_the_model() -> None:
    schema = BatchingPatch.model_json_schema()
    assert schema["additionalProperties"] is False and schema["minProperties"] == 1
    assert set(schema["properties"]) == set(BatchingPatch.model_fields)
    wait = schema["properties"]["max_wait_ms"]
    assert wait["type"] == "number" and wait["minimum"] == 0 and "window policy" in wait["description"]
    assert schema["properties"]["policy"]["enum"] == ["idle", "window", "adaptive"]
    assert all("anyOf" not in prop and "default" not in prop for prop in schema["properties"].values())
