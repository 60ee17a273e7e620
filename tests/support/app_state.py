"""The least state `create_app` needs, for unit tests of the HTTP app (no engine: only routes that
need none run)."""

from __future__ import annotations

from types import SimpleNamespace

from servewell.api.keys import InferenceAccess
from servewell.api.state import LiveKnobs
from servewell.tenancy.keys import KeyRing


def bare_state() -> SimpleNamespace:
    """What create_app reads of the state to build routes and middleware."""
    return SimpleNamespace(metrics=None, settings=SimpleNamespace(slow_request_ms=300.0),
                           access=InferenceAccess(KeyRing()), knobs=LiveKnobs(0.3, False),
                           console=SimpleNamespace(recent=None))
