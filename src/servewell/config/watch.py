"""Noticing that configuration files changed, by polling: no inotify, so it works the same for an
edited file, a file replaced by rename, and a Kubernetes ConfigMap or Secret volume, whose update
swaps a `..data` symlink (a path that resolves through it then stats as a different file).

A change is a different stat (device, inode, size, mtime) *and* different content, so touching a
file or rewriting it unchanged reloads nothing.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True, frozen=True)
class FileStamp:
    """What a file looked like when it was last read."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    digest: bytes


def stamp(path: Path) -> FileStamp | None:
    """The file's stamp (symlinks followed), or None when it does not exist or cannot be read."""
    try:
        info = os.stat(path)
        content = path.read_bytes()
    except OSError:
        return None
    return FileStamp(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, hashlib.sha256(content).digest())


class FileWatch:
    """Remembers files' stamps and reports which changed since the last look."""

    def __init__(self) -> None:
        self._stamps: dict[Path, FileStamp | None] = {}

    def track(self, path: Path) -> None:
        """Remember `path` as it is now (its current content is the baseline)."""
        self._stamps[path] = stamp(path)

    def forget(self, path: Path) -> None:
        """Stop watching `path`."""
        self._stamps.pop(path, None)

    def changed(self) -> list[Path]:
        """Tracked files whose content differs from the baseline (the new content becomes it)."""
        out = []
        for path, before in list(self._stamps.items()):
            try:
                info = os.stat(path)
            except OSError:
                info = None
            if before is not None and info is not None and (
                    info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns) == (
                    before.dev, before.ino, before.size, before.mtime_ns):
                continue
            now = stamp(path)
            if (now is None) != (before is None) or (now is not None and before is not None
                                                      and now.digest != before.digest):
                out.append(path)
            self._stamps[path] = now
        return out
