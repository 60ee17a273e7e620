"""Warm-up: prove a loaded model answers in the declared shapes, and learn what it can afford.

`warm_up` runs dummy batches of 1, 2, 4, ... up to `max_batch_size` items, measures the peak
memory of each, and stops growing where its memory limit would be exceeded (`host_memory_limit_bytes`, or
`device_memory_limit_bytes` when the runtime measures a GPU). With a torch
runtime's `dtype: auto` resolved to bf16 or fp16, it first compares the outputs with an fp32
reference and falls back to fp32 when they differ by more than `dtype_tolerance`.

Warm-up runs the whole model, so it also loads `pytorch.lazy_submodules`; a model whose lazy parts
should wait for the first real request needs `warmup: false`. A python model's `execute` gets the
same dummy batches (zeros in each declared input, variable sizes as 1): one that cannot take them
(it refuses zeros, or needs a size above 1) needs `warmup: false` too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from servewell.config.model import ModelConfig, TensorSpec
from servewell.runtimes.base import (
    DtypeReporting,
    MemoryProbing,
    ModelLoadError,
    ModelRuntime,
    OomSplitting,
    PeakMemoryProbe,
    PrecisionChecking,
    ProgressFn,
    describe_failure,
)
from servewell.runtimes.memory_probe import ProcessPeakMemory
from servewell.runtimes.precision import PrecisionCheck

_MIB = 1 << 20
#: Seed of the values the precision check feeds: fixed, so a model loads the same way each time.
_PROBE_SEED = 0


@dataclass(slots=True, frozen=True)
class WarmupReport:
    """What warm-up measured and decided."""

    seconds: float
    """Wall time of the whole warm-up."""
    effective_max_batch_size: int
    """Largest batch size that stayed within its memory limit (and did not run out of device
    memory); `max_batch_size` when nothing limited it, 0 for a model without a batch dimension."""
    peak_bytes_by_batch: tuple[tuple[int, int], ...]
    """(batch size, peak bytes) for each batch run, the one over the limit included: resident
    memory of the process on the CPU, allocated device memory on CUDA."""
    serving_dtype: str
    """The dtype the model serves in after warm-up ("" when the runtime does not say)."""
    precision_check: PrecisionCheck | None = None
    """The comparison with fp32 when `dtype: auto` chose a reduced dtype; None otherwise."""
    latency_by_batch: tuple[tuple[int, float], ...] = ()
    """(batch size, seconds) of each warm-up batch: the frontend derives from it how long a batch
    may run before its worker is declared hung."""


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


def precision_probe_batch(config: ModelConfig) -> dict[str, np.ndarray]:
    """A batch of one for the fp32 comparison: seeded standard-normal values in floating inputs.

    Zeros would multiply every weight away and hide the rounding of the weights; other inputs
    keep the zeros of `dummy_batch`, which are valid ids.
    """
    rng = np.random.default_rng(_PROBE_SEED)
    batch = dummy_batch(config, 1)
    for name, array in batch.items():
        if np.issubdtype(array.dtype, np.floating):
            batch[name] = rng.standard_normal(array.shape).astype(array.dtype)
    return batch


def warm_up_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... below `max_batch_size`, then `max_batch_size` itself; [1] for 0 (no batch dimension)."""
    sizes = []
    size = 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    sizes.append(max(max_batch_size, 1))
    return sizes


#: Batch sizes a `first_only` warm-up runs: 1 proves the outputs, 2 the batch dimension.
FIRST_BATCH_SIZES_MAX = 2


