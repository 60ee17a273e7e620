"""The tuner's edits of `model.yaml`: a candidate applied to the user's raw document (for the
temporary copy a server is started with, and for the recommendation), checked by the model's
own config class, and the block a user pastes."""

from __future__ import annotations

import copy
from typing import Any

import yaml

from servewell.config.model import ModelConfig
from servewell.perf.tuner import Candidate

#: Runtimes whose serving dtype can be changed (an ONNX graph computes in the dtypes it was exported with).
TORCH_RUNTIMES = ("torchscript", "pytorch")


class ConfigEditError(ValueError):
    """A candidate that the model's config does not accept (e.g. reserve_instance_for_high with one instance)."""


def _dtype_in_section() -> bool:
    """Whether `dtype` lives in the runtime's own section of model.yaml (`pytorch: {dtype: ...}`)."""
    return "dtype" not in ModelConfig.model_fields


def configured_dtype(config: ModelConfig) -> str | None:
    """The serving dtype of a torch-runtime model; None for other runtimes."""
    if config.runtime not in TORCH_RUNTIMES:
        return None
    if not _dtype_in_section():
        return str(getattr(config, "dtype", "fp32"))
    section = getattr(config, config.runtime, None)
    return str(getattr(section, "dtype", "fp32"))


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
    if candidate.dtype is not None and doc.get("runtime") in TORCH_RUNTIMES:
        if _dtype_in_section():
            runtime = str(doc["runtime"])
            keys[runtime] = {**(doc.get(runtime) or {}), "dtype": candidate.dtype}
        else:
            keys["dtype"] = candidate.dtype
    return keys


def yaml_block(doc: dict[str, Any], candidate: Candidate, slo_ms: float, *, name: str | None = None) -> str:
    """The model.yaml lines to paste: every key the tuner sets (a mapping replaces the user's
    whole mapping, so it carries their other settings in it too)."""
    apply(doc, candidate, slo_ms, name=name)  # raises if the config would not accept it
    return yaml.safe_dump(_tuned(doc, candidate, slo_ms), sort_keys=False, default_flow_style=False)
