"""Config file change detection, including a Kubernetes-style ConfigMap symlink swap."""

from __future__ import annotations

import os
from pathlib import Path

from servewell.config.watch import FileChange, FileWatch


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


def test_a_change_applies_only_once_it_stayed_the_same_for_one_poll(tmp_path: Path) -> None:
    # A writer paused mid-file had its valid prefix served: 198 of 558 /predict got 422.
    path = tmp_path / "model.yaml"
    path.write_text("a: 1\n")
    watch = FileWatch()
    watch.track(path)
    with open(path, "w") as f:
        f.write("a: 2\n")  # a prefix of what the writer means
        f.flush()
        assert [(c.path, c.settled) for c in watch.poll()] == [(path, False)]
        f.write("b: 3\n")
    assert [(c.path, c.settled) for c in watch.poll()] == [(path, False)]  # changed again: wait again
    assert [(c.path, c.settled) for c in watch.poll()] == [(path, True)]
    assert watch.poll() == []
    path.write_text("a: 1\n")
    os.utime(path, ns=(5, 5))
    watch.poll()
    path.write_text("a: 2\nb: 3\n")  # back to the applied content before it settled: nothing to apply
    assert watch.poll() == []
    path.write_text("c: 4\n")
    assert [c.settled for c in watch.poll(settle=False)] == [True]  # SIGHUP: at once


def test_files_that_cannot_be_read_are_reported_once_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "model.yaml"
    path.write_text("a: 1\n")
    watch = FileWatch(max_bytes=1024)
    watch.track(path)
    os.unlink(path)
    os.mkfifo(path)  # would block a plain open() until a writer came
    assert [c.settled for c in watch.poll()] == [False]
    (change,) = watch.poll()
    assert change.settled and change.problem is not None and "FIFO" in change.problem
    assert watch.poll() == [] and watch.poll() == []  # once, not at every poll
    os.unlink(path)
    path.write_bytes(b"#" * 5000)
    watch.poll()
    (change,) = watch.poll()
    assert change.problem is not None and "over the limit of 1024" in change.problem
    path.write_text("a: 2\n")
    watch.poll()
    assert watch.poll() == [FileChange(path, True, None)]