def warm_up(runtime: ModelRuntime, config: ModelConfig, progress: ProgressFn | None = None,
            first_only: bool = False) -> WarmupReport:
    """Check the precision (dtype auto), then run dummy batches of growing size; report what was found.

    `first_only` (fast cold starts): stop after batch 2 where nothing is left to learn from larger
    ones: on the host with no `host_memory_limit_bytes` to hold them to (a GPU runtime sweeps them
    all, since one may run out of device memory). Larger batches then pay their first run when they
    come: measured on ResNet-50 (onnxruntime, 1 thread), a first batch of 8 ran 1.2x its second,
    while warming 1..32 took 63 images' time (13 s on the loaded 2-core dev machine).

    Raises `ModelLoadError` when the model fails on a batch, when an output is missing or does
    not have the declared dtype and shape (the batch size, then every fixed dimension), or when
    even a batch of 1 needs more than its memory limit (`device_memory_limit_bytes` when the runtime
    measures a GPU's memory, else `host_memory_limit_bytes`).
    """
    say = progress or _ignore
    started = time.perf_counter()
    check = None
    precision = config.torch_settings
    if precision is not None and precision.dtype == "auto" and isinstance(runtime, PrecisionChecking) \
            and runtime.serving_dtype != "fp32":
        check = _check_precision(runtime, config, precision.dtype_tolerance, say)
    probe: PeakMemoryProbe = runtime.peak_memory_probe() if isinstance(runtime, MemoryProbing) else ProcessPeakMemory()
    batched = config.max_batch_size > 0
    # A CUDA runtime's probe measures the device, held against the device limit; else resident memory.
    limit_name = f"{probe.measures}_memory_limit_bytes"
    limit = config.device_memory_limit_bytes if probe.measures == "device" else config.host_memory_limit_bytes
    peaks: list[tuple[int, int]] = []
    latencies: list[tuple[int, float]] = []
    effective = 0
    short = (first_only and limit is None and probe.measures == "host"
             and config.max_batch_size > FIRST_BATCH_SIZES_MAX)
    sizes = warm_up_batch_sizes(FIRST_BATCH_SIZES_MAX if short else config.max_batch_size)
    for batch_size in sizes:
        probe.reset()
        batch_started = time.perf_counter()
        try:
            outputs = runtime.run(dummy_batch(config, batch_size))
        except Exception as exc:  # any failure here means the model cannot serve; say so at load
            # Described as a failed batch is (a model's own KeyError: its type and line, not just 'x').
            raise ModelLoadError(f"warm-up batch of {batch_size} failed: {describe_failure(exc)}") from exc
        latencies.append((batch_size, time.perf_counter() - batch_started))
        peak = probe.peak_bytes()
        peaks.append((batch_size, peak))
        for spec in config.outputs:
            _check_output(spec, outputs, batched, batch_size)
        if limit is not None and peak > limit:
            if batch_size == 1:
                raise ModelLoadError(
                    f"the model does not fit its {limit_name} at batch 1: it peaked at {peak} bytes "
                    f"({peak / _MIB:.0f} MiB), the limit is {limit} bytes ({limit / _MIB:.0f} MiB)"
                )
            say(f"batch {batch_size} peaked at {peak / _MIB:.0f} MiB, over {limit_name} "
                f"({limit / _MIB:.0f} MiB): max batch size {effective}")
            break
        effective = batch_size
    if short:
        effective = config.max_batch_size  # no limit to hold larger batches to
        say(f"warmed up batch sizes {sizes[0]}..{sizes[-1]} only (first_only: no host_memory_limit_bytes)")
    if isinstance(runtime, OomSplitting) and runtime.oom_limited_batch_size is not None:
        effective = min(effective, runtime.oom_limited_batch_size)
        say(f"ran out of device memory above batch {runtime.oom_limited_batch_size}")
    return WarmupReport(
        seconds=time.perf_counter() - started,
        effective_max_batch_size=effective if batched else 0,
        peak_bytes_by_batch=tuple(peaks),
        latency_by_batch=tuple(latencies),
        serving_dtype=runtime.serving_dtype if isinstance(runtime, DtypeReporting) else "",
        precision_check=check,
    )


def _check_precision(
    runtime: PrecisionChecking, config: ModelConfig, tolerance: float, say: ProgressFn
) -> PrecisionCheck:
    say(f"compare {runtime.serving_dtype} outputs with fp32")
    try:
        check = runtime.check_against_fp32(precision_probe_batch(config), tolerance)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"warm-up: comparing {runtime.serving_dtype} with fp32 failed: {exc}") from exc
    if check.skipped_reason:
        say(f"kept {check.serving_dtype} unchecked: {check.skipped_reason}")
    elif check.fell_back_to_fp32:
        say(f"{check.checked_dtype} differs from fp32 by {check.max_relative_difference:.3g} "
            f"(dtype_tolerance {tolerance:g}): serving in fp32")
    else:
        say(f"{check.checked_dtype} within {check.max_relative_difference:.3g} of fp32: "
            f"serving in {check.checked_dtype}")
    return check


def _ignore(stage: str) -> None:
    """Progress sink when the caller passes none."""


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
        want == -1 or want == got for want, got in zip(expected, array.shape, strict=True)
    )
    if not fits:
        batch_note = f" (a batch of {batch_size}, then {spec.shape})" if batched else ""
        raise ModelLoadError(
            f"warm-up: output {spec.name!r} has shape {list(array.shape)}, "
            f"model.yaml expects {expected}{batch_note}; -1 matches any size"
        )
