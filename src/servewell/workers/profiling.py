"""Profiling inside a worker without stopping it: the runtime's own profiler when it has one
(onnxruntime), else torch's (kineto) around the batches; either way with the compute thread's
Python stack sampled (`stack_sampler.py`), in a Chrome trace file that chrome://tracing and
Perfetto open.

The worker's main thread runs the batches, so as little as possible happens on it:

- torch: `torch.autograd.profiler.profile` (kineto) is entered and left on the compute thread,
  the one it records (measured: 9 ms to enter; leaving holds the GIL for a time that grows with
  the ops recorded, 0.3 s after 3 s of a loop of 350 small batches a second, during which the
  worker answers nothing: the capture's own overhead). `torch.profiler.profile` is not used:
  entering it imports `torch._inductor` (`hasattr(torch, "_inductor")`), which took 4 s on an
  idle machine and 10 s on a busy one, on the compute thread: long enough for the frontend to
  declare the worker hung and kill it (the 503s of two captures at once).
- onnxruntime: its profiler needs a second session (the whole model loaded again), built in a
  thread of its own while the compute thread keeps serving from the first.
- The trace file is written, and the samples added to it, in a thread of its own.

Replies (`ProfileDone`) go through `reply`, which may be called from those threads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from servewell.workers.messages import ProfileDone
from servewell.workers.stack_sampler import StackSampler, add_to_trace

log = logging.getLogger("servewell.workers")


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
    """One profiling session at a time of the worker's runtime. `start` and `stop` are called on
    the compute thread (between batches); each answers through `reply`, perhaps later and from
    another thread, so the compute thread goes back to its batches at once."""

    def __init__(self, reply: Callable[[ProfileDone], None]) -> None:
        self._reply = reply
        self._torch_profile: Any = None  # a torch.autograd.profiler.profile while torch profiles
        self._runtime: object | None = None
        self._sampler: StackSampler | None = None
        self._starting: threading.Thread | None = None
        self._directory = Path(".")

    @property
    def active(self) -> bool:
        """Whether a session is running (or starting)."""
        return self._runtime is not None

    def start(self, runtime: object, directory: str) -> None:
        """Begin profiling `runtime`'s batches (replies once it has begun)."""
        if self.active:
            raise RuntimeError("a profile is already being captured")
        self._directory = Path(directory)
        self._directory.mkdir(parents=True, exist_ok=True)
        sampler = StackSampler(threading.get_ident())
        if isinstance(runtime, SelfProfiling):
            self._runtime, self._sampler = runtime, sampler
            self._starting = threading.Thread(target=self._start_self_profiling, args=(runtime, sampler),
                                              name="servewell-profile-start", daemon=True)
            self._starting.start()
            return
        import torch
        from torch.autograd.profiler import profile

        device = "cuda" if torch.cuda.is_available() else None
        # Without record_shapes: recording them doubled the time leaving the profiler holds the
        # compute thread (0.7 s instead of 0.3 s after 3 s of 350 small batches a second, measured).
        self._torch_profile = profile(use_kineto=True, use_device=device)
        self._torch_profile.__enter__()
        sampler.start()
        self._runtime, self._sampler = runtime, sampler
        self._reply(ProfileDone(None))

    def _start_self_profiling(self, runtime: SelfProfiling, sampler: StackSampler) -> None:
        try:
            sampler.start()  # just before the profiled session's creation, where its clock starts
            runtime.start_profiling(str(self._directory))
        except Exception as exc:  # the frontend is told; the worker keeps serving
            sampler.stop()
            self._runtime = self._sampler = None
            self._reply(ProfileDone(None, str(exc) or type(exc).__name__))
            return
        self._reply(ProfileDone(None))

    def stop(self) -> None:
        """End the session; replies with the trace file's path once it is written."""
        if self._starting is not None:
            self._starting.join()  # long done: the frontend waits for the start's reply before this
            self._starting = None
        runtime, self._runtime = self._runtime, None
        sampler, self._sampler = self._sampler, None
        if runtime is None or sampler is None:
            raise RuntimeError("no profile is being captured")
        if self._torch_profile is not None:
            profile, self._torch_profile = self._torch_profile, None
            began = time.perf_counter()
            profile.__exit__(None, None, None)  # on the thread that entered it
            log.info("torch profiler stopped in %.3f s on the compute thread", time.perf_counter() - began)
            path = str(self._directory / f"torch-profile-{os.getpid()}-{time.time_ns()}.json")

            def export() -> str:
                # kineto's own writer holds the GIL throughout (4 batches ran during its 0.25 s
                # instead of 50, measured); torch's Python writer lets the compute thread run
                # between its steps (64 in 0.5 s), at the price of a longer write.
                profile.export_chrome_trace(path, use_python_export=True)
                return path

            self._finish(export, sampler)
            return
        if not isinstance(runtime, SelfProfiling):
            raise RuntimeError("the runtime has no profiler of its own")
        trace = runtime.stop_profiling()  # here: the session it ends is the one batches run on
        self._finish(lambda: trace, sampler)

    def _finish(self, write: Callable[[], str], sampler: StackSampler) -> None:
        """Stop the sampler, write the trace file and add the samples, from a thread of its own
        (the last samples show the compute thread back at its batches), then reply."""
        def run() -> None:
            began = time.perf_counter()
            try:
                sampler.stop()
                path = write()
                add_to_trace(path, sampler)
            except Exception as exc:
                self._reply(ProfileDone(None, str(exc) or type(exc).__name__))
                return
            log.info("profile trace written in %.3f s (%d bytes, %d stack samples)", time.perf_counter() - began,
                     Path(path).stat().st_size, sampler.samples)
            self._reply(ProfileDone(path))

        threading.Thread(target=run, name="servewell-profile-write", daemon=True).start()
