"""Python models: a class of the model directory's own code runs the batches (Triton's python backend).

model.yaml names the class (`python.entry: steps:Cropper`; the artifact is its module's file,
`steps.py`). A user writes:

    class Cropper:
        def setup(self, config: dict) -> None: ...        # optional, once, before the first batch
        def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...
        def teardown(self) -> None: ...                    # optional, when the worker stops

A generative model (a `generate:` section in model.yaml) answers in parts instead: `execute` is a
generator that yields each part for its batch, or the class is step-wise (`start`, `step`, `end`
and no `execute` needed): see `runtimes/python_sequences.py`, which runs its sequences.

The class is instantiated without arguments; `setup` gets the model's name, version, directory,
`python.settings`, inputs, outputs, max_batch_size and device. `execute` gets one batch (rows
along axis 0 when max_batch_size > 0) and returns exactly the declared outputs: each is converted
with `np.asarray` to its declared dtype where that loses nothing but precision (float64 to FP32;
not float to INT64, nor a value that overflows), and must have the batch's rows and the declared
shape per row (-1: any size). What does not fit is a `ModelOutputError` naming each mismatch.

The code runs in the model's worker process like any model: an exception in `execute` fails that
batch's requests with model_error and the worker goes on (`workers/process_main`). A SystemExit or
KeyboardInterrupt from the model's code is turned into an ordinary exception here, so it cannot end
the worker either. The code is trusted as a pytorch factory is: it is the operator's repository.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Generator, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from servewell.config.model import ModelConfig, TensorSpec
from servewell.runtimes.base import ModelLoadError, ModelOutputError, ProgressFn
from servewell.runtimes.python_entry import (
    config_problems,
    describe,
    forget_package,
    import_entry,
    is_stepwise,
    message_of,
    python_settings,
)
from servewell.runtimes.python_sequences import SequenceSet

log = logging.getLogger("servewell.runtimes")

class PythonModelRuntime:
    """One instance of the entry class behind the `ModelRuntime` interface."""

    def __init__(self, instance: object, config: ModelConfig, model_dir: Path, package: str) -> None:
        self._instance = instance
        #: Step-wise (start/step/end) rather than execute: runtimes/python_sequences.py.
        self.stepwise = is_stepwise(type(instance))
        execute: Callable[[dict[str, np.ndarray]], object] | None = getattr(instance, "execute", None)
        self._execute = execute
        self._outputs = list(config.outputs)
        self._batched = config.max_batch_size > 0
        self._model_dir = model_dir
        self._package: str | None = package
        self._sequences: SequenceSet | None = None

    @property
    def batched(self) -> bool:
        """Whether inputs and outputs carry a row axis (max_batch_size > 0)."""
        return self._batched

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run `execute` on one batch; its outputs converted to and checked against model.yaml's. A
        generative model answers its first part here (warm-up, and a request that is not a stream's)."""
        rows = next(iter(inputs.values())).shape[0] if self._batched and inputs else None
        if self.stepwise:
            return self._first_step(inputs, rows)
        returned = self.execute_batch(dict(inputs))
        if isinstance(returned, Generator):
            parts = returned
            try:
                returned = next(parts)
            except StopIteration:
                raise ModelOutputError("execute is a generator that yielded nothing; it yields each part of its "
                                       "batch's outputs") from None
            finally:
                parts.close()
        return checked_outputs(returned, self._outputs, rows)

    def execute_batch(self, inputs: dict[str, np.ndarray]) -> object:
        """`execute` as the model wrote it (a dict, or a generator of dicts); its SystemExit and
        KeyboardInterrupt contained."""
        if self._execute is None:
            raise ModelOutputError("this step-wise model has no execute; it runs through start and step")
        return _contained("execute", self._execute, dict(inputs))

    def start_sequences(self, requests: list[dict[str, np.ndarray]]) -> list[object]:
        """The model's `start`: one state per request."""
        return _listed("start", _contained("start", getattr(self._instance, "start"), requests))  # noqa: B009

    def step_sequences(self, states: list[object]) -> list[object]:
        """The model's `step` over every running state: one (outputs, done) each."""
        return _listed("step", _contained("step", getattr(self._instance, "step"), states))  # noqa: B009

    def end_sequences(self, states: list[object]) -> None:
        """The model's `end`, if it has one (a failure is logged: the sequences have left anyway)."""
        end = getattr(self._instance, "end", None)
        if callable(end):
            try:
                _contained("end", end, states)
            except Exception as exc:
                log.warning("python model: end failed: %s", describe(exc, self._model_dir))

    def checked_part(self, outputs: object, rows: int) -> dict[str, np.ndarray]:
        """One part's outputs converted to and checked against model.yaml's outputs."""
        return checked_outputs(outputs, self._outputs, rows if self._batched else None)

    def sequence_set(self) -> SequenceSet:
        """The sequences this instance runs (made on first use)."""
        if self._sequences is None:
            self._sequences = SequenceSet(self)
        return self._sequences

    def _first_step(self, inputs: dict[str, np.ndarray], rows: int | None) -> dict[str, np.ndarray]:
        requests = [{name: array[i:i + 1] for name, array in inputs.items()} for i in range(rows)] \
            if rows is not None else [dict(inputs)]
        states = self.start_sequences(requests)
        try:
            results = self.step_sequences(states)
        finally:
            self.end_sequences(states)
        parts = []
        for result in results:
            outputs = result[0] if isinstance(result, tuple) and len(result) == 2 else result
            parts.append(checked_outputs(outputs, self._outputs, 1 if rows is not None else None))
        if rows is None:
            return parts[0]
        return {spec.name: _stack_rows([part[spec.name] for part in parts]) for spec in self._outputs}

    def close(self) -> None:
        """Call `teardown` once (a failure is logged, never raised) and forget the model's modules."""
        if self._package is None:
            return
        if self._sequences is not None:
            self._sequences.close()
        package, self._package = self._package, None
        teardown = getattr(self._instance, "teardown", None)
        try:
            if callable(teardown):
                teardown()
        except BaseException as exc:  # closing goes on: the worker is stopping anyway
            log.warning("python model: teardown failed: %s", describe(exc, self._model_dir))
        finally:
            forget_package(package)


