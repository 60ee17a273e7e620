"""Running a loaded torch module on numpy batches; shared by the torchscript and pytorch runtimes.

Also resolves the serving device and dtype from the model config, the same way for both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

from servewell.config.model import ModelConfig, ServingDtype, TensorSpec
from servewell.runtimes.base import ModelLoadError

#: Serving dtypes of model.yaml other than "auto".
SERVING_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_DTYPE_NAMES = {dtype: name for name, dtype in SERVING_DTYPES.items()}


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
    """The torch device for model.yaml's `device`; `ModelLoadError` when it is not there."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {name!r} requested, but torch sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ModelLoadError(f"device {name!r} requested, but torch sees {torch.cuda.device_count()} GPU(s)")
    return device


def resolve_serving_dtype(dtype: ServingDtype, device: torch.device) -> torch.dtype:
    """The weight dtype to serve in. "auto" is fp16 on CUDA, bf16 on a CPU with native bf16, else fp32."""
    if dtype != "auto":
        return SERVING_DTYPES[dtype]
    if device.type == "cuda":
        return torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


class TorchModuleRuntime:
    """A torch module (eager or TorchScript) behind the `ModelRuntime` interface.

    Inputs are passed positionally in the order of model.yaml's inputs; floating inputs are
    converted to the serving dtype. The module may return a tensor, a tuple or list (mapped to
    the declared outputs by position) or a dict (mapped by name).
    """

    def __init__(
        self, module: Callable[..., object], config: ModelConfig, device: torch.device, dtype: torch.dtype
    ) -> None:
        self._module: Callable[..., object] | None = module
        self._inputs = list(config.inputs)
        self._outputs = list(config.outputs)
        self._device = device
        self._dtype = dtype

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch under `torch.inference_mode()`; outputs come back in the declared dtypes."""
        if self._module is None:
            raise RuntimeError("the torch runtime is closed")
        missing = [spec.name for spec in self._inputs if spec.name not in inputs]
        if missing:
            raise ValueError(f"missing inputs {missing}")
        with torch.inference_mode():
            args = [self._to_tensor(spec, inputs[spec.name]) for spec in self._inputs]
            return outputs_to_numpy(self._module(*args), self._outputs)

    def close(self) -> None:
        """Drop the module; on CUDA also return cached blocks to the driver."""
        self._module = None
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def _to_tensor(self, spec: TensorSpec, array: np.ndarray) -> torch.Tensor:
        if array.dtype == np.dtype(object):
            raise ValueError(f"input {spec.name!r} holds bytes, which a torch module cannot take")
        # torch.from_numpy warns on read-only buffers (e.g. views of a request body) because
        # it cannot promise not to write; copying such inputs keeps the hot path quiet and safe.
        if not array.flags.writeable:
            array = array.copy()
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if tensor.is_floating_point():
            return tensor.to(device=self._device, dtype=self._dtype)
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
    for spec, value in zip(outputs, values):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"output {spec.name!r} is a {type(value).__name__}, not a tensor")
        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16
            tensor = tensor.float()
        arrays[spec.name] = tensor.numpy().astype(spec.numpy_dtype, copy=False)
    return arrays
