"""Dummy inputs and the warm-up run that proves a loaded model answers in the declared shapes."""

from __future__ import annotations

import time

import numpy as np

from servewell.config.model import ModelConfig, TensorSpec
from servewell.runtimes.base import ModelLoadError, ModelRuntime


def dummy_batch(config: ModelConfig, batch_size: int) -> dict[str, np.ndarray]:
    """Inputs for `batch_size` items in the declared dtypes, keyed by input name.

    Variable dimensions (-1) become 1. Without a batch dimension (`max_batch_size: 0`)
    `batch_size` is ignored. Values are zeros (empty bytes for BYTES): zero is a valid
    value for every dtype, including integer inputs that index a table (token or class ids).
    """
    batch_dims = [batch_size] if config.max_batch_size > 0 else []
    batch: dict[str, np.ndarray] = {}
    for spec in config.inputs:
        shape = batch_dims + [1 if dim == -1 else dim for dim in spec.shape]
        if spec.numpy_dtype == "object":
            batch[spec.name] = np.full(shape, b"", dtype=object)
        else:
            batch[spec.name] = np.zeros(shape, dtype=spec.numpy_dtype)
    return batch


def warm_up(runtime: ModelRuntime, config: ModelConfig) -> float:
    """Run dummy batches of 1 and of `max_batch_size` items; return the seconds it took.

    Raises `ModelLoadError` when the model fails on them or when an output is missing or
    does not have the declared dtype and shape (the batch size, then every fixed dimension).
    """
    started = time.perf_counter()
    sizes = [1]
    if config.max_batch_size > 1:
        sizes.append(config.max_batch_size)
    for batch_size in sizes:
        try:
            outputs = runtime.run(dummy_batch(config, batch_size))
        except Exception as exc:  # any failure here means the model cannot serve; say so at load
            raise ModelLoadError(f"warm-up batch of {batch_size} failed: {exc}") from exc
        for spec in config.outputs:
            _check_output(spec, outputs, config.max_batch_size > 0, batch_size)
    return time.perf_counter() - started


def _check_output(spec: TensorSpec, outputs: dict[str, np.ndarray], batched: bool, batch_size: int) -> None:
    if spec.name not in outputs:
        raise ModelLoadError(
            f"warm-up: the model returned no output {spec.name!r}; it returned {sorted(outputs)}"
        )
    array = outputs[spec.name]
    if array.dtype != np.dtype(spec.numpy_dtype):
        raise ModelLoadError(
            f"warm-up: output {spec.name!r} has dtype {array.dtype}, model.yaml declares {spec.datatype}"
        )
    expected = ([batch_size] if batched else []) + list(spec.shape)
    fits = len(array.shape) == len(expected) and all(
        want == -1 or want == got for want, got in zip(expected, array.shape)
    )
    if not fits:
        batch_note = f" (a batch of {batch_size}, then {spec.shape})" if batched else ""
        raise ModelLoadError(
            f"warm-up: output {spec.name!r} has shape {list(array.shape)}, "
            f"model.yaml expects {expected}{batch_note}; -1 matches any size"
        )
