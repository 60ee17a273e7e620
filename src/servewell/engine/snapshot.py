"""Private copies of model directories: a worker never reads a file someone may overwrite in place.

Workers memory-map their weights. When a user copies a new file over the served one in place
(`cp new.safetensors model.safetensors` keeps the inode, truncates it and writes it again), every
page of the old mapping changes or vanishes under the running model: the worker died with SIGBUS
(measured: 8,618 answers 503 `worker_lost` before the new version even loaded). A hard link
would not help: it is the same inode, so the same pages. Only a copy (or a reflink, which shares
blocks copy-on-write) is immune, so each loaded version serves from its own snapshot of the model
directory, made when it loads and removed when it stops:

    <cache_dir>/snapshots/<server pid>-<model>-<version>-<n>/   (read-only files)

A file that did not change since an earlier snapshot of this server (same device, inode, size,
mtime and ctime: any write changes the last two) is hard-linked from that private copy instead of
copied again, so a reload that changes only model.yaml copies nothing. `copy_file_range` lets the
kernel copy without passing the bytes through this process, and clones the blocks on file systems
that can (XFS, btrfs). A file that changes while it is being copied is copied again.

Only the files the model uses are copied (`engine.model_files` chooses them from its config):
a data folder linked into a 232 KB model's directory once made its snapshot copy 695 MB. A
symlinked *file* is copied (an artifact linked from a model store is common); a symlinked
*directory* is never listed through. A snapshot bigger than `max_bytes` is refused (the model
then serves from the repository's files, with an error logged).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from servewell.threads import lower_priority_pool
from servewell.workers.shm import pid_alive

log = logging.getLogger("servewell.engine")

FileIdentity = tuple[int, int, int, int, int]  # device, inode, size, mtime_ns, ctime_ns
#: How often a file that keeps changing while it is copied is tried before the load gives up.
COPY_ATTEMPTS = 3
#: How far below normal CPU priority the threads that copy and remove snapshots run: a 40 MiB copy
#: holds a core for about 10 ms, which a model load's bookkeeping should not take from the models
#: being served (the requests of resident models were slowest right after other models' loads).
SNAPSHOT_NICE = 10
#: Snapshots made or removed at once (loads run in parallel up to `max_concurrent_loads`).
SNAPSHOT_THREADS = 2
#: Default for `snapshot_max_bytes`: the most one snapshot may copy.
DEFAULT_SNAPSHOT_MAX_BYTES = 16 << 30
_FALLBACK_ERRNOS = frozenset((errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF))


class SnapshotError(OSError):
    """A model directory could not be copied (full disk, a file that never stopped changing)."""


@dataclass(slots=True, frozen=True)
class Snapshot:
    """One private copy of a model directory."""

    directory: Path
    files: int
    copied_bytes: int
    reused_bytes: int
    seconds: float


def _identity(info: os.stat_result) -> FileIdentity:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def copy_bytes(source: Path, target: Path) -> None:
    """Copy `source` to the new file `target` in the kernel (cloning blocks where the file system can)."""
    with open(source, "rb") as fin, open(target, "xb") as fout:
        size = os.fstat(fin.fileno()).st_size
        try:
            copied = 0
            while copied < size:
                step = os.copy_file_range(fin.fileno(), fout.fileno(), size - copied)
                if step == 0:
                    break  # the file shrank while we copied: the identity check catches it
                copied += step
        except OSError as exc:
            if exc.errno not in _FALLBACK_ERRNOS:
                raise
            fin.seek(0)
            fout.seek(0)
            fout.truncate()
            shutil.copyfileobj(fin, fout, 1 << 20)


class SnapshotStore:
    """Makes and removes the snapshots of one server under `root` (thread-safe: snapshots are made
    in a worker thread, several models at once)."""

    def __init__(self, root: Path, copy: Callable[[Path, Path], None] = copy_bytes,
                 max_bytes: int = DEFAULT_SNAPSHOT_MAX_BYTES) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._copy = copy  # tests pass one that races a writer
        self._copies: dict[FileIdentity, Path] = {}
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._serials = itertools.count(1)

    @property
    def executor(self) -> ThreadPoolExecutor:
        """Where `take` and `release` should run: `SNAPSHOT_THREADS` threads at `SNAPSHOT_NICE`
        (created on first use; idle threads cost nothing)."""
        with self._lock:
            if self._executor is None:
                self._executor = lower_priority_pool(SNAPSHOT_THREADS, SNAPSHOT_NICE, "snapshot")
            return self._executor

    def take(self, source: Path, label: str, files: Iterable[str]) -> Snapshot:
        """Copy `files` (paths relative to the model directory `source`, as `engine.model_files`
        chooses them; symlinks followed, a missing one skipped) into a new private, read-only
        directory; `SnapshotError` when it cannot (over `max_bytes` included)."""
        started = time.perf_counter()
        safe_label = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)[:100]
        self.root.mkdir(parents=True, exist_ok=True)
        while True:
            target = self.root / f"{os.getpid()}-{safe_label}-{next(self._serials)}"
            try:
                target.mkdir()
                break
            except FileExistsError:
                continue  # another store of this process used the name
        try:
            count, copied, reused = self._copy_files(source, target, files)
        except OSError as exc:
            shutil.rmtree(target, ignore_errors=True)
            if isinstance(exc, SnapshotError):
                raise
            raise SnapshotError(f"cannot copy {source} into {target}: {exc}") from exc
        return Snapshot(target, count, copied, reused, time.perf_counter() - started)

    def _copy_files(self, source: Path, target: Path, files: Iterable[str]) -> tuple[int, int, int]:
        count = copied = reused = 0
        for name in files:
            relative = PurePosixPath(name)
            if relative.is_absolute() or ".." in relative.parts or not relative.parts:
                raise SnapshotError(f"{name!r} is not a path inside the model directory {source}")
            path = source / relative
            if not path.is_file():
                continue  # absent (the load names it), a directory, a socket, a dangling link
            if copied + reused + path.stat().st_size > self.max_bytes:
                raise SnapshotError(f"the files of {source} hold more than snapshot_max_bytes ({self.max_bytes} "
                                    "bytes)")
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            size, was_reused = self._copy_file(path, target / relative)
            count += 1
            if was_reused:
                reused += size
            else:
                copied += size
        return count, copied, reused

    def _copy_file(self, source: Path, target: Path) -> tuple[int, bool]:
        """Copy one file (or link an unchanged earlier copy); (bytes, whether it was reused)."""
        for _ in range(COPY_ATTEMPTS):
            before = _identity(os.stat(source))
            with self._lock:
                earlier = self._copies.get(before)
            if earlier is not None:
                try:
                    os.link(earlier, target)
                    with self._lock:
                        self._copies[before] = target  # the newest snapshot outlives the older ones
                    return before[2], True
                except OSError:
                    with self._lock:
                        self._copies.pop(before, None)  # its snapshot is gone: copy again
            self._copy(source, target)
            if _identity(os.stat(source)) == before:
                os.chmod(target, 0o444)  # nobody, us included, writes into a snapshot
                with self._lock:
                    self._copies[before] = target
                return before[2], False
            target.unlink()  # it changed while we copied: the copy may be torn
        raise SnapshotError(f"{source} kept changing while it was copied ({COPY_ATTEMPTS} attempts); "
                            "publish new versions by writing elsewhere and renaming (see the README)")

    def release(self, snapshot: Snapshot) -> None:
        """Remove a snapshot (its workers have stopped)."""
        with self._lock:
            for identity, path in list(self._copies.items()):
                if path.is_relative_to(snapshot.directory):
                    del self._copies[identity]
        shutil.rmtree(snapshot.directory, ignore_errors=True)

    def remove_stale(self) -> int:
        """Remove snapshots left by servewell processes that no longer run (a killed server)."""
        removed = 0
        if not self.root.is_dir():
            return 0
        for path in self.root.iterdir():
            pid_text = path.name.split("-", 1)[0]
            if pid_text.isdigit() and int(pid_text) != os.getpid() and not pid_alive(int(pid_text)):
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
        return removed
