"""ONNX models run by onnxruntime."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

from servewell.config.model import ModelConfig, OnnxSettings, TensorSpec
from servewell.cpu_limit import machine_cpus
from servewell.runtimes.base import ModelLoadError, ProgressFn

#: onnxruntime's element type names mapped to numpy; types numpy lacks (bfloat16, ...) are absent.
_ORT_TO_NUMPY: dict[str, np.dtype] = {
    f"tensor({ort_name})": np.dtype(np_name)
    for ort_name, np_name in [
        ("float", "float32"), ("float16", "float16"), ("double", "float64"), ("bool", "bool"),
        ("int8", "int8"), ("int16", "int16"), ("int32", "int32"), ("int64", "int64"),
        ("uint8", "uint8"), ("uint16", "uint16"), ("uint32", "uint32"), ("uint64", "uint64"),
        ("string", "object"),
    ]
}

_NUMPY_DTYPE_NAMES = {np.dtype("float32"): "fp32", np.dtype("float16"): "fp16", np.dtype("float64"): "fp64"}


class OnnxRuntime:
    """An onnxruntime session behind the `ModelRuntime` interface."""

    def __init__(self, session: ort.InferenceSession, config: ModelConfig,
                 make_session: Callable[[ort.SessionOptions], ort.InferenceSession] | None = None,
                 options: ort.SessionOptions | None = None) -> None:
        self._session: ort.InferenceSession | None = session
        self._make_session = make_session
        self._options = options
        self._serving_session: ort.InferenceSession | None = None
        # Cast each input to what the graph takes, so a model.yaml that says FP32 for an
        # FP16 graph still runs; numpy dtype None means "leave as is".
        self._input_dtypes = {i.name: _ORT_TO_NUMPY.get(i.type) for i in session.get_inputs()}
        self._output_names = [spec.name for spec in config.outputs]
        self._output_dtypes = [np.dtype(spec.numpy_dtype) for spec in config.outputs]
        floating = [d for d in self._input_dtypes.values() if d is not None and d.kind == "f"]
        self._serving_dtype = _NUMPY_DTYPE_NAMES.get(floating[0], str(floating[0])) if floating else "graph"

    @property
    def serving_dtype(self) -> str:
        """The dtype of the graph's floating inputs (fp32, fp16); "graph" when it takes none.

        ONNX models compute in the dtypes they were exported with; model.yaml's `dtype` does
        not change them.
        """
        return self._serving_dtype

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch; outputs are cast to the dtypes model.yaml declares."""
        if self._session is None:
            raise RuntimeError("the ONNX runtime is closed")
        missing = [name for name in self._input_dtypes if name not in inputs]
        if missing:
            raise ValueError(f"missing inputs {missing}")
        feeds = {
            name: np.ascontiguousarray(inputs[name], dtype=dtype) for name, dtype in self._input_dtypes.items()
        }
        results = self._session.run(self._output_names, feeds)
        return {
            name: np.asarray(result).astype(dtype, copy=False)
            for name, result, dtype in zip(self._output_names, results, self._output_dtypes, strict=True)
        }

    def start_profiling(self, directory: str) -> None:
        """Serve from a second session with onnxruntime's profiler on until `stop_profiling`.

        onnxruntime turns profiling on only when a session is created, so the profiled session
        is a temporary copy of the model (its memory is freed when profiling stops).
        """
        if self._make_session is None or self._options is None:
            raise RuntimeError("this runtime was built without a way to make a profiling session")
        options = ort.SessionOptions()
        options.intra_op_num_threads = self._options.intra_op_num_threads
        options.inter_op_num_threads = self._options.inter_op_num_threads
        options.execution_mode = self._options.execution_mode
        options.graph_optimization_level = self._options.graph_optimization_level
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(directory) / "onnxruntime-profile")
        self._serving_session, self._session = self._session, self._make_session(options)

    def stop_profiling(self) -> str:
        """End profiling; the path of the Chrome trace file onnxruntime wrote."""
        if self._serving_session is None or self._session is None:
            raise RuntimeError("no profile is being captured")
        path: str = self._session.end_profiling()
        self._session, self._serving_session = self._serving_session, None
        return path

    def close(self) -> None:
        """Drop the session; onnxruntime frees its memory when the last reference goes."""
        self._session = None
        self._serving_session = None


