"""A pipeline (`kind: pipeline`): a model to every client, whose requests run steps on other served
models inside the engine.

Each step is queued on its model's own scheduler, so it batches with that model's direct requests
and everyone else's steps; the request's lane (by name), tenant and absolute deadline go with it
through every step, and a step whose model's measured batch time no longer fits before the
deadline is not started. Tensors between steps stay in the engine process: they never go back
through an ingress. Steps whose sources are ready run together (the DAG's levels, computed once),
so a fan-out costs the slowest branch, not the sum.

`PipelineEntry` is the pipeline's `Entry` in its slot (no worker, no memory; validated against its
step models at load, and a step again whenever its model was reloaded); `PipelineSteps` runs a
request's steps, each one more request of the admission chain (engine/admission.py).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from opentelemetry import trace

from servewell.config.model import ModelConfig
from servewell.config.pipeline import PipelineStep, split_source
from servewell.config.tensors import TensorSpec
from servewell.engine.lanes import resolve_lane
from servewell.engine.model_lifecycle import StopCause, VersionLifecycle, VersionPhase, not_ready
from servewell.engine.pipeline_check import StepConfigs, check_pipeline, check_step
from servewell.engine.protocol import ModelState, ModelView, RequestResult, StepTiming
from servewell.errors import Conflict, InvalidInput, ModelNotReady, ServeError
from servewell.observability.metrics import ModelSample
from servewell.observability.signals import ModelFacts

if TYPE_CHECKING:
    from servewell.engine.admission import AdmissionChain
    from servewell.engine.model_entry import EntryServices, ModelEntry
    from servewell.engine.model_slot import ModelSlot
    from servewell.engine.request import InferenceRequest

log = logging.getLogger("servewell.engine")


@dataclass(slots=True)
class _Run:
    """One request's tensors by source name, and what its steps did."""

    values: dict[str, np.ndarray]
    skipped: set[str]
    timings: dict[str, StepTiming]


