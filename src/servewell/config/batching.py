"""Dynamic batching settings of a model (`batching:` in model.yaml) and their live change.

Each setting's type, bounds and description are written once, as an annotated type, and used
by both `BatchingConfig` (the model.yaml section) and `BatchingPatch` (the body of
`PATCH /admin/models/{name}/batching`), so the admin route's OpenAPI schema and its checks come
from the same definitions as the file's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from servewell.config.problems import Problems, config_error
from servewell.config.strict import StrictModel

#: Bounds of the live settings. Each is a value past which the setting stops the model rather than tunes
#: it (issue 19.10: `compute_timeout_ms: 0.001` served 0 of 6,367 requests and restarted the workers 4
#: times; `max_wait_ms: 1e308` under the window policy never ran a batch; `default_timeout_ms: 1e300`
#: left clients hanging; `max_queue_size: 10^12` queued without bound).
#:
#: max_wait_ms: a batch waits at most this long for company. 10 s is 400x the default (25 ms) and
#: far beyond any useful batching wait; a longer one only holds requests back.
MAX_WAIT_LIMIT_MS = 10_000.0
#: latency_slo_ms: the adaptive policy's target; its waits are capped by max_wait_ms anyway, so a
#: target above 10 min says nothing more (and keeps the arithmetic finite).
LATENCY_SLO_LIMIT_MS = 600_000.0
#: max_queue_size: queued requests per lane. 100,000 is 390x the default (256): at the default 30 s
#: deadline it needs a model serving over 3,000 requests/s to drain before the deadlines pass, and
#: it keeps a flood's queued tensors (up to max_body_bytes each) within what a host can hold.
MAX_QUEUE_LIMIT = 100_000
#: default_timeout_ms: from 100 ms (below that a request that names no deadline expires before a
#: batch can even be formed and computed) to 10 min (a client waiting longer has gone; the answer
#: must come, as 503 deadline_exceeded, while someone still reads it).
DEFAULT_TIMEOUT_MIN_MS = 100.0
DEFAULT_TIMEOUT_LIMIT_MS = 600_000.0
#: max_consecutive_high: up to 1,000 batches of a higher lane before a waiting lower lane gets one;
#: beyond that the lower lane starves in all but name.
MAX_CONSECUTIVE_HIGH_LIMIT = 1_000
#: compute_timeout_ms: from 100 ms (a shorter budget declares healthy batches hung; the scheduler
#: also never uses less than a few times the batch latency it measured, engine/batch_watch.py) to
#: 1 h (a longer one never catches a hang before the requests' own deadlines have long passed).
COMPUTE_TIMEOUT_MIN_MS = 100.0
COMPUTE_TIMEOUT_LIMIT_MS = 3_600_000.0

Policy = Annotated[Literal["idle", "window", "adaptive"], Field(
    description="idle: start a batch as soon as an instance is free; window: wait up to max_wait_ms for a "
    "fuller batch; adaptive: wait only as long as the learned batch-latency curve and latency_slo_ms allow.",
)]
MaxWaitMs = Annotated[float, Field(ge=0, le=MAX_WAIT_LIMIT_MS, description="window policy: longest a request "
                                   "waits for others to join its batch (also the adaptive policy's cap), 0 to 10 s.")]
LatencySloMs = Annotated[float, Field(gt=0, le=LATENCY_SLO_LIMIT_MS, description="adaptive policy: p99 latency "
                                      "target the waits must respect, at most 10 min.")]
MaxQueueSize = Annotated[int, Field(ge=1, le=MAX_QUEUE_LIMIT, description="Requests queued per lane before new ones "
                                    "are refused (503), 1 to 100,000.")]
DefaultTimeoutMs = Annotated[float, Field(ge=DEFAULT_TIMEOUT_MIN_MS, le=DEFAULT_TIMEOUT_LIMIT_MS,
                                          description="Deadline of a request that names none, 100 ms to 10 min.")]
MaxConsecutiveHigh = Annotated[int, Field(
    ge=1, le=MAX_CONSECUTIVE_HIGH_LIMIT, description="After this many batches in a row from a higher lane while a "
    "lower one waits, the lower lane gets the next batch (no starvation); 1 to 1,000.",
)]
ReserveInstanceForHigh = Annotated[bool, Field(
    description="Keep one instance for the first lane only, so urgent requests never queue behind "
    "running work (needs instances >= 2).",
)]
ComputeTimeoutMs = Annotated[float, Field(
    ge=COMPUTE_TIMEOUT_MIN_MS, le=COMPUTE_TIMEOUT_LIMIT_MS,
    description="A batch running longer is declared hung: its requests get 503 worker_hung and its worker is "
    "killed and replaced; 100 ms to 1 h, and never less than 3x the latency measured for that batch size. "
    "Default (unset or null): 20x the warm-up latency of that batch size, at least 10 s (60 s without warm-up).",
)]
LiveMaxBatchSize = Annotated[int, Field(
    ge=1, description="Largest batch from now on: from 1 to the largest batch the model's warm-up proved fits.",
)]


class BatchingConfig(StrictModel):
    """How the model's scheduler groups requests into batches (all but `lanes` changeable while serving)."""

    policy: Policy = "idle"
    max_wait_ms: MaxWaitMs = 25.0
    latency_slo_ms: LatencySloMs = 200.0
    max_queue_size: MaxQueueSize = 256
    default_timeout_ms: DefaultTimeoutMs = 30000.0
    lanes: list[str] = Field(
        default_factory=lambda: ["high", "normal"], min_length=1,
        description="Priority lanes, highest first; requests name one (default: 'normal', else the last lane). "
        "Fixed while the model is loaded.",
    )
    max_consecutive_high: MaxConsecutiveHigh = 8
    reserve_instance_for_high: ReserveInstanceForHigh = False
    compute_timeout_ms: ComputeTimeoutMs | None = None

    @field_validator("lanes")
    @classmethod
    def _lanes_unique(cls, lanes: list[str]) -> list[str]:
        if len(set(lanes)) != len(lanes):
            raise config_error("lane names must be unique")
        return lanes


