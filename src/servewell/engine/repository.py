"""Reads a model repository: one directory per model, each with a `model.yaml`.

A broken model is reported with its file, field and reason and never stops the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import ValidationError

from servewell.config.model import ModelConfig

CONFIG_FILE = "model.yaml"


@dataclass(slots=True, frozen=True)
class ModelSource:
    """One model directory and either its valid config or why it is invalid."""

    name: str
    directory: Path
    config: ModelConfig | None
    error: str | None


def read_model_config(directory: Path) -> ModelConfig:
    """Parse and check `<directory>/model.yaml`; raises `ValueError` naming file, field and reason."""
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{path}: missing (each model directory needs a {CONFIG_FILE})")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of fields, got {type(raw).__name__}")
    raw.setdefault("name", directory.name)
    try:
        config = ModelConfig.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            problems.append(f"field '{where}': {err['msg']}")
        raise ValueError(f"{path}: " + "; ".join(problems)) from None
    if config.name != directory.name:
        raise ValueError(f"{path}: field 'name': '{config.name}' must match the directory name '{directory.name}'")
    artifact = directory / config.artifact
    if not artifact.is_file():
        raise ValueError(f"{path}: field 'artifact': file {artifact} does not exist")
    return config


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
