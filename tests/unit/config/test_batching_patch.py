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


def test_null_returns_a_field_to_its_default() -> None:
    # The engine resolves None to model.yaml's value (engine/model_entry.py); here it is accepted as such.
    patch = BatchingPatch.model_validate({"compute_timeout_ms": None, "max_wait_ms": None})
    assert patch.changes() == {"compute_timeout_ms": None, "max_wait_ms": None}


#: Values that stopped a model when PATCHed (issue 19.10), and the bound each meets.
MODEL_STOPPERS = [
    ("compute_timeout_ms", 0.001, "greater than or equal to 100"),
    ("compute_timeout_ms", 1e300, "less than or equal to 3600000"),
    ("max_wait_ms", 1e308, "less than or equal to 10000"),
    ("default_timeout_ms", 1e300, "less than or equal to 600000"),
    ("default_timeout_ms", 0.001, "greater than or equal to 100"),
    ("max_queue_size", 10**12, "less than or equal to 100000"),
    ("max_consecutive_high", 10**12, "less than or equal to 1000"),
    ("latency_slo_ms", 1e308, "less than or equal to 600000"),
    ("max_wait_ms", float("inf"), "less than or equal to 10000"),
    ("default_timeout_ms", float("nan"), "less than or equal to 600000"),
]


@pytest.mark.parametrize(("field", "value", "bound"), MODEL_STOPPERS)
def test_values_that_would_stop_the_model_are_refused_naming_field_and_bound(field: str, value: Any,
                                                                              bound: str) -> None:
    found = problems({field: value})
    assert set(found) == {field} and bound in found[field], found
    with pytest.raises(ValidationError) as caught:  # model.yaml's batching section has the same bounds
        BatchingConfig.model_validate({field: value})
    assert bound in str(caught.value)


def test_the_bounds_themselves_are_accepted() -> None:
    edge = {"compute_timeout_ms": 100, "max_wait_ms": 10_000, "default_timeout_ms": 600_000,
            "max_queue_size": 100_000, "max_consecutive_high": 1000, "latency_slo_ms": 600_000}
    assert BatchingPatch.model_validate(edge).changes() == edge
    BatchingConfig.model_validate(edge)


def test_lanes_are_refused_with_the_reason() -> None:
    assert problems({"lanes": ["urgent", "bulk"], "max_wait_ms": 5}) == {"lanes": LANES_FIXED}


def test_the_schema_comes_from_the_model() -> None:
    schema = BatchingPatch.model_json_schema()
    assert schema["additionalProperties"] is False and schema["minProperties"] == 1
    assert set(schema["properties"]) == set(BatchingPatch.model_fields)
    wait = schema["properties"]["max_wait_ms"]
    number, null = wait["anyOf"]
    assert number["type"] == "number" and number["minimum"] == 0 and number["maximum"] == 10_000
    assert null == {"type": "null"} and "window policy" in wait["description"]
    assert schema["properties"]["policy"]["anyOf"][0]["enum"] == ["idle", "window", "adaptive"]
    assert all("default" not in prop for prop in schema["properties"].values())
