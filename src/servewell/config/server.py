"""Typed configuration of the server: one tree, read from a file, the environment and the CLI.

Precedence: CLI flags > environment (`SERVEWELL_<FIELD>`, read only in `load_server_config`) >
config file (YAML) > defaults. Field descriptions are the CLI's help text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from servewell.config.alerting import AlertingConfig
from servewell.config.bounded_yaml import cut, load_bounded, short_yaml_error
from servewell.config.fields import values_from_env
from servewell.config.file_read import DEFAULT_MAX_CONFIG_BYTES, decode_utf8, read_config_bytes
from servewell.config.payload_log import PayloadLogConfig

ENV_PREFIX = "SERVEWELL_"


class ServerConfig(BaseModel):
    """Everything `servewell serve` can be told."""

    model_config = ConfigDict(extra="forbid")

    model_repository: Path | None = Field(
        None, description="Directory with one sub-directory per model; default: the built-in digits model."
    )
    default_model: str | None = Field(
        None, description="Model /predict uses when a request names none; default: the built-in model, else the "
        "repository's first valid model.",
    )
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=1, le=65535, description="TCP port to listen on.")
    grpc_port: int = Field(8001, ge=0, le=65535, description="TCP port of the OIP v2 gRPC listener (Triton's "
                           "GRPCInferenceService); 0 turns it off.")
    grpc_max_concurrent_rpcs: int = Field(
        1024, ge=1, description="gRPC calls served at once, counted from when a call's message is in and its key "
        "checked; more are refused with RESOURCE_EXHAUSTED and a retry-after trailer (per process serving gRPC: each "
        "ingress process of a split server has its own).")
    # gRPC connection and stream limits (api/grpc/listener.py), so the gRPC port cannot starve HTTP of descriptors.
    grpc_max_connections: int = Field(
        1000, ge=1, le=1_000_000, description="gRPC connections open at once (more are closed on accept); lowered "
        "at start so that HTTP's connections and fd_reserve always fit under the open-files limit (per process serving "
        "gRPC: each ingress process of a split server has its own). Past three quarters of it, the oldest connections "
        "that never opened a call (then those idle longest, 5 s at least) are closed to keep room for new clients.")
    grpc_max_streams_per_connection: int = Field(
        100, ge=1, le=10_000, description="Calls one gRPC connection may have open at once (HTTP/2 "
        "MAX_CONCURRENT_STREAMS).")
    grpc_handshake_timeout_s: float = Field(
        10.0, gt=0, le=600, description="Time a new gRPC connection has to send the HTTP/2 preface and SETTINGS.")
    grpc_idle_timeout_s: float = Field(
        60.0, gt=0, le=86_400, description="A gRPC connection with no call open this long is sent GOAWAY and closed.")
    grpc_max_connection_age_s: float = Field(
        3600.0, gt=0, le=604_800, description="A gRPC connection this old is sent GOAWAY (clients reconnect), so "
        "none is held for ever.")
    grpc_connection_age_grace_s: float = Field(
        30.0, ge=0, le=3600, description="Time the calls of a connection sent GOAWAY for its age get to finish "
        "before it is closed.")
    grpc_receive_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="Time a gRPC call's request message has to arrive complete after its "
        "headers (DEADLINE_EXCEEDED after; as body_timeout_s over HTTP).")
    grpc_min_ping_interval_s: float = Field(
        10.0, gt=0, le=3600, description="Shortest interval between client keepalive pings the gRPC listener "
        "accepts; a client pinging faster is sent GOAWAY (too_many_pings).")
    fd_reserve: int = Field(
        256, ge=32, le=100_000, description="Open files kept free for workers, model files, logs and HTTP probes: "
        "the gRPC connection cap is lowered so that it never eats into them.")
    cache_dir: Path = Field(
        Path.home() / ".cache" / "servewell", description="Where built-in models are built and cached."
    )
    max_body_bytes: int = Field(1_048_576, ge=1024, description="Largest request body accepted (413 above).")
    max_output_bytes: int = Field(
        64 << 20, ge=1024, description="Largest answer to one request, all its outputs together, in bytes, for a "
        "model whose model.yaml sets no max_output_bytes: a larger one is refused in the worker (500 "
        "output_too_large), so it never crosses to the engine and the ingress nor holds their event loops.",
    )
    max_image_pixels: int = Field(
        16_000_000, ge=1,
        description="Largest decoded image, in pixels, accepted (413 above; stops decompression bombs).",
    )
    load_timeout_s: float = Field(
        30.0, gt=0, description="A model whose load and warm-up take longer is killed and marked failed (counted "
        "from the load's turn: time waiting for a load slot is not counted; see max_loading_workers)."
    )
    max_loading_workers: int | None = Field(
        None, ge=1, le=256, description="Worker starts (spawn, imports, model load, warm-up) running at once across "
        "every model, in every repository mode (at start, reloads, versions, lazy loads, restarts); the others wait "
        "in order, shown as instance state 'queued'. Default: one per usable CPU (the affinity mask, at most the "
        "container's CPU limit).",
    )
    load_attempts: int = Field(
        3, ge=1, le=20, description="Attempts a model instance's load gets when it times out or its worker dies "
        "while loading (a load the model itself refuses, such as an exception in its setup, is not tried again); "
        "between attempts the instance shows state 'backoff' and next_attempt_at in /healthz. 1: no retry.",
    )
    load_retry_backoff_s: float = Field(
        2.0, ge=0, le=600, description="Wait before a load's second attempt, doubling for each further one (at "
        "most 60 s).",
    )
    max_image_side: int = Field(
        16_384, ge=1, description="Longest image side, in pixels, accepted (413 above; checked from the header)."
    )
    decode_queue_size: int = Field(
        64, ge=1, description="Image decodes that may wait for a decode thread (urgent ones: as many again); "
        "past it requests are refused with 503 overloaded before their images are decoded.",
    )
    memory_budget_bytes: int | None = Field(
        None, ge=1, description="Host memory all models together may use (estimated before loading); "
        "default: 90% of the memory available at start (within a container, of what its cgroup limit leaves).",
    )
    device_memory_budget_bytes: int | None = Field(
        None, ge=1, description="GPU memory all models on a device together may use (estimated before loading); "
        "unset: not limited by the server.",
    )
    repository_mode: Literal["eager", "lazy"] = Field(
        "eager", description="eager: every model loads at start; lazy: models are listed (with their estimated "
        "memory) and load on their first request, evicting idle ones when the memory budget is full.",
    )
    repository_poll_s: float = Field(
        5.0, ge=0, le=3600, description="Lazy mode: how often the repository is scanned for new model directories "
        "(0: never; new models then need an explicit load).",
    )
    max_load_wait_ms: int = Field(
        30000, ge=0, le=600000, description="How long a request waits for its model to load (lazy mode; its own "
        "deadline may cut it shorter).",
    )
    max_concurrent_loads: int | None = Field(
        None, ge=1, le=64, description="Model loads running at once (lazy mode); default: a quarter of the usable "
        "CPUs, at least 1 (a load keeps a core busy for seconds: more at once take the cores the resident models "
        "serve from).",
    )
    load_queue_per_model: int = Field(
        64, ge=0, le=100000, description="Requests that may wait for one model's load; past it: 503 model_loading "
        "with a Retry-After from the measured load time.",
    )
    idle_unload_s: float = Field(
        0.0, ge=0, description="Unload a model (not pinned) after this many seconds without a request, counted from "
        "the end of the load a request started if that came later; a model's own idle_unload_s wins (0: never).",
    )
    admin_token: str | None = Field(
        None, description="Bearer token for /admin endpoints; when unset they answer loopback clients only."
    )
    trust_loopback_admin: bool = Field(
        True, description="With no admin_token: let loopback clients that did not come through a proxy (no "
        "Forwarded, X-Forwarded-*, X-Real-IP or Via header) use the admin endpoints; false: admin needs the token.",
    )
    api_keys_file: Path | None = Field(
        None, description="File of API keys for inference, one per line ('<key>', '<id>:<key>' or "
        "'<id>:sha256:<hex>', optionally ' rate=<n>'); watched and reloaded. Unset and no api_keys: inference is open.",
    )
    api_keys: list[str] = Field(
        default_factory=list, description="API keys in the same format, from SERVEWELL_API_KEYS (comma separated) "
        "or the config file; never a command-line flag (it would show in ps).",
    )
    api_key_rate_per_s: float | None = Field(
        None, gt=0, description="Requests per second each tenant may make (a key without tenant= is its own "
        "tenant), for the whole server (429 over_quota + Retry-After above); a key's own 'rate=' wins. Unset: no "
        "limit.",
    )
    metrics_require_key: bool = Field(
        False, description="Kept so old configuration files load; it changes nothing (with API keys configured, "
        "/metrics always needs an operator: the admin token or a role=operator key as a bearer credential, or a "
        "trusted loopback client), except that true without any API key still refuses to start.")
    config_poll_s: float = Field(
        2.0, ge=0, description="How often the --config file, the API keys file and every model.yaml are checked for "
        "changes (0: only on SIGHUP).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Lowest level logged.")
    log_format: Literal["json", "console"] = Field("json", description="JSON lines, or human-readable console lines.")
    metrics_enabled: bool = Field(True, description="Serve Prometheus metrics at /metrics and record them.")
    slow_request_ms: float = Field(
        300.0, gt=0, description="Requests slower than this log a warning with their stage breakdown."
    )
    slow_request_lines_per_model: int = Field(
        5, ge=0, le=10_000, description="Slow requests logged one by one per model in each 10 s; the rest of "
        "those 10 s are summed up in one line (count, p50/p99, the slowest three with their ids and stages).",
    )
    latency_buckets_s: list[float] = Field(
        default_factory=lambda: [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
        min_length=1, description="Bucket bounds (seconds) of the latency histograms.",
    )
    otlp_endpoint: str | None = Field(
        None,
        description="OTLP collector for traces (default: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT); unset: tracing off.",
    )
    otlp_protocol: Literal["http/protobuf", "grpc"] | None = Field(
        None, description="OTLP transport (default: OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf).",
    )
    trace_sample_ratio: float | None = Field(
        None, ge=0, le=1,
        description="Share of traces recorded (default: OTEL_TRACES_SAMPLER_ARG, else 0.01; a sampled incoming "
        "traceparent is always followed).",
    )
    alerting: AlertingConfig = Field(
        default_factory=AlertingConfig, description="Optional alert webhook (config file only: nested settings)."
    )
    payload_log: PayloadLogConfig = Field(
        default_factory=PayloadLogConfig, description="Sampled log of requests and answers to JSONL files and/or "
        "CloudEvents over HTTP (config file only: nested settings; off by default; applied live).")
    decode_threads: int = Field(2, ge=1, le=64, description="Threads that decode and resize images off the event loop.")
    decode_heavy_nice: int = Field(
        10, ge=0, le=19,
        description="How many nice steps below normal the threads decoding images over a megapixel run (0: same).",
    )
    # Connection and request limits, enforced by the HTTP protocol (api/http_limits.py) before the app sees a request.
    max_header_bytes: int = Field(
        16_384, ge=1024, le=1_048_576,
        description="Largest request head (request line and headers) read (431 and closed above).",
    )
    max_header_count: int = Field(
        100, ge=8, le=10_000, description="Most header fields a request may carry (431 above).")
    max_url_bytes: int = Field(
        8192, ge=256, le=1_048_576, description="Longest URL a request line may carry (414 above).")
    header_timeout_s: float = Field(
        10.0, gt=0,
        description="Time a connection has to send a request's head (408 and closed after; silently if it sent "
        "nothing).",
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="Time a request's body has to arrive after its head (408 and closed after).")
    keep_alive_timeout_s: float = Field(
        5.0, gt=0, description="An idle keep-alive connection is closed after this long.")
    max_connections: int = Field(
        1024, ge=1, le=1_000_000,
        description="Client connections open at once; when full, the longest-waiting idle one is closed for a "
        "newcomer, and with none idle the newcomer gets 503.",
    )
    reserved_connections: int = Field(
        16, ge=0, le=10_000,
        description="Connections beyond max_connections that may only ask for health probes and /metrics.",
    )
    # Per-connection bounds on pipelining, slow bodies and unread answers (issue 19, items 8 and 9).
    max_pipelined_requests: int = Field(
        16, ge=1, le=1024, description="Requests one connection may send ahead of the answer it waits for; past "
        "that, those queued and the next are answered 503 and the connection closes (the client retries them).",
    )
    min_body_rate_bytes_s: float = Field(
        1024.0, ge=0, description="Slowest average rate, in bytes per second, at which a request body may arrive "
        "once body_rate_grace_s has passed (408 and closed below; 0: no minimum).",
    )
    body_rate_grace_s: float = Field(
        2.0, ge=0, description="Time a request body may take before min_body_rate_bytes_s applies.")
    send_timeout_s: float = Field(
        30.0, gt=0, description="Time an answer may wait for a client that reads nothing while the connection's "
        "send buffer is full; the connection is then closed.",
    )
    readiness: Literal["any", "strict", "required-models"] = Field(
        "any", description="When the server reports ready: any (every first load finished and at least one model "
        "ready: a failed model keeps the others in rotation), strict (every model ready, as Triton), or "
        "required-models (every model in --required-models ready).",
    )
    required_models: list[str] = Field(
        default_factory=list, description="Models that must be ready for the server to be ready, with "
        "--readiness required-models.",
    )
    shutdown_delay_s: float = Field(
        5.0, ge=0, le=300, description="After SIGTERM, seconds the server stays up and serving with readiness "
        "false before it closes its listeners, so load balancers stop sending first (SIGINT skips it).",
    )
    shutdown_timeout_s: float = Field(
        20.0, gt=0, le=3600, description="Longest the drain after the listeners close may take; then the requests "
        "still waiting get 503 shutting_down and the workers are stopped (a second SIGTERM or SIGINT: at once).",
    )
    worker_heartbeat_timeout_s: float = Field(
        2.0, gt=0, le=600, description="A worker whose heartbeat thread is silent this long (stopped, or stuck "
        "holding the GIL) is declared hung, killed and replaced.",
    )
    artifact_snapshots: bool = Field(
        True, description="Load each model version from a private copy of its directory under cache_dir/snapshots, "
        "so that overwriting a served file in place cannot crash its workers; off: workers map the repository's "
        "files (publish new versions only by atomic rename).",
    )
    # A worker's stdout and stderr in the server's log (issue 45): workers/output_cap.py.
    worker_output_rate_bytes_per_s: int = Field(
        65536, ge=0, le=1 << 30, description="Bytes per second of one worker's stdout and stderr (a python model's "
        "prints, a library's messages) that reach the server's log after its burst; the rest is dropped and counted "
        "in a warning (event worker_output_dropped).",
    )
    worker_output_burst_bytes: int = Field(
        1 << 20, ge=4096, le=1 << 30, description="Bytes of one worker's output that may reach the log at once "
        "before the rate applies (a crash's stack trace, a burst of warnings).",
    )
    worker_output_line_max_bytes: int = Field(
        16384, ge=256, le=1 << 24, description="Longest line of a worker's output that reaches the log whole; a "
        "longer one is cut there and marked.",
    )
    # Fast cold starts (issue 21): workers/spare.py.
    spare_workers: int | None = Field(
        None, ge=0, le=64, description="Worker processes kept started ahead of time with the runtime imported, "
        "taken by the next model load instead of a fresh spawn (a load skips the interpreter start and imports); "
        "default: 1 in the lazy repository mode, else 0.",
    )
    fork_worker_starts: bool = Field(
        True, description="A worker start that finds no idle spare forks one from the engine's fork server (which "
        "imported the worker's modules once: about 10 ms of CPU a start) instead of starting a fresh interpreter "
        "(about a second of CPU each, which a start of many models paid once per worker). The fork server is one "
        "more process of the engine, started with the first worker; false: fresh spawns, as before.",
    )
    load_cpu_policy: Literal["idle", "normal"] | None = Field(
        None, description="The CPU priority a model load and its warm-up run at; default: idle in the lazy "
        "repository mode (loads run while the resident models serve), else normal (a restart under load comes "
        "back sooner: a starved idle load starts over). idle: SCHED_IDLE (Linux), so any "
        "serving thread that wakes preempts the load at once and a load takes only the CPU the served models leave; "
        "a load that spends more than half of any half second waiting for a core starts over at normal priority, so "
        "a saturated machine still loads. Only where no serving thread could inherit the priority (ONNX on CPU "
        "with threads: 1; every other model loads at normal). normal: the worker's own priority.",
    )
    warmup_batch_sizes: Literal["all", "first"] | None = Field(
        None, description="Warm-up batches a model load runs before the model is ready: all (1, 2, 4, ... "
        "max_batch_size: the memory and latency of each measured) or first (1 and 2, then larger batches pay their "
        "first run when they come; on CPU without host_memory_limit_bytes only: a limit is always proven); "
        "default: first in the lazy repository mode, else all.",
    )

    # Configuration files and fail-closed security settings (config/file_read.py, live_config.py).
    config_max_bytes: int = Field(
        DEFAULT_MAX_CONFIG_BYTES, ge=1024, le=64 * 1_048_576,
        description="Largest --config, API keys or model.yaml file the watcher reads; a bigger one (or a FIFO, "
        "device or directory) is rejected and the running configuration stays. A model load reads at most 1 MiB "
        "of model.yaml whatever this says.",
    )

    snapshot_max_bytes: int = Field(
        16 << 30, ge=1, description="Most bytes one model snapshot may copy; a bigger model directory serves from the "
        "repository's files (logged). Symlinked directories inside a model directory are never copied.",
    )
    models_outside_repository: Literal["warn", "refuse"] = Field(
        "warn", description="A model directory that resolves outside the model repository (a symlink out): warn "
        "and load it, or refuse it (failed, with the reason, at start, load and reload; the other models serve).",
    )

    # The process split (issue 20): supervisor.py, process_tree.py.
    standby_engine: bool = Field(
        False, description="Keep a second engine process with its imports done and its worker fork server started "
        "(about 95 MB RSS, and the fork server's), started 10 s after each engine start, which takes over at once "
        "when the engine dies (kill -9, an out-of-memory kill): a restart then skips the new engine's interpreter "
        "start and imports (about 1.5 s of CPU) and the fork server's.",
    )
    ingress_processes: int | None = Field(
        None, ge=0, le=256, description="HTTP front-end processes in front of one engine process, started and "
        "restarted by a supervisor; default: one per CPU this process may use (its affinity), at least 1 and at "
        "most 8; 0: everything in one process, no supervisor.",
    )

    shared_tensor_min_bytes: int = Field(
        32768, ge=0, description="Between an ingress process and the engine, a request's input tensors (and a "
        "result's outputs) of at least this many bytes travel in shared memory, written once and read in place; "
        "smaller ones inline in the message, where copying costs less than the bookkeeping.",
    )
    shared_tensor_limit_bytes: int = Field(
        64 << 20, ge=0, description="Most shared memory each ingress process (for inputs) and the engine, per "
        "ingress (for outputs), holds for such tensors; past it, or while less than half of /dev/shm would stay "
        "free, they go inline. 0: always inline.",
    )

    @field_validator("admin_token")
    @classmethod
    def _admin_token_not_blank(cls, value: str | None) -> str | None:
        # An empty token once meant "no token": admin fell back to loopback clients, which behind a
        # proxy are everyone. A token that is set must be a real one.
        if value is not None and not value.strip():
            raise ValueError("is set but empty; unset it (admin answers loopback clients only) or give a token")
        return value

    @model_validator(mode="after")
    def _metrics_key_needs_keys(self) -> ServerConfig:
        # Without keys, "/metrics needs a key" would silently leave /metrics open.
        if self.metrics_require_key and self.api_keys_file is None and not self.api_keys:
            raise ValueError("metrics_require_key needs API keys (api_keys_file or api_keys)")
        return self

class ConfigFileError(ValueError):
    """The config file or an environment variable holds an invalid value."""


#: Settings a running server takes from a changed --config file (or keys file) without a restart.
LIVE_FIELDS = frozenset((
    "log_level", "trace_sample_ratio", "slow_request_ms", "api_keys", "api_keys_file", "api_key_rate_per_s",
    "metrics_require_key", "config_poll_s", "payload_log",
))


@dataclass(frozen=True)
class ConfigSource:
    """Where a server's settings came from, so a reload merges them the same way: the file is read
    again; command-line flags and environment variables keep their precedence over it."""

    file: Path | None
    overrides: dict[str, Any]

    def load(self) -> ServerConfig:
        """The settings as the file says now (`ConfigFileError` when it is invalid)."""
        return load_server_config(self.file, self.overrides)


def load_server_config(
    config_file: Path | None, overrides: dict[str, Any], environ: dict[str, str] | None = None
) -> ServerConfig:
    """Merge defaults, the YAML file, `SERVEWELL_*` variables and CLI `overrides` (None = unset)."""
    merged: dict[str, Any] = {}
    env = values_from_env(ServerConfig, os.environ if environ is None else environ, ENV_PREFIX)
    max_bytes = int(overrides.get("config_max_bytes") or env.get("config_max_bytes") or DEFAULT_MAX_CONFIG_BYTES)
    if config_file is not None:
        try:
            raw = load_bounded(decode_utf8(read_config_bytes(config_file, max_bytes))) or {}
        except OSError as exc:
            raise ConfigFileError(f"{config_file}: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigFileError(f"{config_file}: not valid YAML: {short_yaml_error(exc)}") from None
        if not isinstance(raw, dict):
            raise ConfigFileError(f"{config_file}: expected a mapping of fields")
        merged.update(raw)
    merged.update(env)
    merged.update({k: v for k, v in overrides.items() if v is not None})
    if "api_keys" in merged and not merged["api_keys"]:
        # SERVEWELL_API_KEYS="" (or `api_keys: []`) says keys were meant: an empty list must not open inference.
        raise ConfigFileError(f"{config_file or 'settings'}: field 'api_keys': is set but holds no key "
                              "(unset it for open inference)")
    try:
        return ServerConfig.model_validate(merged)
    except ValidationError as exc:
        where = config_file or "settings"
        problems = "; ".join(cut(f"field '{'.'.join(map(str, e['loc']))}': {e['msg']}", 300)
                             for e in exc.errors()[:10])
        raise ConfigFileError(f"{where}: {problems}") from None