def load(config: ModelConfig, model_dir: Path, progress: ProgressFn) -> PythonModelRuntime:
    """Import the entry class of `model_dir`, instantiate it and run its `setup`."""
    settings = python_settings(config)
    problems = config_problems(config)
    if problems:
        raise ModelLoadError("; ".join(problem.reason for problem in problems))
    progress(f"import {config.artifact}")
    entry_class, package = import_entry(config, model_dir)
    name = entry_class.__name__
    try:
        try:
            instance = entry_class()
        except BaseException as exc:
            raise ModelLoadError(f"{name}() failed: {describe(exc, model_dir)} (the class is instantiated without "
                                 "arguments; settings come to setup(config))") from exc
        setup = getattr(instance, "setup", None)
        if callable(setup):
            progress("setup")
            try:
                setup(setup_config(config, model_dir, settings.settings))
            except BaseException as exc:
                raise ModelLoadError(f"{name}.setup failed: {describe(exc, model_dir)}") from exc
    except ModelLoadError:
        forget_package(package)
        raise
    return PythonModelRuntime(instance, config, model_dir, package)


def setup_config(config: ModelConfig, model_dir: Path, settings: Mapping[str, Any]) -> dict[str, Any]:
    """What `setup` is given: plain values, a copy the model may keep or change."""
    return {
        "name": config.name, "version": config.version, "directory": str(model_dir),
        "settings": copy.deepcopy(dict(settings)),
        "inputs": [spec.model_dump(mode="json") for spec in config.inputs],
        "outputs": [spec.model_dump(mode="json") for spec in config.outputs],
        "max_batch_size": config.max_batch_size, "device": config.device,
    }


def checked_outputs(returned: object, specs: list[TensorSpec], rows: int | None) -> dict[str, np.ndarray]:
    """`returned` as the declared outputs, in their order and dtypes; `rows`: the batch's rows (None:
    the model takes no batch dimension). `ModelOutputError` naming every output that does not fit."""
    declared = [spec.name for spec in specs]
    if not isinstance(returned, Mapping):
        raise ModelOutputError(f"execute returned {type(returned).__name__}; it must return a dict of output "
                               f"name -> array with the outputs {declared}")
    missing = [name for name in declared if name not in returned]
    extra = [str(key) for key in returned if key not in declared]
    if missing or extra:
        parts = ([f"missing {', '.join(map(repr, missing))}"] if missing else []) + \
            ([f"not declared {', '.join(map(repr, extra[:8]))}"] if extra else [])
        raise ModelOutputError(f"execute returned outputs that differ from model.yaml's ({declared}): "
                               + "; ".join(parts))
    problems: list[str] = []
    outputs: dict[str, np.ndarray] = {}
    for spec in specs:
        try:
            outputs[spec.name] = _output(spec, returned[spec.name], rows)
        except ModelOutputError as exc:
            problems.append(str(exc))
    if problems:
        raise ModelOutputError("; ".join(problems))
    return outputs


