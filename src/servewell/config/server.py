"""Typed configuration of the server: one tree, read from a file, the environment and the CLI.

Precedence: CLI flags > environment (`SERVEWELL_<FIELD>`, read only in `load_server_config`) >
config file (YAML) > defaults. Field descriptions are the CLI's help text.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from servewell.config.alerting import AlertingConfig

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
    cache_dir: Path = Field(
        Path.home() / ".cache" / "servewell", description="Where built-in models are built and cached."
    )
    max_body_bytes: int = Field(1_048_576, ge=1024, description="Largest request body accepted (413 above).")
    max_image_pixels: int = Field(
        16_000_000, ge=1, description="Largest decoded image, in pixels, accepted (413 above; stops decompression bombs)."
    )
    max_image_side: int = Field(
        16_384, ge=1, description="Longest image side, in pixels, accepted (413 above; checked from the header)."
    )
    decode_queue_size: int = Field(
        64, ge=1, description="Image decodes that may wait for a decode thread (urgent ones: as many again); "
        "past it requests are refused with 503 overloaded before their images are decoded.",
    )
    load_timeout_s: float = Field(30.0, gt=0, description="A model whose load and warm-up take longer is killed and marked failed.")
    memory_budget_bytes: int | None = Field(
        None, ge=1, description="Host memory all models together may use (estimated before loading); "
        "default: 90% of the memory available at start.",
    )
    admin_token: str | None = Field(
        None, description="Bearer token for /admin endpoints; when unset they answer loopback clients only."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Lowest level logged.")
    log_format: Literal["json", "console"] = Field("json", description="JSON lines, or human-readable console lines.")
    metrics_enabled: bool = Field(True, description="Serve Prometheus metrics at /metrics and record them.")
    slow_request_ms: float = Field(300.0, gt=0, description="Requests slower than this log a warning with their stage breakdown.")
    latency_buckets_s: list[float] = Field(
        default_factory=lambda: [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
        min_length=1, description="Bucket bounds (seconds) of the latency histograms.",
    )
    otlp_endpoint: str | None = Field(
        None, description="OTLP collector for traces (default: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT); unset: tracing off.",
    )
    otlp_protocol: Literal["http/protobuf", "grpc"] | None = Field(
        None, description="OTLP transport (default: OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf).",
    )
    trace_sample_ratio: float | None = Field(
        None, ge=0, le=1, description="Share of traces recorded (default: OTEL_TRACES_SAMPLER_ARG, else 0.01; a sampled incoming "
        "traceparent is always followed).",
    )
    alerting: AlertingConfig = Field(
        default_factory=AlertingConfig, description="Optional alert webhook (config file only: nested settings)."
    )
    decode_threads: int = Field(2, ge=1, le=64, description="Threads that decode and resize images off the event loop.")


class ConfigFileError(ValueError):
    """The config file or an environment variable holds an invalid value."""


def _from_env(environ: dict[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in ServerConfig.model_fields:
        key = ENV_PREFIX + name.upper()
        if key in environ:
            raw = environ[key]
            # List settings come as comma-separated values in the environment.
            values[name] = raw.split(",") if name == "latency_buckets_s" else raw
    return values


def load_server_config(
    config_file: Path | None, overrides: dict[str, Any], environ: dict[str, str] | None = None
) -> ServerConfig:
    """Merge defaults, the YAML file, `SERVEWELL_*` variables and CLI `overrides` (None = unset)."""
    merged: dict[str, Any] = {}
    if config_file is not None:
        try:
            raw = yaml.safe_load(config_file.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigFileError(f"{config_file}: cannot read: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigFileError(f"{config_file}: expected a mapping of fields")
        merged.update(raw)
    merged.update(_from_env(dict(os.environ) if environ is None else environ))
    merged.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return ServerConfig.model_validate(merged)
    except ValidationError as exc:
        where = config_file or "settings"
        problems = "; ".join(f"field '{'.'.join(map(str, e['loc']))}': {e['msg']}" for e in exc.errors())
        raise ConfigFileError(f"{where}: {problems}") from None
