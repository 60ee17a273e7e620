"""Process facts read from /proc, without third-party dependencies."""

from __future__ import annotations

import os

from servewell.observability.diagnosis import CpuFacts

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (0 when it cannot be read, e.g. it has exited)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (every thread's `children` file); [] when it is gone."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                found.extend(int(p) for p in f.read().split())
        except (OSError, ValueError):
            continue  # the thread or the process ended while we read
    return found


def tree_cpu_seconds(root: int, max_processes: int = 4096) -> float:
    """CPU seconds (user + system) of `root` and its descendants alive now, each with its reaped
    children's (so a worker that was replaced keeps counting); 0 when `root` is gone."""
    total, queue, seen = 0.0, [root], {root}
    while queue and len(seen) <= max_processes:
        pid = queue.pop()
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read().rsplit(b")", 1)[1].split()
            total += sum(int(stat[i]) for i in (11, 12, 13, 14)) / _TICKS
        except (OSError, IndexError, ValueError):
            continue
        for child in child_pids(pid):
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return total


def process_facts(pid: int) -> dict[str, float]:
    """RSS, private (anonymous) memory, file-backed resident memory, CPU seconds and threads of a
    process; {} if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().rsplit(b")", 1)[1].split()
        private = 0
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Anonymous:"):
                    private = int(line.split()[1]) * 1024
                    break
        # RssFile: resident pages backed by files. Weights served as stored (fp32 from an fp32
        # safetensors file) stay memory-mapped, so they count here and not in the private memory.
        file_backed = 0
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssFile:"):
                    file_backed = int(line.split()[1]) * 1024
                    break
    except (OSError, IndexError, ValueError):
        return {}
    # Fields after the command name: state is [0], utime [11], stime [12], num_threads [17], rss [21].
    return {
        "rss_bytes": float(int(stat[21]) * _PAGE),
        "private_bytes": float(private),
        "file_bytes": float(file_backed),
        "cpu_seconds": (int(stat[11]) + int(stat[12])) / _TICKS,
        "threads": float(int(stat[17])),
    }


def cpu_pressure(path: str = "/proc/pressure/cpu") -> float | None:
    """The share of the last 10 s in which some runnable task waited for a CPU (the kernel's
    pressure stall information, `some avg10`); None where the kernel keeps none."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(b"some "):
                    for field in line.split():
                        if field.startswith(b"avg10="):
                            return float(field[6:]) / 100.0
    except (OSError, ValueError):
        return None
    return None


def usable_cpu_count() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_facts() -> CpuFacts:
    """The host's CPU contention now: pressure, the 1-minute load and the usable CPUs."""
    try:
        load1: float | None = os.getloadavg()[0]
    except OSError:
        load1 = None
    return CpuFacts(cpu_pressure(), load1, usable_cpu_count())
