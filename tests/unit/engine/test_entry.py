"""One interface for every model name's entry: an invalid model and a valid one that is not ready
answer the same questions the same way, so the engine never branches on which one it holds."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from servewell.config.model import ModelConfig
from servewell.engine.entry import Entry, InvalidModel
from servewell.engine.memory_budget import MemoryBudget
from servewell.engine.model_entry import EntryServices, ModelEntry
from servewell.errors import ModelNotReady, ShuttingDown


def valid_entry(tmp_path: Path) -> ModelEntry:
    config = ModelConfig.model_validate({
        "name": "m", "runtime": "onnx", "artifact": "model.onnx", "max_batch_size": 4,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}],
    })
    return ModelEntry("m", tmp_path, config, EntryServices(load_timeout_s=1.0, budget=MemoryBudget(1 << 30)))


def test_an_invalid_model_never_serves_and_says_why(tmp_path):
    entry: Entry = InvalidModel("broken", tmp_path, "inputs: field required")
    assert entry.state == "invalid" and entry.config is None
    with pytest.raises(ModelNotReady, match="'broken' is invalid: inputs: field required"):
        entry.ready_entry()
    with pytest.raises(ModelNotReady, match="is invalid"):
        entry.configurable()
    view = entry.view()
    assert (view.name, view.state, view.reason) == ("broken", "invalid", "inputs: field required")
    assert entry.sample().state == "invalid" and entry.facts() is None
    assert entry.report() == {"state": "invalid", "reason": "inputs: field required"}

    async def lifecycle() -> None:  # nothing to load, stop or fail: no error either
        await entry.load()
        entry.close()
        entry.fail_all(ShuttingDown("bye"))
        await entry.stop("shutting_down")

    asyncio.run(lifecycle())
    assert entry.state == "invalid"


def test_a_valid_model_that_is_not_loaded_answers_the_same_questions(tmp_path):
    entry: Entry = valid_entry(tmp_path)
    assert entry.state == "unloaded" and entry.config is not None
    with pytest.raises(ModelNotReady, match="'m' is unloaded"):
        entry.ready_entry()
    assert entry.configurable() is entry
    assert entry.view().state == "unloaded" and entry.sample().state == "unloaded"
    facts = entry.facts()
    assert facts is not None and facts.queue_fill_ratio == 0
    assert entry.report()["state"] == "unloaded"
