"""Shared-memory segments that carry batch tensors between processes without pickling.

A segment is a file in /dev/shm (what `shm_open` makes on Linux), mapped by both processes.
Every name starts with `servewell-<frontend pid>-<worker serial>`: the frontend gives each
worker its prefix, so it can remove every segment of a worker by name however the worker ended
(a `kill -9` included), and every segment of the server when it exits. A server that was itself
killed leaves segments whose pid is dead; the next server removes those at start
(`remove_stale_segments`).

Python's `multiprocessing.shared_memory` is not used: it registers every segment with the
resource tracker, which then warns about "leaked" segments another process already removed,
or removes at exit what a live process still uses. Owners here unlink their own segments and the
frontend sweeps by prefix, so nothing needs a tracker.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import math
import mmap
import os
import struct
import tempfile
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np

from servewell.errors import SharedMemoryFull
from servewell.workers.messages import TensorRef

_ALIGN = 64  # cache-line alignment keeps vectorised copies fast
#: Every segment servewell makes starts with this (then the frontend's pid).
NAME_PREFIX = "servewell-"
_serials = itertools.count(1)


def shm_directory() -> Path:
    """Where segments live: /dev/shm (tmpfs) on Linux, the temp directory elsewhere."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def new_prefix() -> str:
    """A fresh name prefix owned by this process: `servewell-<pid>-<serial>`."""
    return f"{NAME_PREFIX}{os.getpid()}-{next(_serials)}"


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Segment:
    """One named shared-memory file mapped into this process."""

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        path = shm_directory() / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
                _reserve(fd, size)
            else:
                size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size)
        except BaseException:
            if create:
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.name = name
        self.size = size

    @property
    def buf(self) -> mmap.mmap:
        """The mapped bytes (numpy arrays may be laid over them)."""
        return self._map

    def close(self) -> None:
        """Unmap (the file stays until unlinked). A numpy view still alive keeps the mapping:
        it then goes when the view does."""
        try:
            self._map.close()
        except BufferError:
            pass

    def unlink(self) -> None:
        """Remove the name; processes that mapped it keep their mapping."""
        remove_segment(self.name)


def _reserve(fd: int, size: int) -> None:
    """Give the segment its memory now. A tmpfs that is full (a container's /dev/shm is often
    64-256 MiB) then fails here with `OSError` (ENOSPC), where a mapping that only ftruncate sized
    would kill the process with SIGBUS at the first write to a page it cannot get."""
    if size <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):  # no fallocate here: as before
            raise


def shm_free_fraction(size: int) -> float:
    """The fraction of the shared-memory filesystem that would still be free after `size` more
    bytes (1.0 when it cannot be told)."""
    try:
        stat = os.statvfs(shm_directory())
    except OSError:
        return 1.0
    total = stat.f_blocks * stat.f_frsize
    return 1.0 if total <= 0 else (stat.f_bavail * stat.f_frsize - size) / total


def shm_free_bytes() -> int:
    """Bytes free in the shared-memory filesystem now (-1 when it cannot be told)."""
    try:
        stat = os.statvfs(shm_directory())
    except OSError:
        return -1
    return stat.f_bavail * stat.f_frsize


def remove_segment(name: str) -> bool:
    """Unlink one segment by name; whether it existed."""
    try:
        os.unlink(shm_directory() / name)
    except FileNotFoundError:
        return False
    return True


def remove_segments(prefix: str) -> int:
    """Unlink every segment whose name starts with `prefix` + "-"; how many there were."""
    removed = 0
    for path in shm_directory().glob(f"{prefix}-*"):
        removed += remove_segment(path.name)
    return removed


def remove_stale_segments() -> int:
    """Unlink segments left by servewell processes that no longer exist (a killed server)."""
    removed = 0
    for path in shm_directory().glob(f"{NAME_PREFIX}*"):
        pid_text = path.name[len(NAME_PREFIX):].split("-", 1)[0]
        if pid_text.isdigit() and not pid_alive(int(pid_text)):
            removed += remove_segment(path.name)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: not ours to judge
    return True


