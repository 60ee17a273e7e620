"""Peak resident memory of this process around one piece of work (Linux), without a framework.

The kernel keeps the process's high-water mark (VmHWM in /proc/self/status) and lets the
process reset it by writing "5" to /proc/self/clear_refs. Where that write is refused (some
sandboxes), the probe falls back to `getrusage`'s lifetime maximum: exact when a batch sets a
new maximum, otherwise the larger of the resident sizes before and after (a lower bound).
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Literal

_KIB = 1024


class ProcessPeakMemory:
    """Peak resident set size (RSS) of the calling process between `reset` and `peak_bytes`."""

    measures: Literal["host", "device"] = "host"

    def __init__(self, proc: Path = Path("/proc/self")) -> None:
        self._status = proc / "status"
        self._clear_refs = proc / "clear_refs"
        self._rss_before = 0
        self._maxrss_before = 0
        self.exact = self._reset_high_water_mark()
        """True when the kernel's high-water mark can be reset, so peaks are exact."""

    def reset(self) -> None:
        """Start a new measurement at the current resident size."""
        if self.exact and self._reset_high_water_mark():
            return
        self.exact = False
        self._rss_before = self._status_bytes("VmRSS")
        self._maxrss_before = _lifetime_max_rss()

    def peak_bytes(self) -> int:
        """Highest resident size since the last `reset`, in bytes."""
        if self.exact:
            return self._status_bytes("VmHWM")
        maxrss = _lifetime_max_rss()
        if maxrss > self._maxrss_before:
            return maxrss
        return max(self._rss_before, self._status_bytes("VmRSS"))

    def _reset_high_water_mark(self) -> bool:
        try:
            with self._clear_refs.open("w") as clear_refs:
                clear_refs.write("5")
        except OSError:
            return False
        return self._status_bytes("VmHWM") > 0

    def _status_bytes(self, field: str) -> int:
        try:
            with self._status.open() as status:
                for line in status:
                    if line.startswith(field + ":"):
                        return int(line.split()[1]) * _KIB
        except (OSError, ValueError, IndexError):
            pass
        return 0


def _lifetime_max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _KIB  # KiB on Linux
