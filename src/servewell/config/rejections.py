"""Configuration files whose last change was refused, for `/healthz`, `/admin/config`, the
console and metrics: before, a rejected hot reload was visible only in the logs.

An entry is per watched file, with the problems of its latest rejected version; it is cleared
when a later version of that file is applied. File labels come only from the server's own
configured set of files (never from a client).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servewell.config.bounded_yaml import cut

#: Problems kept per file (each cut to `MAX_REASON_CHARS`): unauthenticated /healthz shows them.
MAX_PROBLEMS_PER_FILE = 5
MAX_REASON_CHARS = 300
#: What /healthz and the console say instead of a private file's reasons (the keys file's name key
#: ids and tenants: an operator's data, issue 45).
PRIVATE_REASON = "refused; the reason names keys or tenants: see GET /admin/config or the server log"


@dataclass(slots=True, frozen=True)
class Rejection:
    """One reason a file's latest version was refused."""

    path: Path
    label: str  # the file's name relative to the repository, or its basename: no absolute path
    field: str
    reason: str
    at: float  # Unix seconds
    private: bool = False  # the reason is shown with `full_paths` only (the admin report)


class RejectedFiles:
    """The current rejections, by file; `on_change(count of rejected files)` after each change."""

    def __init__(self, clock: Callable[[], float] = time.time,
                 on_change: Callable[[int], None] | None = None) -> None:
        self._by_file: dict[Path, list[Rejection]] = {}
        self._clock = clock
        self._on_change = on_change

    def reject(self, path: Path, label: str, problems: list[tuple[str, str]], private: bool = False) -> None:
        """Record that the latest version of `path` was refused, for each (field, reason); `private`:
        the reasons are an operator's (the keys file's), left out of what /healthz shows."""
        at = self._clock()
        self._by_file[path] = [Rejection(path, label, cut(field, 120), cut(reason, MAX_REASON_CHARS), at, private)
                               for field, reason in problems[:MAX_PROBLEMS_PER_FILE]]
        self._changed()

    def clear(self, path: Path) -> None:
        """A later version of `path` was applied."""
        if self._by_file.pop(path, None) is not None:
            self._changed()

    def __len__(self) -> int:
        return len(self._by_file)

    def status(self, full_paths: bool = False) -> dict[str, Any]:
        """`{"status": "ok" | "degraded", "rejected": [{"file", "field", "reason", "at"}]}`; the full
        path of each file, and a private file's reasons, only with `full_paths` (for the admin
        report, never for /healthz)."""
        rejected = []
        for entries in self._by_file.values():
            for entry in entries:
                reason = PRIVATE_REASON if entry.private and not full_paths else entry.reason
                item: dict[str, Any] = {"file": entry.label, "field": entry.field, "reason": reason,
                                        "at": round(entry.at, 3)}
                if full_paths:
                    item["path"] = str(entry.path)
                rejected.append(item)
        return {"status": "degraded" if rejected else "ok", "rejected": rejected}

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(len(self._by_file))
