"""What the engine asks of a model name's entry, whether it can serve (`ModelEntry`) or its
`model.yaml` is invalid (`InvalidModel`): one interface, so no caller branches on the type.

An invalid model answers every question the way a model that never serves would: its state is
"invalid", loading and stopping it do nothing, and asking it to serve raises `ModelNotReady`
with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from servewell.config.model import ModelConfig
from servewell.engine.model_lifecycle import StopCause, VersionLifecycle, invalid_lifecycle, stop_refusal
from servewell.engine.model_lifecycle import not_ready as not_ready  # where the ingress imports it from
from servewell.engine.protocol import ModelState, ModelView
from servewell.errors import ModelNotReady, ServeError
from servewell.observability.metrics import ModelSample
from servewell.observability.signals import ModelFacts

if TYPE_CHECKING:
    from servewell.engine.model_entry import ModelEntry


class Entry(Protocol):
    """One model name's current entry, as the engine uses it."""

    @property
    def name(self) -> str:
        """The model's name (its directory's)."""
        ...

    @property
    def version(self) -> str:
        """The version it serves."""
        ...

    @property
    def lifecycle(self) -> VersionLifecycle:
        """Where it is in its life (engine/model_lifecycle.py): what it allows, what users see."""
        ...

    @property
    def state(self) -> ModelState:
        """loading, ready, restarting, failed, invalid or unloaded (its lifecycle's, as users see it)."""
        ...

    @property
    def reason(self) -> str | None:
        """Why it is not ready, when it is not."""
        ...

    @property
    def config(self) -> ModelConfig | None:
        """Its checked model.yaml (None when invalid)."""
        ...

    async def load(self) -> None:
        """Load it (nothing to do for an invalid model)."""
        ...

    def close(self) -> None:
        """Restart no worker from now on (the server is shutting down)."""
        ...

    async def stop(self, cause: StopCause, reason: str | None = None, worker_timeout_s: float = 5.0) -> None:
        """Drain and stop it (nothing to do for an invalid model): it ends stopped ("unloaded", with
        `reason`), or failed if it had failed."""
        ...

    async def release_snapshot(self) -> None:
        """Remove the private copy of its files an eviction kept (nothing when there is none)."""
        ...

    def fail_all(self, error: ServeError) -> None:
        """Answer every queued and running request with `error` now."""
        ...

    def ready_entry(self) -> ModelEntry:
        """The serving entry if its state is ready; `ModelNotReady` with the reason otherwise."""
        ...

    def configurable(self) -> ModelEntry:
        """The entry whose settings may be read and changed; `ModelNotReady` for an invalid model."""
        ...

    def view(self) -> ModelView:
        """What the API shows of it."""
        ...

    def sample(self) -> ModelSample:
        """Its state for a metrics scrape."""
        ...

    def facts(self) -> ModelFacts | None:
        """What the alert webhook evaluates (None: nothing to evaluate)."""
        ...

    def report(self) -> dict[str, Any]:
        """Its active configuration, for the admin report."""
        ...


@dataclass(slots=True, frozen=True)
class InvalidModel:
    """A model directory whose `model.yaml` could not be used, and why (an `Entry` that never serves)."""

    name: str
    directory: Path
    reason: str

    @property
    def version(self) -> str:
        """An invalid model has no version of its own; "1" keeps URLs and listings uniform."""
        return "1"

    @property
    def lifecycle(self) -> VersionLifecycle:
        """Always INVALID: no transition leaves it."""
        return invalid_lifecycle(self.reason)

    @property
    def state(self) -> ModelState:
        """Always "invalid"."""
        return "invalid"

    @property
    def config(self) -> ModelConfig | None:
        """None: it has no usable model.yaml."""
        return None

    async def load(self) -> None:
        """Nothing to load."""

    def close(self) -> None:
        """Nothing runs."""

    async def stop(self, cause: StopCause, reason: str | None = None, worker_timeout_s: float = 5.0) -> None:
        """Nothing to stop: it stays invalid."""

    async def release_snapshot(self) -> None:
        """It has no snapshot."""

    def fail_all(self, error: ServeError) -> None:
        """Nothing is queued."""

    def ready_entry(self) -> ModelEntry:
        """Never ready."""
        raise not_ready(self.name, self.state, self.reason)

    def configurable(self) -> ModelEntry:
        """Nothing to configure."""
        raise ModelNotReady(f"model '{self.name}' is invalid: {self.reason}", retry_after_s=None)

    def view(self) -> ModelView:
        """Name, state and reason; nothing else exists."""
        return ModelView(self.name, self.version, "invalid", self.reason, None, None, 0, 0, (), None)

    def sample(self) -> ModelSample:
        """An invalid model in the state gauges, with no queue and no worker."""
        return ModelSample(self.name, "invalid", {}, 0, 0, ())

    def facts(self) -> ModelFacts | None:
        """Nothing to alert on."""
        return None

    def report(self) -> dict[str, Any]:
        """Its state and why."""
        return {"state": "invalid", "reason": self.reason}


def ready_entry_or_refusal(entry: Entry) -> ModelEntry:
    """`entry` if it takes new requests; otherwise the error that says why (the model is not ready,
    or it is being unloaded or replaced: its own 503 code, never `shutting_down`)."""
    ready = entry.ready_entry()
    cause = ready.lifecycle.stop_cause  # read on every request: the refusal (and its label) only when stopping
    if cause is not None:
        raise stop_refusal(cause, ready.label)
    return ready
