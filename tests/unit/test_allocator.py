"""The frontend's malloc thresholds: large blocks freed in a thread go back to the system."""

from __future__ import annotations

import threading

import numpy as np

from servewell.allocator import bound_freed_memory, give_back_freed_memory


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_memory_freed_by_a_decode_thread_is_given_back():
    assert bound_freed_memory()  # glibc, as on every machine servewell ships for
    kept: list[int] = []

    def decode_like() -> None:
        before = rss_bytes()
        for _ in range(3):  # glibc's own thresholds would keep the 16 MB after the first free
            image = np.ones(16 * 1024 * 1024, dtype=np.uint8)
            temporary = np.ones(1024 * 1024, dtype=np.uint8)
            del image, temporary
        kept.append(rss_bytes() - before)

    thread = threading.Thread(target=decode_like)
    thread.start()
    thread.join()
    assert kept[0] < 4 * 1024 * 1024, kept  # 17 MB without the fixed thresholds


def test_small_blocks_freed_in_bulk_are_given_back_by_a_trim():
    # 1 KiB blocks (malloc's, not Python's small-object allocator), every tenth kept: the freed ones
    # are holes between live blocks, which no threshold returns; the trim does.
    blocks = [np.empty(1024, dtype=np.uint8) for _ in range(40_000)]
    kept = blocks[::10]
    del blocks
    before = rss_bytes()
    assert give_back_freed_memory()
    assert before - rss_bytes() > 16 * 1024 * 1024, (before, rss_bytes())
    del kept
