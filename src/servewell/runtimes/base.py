"""The interface every model backend implements. Runs inside a worker process only.

`ModelRuntime` is all a backend must offer. The protocols after it are optional abilities that
warm-up and the worker use when a runtime has them (the torch runtimes have all of them).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from servewell.config.model import ModelConfig
from servewell.runtimes.precision import PrecisionCheck

#: Called by a runtime while it loads, with a short stage name ("read graph", "load weights", ...).
ProgressFn = Callable[[str], None]


class ModelLoadError(Exception):
    """The model cannot be loaded; the message says why in words a user can act on."""


class ModelOutputError(ValueError):
    """The outputs a model's code returned for a batch do not fit model.yaml (names, dtypes, shapes).

    The message names each mismatch; where in servewell it was found would tell a model's author
    nothing, so the worker reports the message alone.
    """


class DeviceUnusableError(RuntimeError):
    """The accelerator failed in a way that leaves this process unable to use it again.

    A device-side assert or any "CUDA error" poisons the CUDA context of the process; nothing
    short of a new process recovers it, so the worker should exit and be restarted.
    """


class ModelRuntime(Protocol):
    """A loaded model that runs batches of numpy arrays."""

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch. Inputs and outputs are keyed by the tensor names of the model config;
        outputs are numpy arrays in the dtypes the config declares."""
        ...

    def close(self) -> None:
        """Release the model's resources."""
        ...


def describe_failure(exc: BaseException) -> str:
    """A model's failure in one line, as a worker reports it (to the client of a failed batch too):
    the message, the exception's type where the message alone would not say it, and the last line
    the exception passed through, which tells a model's author where it broke without a traceback."""
    try:
        text = str(exc) or type(exc).__name__
    except Exception:  # an exception whose __str__ fails: raised from here, it would end the worker
        text = type(exc).__name__
    if not isinstance(exc, (ValueError, RuntimeError, OSError, ModelLoadError)):
        text = f"{type(exc).__name__}: {text}"
    # A mismatch of outputs is found in servewell's code, whose line would tell the author nothing.
    frames = traceback.extract_tb(exc.__traceback__)
    if frames and not isinstance(exc, (ModelLoadError, ModelOutputError)):
        last = frames[-1]
        text += f" (at {Path(last.filename).name}:{last.lineno})"
    return text


class PeakMemoryProbe(Protocol):
    """Measures the peak memory used between `reset` and `peak_bytes`."""

    #: What it measures: "host" (resident memory of the process) or "device" (a GPU's memory),
    #: so warm-up holds it against host_memory_limit_bytes or device_memory_limit_bytes.
    measures: Literal["host", "device"]

    def reset(self) -> None:
        """Start a new measurement at the current usage."""
        ...

    def peak_bytes(self) -> int:
        """Highest usage, in bytes, since the last `reset`."""
        ...


@runtime_checkable
class MemoryProbing(Protocol):
    """A runtime that knows where its memory lives (device memory for a CUDA runtime)."""

    def peak_memory_probe(self) -> PeakMemoryProbe:
        """A probe of the memory this runtime's batches use."""
        ...


@runtime_checkable
class DtypeReporting(Protocol):
    """A runtime that can say in which dtype it computes."""

    @property
    def serving_dtype(self) -> str:
        """fp32, fp16, bf16, ... as model.yaml spells dtypes."""
        ...


@runtime_checkable
class PrecisionChecking(DtypeReporting, Protocol):
    """A runtime that may serve in reduced precision and can compare itself with fp32."""

    def check_against_fp32(self, inputs: dict[str, np.ndarray], tolerance: float) -> PrecisionCheck:
        """Compare outputs on `inputs` with an fp32 reference; switch to fp32 above `tolerance`."""
        ...


@runtime_checkable
class OomSplitting(Protocol):
    """A runtime that splits a batch that runs out of device memory into smaller ones."""

    @property
    def oom_limited_batch_size(self) -> int | None:
        """Largest batch that ran in one piece after an out-of-memory split; None if none was split."""
        ...


RuntimeLoader = Callable[[ModelConfig, Path, ProgressFn], ModelRuntime]
