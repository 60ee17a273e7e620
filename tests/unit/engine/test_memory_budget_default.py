"""The default memory budget: the host's available memory, or what a container's cgroup limit leaves."""

from __future__ import annotations

from pathlib import Path

from servewell.engine.memory_budget import machine_memory_budget

GiB = 1 << 30


def meminfo(tmp_path: Path, available_kib: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kib} kB\n")
    return path


def test_without_a_cgroup_limit_the_hosts_available_memory_counts(tmp_path: Path) -> None:
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("max\n")
    assert machine_memory_budget(0.5, meminfo(tmp_path, 16 * 1024 * 1024), cgroup) == 8 * GiB


def test_a_cgroup_v2_limit_bounds_the_budget(tmp_path: Path) -> None:
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(f"{2 * GiB}\n")
    (cgroup / "memory.current").write_text(f"{GiB // 2}\n")
    # The host has 16 GiB free, the container may use 1.5 GiB more.
    assert machine_memory_budget(0.5, meminfo(tmp_path, 16 * 1024 * 1024), cgroup) == int(1.5 * GiB * 0.5)


def test_a_cgroup_v1_limit_bounds_the_budget(tmp_path: Path) -> None:
    cgroup = tmp_path / "cgroup"
    (cgroup / "memory").mkdir(parents=True)
    (cgroup / "memory" / "memory.limit_in_bytes").write_text(f"{GiB}\n")
    (cgroup / "memory" / "memory.usage_in_bytes").write_text("0\n")
    assert machine_memory_budget(1.0, meminfo(tmp_path, 16 * 1024 * 1024), cgroup) == GiB
