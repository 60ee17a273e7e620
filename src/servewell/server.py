"""Composition root: settings -> repository -> engine (+ its control table) -> app -> uvicorn.

`build_engine` composes the engine side (what a split server's engine process runs, engine_main.py:
no HTTP app, only the door); `build_app` adds the HTTP app and gRPC on top of it for the
single-process server (`--ingress-processes 0`, `serve`)."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from servewell.allocator import bound_freed_memory
from servewell.api.app import create_app
from servewell.api.codecs.image import ImageLimits
from servewell.api.control_handlers import control_table
from servewell.api.control_plane import LocalControlPlane
from servewell.api.dataplane import DataPlane
from servewell.api.decode_scheduler import DecodeScheduler
from servewell.api.diagnosis_evidence import ServerViews, process_memory
from servewell.api.early_refusal import EarlyRefusal
from servewell.api.engine_parts import EngineParts
from servewell.api.grpc.listener import build_grpc_listener, call_slots
from servewell.api.grpc.scope import RpcScope
from servewell.api.grpc.servicer import InferenceServicer
from servewell.api.http_limits import uvicorn_limit_options
from servewell.api.keys import InferenceAccess
from servewell.api.state import AppState, LiveKnobs
from servewell.config.server import ConfigFileError, ConfigSource, ServerConfig
from servewell.engine.control import ControlDispatch
from servewell.engine.door import EngineDoor
from servewell.engine.engine import InferenceEngine
from servewell.engine.envelope import LiveSettings
from servewell.engine.model_pool import PoolSettings
from servewell.engine.snapshot import SnapshotStore
from servewell.engine.tenants import Tenants
from servewell.engine.versions import rollout_gauges
from servewell.live_config import ConfigReloader, load_keys
from servewell.observability.alerting import run_alerting
from servewell.observability.console_feed import ConsoleFeed
from servewell.observability.gpu import GpuProbe
from servewell.observability.metrics import (
    ProcessRestartsCollector,
    RolloutCollector,
    ServeMetrics,
    StateCollector,
    ViewsCollector,
)
from servewell.observability.payload_log import PayloadLog, PayloadLogCollector
from servewell.observability.process import process_facts
from servewell.observability.signals import SignalTracker
from servewell.observability.steps import set_step_sink
from servewell.observability.tracing import Tracing, settings_from
from servewell.process_tree import read_restart_counts, usable_cpus
from servewell.shutdown import GracefulServer, ShutdownPlan, run_after_drain, uvicorn_graceful_timeout_s
from servewell.tenancy.keys import KeyFormatError
from servewell.threads import lower_priority_pool
from servewell.workers.handle import WorkerSettings
from servewell.workers.load_slots import load_retry_for, load_slots_for
from servewell.workers.messages import SpareLaunch
from servewell.workers.output_cap import output_limits_for
from servewell.workers.shm import NAME_PREFIX, remove_segments, remove_stale_segments
from servewell.workers.spare import (
    SpareWorkers,
    effective_load_cpu_policy,
    effective_spare_workers,
    effective_warmup_first_only,
)

log = logging.getLogger("servewell.server")

BUILTIN_MODEL = "digits"


def builtin_repository(cache_dir: Path) -> Path:
    """Where the built-in models live."""
    return cache_dir / "models"


def ensure_builtin_repository(cache_dir: Path) -> Path:
    """Build (once, cached) the built-in digits model and return its repository.

    Building imports torch, so it runs in a child process: the frontend never imports it.
    """
    repository = builtin_repository(cache_dir)
    missing = [name for name in ("torch", "onnx", "sklearn", "onnxruntime") if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigFileError(f"the built-in model needs {', '.join(missing)}, which are not installed: "
                              "pip install 'servewell[examples]', or serve your own models with --model-repository")
    if not (repository / BUILTIN_MODEL / "model.yaml").is_file():
        log.info("building the built-in model '%s' into %s (first run only)", BUILTIN_MODEL, repository)
    command = [sys.executable, "-m", "servewell.examples.build", BUILTIN_MODEL, "--out", str(repository)]
    done = subprocess.run(command, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"building the built-in model failed (exit code {done.returncode})")
    return repository


def _log_progress(model: str, instance: int, stage: str, elapsed_s: float) -> None:
    log.info("loading %s[%d]: %s (%.1f s)", model, instance, stage, elapsed_s,
             extra={"model": model, "instance": instance, "stage": stage, "elapsed_s": round(elapsed_s, 3)})


#: Net new container objects between two young-generation collections (CPython's default: 700).
#: Requests in flight allocate in bursts that crossed 700 about once every 9 requests on the tiny
#: MLP (and every 10th of those collections scans the middle generation too): about 22 us of CPU
#: per request. Nearly everything a request allocates is freed by reference counting, so at 10,000
#: a collection runs about once per thousand requests; what one still finds is at most 10,000
#: small objects' worth of cyclic garbage.
GC_YOUNG_THRESHOLD = 10_000


def tune_garbage_collector() -> None:
    """Keep the cyclic garbage collector off the request path.

    What exists at startup (modules, routes, settings: about 80,000 objects) lives as long as the
    process, yet every full collection walked it all: a 30 ms pause about every 0.6 s under load
    on the tiny MLP, some 30 us of CPU per request. It is frozen (moved out of the collector's
    reach) after a last collection, so no startup garbage is pinned; and young collections run
    less often (`GC_YOUNG_THRESHOLD`). Measured with `gc.callbacks` timing every collection of a
    server under the tiny MLP's closed loop (32 clients): 51 us of collection per request before,
    4 after; exposed as `python_gc_collections_total` on /metrics."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


