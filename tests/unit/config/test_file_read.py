"""Only regular files of bounded size are read as configuration."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from servewell.config.file_read import ConfigReadError, decode_utf8, read_config_bytes


def test_regular_files_are_read_others_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "model.yaml"
    path.write_bytes(b"a: 1\n")
    assert read_config_bytes(path) == b"a: 1\n"
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # opening it for reading used to wait for a writer: 24.5 s of frozen server
    started = time.perf_counter()
    with pytest.raises(ConfigReadError, match="FIFO"):
        read_config_bytes(fifo)
    assert time.perf_counter() - started < 0.5
    with pytest.raises(ConfigReadError, match="directory"):
        read_config_bytes(tmp_path)
    with pytest.raises(ConfigReadError, match="cannot read"):
        read_config_bytes(tmp_path / "missing.yaml")


def test_a_file_over_the_limit_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_bytes(b"#" * 5000)
    with pytest.raises(ConfigReadError, match="over the limit of 4096"):
        read_config_bytes(path, 4096)
    assert len(read_config_bytes(path, 5000)) == 5000


def test_non_utf8_is_named_by_offset() -> None:
    with pytest.raises(ConfigReadError, match=r"0xff at offset 3"):
        decode_utf8(b"key\xffrest")
