"""The data plane turns a client's timeout into the request's one absolute deadline, once."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import numpy as np

from servewell.api.codecs.image import ImageLimits
from servewell.api.dataplane import DataPlane
from servewell.api.decode_scheduler import DecodeScheduler
from servewell.config.model import ModelConfig
from servewell.engine.protocol import RequestResult, ServingEngine
from servewell.observability.tracing import Tracing, TracingSettings

CONFIG = ModelConfig.model_validate({
    "name": "m", "runtime": "onnx", "artifact": "m.onnx",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
})


class RecordingModel:
    """A ready model that answers at once and remembers the deadline it was given."""

    name = "m"
    config = CONFIG

    def __init__(self) -> None:
        self.deadlines: list[tuple[float | None, float | None]] = []

    def resolve_lane(self, urgency: str | None = None, priority: object = None) -> int:
        return 1

    def admit(self, lane: int) -> None:
        pass

    def infer(self, inputs: dict[str, np.ndarray], *, lane: int, deadline: float | None, request_id: str,
              arrived_at: float | None) -> asyncio.Future[RequestResult]:
        self.deadlines.append((deadline, arrived_at))
        future: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
        future.set_result(RequestResult({}, 0.0, 0.0, 1))
        return future


class OneModelEngine:
    def __init__(self, model: RecordingModel) -> None:
        self.model = model

    def resolve(self, name: str, version: str | None = None) -> RecordingModel:
        return self.model

    async def resolve_async(self, name: str, version: str | None = None) -> RecordingModel:
        return self.model

    def knows(self, name: str) -> bool:
        return True


def deadlines_of(*calls: dict[str, float | None]) -> list[tuple[float | None, float]]:
    """(deadline - arrived_at, arrived_at) of one request per `calls` entry (infer's keywords)."""
    model = RecordingModel()

    async def main() -> None:
        with ThreadPoolExecutor(1) as pool:
            plane = DataPlane(cast(ServingEngine, OneModelEngine(model)), DecodeScheduler(pool, 1, 1),
                              ImageLimits(1), None, Tracing(TracingSettings(None, "grpc", 0.0)))
            for keywords in calls:
                call = plane.call()
                await call.open("m")
                not_after = keywords.get("not_after_in_s")
                await call.infer({"x": np.zeros((1, 1), np.float32)}, timeout_ms=keywords.get("timeout_ms"),
                                 not_after=call.arrived_at + not_after if not_after is not None else None)

    asyncio.run(main())
    out: list[tuple[float | None, float]] = []
    for deadline, arrived in model.deadlines:
        assert arrived is not None
        out.append((round(deadline - arrived, 9) if deadline is not None else None, arrived))
    return out


def test_a_timeout_in_ms_becomes_an_absolute_deadline_from_arrival() -> None:
    [(after, arrived)] = deadlines_of({"timeout_ms": 250.0})
    assert after == 0.25 and arrived > 0  # monotonic seconds, the scheduler's clock


def test_no_timeout_leaves_the_model_default_to_the_engine() -> None:
    assert deadlines_of({})[0][0] is None


def test_a_grpc_deadline_bounds_the_timeout_whichever_is_first() -> None:
    sooner, later, alone = deadlines_of({"timeout_ms": 5000.0, "not_after_in_s": 0.5},
                                        {"timeout_ms": 100.0, "not_after_in_s": 0.5}, {"not_after_in_s": 0.5})
    assert (sooner[0], later[0], alone[0]) == (0.5, 0.1, 0.5)
