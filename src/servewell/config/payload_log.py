"""Typed settings of the payload log (observability/payload_log.py): a sampled log of requests and
answers to rotating JSONL files and/or an HTTP sink of CloudEvents (part of the server's config tree)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

#: Headers the HTTP sink sets itself: configured headers may not replace them.
_OWN_HEADERS = ("content-type", "content-length", "host", "connection", "transfer-encoding")
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}$")  # an HTTP header name (RFC 9110 token)


class PayloadFileSink(BaseModel):
    """Rotating JSONL files: one line per request."""

    model_config = ConfigDict(extra="forbid")

    path: Path = Field(description="The file written (its directory must exist); rotated to PATH.1, PATH.2, ...")
    max_bytes: int = Field(
        100 * 1_048_576, ge=4096, le=1 << 40, description="Size at which the file is rotated (renamed PATH.1).")
    keep: int = Field(5, ge=0, le=1000, description="Rotated files kept (PATH.1 newest ... PATH.KEEP); 0: none.")


class PayloadHttpSink(BaseModel):
    """An HTTP endpoint that receives CloudEvents as KServe's inference logger sends them."""

    model_config = ConfigDict(extra="forbid")

    url: SecretStr = Field(description="http(s) URL the events are POSTed to (kept out of /admin/config).")
    mode: Literal["binary", "batch"] = Field(
        "binary", description="binary: one POST per event in CloudEvents binary mode, a request and a response "
        "event per request, exactly as KServe's logger; batch: many structured events per POST "
        "(application/cloudevents-batch+json), for receivers that take it at high rates.")
    timeout_s: float = Field(2.0, gt=0, le=60, description="Timeout of one POST, connect to response.")
    retries: int = Field(2, ge=0, le=5, description="Further tries of a POST that failed to connect or got a 5xx "
                         "or 429 (then the record counts as failed).")
    batch_events: int = Field(200, ge=1, le=10_000, description="Most events in one POST of batch mode.")
    source: str = Field("servewell", min_length=1, max_length=256,
                        description="The events' ce-source (a URI reference naming this server).")
    namespace: str = Field("", max_length=256, description="The events' ce-namespace extension (KServe: the "
                           "InferenceService's namespace); empty: not sent.")
    headers: dict[str, SecretStr] = Field(
        default_factory=dict, max_length=32, description="Extra request headers (e.g. Authorization), kept out "
        "of /admin/config.")

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: SecretStr) -> SecretStr:
        parts = urlsplit(url.get_secret_value())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        return url

    @field_validator("headers")
    @classmethod
    def _header_names(cls, headers: dict[str, SecretStr]) -> dict[str, SecretStr]:
        for name, value in headers.items():
            if not _TOKEN.match(name):
                raise ValueError(f"{name[:64]!r} is not an HTTP header name")
            if name.lower() in _OWN_HEADERS or name.lower().startswith("ce-"):
                raise ValueError(f"{name!r} is set by the sink itself")
            if any(c in value.get_secret_value() for c in "\r\n\0"):
                raise ValueError(f"the value of {name!r} holds a line break")
        return headers


class PayloadLogConfig(BaseModel):
    """The payload log: off by default. Each sampled request is handed to a background thread
    through a bounded queue (full: the record is dropped and counted), so serving never waits."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Log sampled requests and answers to the sinks below.")
    sample: float = Field(1.0, ge=0, le=1, description="Share of requests logged, drawn per request.")
    models: list[str] = Field(default_factory=list, max_length=1000,
                              description="Models whose requests are logged; empty: every model.")
    content: Literal["tensors", "digests"] = Field(
        "tensors", description="tensors: each tensor's values; digests: its sha256 (of its C-order bytes) only.")
    max_tensor_bytes: int = Field(
        65_536, ge=0, le=64 * 1_048_576, description="A tensor larger than this is logged as its digest.")
    redact: list[str] = Field(
        default_factory=list, max_length=1000, description="Input and output names whose values and digests are "
        "never logged (only their datatype and shape, with \"[redacted]\").")
    queue_records: int = Field(10_000, ge=1, le=1_000_000,
                               description="Records waiting to be written, per stage; more are dropped and counted.")
    queue_bytes: int = Field(64 * 1_048_576, ge=1_048_576, le=1 << 34,
                             description="Tensor bytes waiting to be written, per stage; more are dropped and counted.")
    file: PayloadFileSink | None = Field(None, description="Rotating JSONL files.")
    http: PayloadHttpSink | None = Field(None, description="CloudEvents to an HTTP endpoint.")

    @model_validator(mode="after")
    def _a_sink_when_enabled(self) -> PayloadLogConfig:
        # Enabled with nowhere to write would sample, copy and count for nothing.
        if self.enabled and self.file is None and self.http is None:
            raise ValueError("payload_log is enabled but has no sink: set file, http or both")
        if self.enabled and self.file is not None:
            # Checked at load, so a server does not start (and a reload is rejected) with a log
            # it could not write; the file itself is opened when the settings are applied.
            path = self.file.path
            if not path.parent.is_dir() or not os.access(path.parent, os.W_OK | os.X_OK):
                raise ValueError(f"file.path {str(path)!r}: its directory does not exist or is not writable")
            if path.is_dir() or (path.exists() and not os.access(path, os.W_OK)):
                raise ValueError(f"file.path {str(path)!r}: is a directory or not writable")
        return self
