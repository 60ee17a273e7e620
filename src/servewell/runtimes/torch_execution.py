"""Running a loaded torch module on numpy batches; shared by the torchscript and pytorch runtimes.

Also resolves the serving device and dtype from the model config, the same way for both, and
handles the ways a CUDA device fails: a batch that runs out of memory is split in halves and
retried; a device-side error, which leaves the process's CUDA context unusable, becomes
`DeviceUnusableError` so that the worker exits and is restarted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from servewell.config.model import ModelConfig, ServingDtype, TensorSpec, TorchSettings
from servewell.runtimes.base import DeviceUnusableError, ModelLoadError, PeakMemoryProbe
from servewell.runtimes.memory_probe import ProcessPeakMemory
from servewell.runtimes.precision import PrecisionCheck, max_relative_difference

#: Serving dtypes of model.yaml other than "auto".
SERVING_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_DTYPE_NAMES = {dtype: name for name, dtype in SERVING_DTYPES.items()}
#: Texts of the RuntimeErrors after which a CUDA context cannot be used again.
_DEVICE_FAILURE_MARKS = ("CUDA error", "device-side assert")

Module = Callable[..., object]
Arrays = dict[str, np.ndarray]


def dtype_name(dtype: torch.dtype) -> str:
    """Short name of a torch dtype as model.yaml spells it (fp32, fp16, bf16)."""
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True when the CPU advertises native bfloat16 arithmetic (AVX512-BF16 or AMX-BF16).

    Without it, bf16 is emulated and runs slower than fp32. False where `cpuinfo` is unreadable.
    """
    try:
        with cpuinfo.open() as lines:
            for line in lines:
                if line.startswith("flags"):
                    return bool({"avx512_bf16", "amx_bf16"} & set(line.partition(":")[2].split()))
    except OSError:
        pass
    return False


def resolve_device(name: str) -> torch.device:
    """The torch device for model.yaml's `device`; `ModelLoadError` when it is not there.

    A bare "cuda" becomes the current CUDA device with its index, which the memory APIs need.
    """
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {name!r} requested, but torch sees no CUDA device")
        if device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ModelLoadError(f"device {name!r} requested, but torch sees {torch.cuda.device_count()} GPU(s)")
    return device


def resolve_serving_dtype(dtype: ServingDtype, device: torch.device) -> torch.dtype:
    """The weight dtype to serve in. "auto" is fp16 on CUDA, bf16 on a CPU with native bf16, else fp32."""
    if dtype != "auto":
        return SERVING_DTYPES[dtype]
    if device.type == "cuda":
        return torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def limit_device_memory(
    device: torch.device,
    fraction: float | None,
    set_fraction: Callable[[float, int], None] | None = None,
) -> None:
    """Cap this process's share of a CUDA device's memory (`gpu_memory_fraction`, or
    `device_memory_limit_bytes` as a share: `device_memory_share`); no-op elsewhere.

    `set_fraction` defaults to `torch.cuda.set_per_process_memory_fraction`.
    """
    if fraction is None or device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    (set_fraction or torch.cuda.set_per_process_memory_fraction)(fraction, index)


def device_memory_share(fraction: float | None, limit_bytes: int | None,
                        total_bytes: Callable[[], int]) -> float | None:
    """The share of a CUDA device to cap the process at: `gpu_memory_fraction`, or
    `device_memory_limit_bytes` over the device's `total_bytes()` (read only when a limit is set);
    the smaller where both are given, never above the whole device."""
    if limit_bytes is None:
        return fraction
    share = min(1.0, limit_bytes / total_bytes())
    return share if fraction is None else min(fraction, share)


def prepare_torch(config: ModelConfig) -> tuple[torch.device, torch.dtype]:
    """Resolve device and serving dtype, set the thread count and the device memory cap."""
    settings = config.torch_settings or TorchSettings()
    device = resolve_device(config.device)
    dtype = resolve_serving_dtype(settings.dtype, device)
    torch.set_num_threads(config.threads)
    if device.type == "cuda":  # unverified on a GPU in this project's CI
        limit_device_memory(device, device_memory_share(
            settings.gpu_memory_fraction, config.device_memory_limit_bytes,
            lambda: int(torch.cuda.get_device_properties(device).total_memory)))
    return device, dtype


