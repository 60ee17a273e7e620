"""Reads a model repository: one directory per model, each with a `model.yaml`.

A broken model is reported with its file, field and reason and never stops the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from servewell.config.model import ModelConfig
from servewell.config.model_file import read_model_yaml


@dataclass(slots=True, frozen=True)
class ModelSource:
    """One model directory and either its valid config or why it is invalid."""

    name: str
    directory: Path
    config: ModelConfig | None
    error: str | None


def read_model_config(directory: Path) -> ModelConfig:
    """Parse and check `<directory>/model.yaml`; raises `ValueError` naming file, field and reason."""
    return read_model_yaml(directory)


def scan_repository(root: Path) -> list[ModelSource]:
    """Every model directory under `root`, sorted by name, valid or not."""
    if not root.is_dir():
        raise FileNotFoundError(f"model repository {root} is not a directory")
    sources: list[ModelSource] = []
    for directory in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        try:
            sources.append(ModelSource(directory.name, directory, read_model_config(directory), None))
        except ValueError as exc:
            sources.append(ModelSource(directory.name, directory, None, str(exc)))
    return sources
