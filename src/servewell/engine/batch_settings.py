"""An admin's live change of a model's batching settings, checked as a whole before any of it
applies (the scheduler applies what this returns; `ModelScheduler.update`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from servewell.config.model import BatchingConfig
from servewell.errors import InvalidInput


def validated_update(batching: BatchingConfig, max_batch_size: int, proven_max: int, instances: int,
                     changes: Mapping[str, Any]) -> tuple[BatchingConfig, int]:
    """The batching settings and max_batch_size after `changes`, all or nothing (`InvalidInput`
    naming the first problem). `max_batch_size` may not exceed `proven_max`; lanes are fixed while
    the model is loaded."""
    candidate = dict(changes)
    if "lanes" in candidate:
        raise InvalidInput("lanes are fixed while the model is loaded; change model.yaml and reload")
    size = candidate.pop("max_batch_size", max_batch_size)
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= proven_max:
        raise InvalidInput(f"max_batch_size must be an integer from 1 to {proven_max} (the largest batch "
                           "this model's warm-up proved fits)")
    try:
        updated = BatchingConfig.model_validate({**batching.model_dump(), **candidate})
    except ValueError as exc:
        raise InvalidInput(f"invalid batching settings: {exc}") from None
    if updated.reserve_instance_for_high and instances < 2:
        raise InvalidInput("reserve_instance_for_high needs instances >= 2")
    return updated, size
