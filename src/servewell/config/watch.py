"""Noticing that configuration files changed, by polling: no inotify, so it works the same for an
edited file, a file replaced by rename, and a Kubernetes ConfigMap or Secret volume, whose update
swaps a `..data` symlink (a path that resolves through it then stats as a different file).

A change is different *content* (or a file that appeared, vanished or became unreadable), so
touching a file or rewriting it unchanged reloads nothing. A change is *settled*, and applied,
only once the file looked the same (identity, size, mtime and content hash) at two consecutive
polls: a writer paused mid-file at a valid prefix once had that prefix served (198 of 558
/predict got 422 and the model reloaded twice). SIGHUP means "done, apply now" and skips the wait.

Reading is blocking file I/O: callers on the event loop run `poll` in a thread. Only regular
files within `max_bytes` are read (`config.file_read`); anything else is reported as a change
with its `problem`, once, and then is the baseline until the file changes again.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from servewell.config.bounded_yaml import cut
from servewell.config.file_read import DEFAULT_MAX_CONFIG_BYTES, read_config_bytes


@dataclass(slots=True, frozen=True)
class FileState:
    """What a file looked like at one poll: its identity and content hash, or why it was not read."""

    exists: bool
    dev: int = 0
    ino: int = 0
    size: int = 0
    mtime_ns: int = 0
    digest: bytes = b""
    problem: str | None = None

    @property
    def content(self) -> tuple[bool, bytes, str | None]:
        """What decides whether the file changed (its stat alone does not: a touch changes nothing)."""
        return self.exists, self.digest, self.problem


@dataclass(slots=True, frozen=True)
class FileChange:
    """A watched file whose content differs from the applied one. `settled`: unchanged since the
    previous poll, so apply it; else it is still being written (seen for the first time)."""

    path: Path
    settled: bool
    problem: str | None = None


def read_state(path: Path, max_bytes: int = DEFAULT_MAX_CONFIG_BYTES, known: FileState | None = None) -> FileState:
    """The file's state (symlinks followed). Its content is read only when its stat differs from
    `known`'s; a FIFO, device, oversized or unreadable file gets a `problem` instead of a digest."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return FileState(False)
    except OSError as exc:
        return FileState(True, problem=cut(f"cannot read: {exc.strerror or exc}", 200))
    ident = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    if known is not None and known.problem is None and known.exists and ident == (
            known.dev, known.ino, known.size, known.mtime_ns):
        return known
    try:
        digest = hashlib.sha256(read_config_bytes(path, max_bytes)).digest()
    except OSError as exc:
        return FileState(True, *ident, problem=cut(str(exc), 200))
    except Exception as exc:  # a watcher that raises stops watching every file
        return FileState(True, *ident, problem=cut(f"cannot read: {type(exc).__name__}: {exc}", 200))
    return FileState(True, *ident, digest=digest)


class FileWatch:
    """Remembers files' applied states and reports which changed since (thread-safe: `poll` runs
    in a thread while the event loop may `track` or `forget`)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_CONFIG_BYTES) -> None:
        self.max_bytes = max_bytes
        self._applied: dict[Path, FileState] = {}
        self._pending: dict[Path, FileState] = {}
        self._lock = threading.Lock()

    def track(self, path: Path) -> None:
        """Remember `path` as it is now (its current content is the baseline)."""
        state = read_state(path, self.max_bytes)
        with self._lock:
            self._applied[path] = state
            self._pending.pop(path, None)

    def forget(self, path: Path) -> None:
        """Stop watching `path`."""
        with self._lock:
            self._applied.pop(path, None)
            self._pending.pop(path, None)

    def tracked(self) -> list[Path]:
        """The watched paths."""
        with self._lock:
            return list(self._applied)

    def poll(self, settle: bool = True) -> list[FileChange]:
        """Look at every file once. Settled changes become the new baseline; with `settle=False`
        (SIGHUP) every change is settled at once. An unsettled change is reported when first seen."""
        out: list[FileChange] = []
        for path in self.tracked():
            with self._lock:
                applied = self._applied.get(path)
                pending = self._pending.get(path)
            if applied is None:
                continue  # forgotten meanwhile
            state = read_state(path, self.max_bytes, pending or applied)
            with self._lock:
                if path not in self._applied:
                    continue
                if state.content == applied.content:
                    self._applied[path] = state  # a touch: remember the new stat, skip reading next time
                    self._pending.pop(path, None)
                elif not settle or state == pending:
                    self._applied[path] = state
                    self._pending.pop(path, None)
                    out.append(FileChange(path, True, state.problem))
                else:
                    self._pending[path] = state
                    out.append(FileChange(path, False, state.problem))
        return out

    def changed(self) -> list[Path]:
        """Files whose content differs from the baseline, applied at once (the new content becomes it)."""
        return [change.path for change in self.poll(settle=False)]
