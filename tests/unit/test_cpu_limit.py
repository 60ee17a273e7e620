"""The CPUs a process may use inside a container: the affinity mask, at most the control group's CPU
limit (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`) on its path, read from a
fake cgroup tree laid out as the kernel lays out the real one."""

from __future__ import annotations

from pathlib import Path

import pytest

from servewell.cpu_limit import affinity_cpus, cpu_quota, usable_cpus
from servewell.process_tree import DEFAULT_MAX_INGRESS_PROCESSES, ingress_process_count


def v2_tree(tmp_path: Path, group: str, limits: dict[str, str]) -> tuple[Path, Path]:
    """A unified hierarchy with `cpu.max` written at each of `limits`' groups ("" is the mount)."""
    root = tmp_path / "cgroup"
    (root / group.strip("/")).mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for where, text in limits.items():
        (root / where).mkdir(parents=True, exist_ok=True)
        (root / where / "cpu.max").write_text(text)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(f"0::{group}\n")
    return root, proc


def test_cgroup_v2_limit_is_quota_over_period(tmp_path: Path):
    # Kubernetes writes `limits.cpu: "3"` as "300000 100000" (a 100 ms period).
    root, proc = v2_tree(tmp_path, "/kubepods/pod1/ctr", {"kubepods/pod1/ctr": "300000 100000\n"})
    assert cpu_quota(root, proc) == 3.0


def test_a_limit_on_a_parent_group_applies_and_the_smallest_wins(tmp_path: Path):
    root, proc = v2_tree(tmp_path, "/kubepods/pod1/ctr",
                         {"kubepods/pod1/ctr": "max 100000\n", "kubepods/pod1": "150000 100000\n",
                          "kubepods": "800000 100000\n"})
    assert cpu_quota(root, proc) == 1.5


def test_a_namespaced_container_sees_its_own_limit_at_the_mount(tmp_path: Path):
    root, proc = v2_tree(tmp_path, "/", {"": "250000 100000\n"})
    assert cpu_quota(root, proc) == 2.5


@pytest.mark.parametrize("text", ["max 100000\n", "", "garbage\n", "-5 100000\n", "100000 0\n", "1e9 100000\n",
                                  "9" * 5000])
def test_no_limit_or_a_malformed_one_is_no_limit(tmp_path: Path, text: str):
    root, proc = v2_tree(tmp_path, "/ctr", {"ctr": text})
    assert cpu_quota(root, proc) is None


def test_cgroup_v1_cfs_quota(tmp_path: Path):
    root = tmp_path / "cgroup"
    group = root / "cpu,cpuacct" / "docker" / "abc"
    group.mkdir(parents=True)
    (group / "cpu.cfs_quota_us").write_text("250000\n")
    (group / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("12:pids:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n0::/docker/abc\n")
    assert cpu_quota(root, proc) == 2.5
    (group / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no limit"
    assert cpu_quota(root, proc) is None


def test_an_unreadable_or_missing_cgroup_file_means_no_limit(tmp_path: Path):
    assert cpu_quota(tmp_path / "nothing", tmp_path / "no-proc-file") is None
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("not a cgroup line\n0::relative/path\n")
    assert cpu_quota(tmp_path, proc) is None
    proc.write_text("0::/../../etc\n")  # no way out of the mount
    assert cpu_quota(tmp_path, proc) is None


def test_usable_cpus_is_the_affinity_mask_at_most_the_limit_rounded_up(tmp_path: Path):
    root, proc = v2_tree(tmp_path, "/ctr", {"ctr": "50000 100000\n"})  # half a CPU: still one process
    assert usable_cpus(root, proc) == 1
    root, proc = v2_tree(tmp_path, "/big", {"big": "100000000 100000\n"})  # 1,000 CPUs: the mask wins
    assert usable_cpus(root, proc) == affinity_cpus()
    root, proc = v2_tree(tmp_path, "/none", {"none": "max 100000\n"})
    assert usable_cpus(root, proc) == affinity_cpus()


def test_the_default_ingress_count_follows_a_containers_limit(tmp_path: Path):
    # The shipped Deployment limits the pod to 3 CPUs: on any larger node, 3 ingress processes.
    root, proc = v2_tree(tmp_path, "/kubepods/pod/ctr", {"kubepods/pod/ctr": "300000 100000\n"})
    cpus = usable_cpus(root, proc)
    assert cpus == min(3, affinity_cpus())
    assert ingress_process_count(None, cpus) == min(cpus, DEFAULT_MAX_INGRESS_PROCESSES)
