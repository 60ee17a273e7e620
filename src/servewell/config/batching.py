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

Policy = Annotated[Literal["idle", "window", "adaptive"], Field(
    description="idle: start a batch as soon as an instance is free; window: wait up to max_wait_ms for a "
    "fuller batch; adaptive: wait only as long as the learned batch-latency curve and latency_slo_ms allow.",
)]
MaxWaitMs = Annotated[float, Field(ge=0, description="window policy: longest a request waits for others to join "
                                   "its batch (also the adaptive policy's cap).")]
LatencySloMs = Annotated[float, Field(gt=0, description="adaptive policy: p99 latency target the waits must respect.")]
MaxQueueSize = Annotated[int, Field(ge=1, description="Requests queued per lane before new ones are refused (503).")]
DefaultTimeoutMs = Annotated[float, Field(gt=0, description="Deadline of a request that names none.")]
MaxConsecutiveHigh = Annotated[int, Field(
    ge=1, description="After this many batches in a row from a higher lane while a lower one waits, "
    "the lower lane gets the next batch (no starvation).",
)]
ReserveInstanceForHigh = Annotated[bool, Field(
    description="Keep one instance for the first lane only, so urgent requests never queue behind "
    "running work (needs instances >= 2).",
)]
ComputeTimeoutMs = Annotated[float, Field(
    gt=0, description="A batch running longer is declared hung: its requests get 503 worker_hung and its worker is "
    "killed and replaced. Default: 20x the warm-up latency of that batch size, at least 10 s (60 s without warm-up).",
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


def _schema_without_nulls(schema: dict[str, Any]) -> None:
    """Show each optional field as its plain type: null means "absent" in Python, but a client
    sends a value or leaves the field out. At least one field is required."""
    for name, prop in schema.get("properties", {}).items():
        branches = prop.pop("anyOf", None)
        if branches:
            kept = [b for b in branches if b.get("type") != "null"]
            prop.update(kept[0] if len(kept) == 1 else {"anyOf": kept})
        prop.pop("default", None)
        prop["title"] = name.replace("_", " ").capitalize()
    schema["minProperties"] = 1


class BatchingPatch(StrictModel, json_schema_extra=_schema_without_nulls):
    """The body of `PATCH /admin/models/{name}/batching`: the settings to change, at least one.

    Every field of `BatchingConfig` but `lanes` (fixed while the model is loaded), plus
    `max_batch_size`, with the same bounds. The engine still checks what depends on the model
    (max_batch_size against what warm-up proved, reserve_instance_for_high against instances).
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
            return value  # refused with its own message below
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
        for name in sorted(self.model_fields_set):
            if getattr(self, name) is None:
                problems.add((name,), "null is not a setting; give a value or leave the field out")
        problems.raise_if_any()
        return self

    def changes(self) -> dict[str, Any]:
        """The settings the client sent, by name (what the engine applies, all or none)."""
        return self.model_dump(exclude_unset=True)
