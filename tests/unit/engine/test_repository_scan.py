"""Scanning a model repository: one bad model.yaml fails only its model, and a model directory
that resolves outside the repository is noticed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from servewell.engine.repository import outside_repository, scan_repository


def test_hostile_model_files_fail_alone_with_a_short_reason(tmp_path: Path) -> None:
    # Lists nested 600 deep made PyYAML raise RecursionError: the scan died and no model loaded.
    for name, text in (("deep", "a: " + "[" * 600 + "]" * 600), ("binary", "a: \xff"), ("ok", "not: [valid")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.yaml").write_bytes(text.encode("latin-1"))
    sources = {s.name: s for s in scan_repository(tmp_path)}
    assert sorted(sources) == ["binary", "deep", "ok"]
    assert all(s.config is None and s.error is not None and len(s.error) < 1000 for s in sources.values())
    assert "deeper than" in (sources["deep"].error or "")


def test_a_model_directory_outside_the_repository_is_warned_about(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    root, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    (root / "inside").mkdir(parents=True)
    elsewhere.mkdir()
    (root / "linked").symlink_to(elsewhere)
    assert outside_repository(root, root / "inside") is None
    assert outside_repository(root, root / "linked") == elsewhere.resolve()
    with caplog.at_level(logging.WARNING, "servewell.engine"):
        scan_repository(root)
    assert [r.getMessage() for r in caplog.records if "outside the repository" in r.getMessage()]
