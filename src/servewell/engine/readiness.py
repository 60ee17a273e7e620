"""Whether the server as a whole should receive traffic: the readiness policy.

- `any` (the default): once every model's first load has finished (ready or failed), the server
  is ready while at least one model is ready. Chosen for Kubernetes: readiness decides whether a
  replica receives traffic at all, and a model that failed on one replica usually fails on all of
  them (same image, same repository), so `strict` would take every replica, and every healthy model
  on them, out of service for one broken model. Requests to a failed model get 503
  `model_not_ready` at once either way. Waiting for the first loads keeps a new replica out of
  rotation until every model had its chance to load (a rollout sends no traffic to a replica that
  would refuse models that are only loading).
- `strict`: every model is ready (Triton's strict readiness; an invalid model.yaml counts as not
  ready). For a replica that must serve all of its models or none.
- `required-models`: every model in `required_models` is ready; the others may be failed.

Per-model readiness (`/v2/models/{name}/ready`), `/healthz` (status `degraded` when the server is
ready but a model is not) and `servewell_model_state` show a failed model under every policy.
Unloaded models do not count. A server that is shutting down is never ready.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from servewell.engine.protocol import ModelState, Readiness

ReadinessPolicy = Literal["strict", "any", "required-models"]
READINESS_POLICIES: tuple[ReadinessPolicy, ...] = ("any", "strict", "required-models")


def evaluate_readiness(
    policy: ReadinessPolicy, required: Sequence[str], models: Sequence[tuple[str, ModelState]], accepting: bool,
) -> Readiness:
    """Apply `policy` to the (name, state) of every model of the repository."""
    if not accepting:
        return Readiness(False, "the server is shutting down", shutting_down=True)
    counted = [(name, state) for name, state in models if state != "unloaded"]
    not_ready = [f"{name} ({state})" for name, state in counted if state != "ready"]
    degraded = bool(not_ready)
    if policy == "required-models":
        states = dict(models)
        missing = [name for name in required if name not in states]
        if missing:
            return Readiness(False, f"required models not in the repository: {', '.join(missing)}")
        waiting = [f"{name} ({states[name]})" for name in required if states[name] != "ready"]
        if waiting:
            return Readiness(False, f"required models not ready: {', '.join(waiting)}")
        return Readiness(True, "every required model is ready", degraded)
    if not any(state == "ready" for _, state in counted):
        return Readiness(False, "no model is ready" + (f": {', '.join(not_ready)}" if not_ready else ""))
    if policy == "strict":
        if not_ready:
            return Readiness(False, f"strict: models not ready: {', '.join(not_ready)}")
        return Readiness(True, "every model is ready")
    loading = [name for name, state in counted if state == "loading"]
    if loading:
        return Readiness(False, f"models still loading for the first time: {', '.join(loading)}")
    if not_ready:
        return Readiness(True, f"serving; not ready: {', '.join(not_ready)}", True)
    return Readiness(True, "every model is ready")
