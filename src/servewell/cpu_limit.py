"""How many CPUs this process may really use: its affinity mask (a cpuset narrows it) and its
control group's CPU limit (a Kubernetes `resources.limits.cpu`, `docker run --cpus`), whichever is
less.

A container limited to 3 CPUs on a 64-core node sees 64 CPUs in its affinity mask: the limit is a
quota of CPU time per period, enforced by throttling, not a set of cores. Sizing a process count
from the mask there starts 8 ingress processes that the quota then throttles in turn. So the
count is min(affinity, ceil(quota / period)) over the process's control group and every group above
it (a limit on a parent applies to its children), as Go's GOMAXPROCS and the JVM's
ActiveProcessorCount do in containers.

cgroup v2 (`/proc/self/cgroup` line `0::PATH`, limit in `PATH/cpu.max`: `max PERIOD` or `QUOTA
PERIOD`) and v1 (`N:...cpu...:PATH`, limit in `cpu/PATH/cpu.cfs_quota_us` and `cpu.cfs_period_us`,
-1 for none) are read. Anything missing, unreadable or malformed means no limit from that file:
the affinity mask alone then decides, as before. Every read is bounded.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
#: Bytes read of any of these files: a limit is two numbers; /proc/self/cgroup a few lines.
_READ_LIMIT = 4096
#: Group directories walked up from the process's own, at most.
_MAX_DEPTH = 64


def _read(path: Path) -> str | None:
    try:
        with path.open("rb") as f:
            return f.read(_READ_LIMIT).decode("ascii", "replace")
    except OSError:
        return None


def _positive_int(text: str) -> int | None:
    text = text.strip()
    if not text.isdigit() or len(text) > 18:
        return None
    value = int(text)
    return value if value > 0 else None


def _v2_limit(directory: Path) -> float | None:
    """`cpu.max` of one cgroup v2 group: quota / period in CPUs, None for `max` or unreadable."""
    text = _read(directory / "cpu.max")
    if text is None:
        return None
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    quota, period = _positive_int(parts[0]), _positive_int(parts[1])
    return quota / period if quota and period else None


def _v1_limit(directory: Path) -> float | None:
    """`cpu.cfs_quota_us` / `cpu.cfs_period_us` of one cgroup v1 group, None for -1 or unreadable."""
    quota_text, period_text = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    if quota_text is None or period_text is None:
        return None
    quota, period = _positive_int(quota_text), _positive_int(period_text)
    return quota / period if quota and period else None


def _groups(mount: Path, group: str) -> list[Path]:
    """The group's directory under `mount` and each parent's up to the mount, deepest first."""
    parts = [p for p in group.split("/") if p and p not in (".", "..")][:_MAX_DEPTH]
    return [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def cpu_quota(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> float | None:
    """The CPUs this process's control groups allow (the smallest quota / period on its path), None
    when no limit is set or none can be read."""
    text = _read(proc_cgroup)
    if text is None:
        return None
    limits: list[float] = []
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, group = rest.partition(":")
        if not hierarchy.isdigit() or not group.startswith("/"):
            continue
        if hierarchy == "0" and controllers == "":  # cgroup v2, the unified hierarchy
            unified = cgroup_root / "unified"  # a hybrid host mounts v2 beside the v1 controllers
            mount = unified if (unified / "cgroup.controllers").is_file() else cgroup_root
            limits += [limit for d in _groups(mount, group) if (limit := _v2_limit(d)) is not None]
        elif "cpu" in controllers.split(","):  # cgroup v1, the cpu controller's hierarchy
            for name in (controllers, "cpu", "cpu,cpuacct"):
                mount = cgroup_root / name
                if mount.is_dir():
                    limits += [limit for d in _groups(mount, group) if (limit := _v1_limit(d)) is not None]
                    break
    return min(limits) if limits else None


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (a container's cpuset narrows it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_cpus(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> int:
    """The machine's CPUs (`os.cpu_count()`, whatever the affinity mask), at most the control
    groups' CPU limit rounded up: how many cores this container's processes may keep busy together."""
    return _within_limit(os.cpu_count() or 1, cgroup_root, proc_cgroup)


def usable_cpus(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> int:
    """CPUs this process may use: its affinity mask, at most its control groups' CPU limit rounded up,
    at least 1."""
    return _within_limit(affinity_cpus(), cgroup_root, proc_cgroup)


def _within_limit(cpus: int, cgroup_root: Path, proc_cgroup: Path) -> int:
    """`cpus`, at most the control groups' CPU limit rounded up (half a CPU is still one), at least 1."""
    quota = cpu_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota - 1e-9))
    return max(1, cpus)
