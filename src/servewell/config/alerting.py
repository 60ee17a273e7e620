"""Typed settings of the server's own alert evaluation and its optional webhook (part of the server's
config tree)."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

AlertFormat = Literal["generic", "slack", "wecom"]


class AlertThresholds(BaseModel):
    """When each alert fires; the defaults match deploy/prometheus/alerts.yml."""

    model_config = ConfigDict(extra="forbid")

    p99_latency_s: float = Field(
        0.5, gt=0, description="p99 request latency, in seconds, above which latency_p99 fires."
    )
    error_ratio: float = Field(0.05, gt=0, le=1, description="Share of 5xx responses above which error_ratio fires.")
    rejected_ratio: float = Field(
        0.01, gt=0, le=1, description="Share of requests refused by a full queue above which rejected_ratio fires."
    )
    queue_fill_ratio: float = Field(
        0.8, gt=0, le=1, description="Fullest lane's depth over max_queue_size above which queue_saturation fires."
    )
    worker_restarts: int = Field(
        1, ge=1, description="Worker restarts within the snapshot's window at or above which worker_restarts fires."
    )
    memory_headroom_ratio: float = Field(
        0.1, ge=0, lt=1, description="Free share of the model's memory limit below which memory_headroom fires."
    )


class AlertingConfig(BaseModel):
    """Alerting of one server: the rules are always evaluated (active alerts in the console and
    `/healthz`); notifications are sent only while `webhook_url` is set."""

    model_config = ConfigDict(extra="forbid")

    webhook_url: SecretStr | None = Field(
        None, description="http(s) URL alerts are POSTed to; unset turns the alert webhook off."
    )
    format: AlertFormat = Field(
        "generic", description="Message shape: generic JSON, Slack ({'text'}) or WeCom group bot (markdown)."
    )
    source: str = Field(
        "servewell", min_length=1, description="Name of this server in messages, e.g. host or deployment."
    )
    thresholds: AlertThresholds = Field(default_factory=AlertThresholds, description="When each alert fires.")
    min_interval_s: float = Field(
        600.0, ge=0, description="Least time between two notifications of the same alert for the same model."
    )
    evaluation_interval_s: float = Field(15.0, gt=0, description="Time between two evaluations of the signals "
                                         "(each covers the time since the previous one).")
    timeout_s: float = Field(3.0, gt=0, le=60, description="Timeout of one webhook POST, connect to response.")

    @field_validator("webhook_url")
    @classmethod
    def _http_url(cls, url: SecretStr | None) -> SecretStr | None:
        if url is not None:
            parts = urlsplit(url.get_secret_value())
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("must be an http:// or https:// URL with a host")
        return url
