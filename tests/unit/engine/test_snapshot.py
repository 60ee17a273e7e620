"""Private snapshots of model directories: a copy that an in-place rewrite of the original cannot
touch, unchanged files linked instead of copied again, torn copies retried, nothing left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from servewell.engine.snapshot import SnapshotError, SnapshotStore, copy_bytes


def model_dir(root: Path) -> Path:
    directory = root / "m"
    (directory / "sub").mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"A" * 100_000)
    (directory / "factory.py").write_text("def build(): ...\n")
    (directory / "sub" / "labels.txt").write_text("cat\ndog\n")
    (directory / "__pycache__").mkdir()
    (directory / "__pycache__" / "factory.cpython-311.pyc").write_bytes(b"compiled")
    return directory


def test_a_snapshot_is_a_private_read_only_copy_that_in_place_rewrites_do_not_reach(tmp_path: Path) -> None:
    source = model_dir(tmp_path)
    store = SnapshotStore(tmp_path / "snapshots")
    snapshot = store.take(source, "m-1")
    copy = snapshot.directory / "model.safetensors"
    assert copy.read_bytes() == b"A" * 100_000 and (snapshot.directory / "sub" / "labels.txt").is_file()
    assert not (snapshot.directory / "__pycache__").exists()
    assert os.stat(copy).st_ino != os.stat(source / "model.safetensors").st_ino  # not a hard link
    assert not os.access(copy, os.W_OK) or os.geteuid() == 0
    assert oct(os.stat(copy).st_mode & 0o777) == oct(0o444)
    with open(source / "model.safetensors", "r+b") as f:  # what `cp new model.safetensors` does
        f.truncate(0)
        f.write(b"B" * 10)
    assert copy.read_bytes() == b"A" * 100_000
    assert snapshot.files == 3 and snapshot.copied_bytes > 100_000 and snapshot.reused_bytes == 0


def test_an_unchanged_file_is_linked_from_the_previous_snapshot_and_a_changed_one_copied(tmp_path: Path) -> None:
    source = model_dir(tmp_path)
    store = SnapshotStore(tmp_path / "snapshots")
    first = store.take(source, "m-1")
    (source / "factory.py").write_text("def build(): return 2\n")
    second = store.take(source, "m-2")
    inode = os.stat(first.directory / "model.safetensors").st_ino
    assert os.stat(second.directory / "model.safetensors").st_ino == inode
    assert (second.directory / "factory.py").read_text() == "def build(): return 2\n"
    assert (first.directory / "factory.py").read_text() == "def build(): ...\n"
    assert second.reused_bytes >= 100_000
    store.release(first)  # the old version stops: the new one keeps its (linked) files
    assert not first.directory.exists() and (second.directory / "model.safetensors").read_bytes() == b"A" * 100_000
    third = store.take(source, "m-3")
    assert third.reused_bytes >= 100_000  # linked from the second, which still exists
    store.release(second)
    store.release(third)
    assert list((tmp_path / "snapshots").iterdir()) == []


def test_a_file_rewritten_during_its_copy_is_copied_again_and_one_that_never_settles_fails_cleanly(
        tmp_path: Path) -> None:
    source = tmp_path / "m"
    source.mkdir()
    weights = source / "model.safetensors"
    weights.write_bytes(b"old" * 1000)
    rewrites = {"left": 1}

    def copy_racing_a_writer(src: Path, dst: Path) -> None:
        copy_bytes(src, dst)
        if rewrites["left"]:  # someone rewrites the file in place while (just after) we copy it
            rewrites["left"] -= 1
            with open(src, "r+b") as f:
                f.write(b"new")

    store = SnapshotStore(tmp_path / "snapshots", copy=copy_racing_a_writer)
    snapshot = store.take(source, "m")
    assert (snapshot.directory / "model.safetensors").read_bytes() == weights.read_bytes()  # the settled file
    weights.write_bytes(b"newer" * 1000)  # a new version, being written by a writer that never stops
    rewrites["left"] = 10**6
    with pytest.raises(SnapshotError, match="kept changing"):
        store.take(source, "m")
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == [snapshot.directory.name]


def test_snapshots_of_servers_that_no_longer_run_are_removed(tmp_path: Path) -> None:
    root = tmp_path / "snapshots"
    (root / "999999999-m-1-1").mkdir(parents=True)  # no such process
    (root / f"{os.getpid()}-m-1-1").mkdir()  # ours
    assert SnapshotStore(root).remove_stale() == 1
    assert [p.name for p in root.iterdir()] == [f"{os.getpid()}-m-1-1"]


def test_a_symlinked_directory_inside_is_not_copied_and_a_snapshot_has_a_size_cap(tmp_path: Path) -> None:
    # A link to a data folder made a 232 KB model's snapshot copy 695 MB.
    source = model_dir(tmp_path)
    outside = tmp_path / "data"
    outside.mkdir()
    (outside / "big.bin").write_bytes(b"D" * 300_000)
    (source / "data").symlink_to(outside)
    (source / "weights.bin").symlink_to(outside / "big.bin")  # a symlinked *file* is still copied
    snapshot = SnapshotStore(tmp_path / "snapshots").take(source, "m-1")
    assert not (snapshot.directory / "data").exists()
    assert (snapshot.directory / "weights.bin").stat().st_size == 300_000
    with pytest.raises(SnapshotError, match="snapshot_max_bytes"):
        SnapshotStore(tmp_path / "small", max_bytes=200_000).take(source, "m-2")
    assert list((tmp_path / "small").iterdir()) == []  # nothing left behind
