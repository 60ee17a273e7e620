"""Checks a request's tensors against the model's declared inputs (answers 422 otherwise)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from servewell.config.model import ModelConfig
from servewell.engine.protocol import client_shape
from servewell.errors import InvalidInput, quote


def _shape_text(shape: list[int] | tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


@dataclass(slots=True, frozen=True)
class _InputRule:
    """What one declared input must be: its dtype and its full shape as a client sends it."""

    name: str
    dtype: np.dtype
    datatype: str
    shape: tuple[int, ...]  # -1: any size


#: Each model config's input rules, by the config's id (the config is kept with them, so the id
#: cannot be reused while cached). A config is immutable; a reload makes a new one. Requests check
#: against the rules instead of rebuilding dtypes and shapes from the config every time (a
#: pipeline checks each step's inputs too).
_RULES: dict[int, tuple[ModelConfig, tuple[str, ...], tuple[_InputRule, ...]]] = {}
_MAX_RULES = 4096


def _rules(config: ModelConfig) -> tuple[tuple[str, ...], tuple[_InputRule, ...]]:
    held = _RULES.get(id(config))
    if held is not None and held[0] is config:
        return held[1], held[2]
    rules = tuple(_InputRule(spec.name, np.dtype(spec.numpy_dtype), spec.datatype, tuple(client_shape(config, spec)))
                  for spec in config.inputs)
    if len(_RULES) >= _MAX_RULES:
        _RULES.clear()
    declared = tuple(rule.name for rule in rules)
    _RULES[id(config)] = (config, declared, rules)
    return declared, rules


def check_inputs(config: ModelConfig, inputs: dict[str, np.ndarray]) -> int:
    """Validate names, dtypes and shapes; return the number of rows (batch items) in the request."""
    declared, rules = _rules(config)
    if len(inputs) != len(declared) or any(name not in inputs for name in declared):
        unknown = [name for name in inputs if name not in declared]
        if unknown:
            raise InvalidInput(f"unknown input {quote(unknown[0])}; model '{config.name}' takes {list(declared)}")
        missing = [name for name in declared if name not in inputs]
        raise InvalidInput(f"missing input '{missing[0]}'; model '{config.name}' takes {list(declared)}")
    rows: int | None = None
    batched = config.max_batch_size > 0
    for rule in rules:
        array = inputs[rule.name]
        if array.dtype != rule.dtype:
            raise InvalidInput(
                f"input '{rule.name}' has dtype {array.dtype}, model '{config.name}' expects {rule.datatype}"
            )
        want = rule.shape
        if array.ndim != len(want) or any(w != -1 and w != g for w, g in zip(want, array.shape, strict=False)):
            raise InvalidInput(
                f"input '{rule.name}' has shape {_shape_text(array.shape)}, model '{config.name}' expects "
                f"{_shape_text(want)} (-1: any size)"
            )
        if batched:
            if array.shape[0] < 1:
                raise InvalidInput(f"input '{rule.name}' has an empty batch")
            if rows is not None and array.shape[0] != rows:
                raise InvalidInput("all inputs must have the same batch size")
            rows = array.shape[0]
            if rows > config.max_batch_size:
                raise InvalidInput(
                    f"input '{rule.name}' has a batch of {rows}, above the model's max_batch_size "
                    f"{config.max_batch_size}"
                )
    return rows if rows is not None else 1
