"""Tensors across the door in shared memory (`engine/shared_tensors.py`): written once by their
owner, read in place by the other process, and a block reused only after every array over it is
gone; every reference the reader cannot trust is refused and still released."""

from __future__ import annotations

import asyncio
import gc
import os
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servewell.engine.shared_tensors import (
    SharedTensor,
    SharedTensors,
    TensorLeases,
    TensorStore,
    ThreadSafeReleases,
    tensor_bytes,
)
from servewell.workers.shm import Segment, shm_directory

PID = os.getpid()


def _files(store_prefix: str) -> list[Path]:
    return sorted(shm_directory().glob(f"{store_prefix}*"))


@pytest.fixture
def store() -> Iterator[TensorStore]:
    made = TensorStore(limit_bytes=64 << 20, segment_bytes=1 << 20)
    yield made
    made.close()


def test_the_reader_sees_the_owners_bytes_in_place_not_a_copy(store: TensorStore) -> None:
    image = np.arange(3 * 224 * 224, dtype=np.float32).reshape(1, 3, 224, 224)
    mask = np.array([[True, False, True]])
    shared = store.put({"image": image, "mask": mask})
    assert shared is not None
    released: list[int] = []
    arrays = TensorLeases(PID, released.append).arrays(shared)
    assert arrays["image"].dtype == np.float32 and np.array_equal(arrays["image"], image)
    assert arrays["mask"].dtype == np.bool_ and np.array_equal(arrays["mask"], mask)
    # In place: what the owner's segment holds now is what the reader's array shows.
    where = shared.tensors[0].offset
    segment = Segment(shared.segment, 0, create=False)  # another mapping of the owner's segment
    owner_view = np.ndarray((4,), np.float32, buffer=segment.buf, offset=where)
    owner_view[:] = -1.0
    assert arrays["image"].reshape(-1)[:4].tolist() == [-1.0] * 4
    del owner_view
    segment.close()


def test_a_block_is_released_when_the_last_array_over_it_goes_and_only_then(store: TensorStore) -> None:
    shared = store.put({"x": np.ones((64, 64), np.float32), "y": np.zeros(10, np.int64)})
    assert shared is not None
    released: list[int] = []
    arrays = TensorLeases(PID, released.append).arrays(shared)
    kept = arrays["x"][3:, ::2].T  # a view of a view keeps the lease too
    del arrays
    gc.collect()
    assert released == []
    del kept
    assert released == [shared.block]


def test_a_released_block_is_reused_and_one_in_use_never_is(store: TensorStore) -> None:
    tensors = {"x": np.ones(1000, np.float32)}
    first = store.put(tensors)
    second = store.put(tensors)
    assert first is not None and second is not None
    assert (first.segment, first.tensors[0].offset) != (second.segment, second.tensors[0].offset)
    store.release((first.block,))
    third = store.put(tensors)
    assert third is not None
    assert (third.segment, third.tensors[0].offset) == (first.segment, first.tensors[0].offset)
    assert store.blocks_in_use == 2
    store.release((first.block,))  # a stale id (already released) changes nothing
    assert store.blocks_in_use == 2


