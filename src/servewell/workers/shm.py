"""Shared-memory segments that carry batch tensors between processes without pickling.

One side owns (creates and unlinks) a segment; the other attaches by name. Workers are
spawned by the frontend and share its resource tracker, which keeps one entry per name:
attaching re-registers the same name (no effect) and the owner's unlink removes it, so
nobody unregisters by hand. A segment whose owner was killed is removed by the tracker
when the server exits.
"""

from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np

from servewell.workers.messages import TensorRef

_ALIGN = 64  # cache-line alignment keeps vectorised copies fast


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class SharedArena:
    """A growable shared-memory segment owned by this process, reused for one batch at a time."""

    def __init__(self, initial_bytes: int = 1 << 20) -> None:
        self._segment = shared_memory.SharedMemory(create=True, size=max(_ALIGN, initial_bytes))

    @property
    def name(self) -> str:
        """Name the other process attaches to."""
        return self._segment.name

    def write(self, arrays: dict[str, np.ndarray]) -> tuple[TensorRef, ...]:
        """Copy `arrays` into the segment (growing it if needed) and describe where they lie."""
        need = sum(_aligned(a.nbytes) for a in arrays.values())
        self._ensure(need)
        refs: list[TensorRef] = []
        offset = 0
        for name, array in arrays.items():
            view = np.ndarray(array.shape, dtype=array.dtype, buffer=self._segment.buf, offset=offset)
            np.copyto(view, array, casting="no")
            refs.append(TensorRef(name, array.dtype.str, tuple(array.shape), offset, array.nbytes))
            offset += _aligned(array.nbytes)
        return tuple(refs)

    def views(self, shapes: dict[str, tuple[tuple[int, ...], np.dtype]]) -> dict[str, np.ndarray]:
        """Writable arrays laid out in the segment, for filling a batch in place."""
        need = sum(_aligned(int(np.prod(s)) * np.dtype(d).itemsize) for s, d in shapes.values())
        self._ensure(need)
        out: dict[str, np.ndarray] = {}
        offset = 0
        for name, (shape, dtype) in shapes.items():
            out[name] = np.ndarray(shape, dtype=dtype, buffer=self._segment.buf, offset=offset)
            offset += _aligned(out[name].nbytes)
        return out

    def refs_of(self, views: dict[str, np.ndarray]) -> tuple[TensorRef, ...]:
        """Descriptors of arrays obtained from `views` (laid out in the same order)."""
        refs: list[TensorRef] = []
        offset = 0
        for name, array in views.items():
            refs.append(TensorRef(name, array.dtype.str, tuple(array.shape), offset, array.nbytes))
            offset += _aligned(array.nbytes)
        return tuple(refs)

    def _ensure(self, nbytes: int) -> None:
        if nbytes <= self._segment.size:
            return
        self.close()
        self._segment = shared_memory.SharedMemory(create=True, size=max(nbytes, 2 * self._segment.size))

    def close(self) -> None:
        """Release and unlink the segment."""
        try:
            self._segment.close()
            self._segment.unlink()
        except FileNotFoundError:
            pass


class SegmentReader:
    """Attaches to segments owned by the other process and reads tensors out of them."""

    def __init__(self) -> None:
        self._attached: dict[str, shared_memory.SharedMemory] = {}

    def arrays(self, segment: str, refs: tuple[TensorRef, ...], copy: bool) -> dict[str, np.ndarray]:
        """The tensors `refs` in `segment`; `copy=True` detaches them from the segment."""
        shm = self._attach(segment)
        out: dict[str, np.ndarray] = {}
        for ref in refs:
            view = np.ndarray(ref.shape, dtype=np.dtype(ref.dtype), buffer=shm.buf, offset=ref.offset)
            out[ref.name] = view.copy() if copy else view
        return out

    def _attach(self, segment: str) -> shared_memory.SharedMemory:
        shm = self._attached.get(segment)
        if shm is None:
            # A new name means the owner grew its arena: drop the stale attachment.
            self.close()
            shm = shared_memory.SharedMemory(name=segment, create=False)
            self._attached[segment] = shm
        return shm

    def close(self) -> None:
        """Detach from every segment (never unlinks: the owner does)."""
        for shm in self._attached.values():
            try:
                shm.close()
            except BufferError:
                # A caller still holds a view; the mapping goes when the process exits.
                pass
        self._attached.clear()
