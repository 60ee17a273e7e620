"""Config file change detection, including a Kubernetes-style ConfigMap symlink swap."""

from __future__ import annotations

import os
from pathlib import Path

from servewell.config.watch import FileWatch


def test_edits_count_touches_do_not(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("log_level: info\n")
    watch = FileWatch()
    watch.track(path)
    assert watch.changed() == []
    os.utime(path, ns=(1, 1))  # touched: new mtime, same content
    assert watch.changed() == []
    path.write_text("log_level: debug\n")
    assert watch.changed() == [path]
    assert watch.changed() == []  # the new content is the baseline


def test_replaced_by_rename_and_deleted(tmp_path: Path) -> None:
    path = tmp_path / "model.yaml"
    path.write_text("a: 1\n")
    watch = FileWatch()
    watch.track(path)
    new = tmp_path / "model.yaml.tmp"
    new.write_text("a: 2\n")
    new.replace(path)
    assert watch.changed() == [path]
    path.unlink()
    assert watch.changed() == [path]


def test_configmap_symlink_swap(tmp_path: Path) -> None:
    # kubelet's layout: config.yaml -> ..data/config.yaml, ..data -> ..<timestamp>/
    first = tmp_path / "..2026_12_03_10_00_00.1"
    first.mkdir()
    (first / "config.yaml").write_text("log_level: info\n")
    (tmp_path / "..data").symlink_to(first.name)
    (tmp_path / "config.yaml").symlink_to("..data/config.yaml")
    watch = FileWatch()
    watch.track(tmp_path / "config.yaml")
    second = tmp_path / "..2026_12_03_10_05_00.2"
    second.mkdir()
    (second / "config.yaml").write_text("log_level: debug\n")
    (tmp_path / "..data_tmp").symlink_to(second.name)
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")  # the atomic swap kubelet does
    assert watch.changed() == [tmp_path / "config.yaml"]
