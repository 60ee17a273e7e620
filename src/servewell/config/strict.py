"""The base of every model.yaml section: unknown keys are errors, and a loaded config never changes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Rejects unknown keys (a typo is reported, not ignored) and is immutable once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)
