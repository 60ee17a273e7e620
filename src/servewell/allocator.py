"""How much freed memory the frontend process keeps: glibc's malloc, with fixed thresholds.

glibc raises its mmap threshold to the size of each large block freed (up to 32 MB), after which
blocks of that size come from the arena heaps and stay there once freed, in every thread's arena.
A frontend that decoded one 16-megapixel PNG thus kept about 24 MB per decode thread for its
whole life (bench.hostile's heavy-decode attack: RSS 101 -> 137 MB, and it stayed there).
Fixed thresholds make a block of 8 MB or more its own mapping, returned on free, and give an
arena's free top back once it passes 2 MB: memory in use is unchanged, and what is kept after a
burst of large requests is bounded by about 2 MB per arena (the heavy-decode attack now leaves
the frontend within a few MB of where it started). Smaller blocks (request bodies of up to a
megabyte, tensors of the usual sizes) are allocated as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

#: From glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Large enough that no ordinary request's allocation is a mapping of its own.
MMAP_THRESHOLD_BYTES = 8 * 1024 * 1024
#: Free memory an arena keeps at its top: a few of the megabyte-sized temporaries of a request.
TRIM_THRESHOLD_BYTES = 2 * 1024 * 1024


def bound_freed_memory(mmap_threshold_bytes: int = MMAP_THRESHOLD_BYTES,
                       trim_threshold_bytes: int = TRIM_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap and trim thresholds for this process; False where the C library is not
    glibc (nothing changes then)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    done = (mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes) == 1
            and mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes) == 1)
    if not done:
        log.debug("mallopt refused the thresholds; the C library keeps its own")
    return done


def give_back_freed_memory() -> bool:
    """Hand the C heap's free pages back to the system now (glibc's `malloc_trim(0)`): blocks freed
    in bulk (an emptied response cache: many small answers) otherwise stay in the arenas, resident,
    until reused. Takes milliseconds for a heap of tens of MB; False where the C library is not
    glibc (nothing is done)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim(0)
    return True
