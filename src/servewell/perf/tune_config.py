"""The tuner's edits of `model.yaml`: a candidate applied to the user's raw document (for the
temporary copy a server is started with, and for the recommendation), checked by the model's
own config class, and the block a user pastes."""

from __future__ import annotations

import copy
from typing import Any

import yaml

from servewell.config.model import ModelConfig
from servewell.config.runtimes import runtimes_with
from servewell.perf.tuner import Candidate


class ConfigEditError(ValueError):
    """A candidate that the model's config does not accept (e.g. reserve_instance_for_high with one instance)."""


def configured_dtype(config: ModelConfig) -> str | None:
    """The serving dtype of a model whose runtime has one (its section's `dtype`: the torch
    runtimes; an ONNX graph computes in the dtypes it was exported with); None for other runtimes."""
    dtype = getattr(config.runtime_settings, "dtype", None)
    return None if dtype is None else str(dtype)


def baseline_candidate(config: ModelConfig) -> Candidate:
    """The user's own settings, as a candidate."""
    return Candidate(config.max_batch_size, config.batching.policy, config.batching.max_wait_ms,
                     config.instances, config.threads, configured_dtype(config))


def apply(doc: dict[str, Any], candidate: Candidate, slo_ms: float,
          max_batch_size: int | None = None, *, name: str | None = None) -> dict[str, Any]:
    """A copy of the raw model.yaml document with the candidate's settings (and, for a server
    whose batch size is changed live, `max_batch_size` as given), validated as the server reads
    it: named `name` (its directory's) when the document names no model."""
    new = copy.deepcopy(doc)
    new.update(_tuned(doc, candidate, slo_ms))
    if max_batch_size is not None and candidate.max_batch_size > 0:
        new["max_batch_size"] = max_batch_size
    try:
        ModelConfig.model_validate(new if name is None or "name" in new else {"name": name, **new})
    except ValueError as exc:
        raise ConfigEditError(f"{candidate.describe()}: {exc}") from None
    return new


def _tuned(doc: dict[str, Any], candidate: Candidate, slo_ms: float) -> dict[str, Any]:
    """The top-level keys the tuner sets, with the user's other batching (and section) settings kept."""
    batching = dict(doc.get("batching") or {})
    batching["policy"] = candidate.policy
    if candidate.policy != "idle":
        batching["max_wait_ms"] = candidate.max_wait_ms
    if candidate.policy == "adaptive":
        batching["latency_slo_ms"] = slo_ms
    keys: dict[str, Any] = {}
    if candidate.max_batch_size > 0:
        keys["max_batch_size"] = candidate.max_batch_size
    keys.update(instances=candidate.instances, threads=candidate.threads, batching=batching)
    if candidate.dtype is not None and doc.get("runtime") in runtimes_with("dtype"):
        runtime = str(doc["runtime"])
        keys[runtime] = {**(doc.get(runtime) or {}), "dtype": candidate.dtype}
    return keys


def yaml_block(doc: dict[str, Any], candidate: Candidate, slo_ms: float, *, name: str | None = None) -> str:
    """The model.yaml lines to paste: every key the tuner sets (a mapping replaces the user's
    whole mapping, so it carries their other settings in it too)."""
    apply(doc, candidate, slo_ms, name=name)  # raises if the config would not accept it
    return yaml.safe_dump(_tuned(doc, candidate, slo_ms), sort_keys=False, default_flow_style=False)
