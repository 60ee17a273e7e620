"""Building `InferenceRequest`s in tests (engine/request.py): the fields a test does not care
about get values that never decide anything."""

from __future__ import annotations

import numpy as np

from servewell.engine.request import InferenceRequest

#: A deadline no test reaches (absolute monotonic seconds).
FAR = 1e12


def request_of(inputs: dict[str, np.ndarray], *, model: str = "m", lane: int = 0, deadline_at: float = FAR,
               arrived_at: float = 0.0, tenant: str = "", request_id: str = "r", version: str | None = None,
               route_key: str = "") -> InferenceRequest:
    """A request of `model` with `inputs`."""
    return InferenceRequest(request_id, model, version, lane, deadline_at, arrived_at, inputs, tenant=tenant,
                            route_key=route_key)