def test_a_block_larger_than_a_segment_has_its_own_kept_for_the_next_one_until_the_store_is_idle() -> None:
    """A large result's own segment is kept at release and carries the next large one (making and
    unlinking one per result cost the engine's loop ~100 ms each at 60 MB, issue 45 H1); the
    store's idle trim unlinks it."""
    store = TensorStore(limit_bytes=64 << 20, segment_bytes=1 << 20, trim_after_s=3600)
    try:
        big = np.zeros((3 << 20) // 4, np.float32)  # 3 MiB against 1 MiB segments
        shared = store.put({"big": big})
        assert shared is not None and shared.own_segment
        path = shm_directory() / shared.segment
        assert path.stat().st_size >= big.nbytes
        released: list[int] = []
        arrays = TensorLeases(PID, released.append).arrays(shared)
        assert arrays["big"].shape == big.shape
        del arrays
        store.release(tuple(released))
        assert path.exists() and store.blocks_in_use == 0  # kept, not in use

        smaller = np.ones((2 << 20) // 4, np.float32)
        again = store.put({"big": smaller})
        assert again is not None and again.own_segment and again.segment == shared.segment  # reused
        read = TensorLeases(PID, lambda block: None).arrays(again)
        assert np.array_equal(read["big"], smaller)
        del read
        store.release((again.block,))
    finally:
        store.close()
    assert not path.exists() and store.mapped_bytes == 0


def test_an_idle_store_unlinks_its_kept_own_segments() -> None:
    store = TensorStore(limit_bytes=64 << 20, segment_bytes=1 << 20, trim_after_s=0)
    try:
        shared = store.put({"big": np.zeros((3 << 20) // 4, np.float32)})
        assert shared is not None
        store.release((shared.block,))  # idle now, and trim_after_s has passed
        assert not (shm_directory() / shared.segment).exists()
        assert store.mapped_bytes == 0
    finally:
        store.close()


def test_kept_own_segments_give_way_to_a_larger_block_under_the_limit() -> None:
    store = TensorStore(limit_bytes=6 << 20, segment_bytes=1 << 20, trim_after_s=3600)
    try:
        first = store.put({"big": np.zeros((3 << 20) // 4, np.float32)})
        assert first is not None
        store.release((first.block,))
        second = store.put({"big": np.zeros((5 << 20) // 4, np.float32)})  # 3 + 5 MiB would pass 6 MiB
        assert second is not None and second.segment != first.segment
        assert not (shm_directory() / first.segment).exists()
        assert store.mapped_bytes <= 6 << 20
    finally:
        store.close()


def test_past_its_limit_or_for_objects_the_store_says_inline() -> None:
    store = TensorStore(limit_bytes=1 << 20, segment_bytes=1 << 20)
    try:
        assert store.put({"x": np.zeros(200_000, np.float32)}) is not None  # 800 kB: the one segment
        assert store.put({"x": np.zeros(200_000, np.float32)}) is None  # a second segment would pass the limit
        assert store.put({"text": np.array([b"a", b"b"], dtype=object)}) is None
        assert store.put({}) is None
    finally:
        store.close()
    assert TensorStore(limit_bytes=0).put({"x": np.zeros(4, np.float32)}) is None


def test_abandoning_unlinks_everything_yet_arrays_already_read_stay_whole(store: TensorStore) -> None:
    data = np.arange(5000, dtype=np.int32)
    shared = store.put({"x": data})
    big = store.put({"big": np.ones((2 << 20) // 4, np.float32)})
    assert shared is not None and big is not None
    arrays = TensorLeases(PID, lambda block: None).arrays(shared)
    assert _files(f"servewell-{PID}-")
    names = {shared.segment, big.segment}
    store.abandon()
    assert not any((shm_directory() / name).exists() for name in names)
    assert np.array_equal(arrays["x"], data)  # still mapped here until the arrays go
    assert store.blocks_in_use == 0 and store.mapped_bytes == 0
    again = store.put({"x": data})
    assert again is not None and again.segment not in names


def _ref(segment: str, *tensors: SharedTensor) -> SharedTensors:
    return SharedTensors(7, segment, tensors)


@pytest.mark.parametrize("broken", [
    lambda s: _ref("servewell-1-1-t0", SharedTensor("x", "<f4", (4,), 0)),  # another process's segment
    lambda s: _ref("../../etc/passwd", SharedTensor("x", "<f4", (4,), 0)),
    lambda s: _ref(s.segment + "-gone", SharedTensor("x", "<f4", (4,), 0)),  # no such segment
    lambda s: _ref(s.segment, SharedTensor("x", "|O", (4,), 0)),  # pointers of another process
    lambda s: _ref(s.segment, SharedTensor("x", "not a dtype", (4,), 0)),
    lambda s: _ref(s.segment, SharedTensor("x", "<f4", (1 << 30,), 0)),  # beyond the segment
    lambda s: _ref(s.segment, SharedTensor("x", "<f4", (4,), -64)),
    lambda s: _ref(s.segment, SharedTensor("x", "<f4", (-1, 4), 0)),
    lambda s: _ref(s.segment, SharedTensor("x", "<f4", (2.5,), 0)),  # type: ignore[arg-type]
])
def test_a_reference_the_reader_cannot_trust_is_refused_and_released(
        store: TensorStore, broken: Callable[[SharedTensors], SharedTensors]) -> None:
    good = store.put({"x": np.ones(4, np.float32)})
    assert good is not None
    released: list[int] = []
    with pytest.raises(ValueError):
        TensorLeases(PID, released.append).arrays(broken(good))
    gc.collect()
    assert released == [7]


def test_releases_from_other_threads_reach_the_loop_once_per_step() -> None:
    delivered: list[tuple[int, ...]] = []

    async def scenario() -> None:
        releases = ThreadSafeReleases(asyncio.get_running_loop(), delivered.append)
        releases(1)
        releases(2)
        threads = [threading.Thread(target=releases, args=(10 + i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for _ in range(5):
            await asyncio.sleep(0)
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    flat = [block for batch in delivered for block in batch]
    assert sorted(flat) == [1, 2, *range(10, 18)]
    assert delivered[0][:2] == (1, 2)  # the two released in one step left together
    assert len(delivered) <= 1 + 8


def test_an_array_dropped_on_a_worker_thread_releases_through_the_loop(store: TensorStore) -> None:
    shared = store.put({"x": np.ones(100, np.float32)})
    assert shared is not None
    delivered: list[tuple[int, ...]] = []

    async def scenario() -> None:
        releases = ThreadSafeReleases(asyncio.get_running_loop(), delivered.append)
        box = [TensorLeases(PID, releases).arrays(shared)]
        await asyncio.to_thread(box.clear)  # the last reference dies on another thread
        for _ in range(20):
            if delivered:
                return
            await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert delivered == [(shared.block,)]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300_000), st.booleans()), min_size=1, max_size=40))
def test_blocks_in_use_never_overlap_and_the_store_stays_within_its_limit(steps: list[tuple[int, bool]]) -> None:
    store = TensorStore(limit_bytes=4 << 20, segment_bytes=1 << 20)
    live: dict[int, SharedTensors] = {}
    try:
        for size, release_oldest in steps:
            shared = store.put({"x": np.zeros(size, np.uint8)})
            if shared is not None:
                live[shared.block] = shared
            if release_oldest and live:
                oldest = next(iter(live))
                store.release((oldest,))
                del live[oldest]
            spans = sorted((s.segment, s.tensors[0].offset, s.tensors[0].offset + tensor_bytes(
                {"x": np.empty(s.tensors[0].shape, np.uint8)})) for s in live.values())
            for (seg_a, _, end_a), (seg_b, start_b, _) in zip(spans, spans[1:], strict=False):
                assert seg_a != seg_b or end_a <= start_b
            assert store.mapped_bytes <= 4 << 20
    finally:
        store.close()


def test_a_store_leaves_half_of_dev_shm_to_the_workers_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    from servewell.engine import shared_tensors

    monkeypatch.setattr(shared_tensors, "shm_free_fraction", lambda size: 0.49)
    store = TensorStore(limit_bytes=64 << 20, segment_bytes=1 << 20)
    assert store.put({"x": np.ones(1000, np.float32)}) is None
    assert store.put({"x": np.ones(1 << 20, np.float32)}) is None  # an own segment too
    monkeypatch.setattr(shared_tensors, "shm_free_fraction", lambda size: 0.51)
    try:
        assert store.put({"x": np.ones(1000, np.float32)}) is not None
    finally:
        store.close()


def test_a_store_that_grew_just_now_keeps_its_segments_when_idle() -> None:
    store = TensorStore(limit_bytes=64 << 20, segment_bytes=1 << 20)  # trims 30 s after it last grew
    try:
        burst = [store.put({"x": np.ones(100_000, np.float32)}) for _ in range(4)]
        store.release(tuple(b.block for b in burst if b is not None))
        assert store.mapped_bytes == 2 << 20  # no churn: a busy load touches zero blocks in use often
    finally:
        store.close()


def test_after_a_burst_the_store_keeps_one_segment_and_unlinks_the_rest() -> None:
    store = TensorStore(limit_bytes=64 << 20, segment_bytes=1 << 20, trim_after_s=0.0)
    try:
        burst = [store.put({"x": np.ones(100_000, np.float32)}) for _ in range(12)]  # 512 KiB blocks: 6 segments
        assert all(b is not None for b in burst)
        names = {b.segment for b in burst if b is not None}
        assert len(names) == 6 and store.mapped_bytes == 6 << 20
        store.release(tuple(b.block for b in burst[:-1] if b is not None))
        assert store.mapped_bytes == 6 << 20  # one block still in use: nothing goes
        last = burst[-1]
        assert last is not None
        store.release((last.block,))
        assert store.mapped_bytes == 1 << 20
        left = [name for name in names if (shm_directory() / name).exists()]
        assert left == [last.segment]  # the one blocks were being carved from
        again = [store.put({"x": np.ones(100_000, np.float32)}) for _ in range(3)]
        assert all(a is not None for a in again)
        assert len({a.segment for a in again if a is not None}) == 2  # its free blocks reused, then one new
        assert store.mapped_bytes == 2 << 20
    finally:
        store.close()


def test_an_idle_store_gives_a_burst_back_at_its_owners_periodic_check() -> None:
    import time

    store = TensorStore(limit_bytes=64 << 20, segment_bytes=1 << 20, trim_after_s=0.2)
    try:
        burst = [store.put({"x": np.ones(100_000, np.float32)}) for _ in range(6)]
        store.release(tuple(b.block for b in burst if b is not None))  # idle, but it grew just now
        assert store.mapped_bytes == 3 << 20
        store.trim_if_idle()
        assert store.mapped_bytes == 3 << 20
        time.sleep(0.25)
        store.trim_if_idle()  # no release needed: the owner's loop asks every few seconds
        assert store.mapped_bytes == 1 << 20
    finally:
        store.close()


def test_the_reader_forgets_segments_its_owner_unlinked_but_arrays_over_them_stay_whole(store: TensorStore) -> None:
    data = np.arange(2000, dtype=np.float32)
    first = store.put({"x": data})
    assert first is not None
    leases = TensorLeases(PID, lambda block: None)
    arrays = leases.arrays(first)
    assert leases.attached == 1
    leases.prune()
    assert leases.attached == 1  # still the owner's: kept
    store.abandon()  # unlinks it (a trim does the same to the segments it gives back)
    leases.prune()
    assert leases.attached == 0  # the mapping no longer keeps the unlinked memory alive
    assert np.array_equal(arrays["x"], data)  # ...except under arrays still over it
    second = store.put({"x": data})
    assert second is not None
    assert np.array_equal(leases.arrays(second)["x"], data) and leases.attached == 1


def test_puts_on_a_copy_thread_and_releases_on_the_loop_keep_the_books_straight() -> None:
    """The door writes a large result into the store on its copy thread while the event loop
    releases others: every block is handed out once, and the store ends with none in use."""
    store = TensorStore(limit_bytes=32 << 20, segment_bytes=1 << 20, trim_after_s=3600)
    handed: queue.Queue[SharedTensors | None] = queue.Queue()

    def writer() -> None:
        for i in range(100):
            handed.put(store.put({"x": np.full(20_000 if i % 2 else 400_000, i, np.float32)}))
        handed.put(None)

    thread = threading.Thread(target=writer)
    thread.start()
    blocks: list[int] = []
    while (shared := handed.get(timeout=10)) is not None:
        blocks.append(shared.block)
        store.release((shared.block,))
    thread.join()
    try:
        assert len(set(blocks)) == len(blocks) == 100
        assert store.blocks_in_use == 0
        assert store.mapped_bytes <= 32 << 20
    finally:
        store.close()
    assert store.mapped_bytes == 0