def load(config: ModelConfig, model_dir: Path, progress: ProgressFn) -> OnnxRuntime:
    """Create an inference session for `model_dir / config.artifact` and check it against the config."""
    path = model_dir / config.artifact
    options = ort.SessionOptions()
    options.intra_op_num_threads = config.threads
    # One batch at a time per worker: parallelism across operators would only fight the
    # intra-op threads and the other instances for cores.
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if not spin_wait(config):
        # Spinning threads look busy to the OS and take cores the frontend and other instances
        # need; measured in bench/: 58% more CPU per image than offline with spinning on 2 cores.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    providers = _providers(config.device, config.device_memory_limit_bytes, progress)
    progress("read and optimize graph")
    def make_session(session_options: ort.SessionOptions) -> ort.InferenceSession:
        return ort.InferenceSession(str(path), sess_options=session_options, providers=providers)

    try:
        session = make_session(options)
    except Exception as exc:  # onnxruntime raises its own exception types for bad files
        raise ModelLoadError(f"onnxruntime cannot load {config.artifact}: {exc}") from exc
    progress("check graph against model.yaml")
    _check_names(config, session)
    graph_inputs = {i.name: i.shape for i in session.get_inputs()}
    for spec in config.inputs:
        _check_input_shape(spec, graph_inputs[spec.name], config.max_batch_size)
    return OnnxRuntime(session, config, make_session, options)


def spin_wait(config: ModelConfig, cpus: int | None = None) -> bool:
    """Whether idle intra-op threads may spin: as `onnx.spin_wait` says, else only when a core stays
    free of the machine's `cpus` (default `cpu_limit.machine_cpus`: a container's CPU limit counts,
    since spinning threads spend its quota and get the whole container throttled)."""
    settings = config.onnx or OnnxSettings()
    if settings.spin_wait is not None:
        return settings.spin_wait
    return config.instances * config.threads < (machine_cpus() if cpus is None else cpus)


def _providers(device: str, limit_bytes: int | None, progress: ProgressFn) -> list[str | tuple[str, dict[str, str]]]:
    if not device.startswith("cuda"):
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        progress(f"device {device} requested but onnxruntime has no CUDA provider; running on CPU")
        return ["CPUExecutionProvider"]
    return [("CUDAExecutionProvider", cuda_provider_options(device, limit_bytes)), "CPUExecutionProvider"]


def cuda_provider_options(device: str, limit_bytes: int | None) -> dict[str, str]:
    """Options of onnxruntime's CUDA provider for `device` (cuda or cuda:N): its device, and
    `device_memory_limit_bytes` as the cap of its memory arena (`gpu_mem_limit`). Unverified on a GPU."""
    options = {"device_id": device.partition(":")[2] or "0"}
    if limit_bytes is not None:
        options["gpu_mem_limit"] = str(limit_bytes)
    return options


def _check_names(config: ModelConfig, session: ort.InferenceSession) -> None:
    config_inputs = [spec.name for spec in config.inputs]
    graph_inputs = [i.name for i in session.get_inputs()]
    if sorted(config_inputs) != sorted(graph_inputs):
        raise ModelLoadError(
            f"input names in model.yaml {config_inputs} do not match the ONNX graph's inputs {graph_inputs}"
        )
    graph_outputs = [o.name for o in session.get_outputs()]
    unknown = [spec.name for spec in config.outputs if spec.name not in graph_outputs]
    if unknown:
        raise ModelLoadError(
            f"outputs {unknown} in model.yaml are not outputs of the ONNX graph, which has {graph_outputs}"
        )


def _check_input_shape(spec: TensorSpec, graph_shape: list[int | str | None], max_batch_size: int) -> None:
    """Catch the usual export mistakes at load: a missing batch axis, a batch axis fixed to 1."""
    batched = max_batch_size > 0
    declared: list[int] = ([-1] if batched else []) + list(spec.shape)
    if len(graph_shape) != len(declared):
        how = "a batch dimension plus " if batched else "no batch dimension (max_batch_size 0) and "
        raise ModelLoadError(
            f"input {spec.name!r}: the ONNX graph takes shape {graph_shape}, model.yaml declares {how}"
            f"{spec.shape}; fix shape or max_batch_size"
        )
    # Batches hold 1..max_batch_size items, so a fixed batch axis only works when it is 1 = max.
    if batched and isinstance(graph_shape[0], int) and not graph_shape[0] == max_batch_size == 1:
        raise ModelLoadError(
            f"input {spec.name!r}: the ONNX graph fixes the batch dimension to {graph_shape[0]}, "
            f"but batches hold 1 to max_batch_size {max_batch_size} items; export with a dynamic "
            "batch axis, or set max_batch_size: 1 for a graph fixed to 1"
        )
    for index, (want, got) in enumerate(zip(declared, graph_shape, strict=True)):
        if want != -1 and isinstance(got, int) and want != got:
            raise ModelLoadError(
                f"input {spec.name!r}: dimension {index} is {got} in the ONNX graph {graph_shape}, "
                f"model.yaml declares {spec.shape}"
            )
