"""Private snapshots of model directories: a copy that an in-place rewrite of the original cannot
touch, unchanged files linked instead of copied again, torn copies retried, nothing left behind,
and only the files the model uses copied."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from servewell.config.model import ModelConfig
from servewell.engine.model_files import model_files, unlisted_files
from servewell.engine.snapshot import SNAPSHOT_NICE, SnapshotError, SnapshotStore, copy_bytes

FILES = ["model.safetensors", "factory.py", "sub/labels.txt"]


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
    snapshot = store.take(source, "m-1", FILES)
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
    first = store.take(source, "m-1", FILES)
    (source / "factory.py").write_text("def build(): return 2\n")
    second = store.take(source, "m-2", FILES)
    inode = os.stat(first.directory / "model.safetensors").st_ino
    assert os.stat(second.directory / "model.safetensors").st_ino == inode
    assert (second.directory / "factory.py").read_text() == "def build(): return 2\n"
    assert (first.directory / "factory.py").read_text() == "def build(): ...\n"
    assert second.reused_bytes >= 100_000
    store.release(first)  # the old version stops: the new one keeps its (linked) files
    assert not first.directory.exists() and (second.directory / "model.safetensors").read_bytes() == b"A" * 100_000
    third = store.take(source, "m-3", FILES)
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
    snapshot = store.take(source, "m", ["model.safetensors"])
    assert (snapshot.directory / "model.safetensors").read_bytes() == weights.read_bytes()  # the settled file
    weights.write_bytes(b"newer" * 1000)  # a new version, being written by a writer that never stops
    rewrites["left"] = 10**6
    with pytest.raises(SnapshotError, match="kept changing"):
        store.take(source, "m", ["model.safetensors"])
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == [snapshot.directory.name]


def test_snapshots_of_servers_that_no_longer_run_are_removed(tmp_path: Path) -> None:
    root = tmp_path / "snapshots"
    (root / "999999999-m-1-1").mkdir(parents=True)  # no such process
    (root / f"{os.getpid()}-m-1-1").mkdir()  # ours
    assert SnapshotStore(root).remove_stale() == 1
    assert [p.name for p in root.iterdir()] == [f"{os.getpid()}-m-1-1"]


def pytorch_config(**fields: object) -> ModelConfig:
    return ModelConfig.model_validate({
        "name": "m", "runtime": "pytorch", "artifact": "model.safetensors", "pytorch": {"factory": "factory:build"},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}], **fields})


def test_only_the_files_a_model_uses_are_copied_never_a_linked_folder_or_a_big_sibling(tmp_path: Path) -> None:
    # A link to a data folder made a 232 KB model's snapshot copy 695 MB.
    source = model_dir(tmp_path)
    (source / "model.yaml").write_text("(the config)")
    outside = tmp_path / "data"
    outside.mkdir()
    (outside / "big.bin").write_bytes(b"D" * 300_000)
    (source / "data").symlink_to(outside)
    (source / "dataset.npy").write_bytes(b"N" * 500_000)  # a big file beside the model, used by nothing
    (source / "helpers").mkdir()
    (source / "helpers" / "__init__.py").write_text("")
    (source / "helpers" / "layers.py").write_text("X = 1\n")  # imported by the factory
    (source / "weights.bin").symlink_to(outside / "big.bin")  # a named symlinked *file* is still copied
    store = SnapshotStore(tmp_path / "snapshots")
    snapshot = store.take(source, "m-1", model_files(pytorch_config(), source))
    copied = sorted(p.relative_to(snapshot.directory).as_posix() for p in snapshot.directory.rglob("*") if p.is_file())
    assert copied == ["factory.py", "helpers/__init__.py", "helpers/layers.py", "model.safetensors", "model.yaml"]
    assert snapshot.copied_bytes < 101_000  # before: 100 KB + 500 KB + the 300 KB folder (+ the linked file)
    listed = pytorch_config(extra_files=["sub/labels.txt", "weights.bin", "data/*.bin"])
    snapshot = store.take(source, "m-2", model_files(listed, source))
    assert (snapshot.directory / "weights.bin").stat().st_size == 300_000
    assert (snapshot.directory / "sub" / "labels.txt").read_text() == "cat\ndog\n"
    assert not (snapshot.directory / "data").exists() and not (snapshot.directory / "dataset.npy").exists()


def test_extra_files_select_by_name_directory_and_glob(tmp_path: Path) -> None:
    source = model_dir(tmp_path)
    (source / "tok" / "deep").mkdir(parents=True)
    for name in ("tok/vocab.json", "tok/deep/merges.txt", "a.json", "sub/b.json", "notes.md"):
        (source / name).write_text(name)
    onnx = {"runtime": "onnx", "artifact": "model.onnx", "pytorch": None}
    config = pytorch_config(**onnx, extra_files=["tok", "**/*.json", "sub/*.txt", "nothing/*.bin"])
    assert model_files(config, source) == ["model.yaml", "model.onnx", "tok/vocab.json", "tok/deep/merges.txt",
                                           "a.json", "sub/b.json", "sub/labels.txt"]
    assert model_files(pytorch_config(**onnx), source) == ["model.yaml", "model.onnx"]  # no .py for onnx


def test_a_python_model_takes_its_python_files_as_a_pytorch_model_does(tmp_path: Path) -> None:
    # Its entry module may import siblings and packages of the directory (relatively).
    source = model_dir(tmp_path)
    (source / "steps.py").write_text("class Model: ...\n")
    (source / "sub" / "helpers.py").write_text("")
    python = {"runtime": "python", "artifact": "steps.py", "pytorch": None, "python": {"entry": "steps:Model"}}
    assert model_files(pytorch_config(**python), source) == ["model.yaml", "steps.py", "factory.py", "sub/helpers.py"]
    assert model_files(pytorch_config(**python, extra_files=["sub/labels.txt"]), source)[-1] == "sub/labels.txt"


def test_a_snapshot_has_a_size_cap(tmp_path: Path) -> None:
    source = model_dir(tmp_path)
    with pytest.raises(SnapshotError, match="snapshot_max_bytes"):
        SnapshotStore(tmp_path / "small", max_bytes=50_000).take(source, "m-2", FILES)
    assert list((tmp_path / "small").iterdir()) == []  # nothing left behind
    with pytest.raises(SnapshotError, match="not a path inside"):
        SnapshotStore(tmp_path / "small").take(source, "m-3", ["../m/factory.py"])


def test_a_failure_naming_a_file_left_out_of_the_snapshot_is_found(tmp_path: Path) -> None:
    source = model_dir(tmp_path)
    snapshot = SnapshotStore(tmp_path / "snapshots").take(source, "m-1", ["model.safetensors"])
    reason = (f"the factory failed: FileNotFoundError: [Errno 2] No such file or directory: "
              f"'{snapshot.directory}/sub/labels.txt'; also {snapshot.directory}/model.safetensors and "
              f"{snapshot.directory}/absent.json")
    # Only the file that is in the repository but not in the snapshot: not a copied one, not a missing one.
    assert unlisted_files(reason, snapshot.directory, source) == ["sub/labels.txt"]


def test_snapshots_are_made_below_normal_cpu_priority(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "snapshots")
    base = os.getpriority(os.PRIO_PROCESS, 0)

    def take_and_read_priority() -> tuple[int, Path]:
        snapshot = store.take(model_dir(tmp_path), "m-1", FILES)
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), snapshot.directory

    nice, directory = store.executor.submit(take_and_read_priority).result(timeout=30)
    assert nice == min(19, base + SNAPSHOT_NICE) and directory.is_dir()
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the caller's thread is untouched
    assert store.executor is store.executor
