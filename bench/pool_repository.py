"""The model repository of `bench.model_pool`: many ONNX MLPs of mixed sizes, built with numpy + onnx.helper.

Each model is `x [batch, 64] -> Gemm -> Relu -> Gemm -> y [batch, 16]` with a hidden width chosen
so its weights take one of the size classes (2 to 40 MiB); weights are seeded random numbers,
different for every model (each model has its own file and its own bytes, as customers' fine-tunes
would). Building writes about 2 GiB once; the artifacts are cached under the work directory by a
stamp of the layout, and only the model.yaml files are rewritten on every run (cheap), so pinning
and settings can change without rebuilding. No framework is imported (no torch): it runs in the
benchmark's own process.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bench.workspace import write_model_yaml
from servewell.config.model import ModelConfig
from servewell.engine.memory_budget import estimate_model_memory

#: Bump when the artifacts built here change, so cached ones are rebuilt.
BUILD_VERSION = "1"
IN_DIM, OUT_DIM = 64, 16
MiB = 1 << 20
#: (weight MiB, number of models): many small models, few large ones; 200 in all, ~1.9 GiB of weights.
SIZE_CLASSES: tuple[tuple[int, int], ...] = ((2, 70), (5, 50), (10, 40), (20, 25), (40, 15))
#: The model the pinned-latency probe sends to (pinned; gets no Zipf traffic), and a pinned model
#: that is the Zipf distribution's most popular one (the realistic reason to pin a model).
PROBE_MODEL, HOT_PINNED_MODEL = "pinned-probe", "pinned-hot"
SEED = 20261204


@dataclass(slots=True, frozen=True)
class PoolModel:
    """One model of the pool repository."""

    name: str
    weight_mib: int
    pinned: bool


@dataclass(slots=True, frozen=True)
class PoolRepository:
    """The written repository and what the server will estimate for it."""

    path: Path
    models: list[PoolModel]
    weight_bytes: int  # all artifacts' weights
    estimated_bytes: int  # the server's own estimate (servewell.engine.memory_budget), all models
    estimates: dict[str, int]  # the same per model


def layout(count: int, size_classes: tuple[tuple[int, int], ...] = SIZE_CLASSES, seed: int = SEED) -> list[PoolModel]:
    """`count` models: the two pinned ones first, then `m000`...; sizes drawn in the classes' proportions
    and shuffled (seeded), so popularity and size are unrelated."""
    if count < 3:
        raise ValueError("the pool needs at least 3 models (two pinned, one to evict)")
    weights = [c for _, c in size_classes]
    sizes: list[int] = []
    for mib, n in size_classes:
        sizes += [mib] * round(n * count / sum(weights))
    rng = random.Random(seed)
    while len(sizes) < count:
        sizes.append(rng.choices([m for m, _ in size_classes], weights)[0])
    sizes = sizes[:count]
    rng.shuffle(sizes)
    names = [PROBE_MODEL, HOT_PINNED_MODEL] + [f"m{i:03d}" for i in range(count - 2)]
    pinned = (PROBE_MODEL, HOT_PINNED_MODEL)
    return [PoolModel(name, mib, name in pinned) for name, mib in zip(names, sizes, strict=True)]


def hidden_width(weight_mib: int) -> int:
    """Hidden units that make the MLP's FP32 weights about `weight_mib` MiB."""
    per_unit = 4 * (IN_DIM + 1 + OUT_DIM)  # a column of W1, a bias, a row of W2
    return max(1, (weight_mib * MiB - 4 * OUT_DIM) // per_unit)


def build_artifact(path: Path, weight_mib: int, seed: int) -> None:
    """Write one MLP (seeded weights) to `path` as ONNX."""
    hidden = hidden_width(weight_mib)
    rng = np.random.default_rng(seed)
    scale = np.float32(0.05)
    initializers = [
        numpy_helper.from_array((rng.random((IN_DIM, hidden), dtype=np.float32) - 0.5) * scale, "w1"),
        numpy_helper.from_array(np.zeros(hidden, dtype=np.float32), "b1"),
        numpy_helper.from_array((rng.random((hidden, OUT_DIM), dtype=np.float32) - 0.5) * scale, "w2"),
        numpy_helper.from_array(np.zeros(OUT_DIM, dtype=np.float32), "b2"),
    ]
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("Gemm", ["r", "w2", "b2"], ["y"])],
        "pool_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", IN_DIM])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", OUT_DIM])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    tmp = path.with_suffix(".tmp")
    onnx.save(model, str(tmp))
    tmp.replace(path)  # a half-written artifact never looks built


def model_yaml(model: PoolModel, max_batch_size: int) -> dict[str, object]:
    """The model.yaml of one pool model: one single-threaded instance, a small batch; `pinned` only
    where the server knows the field (so the benchmark's plumbing runs on a server without the pool)."""
    config: dict[str, object] = {
        "name": model.name, "runtime": "onnx", "artifact": "model.onnx",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [IN_DIM]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [OUT_DIM]}],
        "max_batch_size": max_batch_size, "instances": 1, "threads": 1,
    }
    if model.pinned and "pinned" in ModelConfig.model_fields:
        config["pinned"] = True
    return config


def build_repository(root: Path, count: int, max_batch_size: int = 4) -> PoolRepository:
    """Write (or reuse) the pool repository `root/repo` of `count` models; artifacts are cached by a stamp."""
    models = layout(count)
    repo = root / "repo"
    stamp_path = root / "BUILD"
    stamp = hashlib.sha256(json.dumps([BUILD_VERSION, SEED, [(m.name, m.weight_mib) for m in models]])
                           .encode()).hexdigest()
    fresh = stamp_path.is_file() and stamp_path.read_text().strip() == stamp
    repo.mkdir(parents=True, exist_ok=True)
    wanted = {m.name for m in models}
    for stale in repo.iterdir():  # a model of an earlier, larger layout must not be served
        if stale.name not in wanted:
            for item in stale.iterdir():
                item.unlink()
            stale.rmdir()
    for index, model in enumerate(models):
        model_dir = repo / model.name
        model_dir.mkdir(exist_ok=True)
        if not fresh or not (model_dir / "model.onnx").is_file():
            build_artifact(model_dir / "model.onnx", model.weight_mib, SEED + index)
        write_model_yaml(model_dir, model_yaml(model, max_batch_size))
    stamp_path.write_text(stamp + "\n")
    weight_bytes = sum((repo / m.name / "model.onnx").stat().st_size for m in models)
    estimates = {}
    for model in models:
        config = ModelConfig.model_validate(model_yaml(model, max_batch_size))
        estimates[model.name] = estimate_model_memory(config, repo / model.name).total_bytes
    return PoolRepository(repo, models, weight_bytes, sum(estimates.values()), estimates)


def infer_body(seed: int = SEED) -> bytes:
    """One OIP v2 JSON request body: a single seeded row of 64 FP32 values (every pool model takes it)."""
    row = np.random.default_rng(seed).standard_normal(IN_DIM).astype(np.float32)
    data = [round(float(v), 6) for v in row]
    doc = {"inputs": [{"name": "x", "shape": [1, IN_DIM], "datatype": "FP32", "data": data}]}
    return json.dumps(doc).encode()
