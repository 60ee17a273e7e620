"""Whether the engine takes new requests, and whether the server should receive traffic
(`ServingGate`): its shutdown phase, and the readiness policy (engine/readiness.py) over every
model's state.

A server serves, then drains (readiness false, no worker restarted, requests still admitted and
served: a load balancer may send some until it notices), then closes (nothing new is admitted).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from servewell.engine.protocol import ModelState, Readiness
from servewell.engine.readiness import ReadinessPolicy, evaluate_readiness


class ServingPhase(enum.Enum):
    """Where the engine is in its shutdown."""

    SERVING = "serving"
    DRAINING = "draining"  # not ready, still admitting and serving
    CLOSED = "closed"  # admits nothing new


class ServingGate:
    """The engine's shutdown phase and readiness verdict."""

    __slots__ = ("policy", "required", "_states", "phase")

    def __init__(self, policy: ReadinessPolicy, required: Sequence[str],
                 states: Callable[[], list[tuple[str, ModelState]]]) -> None:
        self.policy: ReadinessPolicy = policy
        self.required = tuple(required)  # the models the `required-models` policy waits for
        self._states = states  # (name, the state readiness counts) of every model
        self.phase = ServingPhase.SERVING

    @property
    def accepting(self) -> bool:
        """Whether new requests are admitted."""
        return self.phase is not ServingPhase.CLOSED

    @property
    def draining(self) -> bool:
        """Whether the server is shutting down (not ready; nothing restarts)."""
        return self.phase is not ServingPhase.SERVING

    def begin_drain(self) -> None:
        """Shutdown began: readiness turns false, requests are still admitted (again: nothing changes)."""
        if self.phase is ServingPhase.SERVING:
            self.phase = ServingPhase.DRAINING

    def close(self) -> None:
        """Admit nothing new from now on."""
        self.phase = ServingPhase.CLOSED

    def readiness(self) -> Readiness:
        """The readiness verdict, with its reason."""
        return evaluate_readiness(self.policy, self.required, self._states(), not self.draining)