def build_decoder(settings: ServerConfig) -> tuple[DecodeScheduler, tuple[ThreadPoolExecutor, ...]]:
    """The image decode scheduler and the thread pools it runs on (shut them down at exit)."""
    pool = ThreadPoolExecutor(settings.decode_threads, thread_name_prefix="decode")
    heavy_pool = lower_priority_pool(max(1, settings.decode_threads - 1), settings.decode_heavy_nice, "decode-heavy")
    decoder = DecodeScheduler(pool, settings.decode_threads, settings.decode_queue_size, heavy_executor=heavy_pool)
    return decoder, (pool, heavy_pool)


def snapshot_store(settings: ServerConfig) -> SnapshotStore | None:
    """Where model versions are copied before their workers load them (None: snapshots off)."""
    if not settings.artifact_snapshots:
        return None
    return SnapshotStore(settings.cache_dir / "snapshots", max_bytes=settings.snapshot_max_bytes)


@dataclass(frozen=True, slots=True)
class EngineSide:
    """The engine and what runs beside it in the process that holds it (the single-process server,
    or a split server's engine process): registry, workers, live config, console feed, alerting,
    metrics, and the control plane's one table (`control`)."""

    engine: InferenceEngine
    access: InferenceAccess
    knobs: LiveKnobs
    metrics: ServeMetrics | None
    tracing: Tracing
    console: ConsoleFeed
    #: The one dispatch table of the control plane (engine/control.py, api/control_handlers.py).
    control: ControlDispatch
    #: The shutdown it follows (signals, delay, drain: `shutdown.py`).
    plan: ShutdownPlan
    #: Start serving: models load in the background, so liveness answers at once.
    startup: Callable[[], Awaitable[None]]
    #: After the drain: stop the workers, the door, the exporters.
    shutdown: Callable[[], Awaitable[None]]


