"""Places promised to requests on their way in (engine/promised.py) count as taken: a lane whose
free places are all promised to requests still being read or decoded refuses the tenant holding
the most of it before that tenant's next body is read, in the engine's own process (the
scheduler) and in an ingress process (from the engine's published board, with its share of the
free places). Without this, `make bench`'s 3x overload refused 3-9 % of its requests only after
their images were decoded, 20-60 ms after they arrived."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest

from fake_clock import FakeClock
from servewell.api.remote_engine import RemoteEngine
from servewell.config.model import ModelConfig
from servewell.engine.door import _lane_state
from servewell.engine.envelope import LaneState, ModelEntrySummary, ModelTable, encode_frame
from servewell.engine.full_lanes import FullLanes, LaneRefusals
from servewell.engine.promised import PromisedPlaces
from servewell.engine.protocol import Readiness
from servewell.engine.scheduler import ModelScheduler
from servewell.errors import Overloaded

NORMAL = 1  # of the default lanes ["high", "normal"]


def config(max_queue_size: int = 4) -> ModelConfig:
    return ModelConfig.model_validate({
        "name": "m", "runtime": "onnx", "artifact": "m.onnx", "max_batch_size": 1,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [2]}],
        "batching": {"max_queue_size": max_queue_size}})


def test_a_promise_counts_while_held_and_never_outlives_its_holder() -> None:
    places = PromisedPlaces()
    first, second = places.promise(NORMAL), places.promise(NORMAL)
    assert places.count(NORMAL) == 2 and places.count(0) == 0
    del first
    assert places.count(NORMAL) == 1

    def fails_half_way() -> None:  # a call that raises while it holds its promise
        held = places.promise(NORMAL)
        raise ValueError(held)

    with pytest.raises(ValueError):
        fails_half_way()
    gc.collect()
    assert places.count(NORMAL) == 1
    del second
    assert places.count(NORMAL) == 0


def test_the_scheduler_refuses_once_the_free_places_are_promised_and_admits_again_when_one_is_dropped() -> None:
    async def main() -> None:
        s = ModelScheduler(config(max_queue_size=3), clock=FakeClock())
        promises = [s.admit(NORMAL, "flood") for _ in range(3)]  # three requests on their way in: no runner
        with pytest.raises(Overloaded) as refused:
            s.admit(NORMAL, "flood")
        assert "3 on their way in" in str(refused.value) and refused.value.tenant == "flood"
        promises.pop()  # one was built (or failed): its place is free again
        s.admit(NORMAL, "flood")

    asyncio.run(main())


class Queue:
    """A lane's depth and holders, as `FullLanes` reads a `BatchQueue`."""

    def __init__(self, bound: int) -> None:
        self.max_queue_size = bound
        self.held: dict[str, int] = {}

    def depth(self, lane: int) -> int:
        return sum(self.held.values()) if lane == NORMAL else 0

    def refused_tenants(self, lane: int) -> frozenset[str]:
        return frozenset(self.held) if lane == NORMAL else frozenset()

    def places(self, lane: int) -> dict[str, int]:
        return dict(self.held) if lane == NORMAL else {}


def test_a_nearly_full_lane_is_published_with_its_free_places_and_withdrawn_once_far_from_full() -> None:
    published: list[tuple[int, LaneRefusals | None]] = []
    lanes = FullLanes(lambda lane, refusals: published.append((lane, refusals)))
    queue = Queue(bound=10)
    for depth, expected in ((4, []), (5, [5]), (5, []), (8, [2]), (10, [0]), (3, [None])):
        published.clear()
        queue.held = {"flood": depth}
        lanes.refresh(queue, 2, lambda: 1.0, batch=1)
        # nearly full: at most half its places free (or a batch's); each change once, none twice
        assert [None if r is None else r.free for _, r in published] == expected, depth


def test_the_free_places_are_dealt_among_the_ingress_processes_without_overlap() -> None:
    refusals = LaneRefusals({"flood": 7}, 7, 1.0, free=5)
    shares = [_lane_state(("m", "1", NORMAL, refusals), rank, 3).free for rank in range(3)]
    assert shares == [2, 2, 1]
    assert [_lane_state(("m", "1", NORMAL, LaneRefusals({"f": 9}, 9, 1.0, free=1)), rank, 2).free
            for rank in range(2)] == [1, 0]
    assert _lane_state(("m", "1", NORMAL, None), 0, 2).held is None


def test_an_ingress_refuses_once_its_share_of_the_free_places_is_promised(tmp_path: Path) -> None:
    model_config = config(max_queue_size=8)
    entry = ModelEntrySummary("m", "1", "ready", None, model_config, tuple(model_config.batching.lanes))

    async def main() -> None:
        async def door(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            # The engine's word: lane 'normal' is nearly full, flood holds 6, this ingress may promise 2.
            writer.write(encode_frame([ModelTable({"m": entry}, "m", Readiness(True, "ready"), accepting=True),
                                       LaneState("m", "1", NORMAL, {"flood": 6}, depth=6, free=2)]))
            await reader.read()

        path = str(tmp_path / "door")
        server = await asyncio.start_unix_server(door, path)
        engine = RemoteEngine(path, 0, lambda live: None)
        stop = asyncio.Event()
        running = asyncio.ensure_future(engine.run(stop))
        await asyncio.wait_for(engine.connected_once.wait(), 10)
        model = engine.resolve_now("m", None)
        assert model is not None
        held = [model.admit(NORMAL, "flood"), model.admit(NORMAL, "flood")]
        with pytest.raises(Overloaded) as refused:
            model.admit(NORMAL, "flood")
        assert "2 on their way in" in str(refused.value)
        model.admit(NORMAL, "light")  # not the lane's holder: the engine would push out flood's newest
        held.pop()
        held.append(model.admit(NORMAL, "flood"))  # a promise dropped: its place is free again
        stop.set()
        await running
        server.close()

    asyncio.run(main())