#: Why `lanes` is not part of a live change.
LANES_FIXED = "lanes are fixed while the model is loaded; change model.yaml and reload"


def _patch_schema(schema: dict[str, Any]) -> None:
    """Each field is its plain type or null (null: back to model.yaml's value); at least one field."""
    for name, prop in schema.get("properties", {}).items():
        prop.pop("default", None)
        prop["title"] = name.replace("_", " ").capitalize()
        described = [branch.pop("description") for branch in prop.get("anyOf", ()) if "description" in branch]
        prop["description"] = " ".join(described + ["null: back to the value model.yaml gives (or its default)."])
    schema["minProperties"] = 1


class BatchingPatch(StrictModel, json_schema_extra=_patch_schema):
    """The body of `PATCH /admin/models/{name}/batching`: the settings to change, at least one.

    Every field of `BatchingConfig` but `lanes` (fixed while the model is loaded), plus
    `max_batch_size`, with the same bounds. `null` returns a field to the value model.yaml gives
    it (the built-in default when the file sets none) and ends the admin override of that field.
    The engine still checks what depends on the model (max_batch_size against what warm-up proved,
    reserve_instance_for_high against instances).
    """

    max_batch_size: LiveMaxBatchSize | None = None
    policy: Policy | None = None
    max_wait_ms: MaxWaitMs | None = None
    latency_slo_ms: LatencySloMs | None = None
    max_queue_size: MaxQueueSize | None = None
    default_timeout_ms: DefaultTimeoutMs | None = None
    max_consecutive_high: MaxConsecutiveHigh | None = None
    reserve_instance_for_high: ReserveInstanceForHigh | None = None
    compute_timeout_ms: ComputeTimeoutMs | None = None

    @field_validator("*", mode="before")
    @classmethod
    def _json_types_only(cls, value: Any, info: ValidationInfo) -> Any:
        """As strict as the JSON schema: numbers are JSON numbers ("5" and true are refused; 5.0 is
        the integer 5, as JSON Schema has it), the flag a JSON boolean."""
        if value is None:
            return value  # back to model.yaml's value (the engine resolves it)
        if info.field_name == "reserve_instance_for_high":
            if not isinstance(value, bool):
                raise ValueError("must be true or false")
        elif info.field_name != "policy" and isinstance(value, (bool, str)):
            raise ValueError("must be a number")
        return value

    @model_validator(mode="before")
    @classmethod
    def _lanes_are_fixed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "lanes" in data:
            problems = Problems(cls.__name__)
            problems.add(("lanes",), LANES_FIXED, data["lanes"])
            problems.raise_if_any()
        return data

    @model_validator(mode="after")
    def _something_to_change(self) -> BatchingPatch:
        problems = Problems(type(self).__name__)
        if not self.model_fields_set:
            problems.add((), "send at least one setting to change: " + ", ".join(type(self).model_fields))
        problems.raise_if_any()
        return self

    def changes(self) -> dict[str, Any]:
        """The settings the client sent, by name (what the engine applies, all or none); None: back
        to model.yaml's value."""
        return self.model_dump(exclude_unset=True)