class SharedArena:
    """A growable segment owned by this process, reused for one batch at a time.

    Its names are `<prefix>-<generation>`; growing creates the next generation and unlinks the
    outgrown one at once.
    """

    def __init__(self, initial_bytes: int = 1 << 20, prefix: str | None = None) -> None:
        self._prefix = prefix or new_prefix() + "-arena"
        self._generation = itertools.count()
        self._segment = self._new(max(_ALIGN, initial_bytes))

    def _new(self, size: int) -> Segment:
        return Segment(f"{self._prefix}{next(self._generation)}", size, create=True)

    @property
    def name(self) -> str:
        """Name the other process attaches to."""
        return self._segment.name

    def write(self, arrays: dict[str, np.ndarray]) -> tuple[TensorRef, ...]:
        """Copy `arrays` into the segment (growing it if needed) and describe where they lie.
        `TypeError` for an array of Python objects (a BYTES tensor not decoded to numbers): its
        bytes are pointers into this process, which the other process would follow and crash on."""
        _refuse_objects(name for name, array in arrays.items() if array.dtype.hasobject)
        need = sum(_aligned(a.nbytes) for a in arrays.values())
        self._ensure(need)
        refs: list[TensorRef] = []
        offset = 0
        for name, array in arrays.items():
            view: np.ndarray = np.ndarray(array.shape, dtype=array.dtype, buffer=self._segment.buf, offset=offset)
            np.copyto(view, array, casting="no")
            refs.append(TensorRef(name, array.dtype.str, tuple(array.shape), offset, array.nbytes))
            offset += _aligned(array.nbytes)
        return tuple(refs)

    def views(self, shapes: dict[str, tuple[tuple[int, ...], np.dtype]]) -> dict[str, np.ndarray]:
        """Writable arrays laid out in the segment, for filling a batch in place (numbers only)."""
        _refuse_objects(name for name, (_, dtype) in shapes.items() if np.dtype(dtype).hasobject)
        need = sum(_aligned(math.prod(s) * np.dtype(d).itemsize) for s, d in shapes.values())
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
        """Room for `nbytes`: a larger segment (twice the size, or just `nbytes` when that does not
        fit) made before the old one goes, so a full /dev/shm leaves the arena as it was, able to
        carry the batches that fit it, and answers this one `SharedMemoryFull`."""
        if nbytes <= self._segment.size:
            return
        grown: Segment | None = None
        why = ""
        for size in dict.fromkeys((max(nbytes, 2 * self._segment.size), _aligned(nbytes))):
            try:
                grown = self._new(size)
                break
            except OSError as exc:
                why = exc.strerror or str(exc)
        if grown is None:
            raise SharedMemoryFull(f"no room in {shm_directory()} for a batch of {nbytes} bytes "
                                   f"({shm_free_bytes()} bytes free there: {why}); smaller requests are still "
                                   "served, retry once shared memory is freed")
        self.close()
        self._segment = grown

    def close(self) -> None:
        """Release and unlink the segment (closing twice is harmless)."""
        self._segment.close()
        self._segment.unlink()


class SegmentReader:
    """Attaches to segments owned by the other process and reads tensors out of them."""

    def __init__(self) -> None:
        self._attached: dict[str, Segment] = {}

    def arrays(self, segment: str, refs: tuple[TensorRef, ...], copy: bool) -> dict[str, np.ndarray]:
        """The tensors `refs` in `segment`; `copy=True` detaches them from the segment."""
        shm = self._attach(segment)
        out: dict[str, np.ndarray] = {}
        for ref in refs:
            view: np.ndarray = np.ndarray(ref.shape, dtype=np.dtype(ref.dtype), buffer=shm.buf, offset=ref.offset)
            out[ref.name] = view.copy() if copy else view
        return out

    def _attach(self, segment: str) -> Segment:
        shm = self._attached.get(segment)
        if shm is None:
            # A new name means the owner grew its arena: drop the stale attachment.
            self.close()
            shm = Segment(segment, 0, create=False)
            self._attached[segment] = shm
        return shm

    def close(self) -> None:
        """Detach from every segment (never unlinks: the owner does)."""
        for shm in self._attached.values():
            shm.close()
        self._attached.clear()


#: Copies of this many bytes or more are made on `COPIES`' thread, off the event loop: below it the
#: hand-over (tens of microseconds) costs more than the copy.
OFF_LOOP_BYTES = 1 << 20

T = TypeVar("T")


class CopyThread:
    """One thread for the large copies of an event-loop process (a batch's outputs out of a worker's
    arena, a result into an ingress's shared memory), started at its first use. numpy gives up the
    GIL while it copies, so the loop runs on meanwhile: a 60 MB answer's copies held the engine's
    loop, which every model's requests pass through, about 80 ms each (issue 45 H1)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    async def run(self, work: Callable[[], T]) -> T:
        """`work()` on the copy thread; its result."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="servewell-copy")
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)


#: The process's copy thread.
COPIES = CopyThread()


def copies_of(views: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each array copied (numpy releases the GIL for the copy)."""
    return {name: view.copy() for name, view in views.items()}


_BEAT = struct.Struct("<Q")


class HeartbeatCell:
    """An 8-byte counter in a segment: the worker's heartbeat thread increments it, the frontend
    reads it. It needs no message and no event-loop wake-up per beat."""

    SIZE = _ALIGN

    def __init__(self, name: str, *, create: bool) -> None:
        self._segment = Segment(name, self.SIZE, create=create)

    @property
    def name(self) -> str:
        """The segment's name."""
        return self._segment.name

    def read(self) -> int:
        """The current count."""
        value: int = _BEAT.unpack_from(self._segment.buf, 0)[0]
        return value

    def write(self, value: int) -> None:
        """Store a count (one aligned 8-byte store: a reader never sees half of it)."""
        _BEAT.pack_into(self._segment.buf, 0, value)

    def close(self) -> None:
        """Unmap the cell (the owner also unlinks it)."""
        self._segment.close()

    def unlink(self) -> None:
        """Remove the name."""
        self._segment.unlink()


def _refuse_objects(names: Iterable[str]) -> None:
    """`TypeError` naming the tensors that hold Python objects: shared memory carries numbers only."""
    found = list(names)
    if found:
        raise TypeError(f"tensor(s) {found} hold Python objects (BYTES not decoded to numbers); shared memory "
                        "between processes carries numeric and BOOL tensors only")