class PipelineEntry:
    """A pipeline in its slot: validated steps, no worker (an `Entry`)."""

    def __init__(self, name: str, directory: Path, config: ModelConfig, services: EntryServices,
                 slots: Mapping[str, ModelSlot]) -> None:
        assert config.pipeline is not None
        self.name = name
        self.directory = directory
        self.config = config
        self.lifecycle = VersionLifecycle()
        self.configured_at = time.time()
        self._services = services
        self._slots = slots  # every model of the engine: the steps' models are looked up by name
        self.spec = config.pipeline
        self.levels = _levels(self.spec.steps)
        #: Per step, the steps its sources (and its condition's tensor) come from: skipped with any of them.
        self.source_steps: dict[str, tuple[str, ...]] = {
            step.name: tuple(name for name in (split_source(s)[0] for s in _sources(step)) if name is not None)
            for step in self.spec.steps}
        #: The step model config each step was last checked against (by identity: a reload makes a new one).
        self._checked: dict[str, ModelConfig] = {}
        self._inflight: set[asyncio.Future[RequestResult]] = set()
        self._steps = PipelineSteps(self, slots, services)

    @property
    def version(self) -> str:
        """The version it serves."""
        return self.config.version

    @property
    def state(self) -> ModelState:
        """The state users see (its lifecycle's)."""
        return self.lifecycle.state

    @property
    def reason(self) -> str | None:
        """Why it is not ready, when it is not."""
        return self.lifecycle.reason

    @property
    def label(self) -> str:
        """How errors name it."""
        return f"pipeline '{self.name}'"

    async def load(self) -> None:
        """Check the steps against their models' configs: ready, or failed with every mismatch (a
        failed pipeline is checked again when a step model loads: `recheck_pipelines`)."""
        self.lifecycle.loading()
        problems = check_pipeline(self.config, self._step_configs)
        if problems:
            self.lifecycle.load_failed("; ".join(problems))
            log.error("%s does not fit its step models: %s", self.label, self.reason, extra={"model": self.name})
            return
        for step in self.spec.steps:
            config, _ = self._step_configs(step.model)
            assert config is not None
            self._checked[step.name] = config
        self.lifecycle.loaded()
        log.info("%s ready: %d steps in %d levels", self.label, len(self.spec.steps), len(self.levels),
                 extra={"model": self.name})

    def _step_configs(self, model: str) -> tuple[ModelConfig | None, str]:
        return step_config_of(self._slots, model)

    def step_config_checked(self, step: PipelineStep, config: ModelConfig) -> None:
        """Refuse a step whose model's config changed (a reload) and no longer fits; remember one that does."""
        if self._checked.get(step.name) is config:
            return
        tensors = {t.name: t for t in self.config.inputs}
        for earlier in self.spec.steps:
            if earlier.name == step.name:
                break
            seen = self._checked.get(earlier.name)
            if seen is not None:
                tensors.update({f"{earlier.name}.{out.name}": out for out in seen.outputs})
        problems: list[str] = []
        fixed: StepConfigs = lambda _: (config, "")  # noqa: E731
        check_step(self.config, step, tensors, fixed, problems)
        problems += _outputs_fit(self.config, step, config)
        if problems:
            raise ModelNotReady(f"{self.label} step {step.name!r}: model {step.model!r} changed since the pipeline "
                                f"loaded and no longer fits: {'; '.join(problems)}", retry_after_s=None)
        self._checked[step.name] = config

    def close(self) -> None:
        """Nothing restarts: a pipeline has no worker."""

    async def stop(self, cause: StopCause, reason: str | None = None, worker_timeout_s: float = 5.0) -> None:
        """Take no new request; those running finish on their step models (each step drains there).
        A pipeline that failed its check stays failed (and is not checked again)."""
        self.lifecycle.draining(cause)
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=max(worker_timeout_s, 0.1) * 6)
        self.lifecycle.stopped(reason)

    async def release_snapshot(self) -> None:
        """A pipeline has no snapshot."""

    def fail_all(self, error: ServeError) -> None:
        """Answer every running pipeline request with `error` now (the steps it waits on are dropped)."""
        for future in list(self._inflight):
            if not future.done():
                future.set_exception(error)

    def ready_entry(self) -> ModelEntry:
        """A pipeline is served by running its steps (`run`), never as one model's entry."""
        if self.state != "ready":
            raise not_ready(self.name, self.state, self.reason)
        raise Conflict(f"{self.label} has no worker, scheduler or batching of its own; its steps' models "
                       f"({', '.join(sorted({s.model for s in self.spec.steps}))}) have them")

    def configurable(self) -> ModelEntry:
        """The same: nothing of a pipeline is configured live but through its model.yaml."""
        return self.ready_entry()

    def view(self) -> ModelView:
        """What the API shows of it: state and config; no instances, no queue of its own."""
        return ModelView(self.name, self.version, self.state, self.reason, self.config, None, 0, 0, (), None)

    def sample(self) -> ModelSample:
        """Its state for a scrape; its requests are counted per step."""
        return ModelSample(self.name, self.state, {}, len(self._inflight), self.config.max_batch_size, ())

    def facts(self) -> ModelFacts | None:
        """Nothing of its own to alert on (its step models have their facts)."""
        return None

    def report(self) -> dict[str, Any]:
        """The active config."""
        return {"state": self.state, "version": self.version, "file": str(self.directory / "model.yaml"),
                "loaded_at": self.configured_at, "overrides": {}, "config": self.config.model_dump(mode="json")}

    def check_open(self) -> None:
        """Refuse now what could not run: the pipeline stopping or not ready."""
        life = self.lifecycle
        if not life.serving:
            raise not_ready(self.name, "unloaded" if life.phase is VersionPhase.DRAINING else life.state, life.reason)

    def run(self, chain: AdmissionChain, request: InferenceRequest, rows: int) -> asyncio.Future[RequestResult]:
        """Run an admitted request's steps (the admission chain's last stage for a pipeline)."""
        self.check_open()
        return self._steps.start(chain, request, rows)

    def track(self, future: asyncio.Future[RequestResult]) -> None:
        """Keep a running request until it ends (drain on stop, `fail_all`)."""
        self._inflight.add(future)
        future.add_done_callback(self._inflight.discard)


