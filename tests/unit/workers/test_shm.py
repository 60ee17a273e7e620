"""Shared-memory transport: what one side writes the other reads back exactly, the arena grows
for a larger batch, and closing leaves no segment behind in /dev/shm."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from servewell.workers.shm import SegmentReader, SharedArena

SHM = Path("/dev/shm")


@pytest.fixture()
def arena():
    arena = SharedArena(initial_bytes=4096)
    yield arena
    arena.close()


@pytest.fixture()
def reader():
    reader = SegmentReader()
    yield reader
    reader.close()


def test_written_arrays_read_back_exactly_with_dtype_and_shape(arena, reader):
    arrays = {
        "pixels": np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4),
        "ids": np.array([[7], [-9]], dtype=np.int64),
        "mask": np.array([True, False]),
        "half": np.linspace(0, 1, 5, dtype=np.float16),
    }
    refs = arena.write(arrays)
    assert [r.name for r in refs] == list(arrays)
    assert all(r.offset % 64 == 0 for r in refs)  # each tensor starts on a cache line
    back = reader.arrays(arena.name, refs, copy=True)
    assert list(back) == list(arrays)
    for name, array in arrays.items():
        assert back[name].dtype == array.dtype and back[name].shape == array.shape
        np.testing.assert_array_equal(back[name], array)


def test_views_filled_in_place_are_described_by_refs_of(arena, reader):
    views = arena.views({"x": ((3, 2), np.dtype(np.float32)), "n": ((3,), np.dtype(np.int32))})
    views["x"][:] = [[1, 2], [3, 4], [5, 6]]
    views["n"][:] = [10, 20, 30]
    refs = arena.refs_of(views)
    back = reader.arrays(arena.name, refs, copy=True)
    np.testing.assert_array_equal(back["x"], [[1, 2], [3, 4], [5, 6]])
    np.testing.assert_array_equal(back["n"], [10, 20, 30])


def test_a_copy_is_detached_from_later_writes(arena, reader):
    refs = arena.write({"x": np.ones(4, dtype=np.float32)})
    kept = reader.arrays(arena.name, refs, copy=True)["x"]
    arena.write({"x": np.zeros(4, dtype=np.float32)})
    np.testing.assert_array_equal(kept, np.ones(4))


def test_the_arena_grows_for_a_larger_batch_and_the_reader_follows(arena, reader):
    small = {"x": np.full((4,), 1.0, dtype=np.float64)}
    reader.arrays(arena.name, arena.write(small), copy=True)
    first_name = arena.name
    big = {"x": np.arange(100_000, dtype=np.float64)}  # 800 KB, far beyond the 4 KB start
    refs = arena.write(big)
    assert arena.name != first_name  # a new, larger segment
    assert not (SHM / first_name).exists()  # the outgrown one is unlinked at once
    np.testing.assert_array_equal(reader.arrays(arena.name, refs, copy=True)["x"], big["x"])
    # and back to a small batch: the larger segment is reused
    np.testing.assert_array_equal(reader.arrays(arena.name, arena.write(small), copy=True)["x"], small["x"])


def test_close_and_unlink_leave_nothing_in_dev_shm(reader):
    arena = SharedArena(initial_bytes=1024)
    names = [arena.name]
    for size in (10_000, 100_000, 1_000_000):
        refs = arena.write({"x": np.zeros(size, dtype=np.uint8)})
        reader.arrays(arena.name, refs, copy=True)
        names.append(arena.name)
    assert (SHM / names[-1]).exists()
    arena.close()
    reader.close()
    assert [name for name in names if (SHM / name).exists()] == []
    arena.close()  # closing twice is harmless


def test_without_copy_the_reader_returns_views_into_the_segment(arena, reader):
    refs = arena.write({"x": np.arange(8, dtype=np.int32)})
    view = reader.arrays(arena.name, refs, copy=False)["x"]
    assert view.tolist() == list(range(8))
    arena.write({"x": np.zeros(8, dtype=np.int32)})  # the same segment, overwritten in place
    assert view.tolist() == [0] * 8
    del view  # a view must not outlive the reader's close(): it would point at unmapped memory


def test_arrays_of_python_objects_are_refused(arena):
    """BYTES not decoded to numbers would put this process's pointers into the segment, and the
    reader would follow them into another process's memory."""
    strings = np.array([b"ab", b"cde"], dtype=object)
    with pytest.raises(TypeError, match=r"\['s'\] hold Python objects"):
        arena.write({"x": np.zeros(2, np.float32), "s": strings})
    with pytest.raises(TypeError, match=r"\['s'\] hold Python objects"):
        arena.views({"s": ((2,), np.dtype(object))})
    assert arena.write({"x": np.ones(2, np.float32)})  # numbers still go through


def test_a_new_segment_has_its_memory_reserved_so_a_full_dev_shm_fails_at_creation_not_with_sigbus() -> None:
    from servewell.workers.shm import Segment, new_prefix, shm_directory

    name = new_prefix() + "-reserved"
    segment = Segment(name, 4 << 20, create=True)
    try:
        # Blocks allocated up front (posix_fallocate), not only a size (ftruncate leaves a sparse file).
        assert (shm_directory() / name).stat().st_blocks * 512 >= 4 << 20
    finally:
        segment.close()
        segment.unlink()


def test_a_full_filesystem_refuses_the_segment_with_an_os_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    from servewell.workers import shm

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    name = shm.new_prefix() + "-full"
    with pytest.raises(OSError):
        shm.Segment(name, 1 << 20, create=True)
    assert not (shm.shm_directory() / name).exists()  # nothing left behind


def test_an_arena_that_cannot_grow_keeps_its_segment_and_says_shared_memory_is_full(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A /dev/shm without room for a larger batch (issue 45 H14): the batch is refused 503
    `shared_memory_full` naming the directory and the size, and the arena still carries the
    batches that fit it (it used to unlink its segment first, then fail with a bare OSError)."""
    import errno
    import os

    from servewell.errors import SharedMemoryFull
    from servewell.workers.shm import SegmentReader, SharedArena, shm_directory

    real_fallocate = os.posix_fallocate

    def full_past_1_mib(fd: int, offset: int, length: int) -> None:
        if length > 1 << 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fallocate(fd, offset, length)

    arena = SharedArena(initial_bytes=1 << 20)
    reader = SegmentReader()
    try:
        monkeypatch.setattr(os, "posix_fallocate", full_past_1_mib)
        with pytest.raises(SharedMemoryFull, match=rf"no room in {shm_directory()} for a batch of 2097152 bytes"):
            arena.write({"x": np.zeros(1 << 19, np.float32)})  # 2 MiB
        small = np.arange(16, dtype=np.float32)
        refs = arena.write({"x": small})
        np.testing.assert_array_equal(reader.arrays(arena.name, refs, copy=True)["x"], small)
    finally:
        reader.close()
        arena.close()