def build_engine(settings: ServerConfig, source: ConfigSource | None = None,
                 door_path: str | None = None) -> EngineSide:
    """The engine side of a server for `settings`. `source` (where the settings came from) is
    watched for changes; without it, only model.yaml files are. `door_path`: this is the engine
    process of a split server, and its ingress processes hand in their requests and control
    operations at that unix socket (engine/door.py)."""
    try:
        keys = load_keys(settings)
    except (KeyFormatError, OSError) as exc:
        raise ConfigFileError(f"API keys: {exc}") from None
    repository = settings.model_repository or ensure_builtin_repository(settings.cache_dir)
    default_model = settings.default_model or (None if settings.model_repository else BUILTIN_MODEL)
    metrics = ServeMetrics(settings.latency_buckets_s) if settings.metrics_enabled else None
    tracing = Tracing(settings_from(settings.otlp_endpoint, settings.otlp_protocol, settings.trace_sample_ratio),
                      decides_roots=True)
    # Pre-spawned workers for fast cold starts (issue 21): started with the app, stopped after the engine.
    output = output_limits_for(settings)  # what of a worker's stdout/stderr reaches the log (issue 45)
    spares = SpareWorkers(effective_spare_workers(settings), SpareLaunch(settings.log_level, settings.log_format),
                          output, fork_on_demand=settings.fork_worker_starts)
    console = ConsoleFeed(metrics)  # the console's series, recent requests, audit trail, replacements, memory
    workers = WorkerSettings(settings.worker_heartbeat_timeout_s, settings.log_level, settings.log_format,
                             tracing.settings, spares=spares, warmup_first_only=effective_warmup_first_only(settings),
                             load_cpu_policy=effective_load_cpu_policy(settings),
                             max_output_bytes=settings.max_output_bytes, load_slots=load_slots_for(settings),
                             load_retry=load_retry_for(settings), output=output, events=console.worker_events)
    access = InferenceAccess(keys, settings.api_key_rate_per_s, metrics=metrics)
    tenants = Tenants(lambda: access.ring if access.enabled else None, metrics,
                      default_rate=lambda: access.default_rate_per_s)
    engine = InferenceEngine(Path(repository), settings.load_timeout_s, _log_progress, settings.memory_budget_bytes,
                             metrics, tracing, default_model, workers=workers, snapshots=snapshot_store(settings),
                             readiness=settings.readiness, required_models=settings.required_models,
                             models_outside_repository=settings.models_outside_repository,
                             pool=PoolSettings(settings.repository_mode, settings.repository_poll_s,
                                               settings.max_load_wait_ms / 1000,
                                               settings.max_concurrent_loads or max(1, usable_cpus() // 4),
                                               settings.load_queue_per_model, settings.idle_unload_s),
                             device_memory_budget_bytes=settings.device_memory_budget_bytes, tenants=tenants)
    try:  # in the engine process: every request of every ingress passes it (observability/payload_log.py)
        payload_log = PayloadLog(settings.payload_log)
    except OSError as exc:
        raise ConfigFileError(f"payload_log: {exc}") from None
    engine.payload_log = payload_log
    if metrics is not None:
        metrics.registry.register(PayloadLogCollector(payload_log))
        set_step_sink(lambda name, seconds: metrics.trace_steps.labels(name).observe(seconds), tracing.tracer)
        gpus = GpuProbe()
        metrics.registry.register(RolloutCollector(lambda: rollout_gauges(engine.registry.slots.values())))
        metrics.registry.register(StateCollector(engine.views.samples, process_facts, gpus.read,
                                                 lambda: engine.views.memory_budget, lambda: engine.ready,
                                                 lambda: (engine.budget.device_total_bytes,
                                                          engine.budget.device_used_bytes)))
    knobs = LiveKnobs(settings.slow_request_ms / 1000.0, settings.metrics_require_key)
    views = ServerViews(engine, console)  # each model's diagnosis, the processes' memory, rollouts into the audit
    console.on_tick.append(views.tick)
    console.memory_source = lambda: process_memory(engine, console)
    if metrics is not None:
        metrics.registry.register(ViewsCollector(lambda: console.diagnoses, console.memory.latest))
    console.recent.slow_log.lines_per_window = settings.slow_request_lines_per_model
    reloader = ConfigReloader(source or ConfigSource(None, {}), settings, engine, access, tracing, knobs,
                              metrics.registry if metrics is not None else None, audit=console.audit)
    control = control_table(EngineParts(engine, settings, access, knobs, console, metrics, reloader.report,
                                        reloader.status))
    door = None
    if door_path is not None:
        door = EngineDoor(engine, door_path,
                          live=lambda: LiveSettings(reloader.settings, access.ring, access.default_rate_per_s),
                          absorb=console.view.absorb, retire=console.view.retire,
                          shared_min_bytes=settings.shared_tensor_min_bytes,
                          shared_limit_bytes=settings.shared_tensor_limit_bytes, control=control)
        console.view.set_refresher(door.pull_views)  # /metrics, the console and alerts see every ingress
        if metrics is not None:
            run_dir = Path(door_path).parent
            metrics.registry.register(ProcessRestartsCollector(lambda: read_restart_counts(run_dir)))
    background: list[asyncio.Task[None]] = []
    stop = asyncio.Event()
    plan = ShutdownPlan(engine, settings.shutdown_delay_s, settings.shutdown_timeout_s)

    async def start_engine_then_watch() -> None:
        await engine.start()
        reloader.watch_models()  # the models as loaded are the baseline of their model.yaml files

    async def startup() -> None:
        loop = asyncio.get_running_loop()
        tune_garbage_collector()
        if door is not None:
            await door.start()  # ingress processes connect now and see the models load
        spares.start()
        background.append(loop.create_task(start_engine_then_watch()))
        background.append(loop.create_task(reloader.run(stop)))
        background.append(loop.create_task(console.run()))
        loop.add_signal_handler(signal.SIGHUP,
                                lambda: background.append(loop.create_task(reloader.check(settle=False))))
        if metrics is not None:  # always evaluated (console, /healthz); the webhook only delivers
            tracker = SignalTracker(metrics, engine.views.model_facts, lambda: console.diagnoses)
            background.append(loop.create_task(run_alerting(settings.alerting, tracker.snapshots, stop,
                                                            active=console.alerts, refresh=console.view.refresh)))

    async def shutdown() -> None:
        stop.set()
        for task in background:
            if not task.done():
                task.cancel()
        await run_after_drain(plan, lambda worker_stop_s: engine.stop(worker_stop_s))
        await spares.stop()
        if door is not None:
            await door.stop()
        await asyncio.to_thread(payload_log.close)  # every request is answered: bounded (CLOSE_TIMEOUT_S)
        await asyncio.to_thread(tracing.shutdown)  # bounded (SHUTDOWN_FLUSH_S)

    return EngineSide(engine, access, knobs, metrics, tracing, console, control, plan, startup, shutdown)


def build_app(settings: ServerConfig, source: ConfigSource | None = None) -> tuple[FastAPI, ShutdownPlan]:
    """The single-process server's app for `settings` (`--ingress-processes 0`: the engine, the HTTP
    app and gRPC in this one process) and the shutdown it follows (signals, delay, drain: `shutdown`);
    models load in the background once it starts, so liveness answers at once and readiness tells
    the truth while they load."""
    side = build_engine(settings, source)
    decoder, pools = build_decoder(settings)
    plane = DataPlane(side.engine, decoder, ImageLimits(settings.max_image_pixels, settings.max_image_side),
                      side.metrics, side.tracing, side.access.tenant_of)
    control = LocalControlPlane(side.control)
    grpc_listener = None
    if settings.grpc_port:
        scope = RpcScope(side.metrics, side.tracing, side.access, side.knobs, side.console.recent, call_slots(settings))
        servicer = InferenceServicer(side.engine, control, plane, scope, settings.admin_token,
                                     trust_loopback_admin=settings.trust_loopback_admin)
        grpc_listener = build_grpc_listener(settings, servicer, scope)
    shutdown_plan = side.plan
    grpc_stopping: list[asyncio.Task[None]] = []

    def stop_grpc() -> None:
        # From readiness false on: GOAWAY to every connection, new ones refused (clients go to another
        # replica); calls in flight finish within the delay and the drain.
        if grpc_listener is not None and not grpc_stopping:
            grace_s = shutdown_plan.delay_s + shutdown_plan.timeout_s
            grpc_stopping.append(asyncio.get_running_loop().create_task(grpc_listener.stop(grace_s)))

    shutdown_plan.on_begin(stop_grpc)
    shutdown_plan.on_listeners_closed(stop_grpc)

    async def startup() -> None:
        await side.startup()
        if grpc_listener is not None:
            await grpc_listener.start()

    async def shutdown() -> None:
        stop_grpc()
        await asyncio.gather(*grpc_stopping)  # gRPC calls in flight finish on a still-serving engine
        await side.shutdown()
        for pool in pools:
            pool.shutdown(wait=False)

    state = AppState(side.engine, plane, control, settings, side.metrics, side.access, side.knobs, side.console)
    return create_app(state, startup, shutdown, side.tracing), shutdown_plan


def serve(settings: ServerConfig, source: ConfigSource | None = None) -> None:
    """Run the server until SIGINT/SIGTERM (see `shutdown` for the order: readiness, listeners,
    drain, workers); every accepted request is answered before exit. SIGHUP (and every
    `config_poll_s`) re-reads the configuration files."""
    remove_leftovers(settings)
    bound_freed_memory()
    app, plan = build_app(settings, source)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_config=None, access_log=False,
        timeout_graceful_shutdown=uvicorn_graceful_timeout_s(plan), lifespan="on",
        **uvicorn_limit_options(settings, EarlyRefusal.of(app)),
    )
    log.info("servewell listening on http://%s:%d", settings.host, settings.port)
    try:
        GracefulServer(config, plan).run()
    finally:
        remove_own_segments()


def remove_own_segments() -> None:
    """At exit: every worker removed its segments as it stopped; this catches what a bug would leave."""
    left = remove_segments(f"{NAME_PREFIX}{os.getpid()}")
    if left:
        log.warning("removed %d shared-memory segments left at exit", left)


def remove_leftovers(settings: ServerConfig) -> None:
    """Remove what servers that were killed (kill -9, OOM) left: shared memory, model snapshots."""
    segments = remove_stale_segments()
    store = snapshot_store(settings)
    snapshots = store.remove_stale() if store is not None else 0
    if segments or snapshots:
        log.info("removed %d shared-memory segments and %d model snapshots left by servers that no longer run",
                 segments, snapshots)