class PipelineSteps:
    """Runs one pipeline's requests: each step is one more request of the admission chain (its
    model's version, lazy load, input check, deadline, fair lane admission and observers apply),
    with the pipeline request's tenant, deadline and ids; the tensors between steps stay here."""

    __slots__ = ("_entry", "_slots", "_services")

    def __init__(self, entry: PipelineEntry, slots: Mapping[str, ModelSlot], services: EntryServices) -> None:
        self._entry = entry
        self._slots = slots
        self._services = services  # the engine's tracing and metrics

    def start(self, chain: AdmissionChain, request: InferenceRequest, rows: int) -> asyncio.Future[RequestResult]:
        """Run `request`'s steps; the returned future is its answer (cancelling it drops its steps)."""
        outer: asyncio.Future[RequestResult] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(self._run(chain, request, rows))
        task.add_done_callback(partial(_settle, outer))
        outer.add_done_callback(lambda _: task.cancel())  # answered elsewhere or cancelled: drop its steps
        self._entry.track(outer)
        return outer

    async def _run(self, chain: AdmissionChain, request: InferenceRequest, rows: int) -> RequestResult:
        run = _Run(dict(request.inputs), set(), {})
        lanes = self._entry.config.batching.lanes
        lane_name = lanes[min(request.lane, len(lanes) - 1)]
        for level in self._entry.levels:
            if len(level) == 1:
                await self._step(chain, level[0], run, request, lane_name)
                continue
            tasks = [asyncio.ensure_future(self._step(chain, step, run, request, lane_name)) for step in level]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                raise
        config = self._entry.config
        outputs = {spec.name: self._output(spec, run) for spec in config.outputs}
        timings = tuple(run.timings[step.name] for step in self._entry.spec.steps)
        ran = [t for t in timings if t.outcome == "success"]
        return RequestResult(outputs, sum(t.queue_s for t in ran), sum(t.compute_s for t in ran),
                             max((t.batch_size for t in ran), default=rows), steps=timings,
                             version=config.version)

    def _output(self, spec: TensorSpec, run: _Run) -> np.ndarray:
        alternatives = self._entry.spec.alternatives(spec.name)
        for source in alternatives:
            step, _ = split_source(source)
            if step not in run.skipped and source in run.values:
                return run.values[source]
        raise InvalidInput(f"{self._entry.label}: no branch answered output {spec.name!r} for this request (the steps "
                           f"of {alternatives} were skipped by their conditions)")

    async def _step(self, chain: AdmissionChain, step: PipelineStep, run: _Run, request: InferenceRequest,
                    lane_name: str) -> None:
        started = time.monotonic()
        if self._skipped(step, run):
            run.skipped.add(step.name)
            run.timings[step.name] = StepTiming(step.name, step.model, 0.0, 0.0, 0.0, 0, "skipped")
            self._count(step, "skipped", None)
            return
        try:
            config, why = step_config_of(self._slots, step.model)
            if config is None:
                raise ModelNotReady(why, retry_after_s=None)
            self._entry.step_config_checked(step, config)
            inputs = {target: run.values[source] for target, source in step.inputs.items()}
            lanes = config.batching.lanes
            step_request = request.step(step.model, inputs, step.version,
                                        lanes.index(lane_name) if lane_name in lanes else resolve_lane(lanes))
            if self._traced():
                with self._span(step) as span:
                    result = await chain.submit(step_request, coalesce=True)
                    span.set_attribute("servewell.batch_size", result.batch_size)
            else:
                result = await chain.submit(step_request, coalesce=True)
        except ServeError as exc:
            self._count(step, exc.code, None)
            raise _named(exc, self._entry.label, step) from None
        elapsed = time.monotonic() - started
        for name, array in result.outputs.items():
            run.values[f"{step.name}.{name}"] = array
        run.timings[step.name] = StepTiming(step.name, step.model, result.queue_s, result.compute_s, elapsed,
                                            result.batch_size, "success")
        self._count(step, "success", elapsed)

    def _skipped(self, step: PipelineStep, run: _Run) -> bool:
        """Whether the step does not run: a source of it was skipped, or its condition is false."""
        if run.skipped and any(name in run.skipped for name in self._entry.source_steps[step.name]):
            return True
        if step.when is None:
            return False
        return not bool(np.all(run.values[step.when.tensor] == step.when.equals))

    def _traced(self) -> bool:
        """Whether the request is traced (tracing on, and a sampled request span to hang steps under)."""
        tracing = self._services.tracing
        return tracing is not None and tracing.enabled and trace.get_current_span().get_span_context().is_valid

    @contextmanager
    def _span(self, step: PipelineStep) -> Iterator[trace.Span]:
        """A span for the step, a child of the request's span, current while the step is queued (so the
        step model's batch span links to it); only for a traced request (`_traced`)."""
        tracing = self._services.tracing
        assert tracing is not None
        name = self._entry.name
        with tracing.tracer.start_as_current_span(
                f"step {step.name}", attributes={"servewell.pipeline": name, "servewell.step": step.name,
                                                 "servewell.model": step.model}) as span:
            yield span

    def _count(self, step: PipelineStep, outcome: str, elapsed: float | None) -> None:
        metrics = self._services.metrics
        if metrics is None:
            return
        name = self._entry.name
        metrics.pipeline_steps.labels(name, step.name, outcome).inc()
        if elapsed is not None:
            metrics.pipeline_step_duration.labels(name, step.name).observe(elapsed)


