"""Profiling inside a worker: the runtime's own profiler when it has one (onnxruntime), else
`torch.profiler` around the batches. Either way the result is a Chrome trace file that
chrome://tracing and Perfetto open."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class SelfProfiling(Protocol):
    """A runtime with a profiler of its own (onnxruntime's)."""

    def start_profiling(self, directory: str) -> None:
        """Profile every run from now on, writing under `directory`."""
        ...

    def stop_profiling(self) -> str:
        """End profiling; the trace file's path."""
        ...


class WorkerProfiler:
    """Starts and stops one profiling session of a runtime."""

    def __init__(self) -> None:
        self._torch_profile: Any = None  # a torch.profiler.profile while torch profiles
        self._runtime: object | None = None
        self._directory = Path(".")

    @property
    def active(self) -> bool:
        """Whether a session is running."""
        return self._runtime is not None

    def start(self, runtime: object, directory: str) -> None:
        """Begin profiling `runtime`'s batches."""
        if self.active:
            raise RuntimeError("a profile is already being captured")
        self._directory = Path(directory)
        self._directory.mkdir(parents=True, exist_ok=True)
        if isinstance(runtime, SelfProfiling):
            runtime.start_profiling(str(self._directory))
        else:
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._torch_profile = torch.profiler.profile(activities=activities, record_shapes=True)
            self._torch_profile.__enter__()
        self._runtime = runtime

    def stop(self) -> str:
        """End the session; the path of the trace file."""
        runtime, self._runtime = self._runtime, None
        if runtime is None:
            raise RuntimeError("no profile is being captured")
        if self._torch_profile is not None:
            profile, self._torch_profile = self._torch_profile, None
            profile.__exit__(None, None, None)
            path = self._directory / f"torch-profile-{os.getpid()}-{time.time_ns()}.json"
            profile.export_chrome_trace(str(path))
            return str(path)
        if not isinstance(runtime, SelfProfiling):
            raise RuntimeError("the runtime has no profiler of its own")
        return runtime.stop_profiling()
