"""Tensors that cross the door (ingress <-> engine) in shared memory instead of the frame.

The owner of a tensor (an ingress for a request's inputs, the engine for a result's outputs)
writes it once into a block of its own shared memory (`TensorStore.put`) and sends a
`SharedTensors` reference in the message; the reader lays numpy arrays over that block
(`TensorLeases.arrays`) without copying, and batches, encodes or logs from them.

A block belongs to its message until the reader is done with every array over it. The arrays
hold a lease (their numpy `base`), and when the last of them is gone (a batch copied its rows, a
pipeline finished, a shadow compared, a response was written) the lease calls back and the
reader sends `Release` to the owner, which reuses the block. Nothing has to know in advance who
keeps an array how long, and a block is never reused while an array over it lives.

What a reader may attach is bounded: only segments whose name carries the owner's prefix
(`servewell-<owner pid>-`, the names `workers/shm.py` gives and the supervisor sweeps when the
owner dies), only inside the segment, only numeric and BOOL dtypes whose shape matches the bytes.
Anything else is refused with `ValueError`, and the block is still released.

Blocks come in power-of-two size classes carved from segments of `segment_bytes` and reused
through one free list per class; a block larger than a segment gets a segment of its own, kept
when it is released for the next large block (making and unlinking one per 60 MB result cost the
engine's loop about 100 ms each). With no block in use, 30 s or more after it last grew, a store
keeps one segment and unlinks the rest, kept own segments included (checked at each release and
every few seconds by its owner), so a burst does not hold its peak of /dev/shm, which a pod pays
as memory. `put` may run on another thread than the rest (the engine writes a large result on
its copy thread, `workers/shm.py` COPIES): the bookkeeping is under a lock, the copy outside it. It never holds
more than `limit_bytes` of segments, and takes a new one only while half of /dev/shm stays free
(a container's is often 64-256 MiB, and the workers' batch arenas need it); past either, `put`
returns None and the message carries its tensors inline, as small ones always do. Segments get
their memory when made (`workers/shm.py`), so a full /dev/shm is an error there, never a SIGBUS
at a write.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from servewell.workers.shm import Segment, new_prefix, shm_directory, shm_free_fraction

log = logging.getLogger("servewell.shared_tensors")

_ALIGN = 64
_SMALLEST_BLOCK = 4096
#: Segments a reader keeps mapped per owner; past it the oldest mapping is dropped (arrays over
#: it keep it alive until they go).
MAX_ATTACHED = 64
#: Most tensors one reference may name.
MAX_TENSORS = 1024
_DTYPE_KINDS = frozenset("biufc")  # numbers; "b" is BOOL
#: A store takes a new segment only if at least this much of /dev/shm stays free after it: the
#: workers' batch arenas live there too, and every ingress and the engine have a store.
KEEP_FREE_FRACTION = 0.5
#: An idle store unlinks its extra segments only this long after it last grew: a load whose blocks
#: in use touch zero between requests made and unlinked segments 20 times a second without it.
TRIM_AFTER_S = 30.0


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(slots=True, frozen=True)
class SharedTensor:
    """One tensor in a block: its name, dtype (numpy's `dtype.str`), shape and where it lies."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # from the start of the segment

    def __reduce__(self) -> tuple[type[SharedTensor], tuple[str, str, tuple[int, ...], int]]:
        # One per tensor of every message that carries them: a plain tuple pickles several times faster.
        return (SharedTensor, (self.name, self.dtype, self.shape, self.offset))


@dataclass(slots=True, frozen=True)
class SharedTensors:
    """The tensors of one message, in one block of the owner's shared memory."""

    block: int  # the owner's id of the block: `Release` names it
    segment: str
    tensors: tuple[SharedTensor, ...]
    own_segment: bool = False  # the block is the whole segment (unlinked when released)

    def __reduce__(self) -> tuple[type[SharedTensors], tuple[int, str, tuple[SharedTensor, ...], bool]]:
        return (SharedTensors, (self.block, self.segment, self.tensors, self.own_segment))


@dataclass(slots=True, frozen=True)
class Release:
    """The reader is done with these blocks: the owner may reuse them."""

    blocks: tuple[int, ...]


def tensor_bytes(arrays: Mapping[str, np.ndarray]) -> int:
    """The bytes `arrays` take in a block."""
    return sum(_aligned(a.nbytes) for a in arrays.values())


class TensorStore:
    """The owner's side: blocks of shared memory that messages' tensors are written into."""

    def __init__(self, limit_bytes: int, segment_bytes: int = 8 << 20, prefix: str | None = None,
                 trim_after_s: float = TRIM_AFTER_S) -> None:
        self._limit = limit_bytes
        self._trim_after_s = trim_after_s
        self._grown_at = 0.0  # monotonic time the last shared segment was made
        self._segment_bytes = segment_bytes
        self._prefix = prefix or new_prefix() + "-t"
        self._names = itertools.count()
        self._ids = itertools.count(1)
        self._segments: list[Segment] = []  # the shared ones blocks are carved from
        # Own segments (a block larger than a segment) released and kept for the next large block:
        # making one reserves its memory (60 MB: about 15 ms of page clearing) and unlinking it
        # gives the memory back (more again), both for every large result without these.
        self._spares: list[Segment] = []
        self._current: Segment | None = None
        self._bump = 0  # first free byte of `_current`
        self._free: dict[int, list[tuple[Segment, int]]] = {}  # size class -> free blocks
        self._blocks: dict[int, tuple[int, Segment, int]] = {}  # id -> (size class or 0: own segment, segment, offset)
        self._mapped = 0  # bytes of every segment mapped now
        # `put` may run on a copy thread (a large result, engine/door.py) while the loop releases:
        # the bookkeeping is done under this lock, the copy into a block (owned by its put) outside it.
        self._lock = threading.Lock()

    @property
    def blocks_in_use(self) -> int:
        """Blocks written and not yet released."""
        return len(self._blocks)

    @property
    def mapped_bytes(self) -> int:
        """Bytes of shared memory this store holds."""
        return self._mapped

    def put(self, arrays: Mapping[str, np.ndarray]) -> SharedTensors | None:
        """Write `arrays` into a fresh block; None when they cannot go there (a tensor of Python
        objects, nothing to write, or the store is at its limit): send them inline then."""
        if not arrays or any(a.dtype.kind not in _DTYPE_KINDS for a in arrays.values()):
            return None
        need = tensor_bytes(arrays)
        with self._lock:
            place = self._allocate(need)
            if place is None:
                return None
            size_class, segment, start = place
            block = next(self._ids)
            self._blocks[block] = (size_class, segment, start)
        tensors: list[SharedTensor] = []
        offset = start
        for name, array in arrays.items():
            view: np.ndarray = np.ndarray(array.shape, dtype=array.dtype, buffer=segment.buf, offset=offset)
            np.copyto(view, array, casting="no")
            tensors.append(SharedTensor(name, array.dtype.str, tuple(array.shape), offset))
            offset += _aligned(array.nbytes)
        return SharedTensors(block, segment.name, tuple(tensors), own_segment=size_class == 0)

    def release(self, blocks: tuple[int, ...]) -> None:
        """The reader is done with `blocks` (ids it does not know are ignored: an abandoned generation)."""
        with self._lock:
            for block in blocks:
                place = self._blocks.pop(block, None)
                if place is None:
                    continue
                size_class, segment, offset = place
                if size_class == 0:
                    self._spares.append(segment)
                else:
                    self._free.setdefault(size_class, []).append((segment, offset))
            self._trim_if_idle()

    def trim_if_idle(self) -> None:
        """With no block in use, `trim_after_s` or more after the store last grew: keep one segment
        and unlink the rest (called at every release and by its owner's periodic check)."""
        with self._lock:
            self._trim_if_idle()

    def _trim_if_idle(self) -> None:
        if (not self._blocks and (len(self._segments) > 1 or self._spares)
                and time.monotonic() - self._grown_at >= self._trim_after_s):
            self._trim()

    def _trim(self) -> None:
        """Nothing is in use: keep the segment blocks are carved from now and unlink the others,
        so a burst does not hold its peak of /dev/shm (a pod's memory) for ever."""
        keep = self._current
        for segment in self._segments:
            if segment is not keep:
                self._mapped -= segment.size
                segment.close()
                segment.unlink()
        self._segments = [keep] if keep is not None else []
        self._drop_spares(len(self._spares))
        self._free = {size: kept for size, blocks in self._free.items()
                      if (kept := [block for block in blocks if block[0] is keep])}

    def abandon(self) -> None:
        """The reader is gone: unlink every segment (a reader that still maps one keeps its
        memory until its arrays go) and start afresh, so no block it may still read is reused."""
        with self._lock:
            for size_class, segment, _ in self._blocks.values():
                if size_class == 0:  # an own segment
                    segment.close()
                    segment.unlink()
            for segment in self._segments + self._spares:
                segment.close()
                segment.unlink()
            self._segments.clear()
            self._spares.clear()
            self._blocks.clear()
            self._free.clear()
            self._current, self._bump, self._mapped = None, 0, 0

    close = abandon

    def _allocate(self, need: int) -> tuple[int, Segment, int] | None:
        size_class = max(_SMALLEST_BLOCK, 1 << (need - 1).bit_length())
        if size_class > self._segment_bytes:
            size = _aligned(need)
            fits = [spare for spare in self._spares if spare.size >= size]
            if fits:
                spare = min(fits, key=lambda segment: segment.size)
                self._spares.remove(spare)
                self._grown_at = time.monotonic()  # in use: not trimmed while large results keep coming
                return 0, spare, 0
            while self._spares and self._mapped + size > self._limit:
                self._drop_spares(1)
            if self._mapped + size > self._limit:
                return None
            segment = self._new_segment(size)
            if segment is None:
                return None
            self._grown_at = time.monotonic()
            return 0, segment, 0
        free = self._free.get(size_class)
        if free:
            segment, offset = free.pop()
            return size_class, segment, offset
        if self._current is None or self._bump + size_class > self._current.size:
            if self._mapped + self._segment_bytes > self._limit:
                return None
            segment = self._new_segment(self._segment_bytes)
            if segment is None:
                return None
            self._segments.append(segment)
            self._current, self._bump = segment, 0
            self._grown_at = time.monotonic()
        offset = self._bump
        self._bump += size_class
        return size_class, self._current, offset

    def _drop_spares(self, count: int) -> None:
        """Unlink `count` spare own segments, largest first."""
        self._spares.sort(key=lambda segment: segment.size)
        for _ in range(count):
            segment = self._spares.pop()
            self._mapped -= segment.size
            segment.close()
            segment.unlink()

    def _new_segment(self, size: int) -> Segment | None:
        if shm_free_fraction(size) < KEEP_FREE_FRACTION:
            return None  # the workers' batches need it more: inline costs a copy, not a failure
        try:
            segment = Segment(f"{self._prefix}{next(self._names)}", size, create=True)
        except OSError as exc:  # /dev/shm full or not writable: inline is still correct
            log.warning("no shared memory for tensors (%s); sending them inline", exc)
            return None
        self._mapped += size
        return segment


class _Mapping:
    """A segment of the owner's, mapped here; its address for arrays laid over it."""

    __slots__ = ("segment", "size", "address", "_export")

    def __init__(self, name: str) -> None:
        self.segment = Segment(name, 0, create=False)
        self.size = self.segment.size
        # A view over the whole map: it gives the address and keeps the map open while we live.
        self._export = np.frombuffer(self.segment.buf, dtype=np.uint8)
        self.address: int = self._export.__array_interface__["data"][0]


class _Lease:
    """Alive while any array over one block is: when it goes, the block is released."""

    __slots__ = ("_block", "_release", "_mapping")

    def __init__(self, block: int, release: Callable[[int], None], mapping: _Mapping) -> None:
        self._block = block
        self._release = release
        self._mapping = mapping  # the arrays' memory stays mapped while they live

    def __del__(self) -> None:
        try:
            self._release(self._block)
        except Exception:  # never raise from a finalizer (the reader may be gone)
            pass


class _View:
    """One array's description over a leased block; numpy keeps it as the array's base."""

    __slots__ = ("__array_interface__", "_lease")

    def __init__(self, interface: dict[str, object], lease: _Lease) -> None:
        self.__array_interface__ = interface
        self._lease = lease


class TensorLeases:
    """The reader's side: arrays over one owner's blocks, each released when its arrays are gone.

    `release` is called with the block id on whichever thread drops the last array; the caller
    makes it safe to call from any thread (`ThreadSafeReleases`)."""

    def __init__(self, owner_pid: int, release: Callable[[int], None]) -> None:
        self._prefix = f"servewell-{owner_pid}-"
        self._release = release
        self._attached: dict[str, _Mapping] = {}

    def arrays(self, shared: SharedTensors) -> dict[str, np.ndarray]:
        """The tensors of `shared`, as arrays over the owner's memory (`ValueError` naming what is
        wrong with a reference this reader refuses; the block is released either way)."""
        if not isinstance(shared.block, int):
            raise ValueError("a shared tensor reference without a block id")
        mapping = self._attach(shared)
        lease = _Lease(shared.block, self._release, mapping)
        if len(shared.tensors) > MAX_TENSORS:
            raise ValueError(f"a shared tensor reference names {len(shared.tensors)} tensors (at most {MAX_TENSORS})")
        out: dict[str, np.ndarray] = {}
        for tensor in shared.tensors:
            dtype = _dtype(tensor.dtype)
            shape = tuple(tensor.shape)
            if not all(isinstance(n, int) and n >= 0 for n in shape) or len(shape) > 32:
                raise ValueError(f"tensor {tensor.name!r}: bad shape {shape!r}")
            nbytes = math.prod(shape) * dtype.itemsize
            if not isinstance(tensor.offset, int) or tensor.offset < 0 or tensor.offset + nbytes > mapping.size:
                raise ValueError(f"tensor {tensor.name!r} lies outside its segment")
            interface = {"shape": shape, "typestr": dtype.str, "data": (mapping.address + tensor.offset, False),
                         "version": 3}
            out[tensor.name] = np.asarray(_View(interface, lease))
        return out

    @property
    def attached(self) -> int:
        """Segments of the owner's this reader keeps mapped."""
        return len(self._attached)

    def close(self) -> None:
        """Forget every mapping (arrays still alive keep theirs)."""
        self._attached.clear()

    def prune(self) -> None:
        """Forget the mappings of segments their owner has unlinked (a store trimmed after a burst,
        or abandoned): a mapping kept the unlinked memory alive. Arrays still over one keep it
        until they go. Called when a new segment is attached and by the reader's periodic check."""
        directory = shm_directory()
        for name in [name for name in self._attached if not (directory / name).exists()]:
            del self._attached[name]

    def _attach(self, shared: SharedTensors) -> _Mapping:
        name = shared.segment
        if not isinstance(name, str) or not name.startswith(self._prefix) or "/" in name or "\0" in name:
            # No lease yet: release here, so the owner does not keep the block for ever.
            self._release(shared.block)
            raise ValueError(f"segment {name!r} is not one of its sender's")
        mapping = self._attached.get(name)
        if mapping is not None:
            return mapping
        try:
            mapping = _Mapping(name)
        except (OSError, ValueError) as exc:
            self._release(shared.block)
            raise ValueError(f"segment {name!r} cannot be mapped: {exc}") from None
        if not shared.own_segment:  # an own segment is unlinked at release: never mapped again
            self.prune()
            if len(self._attached) >= MAX_ATTACHED:
                del self._attached[next(iter(self._attached))]
            self._attached[name] = mapping
        return mapping


def _dtype(text: object) -> np.dtype:
    try:
        dtype: np.dtype = np.dtype(text)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ValueError(f"unknown dtype {text!r}") from None
    if dtype.kind not in _DTYPE_KINDS or dtype.hasobject or dtype.itemsize == 0:
        raise ValueError(f"dtype {text!r} cannot be shared (numbers and BOOL only)")
    return dtype


class ThreadSafeReleases:
    """Collects released block ids from any thread (a lease goes where its last array is dropped,
    which may be inside a garbage collection) and hands them to `flush` on the event loop, once
    per loop step: one `Release` for every block freed in that step. No lock: a finalizer may
    run on a thread that is inside this object already."""

    def __init__(self, loop: asyncio.AbstractEventLoop, flush: Callable[[tuple[int, ...]], None]) -> None:
        self._loop = loop
        self._flush_to = flush
        self._thread = threading.get_ident()
        self._pending: collections.deque[int] = collections.deque()
        self._scheduled = False

    def __call__(self, block: int) -> None:
        self._pending.append(block)
        if self._scheduled:
            return  # the flush already scheduled runs after this append and takes it
        self._scheduled = True
        if threading.get_ident() == self._thread:
            self._loop.call_soon(self._flush)
        else:
            self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        blocks: list[int] = []
        while self._pending:
            blocks.append(self._pending.popleft())
        if blocks:
            self._flush_to(tuple(blocks))


