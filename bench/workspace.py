"""The benchmark's served model repository and request bodies, made from the cached builds.

Imports no framework: the heavy builds run in `bench.models` as a child process.
"""

from __future__ import annotations

import base64
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import yaml

from servewell.config.model import ModelConfig

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results"
WORK = RESULTS / "work"  # bench/results/ is git-ignored


@dataclass(slots=True, frozen=True)
class ServedModel:
    """One model of the served repository: which build, and what to change in its model.yaml."""

    name: str
    build: str
    overrides: dict[str, Any]


@dataclass(slots=True, frozen=True)
class Workspace:
    """Where everything of one benchmark run lives."""

    repository: Path
    bodies: dict[str, list[Path]]  # model name -> body files
    images: list[Path]


def link_build(build_dir: Path, model_dir: Path) -> dict[str, Any]:
    """Symlink the build's files (not its model.yaml) into `model_dir`; return the build's config."""
    if model_dir.exists():
        shutil.rmtree(model_dir)
    model_dir.mkdir(parents=True)
    for item in build_dir.iterdir():
        if item.name != "model.yaml":
            (model_dir / item.name).symlink_to(item.resolve())
    return yaml.safe_load((build_dir / "model.yaml").read_text(encoding="utf-8"))


def _deep_merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def write_model_yaml(model_dir: Path, config: dict[str, Any]) -> None:
    """Validate `config` as servewell would read it, then write `model_dir/model.yaml`."""
    ModelConfig.model_validate(config)
    (model_dir / "model.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")


def write_repository(models: list[ServedModel]) -> Path:
    """(Re)write the served repository under the work directory; each model.yaml is validated."""
    repository = WORK / "repo"
    if repository.exists():
        shutil.rmtree(repository)
    for model in models:
        model_dir = repository / model.name
        config = link_build(WORK / "build" / model.build, model_dir)
        write_model_yaml(model_dir, _deep_merge(config, {"name": model.name, **model.overrides}))
    return repository


def image_bodies(model: str, images: list[Path]) -> list[Path]:
    """`/predict` bodies, one per JPEG: {"image_base64", "model"}."""
    out = WORK / "bodies"
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for image in images:
        path = out / f"{model}_{image.stem}.json"
        doc = {"image_base64": base64.b64encode(image.read_bytes()).decode("ascii"), "model": model}
        path.write_bytes(orjson.dumps(doc))
        paths.append(path)
    return paths


def mlp_bodies() -> list[Path]:
    """Open Inference Protocol JSON bodies with one [1, 512] FP32 row each (6 decimals, as clients send)."""
    out = WORK / "bodies"
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for source in sorted(WORK.glob("mlp_input_*.npy")):
        row = np.load(source)
        doc = {"inputs": [{"name": "input", "shape": [1, int(row.shape[0])], "datatype": "FP32",
                           "data": [round(float(v), 6) for v in row]}]}
        path = out / f"mlp_{source.stem.rsplit('_', 1)[1]}.json"
        path.write_bytes(orjson.dumps(doc))
        paths.append(path)
    return paths


def mlp_binary_bodies() -> tuple[list[Path], int]:
    """The same rows as `mlp_bodies` in the binary tensor extension (raw FP32 after a JSON header,
    outputs asked for in binary, as tritonclient sends them), and the JSON header's length in bytes
    (the same for every body: the `Inference-Header-Content-Length` to send)."""
    out = WORK / "bodies"
    out.mkdir(parents=True, exist_ok=True)
    paths, lengths = [], set()
    for source in sorted(WORK.glob("mlp_input_*.npy")):
        path = out / f"mlp_{source.stem.rsplit('_', 1)[1]}.bin"
        lengths.add(write_binary_body(path, "input", np.load(source)))
        paths.append(path)
    (length,) = lengths
    return paths, length


def write_binary_body(path: Path, input_name: str, row: np.ndarray) -> int:
    """An OIP binary-extension body at `path`: one FP32 row of `input_name` as raw little-endian
    bytes after its JSON header, outputs asked for in binary; the header's length."""
    row = row.astype("<f4")
    header = orjson.dumps({"inputs": [{"name": input_name, "shape": [1, int(row.shape[0])], "datatype": "FP32",
                                       "parameters": {"binary_data_size": row.nbytes}}],
                           "parameters": {"binary_data_output": True}})
    path.write_bytes(header + row.tobytes())
    return len(header)


def prepare(models: list[ServedModel]) -> Workspace:
    """Repository and bodies for `models` (builds must exist under WORK/build)."""
    repository = write_repository(models)
    images = sorted((WORK / "images").glob("*.jpg"))
    bodies: dict[str, list[Path]] = {}
    for model in models:
        bodies[model.name] = mlp_bodies() if model.build == "mlp" else image_bodies(model.name, images)
    return Workspace(repository, bodies, images)