def step_config_of(slots: Mapping[str, ModelSlot], name: str) -> tuple[ModelConfig | None, str]:
    """A pipeline step's model config as model.yaml says now, or None with why it cannot be a step."""
    slot = slots.get(name)
    if slot is None:
        return None, f"the repository has no model {name!r}"
    config = slot.entry.config
    if config is None:
        return None, f"model {name!r} is invalid: {slot.entry.reason}"
    if config.kind == "pipeline":
        return None, f"model {name!r} is a pipeline; a step must be a model (list its steps here instead)"
    return config, ""


async def recheck_pipelines(slots: Mapping[str, ModelSlot], loaded: str) -> None:
    """Check again each pipeline that failed and has a step on model `loaded`, which just loaded:
    a step model that was missing or invalid when the pipeline loaded may fit now."""
    for slot in list(slots.values()):
        entry = slot.entry
        if isinstance(entry, PipelineEntry) and entry.lifecycle.recheckable and \
                any(step.model == loaded for step in entry.spec.steps):
            async with slot.lock:
                if slot.entry is entry:
                    await entry.load()


def _settle(outer: asyncio.Future[RequestResult], task: asyncio.Future[RequestResult]) -> None:
    """Hand a finished run's result or error to the request's future (unless it was answered already)."""
    if outer.done():
        return
    if task.cancelled():
        outer.cancel()
    elif (error := task.exception()) is not None:
        outer.set_exception(error)
    else:
        outer.set_result(task.result())


def _named(error: ServeError, label: str, step: PipelineStep) -> ServeError:
    """A copy of a step's error whose message names the pipeline, the step and its model (the error
    object may be shared by every request of a batch: it is not changed)."""
    named = copy.copy(error)
    named.message = f"{label} step {step.name!r} (model {step.model!r}): {error.message}"
    named.args = (named.message,)
    return named


def _levels(steps: list[PipelineStep]) -> list[list[PipelineStep]]:
    """Steps grouped so each group's sources come from inputs or earlier groups: a group runs together."""
    level: dict[str, int] = {}
    for step in steps:
        after = [level[s] for s in (split_source(source)[0] for source in _sources(step)) if s is not None]
        level[step.name] = 1 + max(after, default=-1)
    return [[s for s in steps if level[s.name] == n] for n in range(max(level.values()) + 1)]


def _sources(step: PipelineStep) -> list[str]:
    """The tensors a step reads: its inputs' sources and its condition's tensor."""
    return list(step.inputs.values()) + ([step.when.tensor] if step.when is not None else [])


def _outputs_fit(config: ModelConfig, step: PipelineStep, step_config: ModelConfig) -> list[str]:
    """What of the pipeline (later steps, its outputs) reads an output the step's model no longer has."""
    have = {out.name for out in step_config.outputs}
    spec = config.pipeline
    assert spec is not None
    sources = [src for s in spec.steps for src in s.inputs.values()]
    sources += [src for out in config.outputs for src in spec.alternatives(out.name)]
    missing = sorted({split_source(src)[1] for src in sources
                      if split_source(src)[0] == step.name and split_source(src)[1] not in have})
    return [f"its outputs {sorted(have)} lack {missing}"] if missing else []