def is_device_failure(exc: BaseException) -> bool:
    """True for errors after which the process's CUDA context cannot be trusted again."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False  # recoverable: free memory and retry smaller
    if isinstance(exc, torch.AcceleratorError):
        return True
    return isinstance(exc, RuntimeError) and any(mark in str(exc) for mark in _DEVICE_FAILURE_MARKS)


class CudaPeakMemory:
    """Peak memory allocated by torch on one CUDA device between `reset` and `peak_bytes`."""

    measures: Literal["host", "device"] = "device"

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def reset(self) -> None:
        """Start a new measurement at the current allocation."""
        torch.cuda.synchronize(self._device)
        torch.cuda.reset_peak_memory_stats(self._device)

    def peak_bytes(self) -> int:
        """Largest number of bytes allocated on the device since the last `reset`."""
        torch.cuda.synchronize(self._device)
        return int(torch.cuda.max_memory_allocated(self._device))


class TorchModuleRuntime:
    """A torch module (eager or TorchScript) behind the `ModelRuntime` interface.

    Inputs are passed positionally in the order of model.yaml's inputs; floating inputs are
    converted to the serving dtype. The module may return a tensor, a tuple or list (mapped to
    the declared outputs by position) or a dict (mapped by name).

    `fp32_reference`, given when model.yaml says `dtype: auto` and the runtime serves in a
    reduced dtype, builds the same model in fp32 on the same device; `check_against_fp32` uses
    it once, during warm-up, and keeps it as the serving module if the reduced one is off.
    """

    def __init__(
        self,
        module: Module,
        config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        *,
        fp32_reference: Callable[[], Module] | None = None,
    ) -> None:
        self._module: Module | None = module
        self._inputs = list(config.inputs)
        self._outputs = list(config.outputs)
        self._batched = config.max_batch_size > 0
        self._device = device
        self._dtype = dtype
        self._fp32_reference = fp32_reference
        self._oom_limited_batch_size: int | None = None
        self._device_failure: str | None = None

    @property
    def serving_dtype(self) -> str:
        """The dtype weights and floating inputs are in (fp32, fp16, bf16)."""
        return dtype_name(self._dtype)

    @property
    def oom_limited_batch_size(self) -> int | None:
        """Largest piece that ran after a batch ran out of device memory and was split.

        None until a batch is split; afterwards it only goes down. The worker reads it to
        lower the model's max batch size.
        """
        return self._oom_limited_batch_size

    def run(self, inputs: Arrays) -> Arrays:
        """Run one batch under `torch.inference_mode()`; outputs come back in the declared dtypes.

        A batch that runs out of device memory is run again in halves (recursively, down to
        one item). Raises `DeviceUnusableError` once the device has failed.
        """
        if self._module is None:
            raise RuntimeError("the torch runtime is closed")
        if self._device_failure is not None:
            raise DeviceUnusableError(self._device_failure)
        missing = [spec.name for spec in self._inputs if spec.name not in inputs]
        if missing:
            raise ValueError(f"missing inputs {missing}")
        rows = len(inputs[self._inputs[0].name]) if self._batched else 1
        with torch.inference_mode():
            outputs, largest = self._run_fitting(self._module, self._dtype, inputs, rows)
        if largest < rows:
            limit = self._oom_limited_batch_size
            self._oom_limited_batch_size = largest if limit is None else min(limit, largest)
        return outputs

    def peak_memory_probe(self) -> PeakMemoryProbe:
        """Device memory for a CUDA runtime; the process's resident memory otherwise."""
        if self._device.type == "cuda":
            return CudaPeakMemory(self._device)
        return ProcessPeakMemory()

    def check_against_fp32(self, inputs: Arrays, tolerance: float) -> PrecisionCheck:
        """Compare the outputs on `inputs` with those of an fp32 copy; above `tolerance`, serve that copy.

        The fp32 copy is built from the model files (for safetensors and state-dict files these
        are memory-mapped, so it adds little resident memory) and dropped unless it takes over.
        Runs once: the reference builder is released afterwards.
        """
        checked = self.serving_dtype
        build_reference, self._fp32_reference = self._fp32_reference, None
        if self._dtype == torch.float32:
            return PrecisionCheck(checked, checked, None, "the runtime already serves in fp32")
        if build_reference is None:
            return PrecisionCheck(checked, checked, None, "the runtime has no fp32 reference")
        outputs = self.run(inputs)
        try:
            reference_module = build_reference()
            with torch.inference_mode():
                reference, _ = self._run_fitting(reference_module, torch.float32, inputs, rows=0)
        except torch.OutOfMemoryError:
            # fp32 does not fit beside the reduced copy; it would not fit instead of it either.
            self._release_cached_memory()
            return PrecisionCheck(checked, checked, None, "no device memory for an fp32 copy")
        difference = max_relative_difference(outputs, reference)
        if difference > tolerance:
            self._module, self._dtype = reference_module, torch.float32
        del reference_module
        self._release_cached_memory()
        return PrecisionCheck(checked, self.serving_dtype, difference)

    def close(self) -> None:
        """Drop the module; on CUDA also return cached blocks to the driver (unless the device failed:
        a poisoned context fails every call, and the process is about to exit anyway)."""
        self._module = None
        self._fp32_reference = None
        if self._device_failure is None:
            self._release_cached_memory()

    def _run_fitting(self, module: Module, dtype: torch.dtype, inputs: Arrays, rows: int) -> tuple[Arrays, int]:
        """Outputs for `inputs` and the largest number of rows that ran in one piece.

        `rows` is the batch size; 0 or 1 (or an unbatched model) means the batch cannot be split.
        """
        try:
            return self._forward(module, dtype, inputs), rows
        except torch.OutOfMemoryError:
            if not self._batched or rows < 2:
                raise
        # Out of the except block, so the traceback and the tensors its frames hold are gone.
        self._release_cached_memory()
        half = rows // 2
        first, first_largest = self._run_fitting(module, dtype, {k: v[:half] for k, v in inputs.items()}, half)
        second, second_largest = self._run_fitting(
            module, dtype, {k: v[half:] for k, v in inputs.items()}, rows - half
        )
        joined = {name: np.concatenate([first[name], second[name]]) for name in first}
        return joined, max(first_largest, second_largest)

    def _forward(self, module: Module, dtype: torch.dtype, inputs: Arrays) -> Arrays:
        try:
            args = [self._to_tensor(spec, inputs[spec.name], dtype) for spec in self._inputs]
            return outputs_to_numpy(module(*args), self._outputs)
        except RuntimeError as exc:
            if not is_device_failure(exc):
                raise
            self._device_failure = (
                f"device {self._device} failed and cannot run more work in this process: {exc}"
            )
            raise DeviceUnusableError(self._device_failure) from exc

    def _release_cached_memory(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def _to_tensor(self, spec: TensorSpec, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        if array.dtype == np.dtype(object):
            raise ValueError(f"input {spec.name!r} holds bytes, which a torch module cannot take")
        # torch.from_numpy warns on read-only buffers (e.g. views of a request body) because
        # it cannot promise not to write; copying such inputs keeps the hot path quiet and safe.
        if not array.flags.writeable:
            array = array.copy()
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if tensor.is_floating_point():
            return tensor.to(device=self._device, dtype=dtype)
        return tensor.to(device=self._device)


def outputs_to_numpy(result: object, outputs: list[TensorSpec]) -> dict[str, np.ndarray]:
    """Map what a module returned onto the declared outputs, as numpy arrays of the declared dtypes.

    Raises `ValueError` when the result does not fit the declaration.
    """
    names = [spec.name for spec in outputs]
    if isinstance(result, torch.Tensor):
        if len(outputs) != 1:
            raise ValueError(f"the model returned one tensor, model.yaml declares {len(outputs)} outputs {names}")
        values: list[object] = [result]
    elif isinstance(result, Mapping):
        absent = [name for name in names if name not in result]
        if absent:
            raise ValueError(f"the model returned keys {sorted(map(str, result))}, missing outputs {absent}")
        values = [result[name] for name in names]
    elif isinstance(result, (tuple, list)):
        if len(result) != len(outputs):
            raise ValueError(f"the model returned {len(result)} values, model.yaml declares outputs {names}")
        values = list(result)
    else:
        raise ValueError(f"the model returned {type(result).__name__}; expected a tensor, tuple, list or dict")
    arrays: dict[str, np.ndarray] = {}
    for spec, value in zip(outputs, values, strict=True):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"output {spec.name!r} is a {type(value).__name__}, not a tensor")
        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16
            tensor = tensor.float()
        arrays[spec.name] = tensor.numpy().astype(spec.numpy_dtype, copy=False)
    return arrays
