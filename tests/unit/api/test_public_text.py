"""Unauthenticated answers name no absolute file path."""

from __future__ import annotations

from pathlib import Path

from servewell.api.public_text import without_paths


def test_paths_under_the_repository_become_relative_and_others_lose_their_prefix():
    text = ("runtime onnx failed to load /srv/models/digits/1/model.onnx: bad graph; snapshot "
            "'/home/op/.cache/servewell/snapshots/ab12/model.onnx' unreadable")
    public = without_paths(text, [Path("/srv/models"), None])
    assert public is not None
    assert "digits/1/model.onnx: bad graph" in public and "/srv" not in public
    assert "'.../ab12/model.onnx'" in public and "/home" not in public


def test_text_without_paths_is_unchanged():
    for text in ("worker exited with code 1", "ratio 1/2 of a/b", None, ""):
        assert without_paths(text, [Path("/srv/models")]) == text
