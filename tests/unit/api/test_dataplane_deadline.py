"""The data plane turns a client's timeout (or the model's live default) into the request's one
absolute deadline, once, and builds the one request object the engine admits."""

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
from servewell.engine.request import InferenceRequest
from servewell.observability.context import request_id_var
from servewell.observability.tracing import Tracing, TracingSettings

CONFIG = ModelConfig.model_validate({
    "name": "m", "runtime": "onnx", "artifact": "m.onnx",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
})


class RecordingModel:
    """A ready model whose default timeout is 300 ms (as in force: live settings)."""

    name = "m"
    config = CONFIG
    default_timeout_s = 0.3

    def resolve_lane(self, urgency: str | None = None, priority: object = None) -> int:
        return 1

    def admit(self, lane: int, tenant: str = "") -> None:
        pass


class OneModelEngine:
    """Answers every request at once and keeps the requests it was given."""

    def __init__(self, model: RecordingModel) -> None:
        self.model = model
        self.requests: list[InferenceRequest] = []

    async def resolve_async(self, name: str, version: str | None = None) -> RecordingModel:
        return self.model

    def submit(self, request: InferenceRequest) -> asyncio.Future[RequestResult]:
        self.requests.append(request)
        future: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
        future.set_result(RequestResult({}, 0.0, 0.0, 1))
        return future

    def knows(self, name: str) -> bool:
        return True


def requests_of(*calls: dict[str, float | None]) -> list[InferenceRequest]:
    """The request the data plane built for each `calls` entry (infer's keywords)."""
    engine = OneModelEngine(RecordingModel())

    async def main() -> None:
        with ThreadPoolExecutor(1) as pool:
            plane = DataPlane(cast(ServingEngine, engine), DecodeScheduler(pool, 1, 1),
                              ImageLimits(1), None, Tracing(TracingSettings(None, "grpc", 0.0)),
                              tenant_of=lambda key_id: f"tenant-of-{key_id}" if key_id else "")
            for keywords in calls:
                call = plane.call()
                await call.open("m", "2")
                not_after = keywords.get("not_after_in_s")
                await call.infer({"x": np.zeros((1, 1), np.float32)}, timeout_ms=keywords.get("timeout_ms"),
                                 not_after=call.arrived_at + not_after if not_after is not None else None)

    asyncio.run(main())
    return engine.requests


def deadlines_of(*calls: dict[str, float | None]) -> list[tuple[float, float]]:
    """(deadline - arrived_at, arrived_at) of one request per `calls` entry (infer's keywords)."""
    return [(round(r.deadline_at - r.arrived_at, 9), r.arrived_at) for r in requests_of(*calls)]


def test_a_timeout_in_ms_becomes_an_absolute_deadline_from_arrival() -> None:
    [(after, arrived)] = deadlines_of({"timeout_ms": 250.0})
    assert after == 0.25 and arrived > 0  # monotonic seconds, the scheduler's clock


def test_no_timeout_is_the_models_live_default_from_arrival() -> None:
    assert deadlines_of({})[0][0] == 0.3


def test_a_grpc_deadline_bounds_the_timeout_whichever_is_first() -> None:
    sooner, later, alone = deadlines_of({"timeout_ms": 5000.0, "not_after_in_s": 0.5},
                                        {"timeout_ms": 100.0, "not_after_in_s": 0.5}, {"not_after_in_s": 0.5})
    assert (sooner[0], later[0], alone[0]) == (0.5, 0.1, 0.3)  # alone: the default is sooner still


def test_the_request_carries_what_every_stage_decides_on() -> None:
    [request] = requests_of({"timeout_ms": 250.0})
    assert (request.model, request.version, request.lane, request.tenant) == ("m", "2", 1, "")
    assert request.id == request_id_var.get() and request.client_id is None and not request.shadow
