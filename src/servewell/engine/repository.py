"""Reads a model repository: one directory per model, each with a `model.yaml`.

A broken model is reported with its file, field and reason and never stops the others: any
error reading one directory (an unreadable file, a YAML bomb, a bug) lists that model as
invalid with its reason, and the scan goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from servewell.config.bounded_yaml import cut
from servewell.config.model import ModelConfig
from servewell.config.model_file import read_model_yaml

log = logging.getLogger("servewell.engine")

#: What happens to a model directory that resolves outside the repository (`models_outside_repository`).
OutsidePolicy = Literal["warn", "refuse"]


@dataclass(slots=True, frozen=True)
class ModelSource:
    """One model directory and either its valid config or why it is invalid."""

    name: str
    directory: Path
    config: ModelConfig | None
    error: str | None


def read_model_config(directory: Path, version_of: str | None = None) -> ModelConfig:
    """Parse and check `<directory>/model.yaml`; raises `ValueError` naming file, field and reason
    (whatever went wrong: an unexpected error is reported as a `ValueError` too). `version_of`: a
    version directory (`<model>/versions/<v>/`) of that model."""
    try:
        return read_model_yaml(directory, version_of=version_of)
    except ValueError:
        raise
    except Exception as exc:  # one bad file must never stop the scan or the watcher
        raise ValueError(cut(f"{directory / 'model.yaml'}: cannot be read: {type(exc).__name__}: {exc}")) from None


def outside_repository(root: Path, directory: Path) -> Path | None:
    """Where `directory` really is when it resolves outside `root` (a symlink out), else None."""
    try:
        real = directory.resolve()
        return None if real.is_relative_to(root.resolve()) else real
    except (OSError, RuntimeError):
        return None


def outside_refusal(root: Path, directory: Path, policy: OutsidePolicy) -> str | None:
    """Why the model directory `directory` may not load under `policy` (`models_outside_repository`):
    with "refuse", one that resolves outside `root`; None when it may load (and "warn" only warns,
    at the scan and on reload)."""
    if policy != "refuse":
        return None
    real = outside_repository(root, directory)
    if real is None:
        return None
    return (f"the model directory resolves to {real}, outside the model repository {root} "
            "(models_outside_repository: refuse)")


def scan_repository(root: Path, skip: Collection[str] = ()) -> list[ModelSource]:
    """Every model directory under `root` (but those named in `skip`), sorted by name, valid or
    not. A model directory that resolves outside `root` is logged as a warning (and refused when it loads, with
    `models_outside_repository: refuse`): whoever can write the repository can point a model
    anywhere the server may read."""
    if not root.is_dir():
        raise FileNotFoundError(f"model repository {root} is not a directory")
    sources: list[ModelSource] = []
    for directory in sorted(p for p in root.iterdir()
                            if p.name not in skip and p.is_dir() and not p.name.startswith((".", "_"))):
        real = outside_repository(root, directory)
        if real is not None:
            log.warning("model directory %s resolves to %s, outside the repository %s", directory.name, real, root,
                        extra={"model": directory.name})
        try:
            sources.append(ModelSource(directory.name, directory, read_model_config(directory), None))
        except ValueError as exc:
            sources.append(ModelSource(directory.name, directory, None, str(exc)))
    return sources
