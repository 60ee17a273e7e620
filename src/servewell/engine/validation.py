"""Checks a request's tensors against the model's declared inputs (answers 422 otherwise)."""

from __future__ import annotations

import numpy as np

from servewell.config.model import ModelConfig
from servewell.engine.protocol import client_shape
from servewell.errors import InvalidInput, quote


def _shape_text(shape: list[int] | tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_inputs(config: ModelConfig, inputs: dict[str, np.ndarray]) -> int:
    """Validate names, dtypes and shapes; return the number of rows (batch items) in the request."""
    declared = [spec.name for spec in config.inputs]
    unknown = [name for name in inputs if name not in declared]
    if unknown:
        raise InvalidInput(f"unknown input {quote(unknown[0])}; model '{config.name}' takes {declared}")
    missing = [name for name in declared if name not in inputs]
    if missing:
        raise InvalidInput(f"missing input '{missing[0]}'; model '{config.name}' takes {declared}")
    rows: int | None = None
    for spec in config.inputs:
        array = inputs[spec.name]
        if array.dtype != np.dtype(spec.numpy_dtype):
            raise InvalidInput(
                f"input '{spec.name}' has dtype {array.dtype}, model '{config.name}' expects {spec.datatype}"
            )
        want = client_shape(config, spec)
        if array.ndim != len(want) or any(w != -1 and w != g for w, g in zip(want, array.shape, strict=False)):
            raise InvalidInput(
                f"input '{spec.name}' has shape {_shape_text(array.shape)}, model '{config.name}' expects "
                f"{_shape_text(want)} (-1: any size)"
            )
        if config.max_batch_size > 0:
            if array.shape[0] < 1:
                raise InvalidInput(f"input '{spec.name}' has an empty batch")
            if rows is not None and array.shape[0] != rows:
                raise InvalidInput("all inputs must have the same batch size")
            rows = array.shape[0]
            if rows > config.max_batch_size:
                raise InvalidInput(
                    f"input '{spec.name}' has a batch of {rows}, above the model's max_batch_size "
                    f"{config.max_batch_size}"
                )
    return rows if rows is not None else 1
