"""How a model's versions share its traffic: `traffic:` and the `rollout:` section of model.yaml.

A model's directory holds its stable version (`model.yaml` and its artifact) and, under
`versions/<v>/`, candidate versions, each a complete model.yaml of its own. `traffic` gives each
version a weight; versions named in `traffic` or as the shadow are loaded beside the stable one.
The rollout section says how a client sticks to one version, which version shadows the
traffic, and the rules that take a bad canary back (or promote a good one).

engine/rollout.py serves it; these settings change live, through model.yaml or the admin API.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, field_validator, model_validator

from servewell.config.problems import config_error
from servewell.config.strict import StrictModel

#: Versions one model may split its traffic between (stable included): a rollout, not a zoo.
MAX_VERSIONS = 8
#: Longest version name: it is a directory name, a URL segment and a metric label value.
MAX_VERSION_CHARS = 64
#: The directory under a model's directory that holds its other versions.
VERSIONS_DIRECTORY = "versions"


#: A version a split names: a directory name, a URL segment and a label value (ASCII letters,
#: digits, '-', '_', '.'; not starting with '.').
VERSION_PATTERN = rf"^[A-Za-z0-9_-][A-Za-z0-9._-]{{0,{MAX_VERSION_CHARS - 1}}}$"


def is_version_name(text: str) -> bool:
    """Whether `text` matches VERSION_PATTERN."""
    return re.fullmatch(VERSION_PATTERN, text) is not None


class ShadowConfig(StrictModel):
    """A version that gets a copy of the traffic; its answers are compared, never returned."""

    version: str = Field(description="The version shadowing the traffic (under versions/<v>/, or the stable one).")
    percent: float = Field(100.0, ge=0, le=100, description="Share of the model's requests copied to the shadow; "
                           "a copy runs only on spare capacity (lowest lane, shed first).")


class RollbackConfig(StrictModel):
    """When a canary is taken back: its weight goes to 0, an alert fires and the console says why."""

    window_s: float = Field(30.0, ge=1, le=3600, description="Seconds of recent requests the rules look at.")
    min_requests: int = Field(20, ge=1, le=1_000_000, description="Requests a canary (and the stable version) needs "
                              "in the window before it is judged. Either rule also needs its difference to be unlikely "
                              "by chance (p < 0.0001, an exact one-sided test), so a few requests judge only a large "
                              "difference.")
    max_error_rate_increase: float | None = Field(
        0.05, ge=0, le=1, description="Roll back when the canary's error rate exceeds the stable version's by more "
        "than this (0.05: five points); null: rule off.")
    max_p99_ratio: float | None = Field(
        2.0, ge=1, le=1000, description="Roll back when the canary's p99 latency is more than this many times the "
        "stable version's; null: rule off. With fewer than 1,000 requests of either version in the window, the highest "
        "quantile with 10 of the canary's requests above it is compared instead (p90 for 100, the median for 20: never "
        "the slowest answer), and the median always is too; the batches' compute time is compared the same way (a "
        "canary with a small share of the traffic queues less, which hides a slower model in its latency).")
    min_p99_increase_ms: float = Field(
        5.0, ge=0, le=3_600_000, description="The p99 rule also needs the canary's p99 to exceed the stable "
        "version's by at least this many milliseconds: on a busy host a sub-millisecond model's slow requests wait a "
        "few ms for a core (a same-model canary measured 3.1 ms against 0.7). 0: the ratio alone.")
    min_shadow_agreement: float | None = Field(
        None, ge=0, le=1, description="Roll back the shadow (stop it, and take its weight to 0) when the share of "
        "rows whose top-1 agrees with the primary falls below this; null: rule off.")
    promote_after_requests: int | None = Field(
        None, ge=1, le=1_000_000_000, description="Give a canary all the traffic after this many requests with no rule "
        "broken; null (the default): never promote automatically.")


class RolloutConfig(StrictModel):
    """Stickiness, shadow and rules of a model's traffic split."""

    sticky: Literal["route_key", "tenant", "none"] = Field(
        "route_key", description="What keeps one client on one version: route_key (the X-Route-Key header or gRPC "
        "metadata, else the tenant), tenant (the API key's tenant), none (each request drawn anew).")
    shadow: ShadowConfig | None = Field(None, description="A version that gets a copy of the traffic.")
    rollback: RollbackConfig = Field(default_factory=RollbackConfig, description="Rules that take a bad canary back.")


def check_traffic(traffic: dict[str, float]) -> dict[str, float]:
    """Weights are finite, non-negative, at most MAX_VERSIONS versions, and not all zero."""
    if len(traffic) > MAX_VERSIONS:
        raise config_error(f"splits between {len(traffic)} versions; at most {MAX_VERSIONS}")
    for version, weight in traffic.items():
        if not is_version_name(version):
            raise config_error(f"{version!r} is not a version name (letters, digits, '-', '_', '.'; at most "
                               f"{MAX_VERSION_CHARS})")
        if not weight >= 0 or weight > 1e6:
            raise config_error(f"weight {weight!r} of version {version!r} must be between 0 and 1000000")
    if traffic and sum(traffic.values()) <= 0:
        raise config_error("every weight is 0: at least one version must take traffic")
    return traffic


def _patch_schema(schema: dict[str, Any]) -> None:
    schema["minProperties"] = 1
    for branch in schema["properties"]["traffic"].get("anyOf", ()):
        if branch.get("type") == "object":
            branch["additionalProperties"] = False  # a key is a version name (patternProperties) or refused


class TrafficPatch(StrictModel, json_schema_extra=_patch_schema):
    """An admin's change to a model's split (PATCH /admin/models/{name}/rollout), at least one
    field; null returns a field to model.yaml's value. It clears a rollback or a promotion."""

    traffic: dict[Annotated[str, StringConstraints(pattern=VERSION_PATTERN)],
                  Annotated[float, Field(ge=0, le=1e6, strict=True)]] | None = Field(
        None, max_length=MAX_VERSIONS, description="New weights per version (each version loaded already; not all "
        "0); null: model.yaml's.")
    shadow_percent: Annotated[float, Field(ge=0, le=100, strict=True)] | None = Field(
        None, description="New share of requests copied to the shadow (0: shadow off); null: model.yaml's.")

    @field_validator("traffic")
    @classmethod
    def _weights(cls, traffic: dict[str, float] | None) -> dict[str, float] | None:
        return None if traffic is None else check_traffic({k: float(v) for k, v in traffic.items()})

    @model_validator(mode="after")
    def _something_to_change(self) -> TrafficPatch:
        if not self.model_fields_set:
            raise config_error("send at least one of traffic, shadow_percent")
        return self