def _output(spec: TensorSpec, value: object, rows: int | None) -> np.ndarray:
    dtype = np.dtype(spec.numpy_dtype)
    try:
        array = np.asarray(value)
    except Exception as exc:  # ragged lists, objects without an array form
        raise ModelOutputError(f"output {spec.name!r} ({type(value).__name__}) is not an array: {exc}") from None
    if array.dtype != dtype:
        array = _converted(spec, array, dtype)
    expected = ([rows] if rows is not None else []) + list(spec.shape)
    fits = array.ndim == len(expected) and all(want in (-1, got) for want, got in zip(expected, array.shape,
                                                                                      strict=True))
    if not fits:
        per_row = f" (a batch of {rows} rows, each {spec.shape})" if rows is not None else ""
        raise ModelOutputError(f"output {spec.name!r} has shape {list(array.shape)}, model.yaml expects "
                               f"{expected}{per_row}; -1 matches any size")
    return array


def _converted(spec: TensorSpec, array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`array` in `dtype` when every value survives but for precision: float64 to float32 does, and
    an integer to another integer type that holds it; a float to an integer, a number to bool, a
    value out of range or a non-number does not."""
    numeric = array.dtype.kind in "biuf" and dtype.kind in "biuf"
    integers = array.dtype.kind in "iu" and dtype.kind in "iu"
    if numeric and not integers and not np.can_cast(array.dtype, dtype, "same_kind"):
        raise ModelOutputError(f"output {spec.name!r} is {array.dtype}, model.yaml declares {spec.datatype}: "
                               f"{array.dtype} does not convert to {dtype} without losing values (convert it "
                               "in execute)")
    if integers and array.size and not np.can_cast(array.dtype, dtype, "safe"):
        info = np.iinfo(dtype)
        low, high = array.min(), array.max()
        if low < info.min or high > info.max:
            raise ModelOutputError(f"output {spec.name!r} holds values from {low} to {high}, outside "
                                   f"{spec.datatype}'s range")
    try:
        with np.errstate(over="raise", invalid="raise"):
            return array.astype(dtype)
    except (ValueError, TypeError, OverflowError, FloatingPointError) as exc:
        raise ModelOutputError(f"output {spec.name!r} ({array.dtype}) cannot be converted to {spec.datatype}: "
                               f"{exc}") from None


def _contained(what: str, method: Callable[..., object], argument: object) -> object:
    """`method(argument)`, a SystemExit or KeyboardInterrupt from the model's code turned into an
    ordinary exception (with the model's traceback) so it cannot end the worker."""
    try:
        return method(argument)
    except Exception:
        raise  # the worker reports it for this batch's (or step's) requests and goes on
    except BaseException as exc:  # SystemExit, KeyboardInterrupt: not the worker's own end
        contained = RuntimeError(f"{what} raised {type(exc).__name__}: {message_of(exc)}")
        raise contained.with_traceback(exc.__traceback__) from None


def _listed(what: str, returned: object) -> list[object]:
    if not isinstance(returned, Iterable) or isinstance(returned, (str, bytes, Mapping)):
        raise ModelOutputError(f"{what} returned {type(returned).__name__}; it returns a list, one item per "
                               "request (start) or state (step), in order")
    return list(returned)


def _stack_rows(pieces: list[np.ndarray]) -> np.ndarray:
    """One-row parts as one batch; parts of different lengths (text) padded with zeros to the longest."""
    if len({piece.shape for piece in pieces}) == 1:
        return np.concatenate(pieces)
    width = [max(piece.shape[axis] for piece in pieces) for axis in range(pieces[0].ndim)]
    out = np.zeros((len(pieces), *width[1:]), dtype=pieces[0].dtype)
    for i, piece in enumerate(pieces):
        out[(slice(i, i + 1), *(slice(0, n) for n in piece.shape[1:]))] = piece
    return out
