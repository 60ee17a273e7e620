"""model.yaml's `generate:` and `text:` sections (config/generate.py): what fits together is accepted,
every mistake is named by its field when the file loads, never learned from a request."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from servewell.config.generate import MAX_STATE_BYTES
from servewell.config.model import ModelConfig

TEXT_IO = {"inputs": [{"name": "text_input", "datatype": "UINT8", "shape": [-1]}],
           "outputs": [{"name": "text_output", "datatype": "UINT8", "shape": [-1]}]}


def generative(**fields: Any) -> dict[str, Any]:
    return {"name": "g", "runtime": "python", "artifact": "g.py", "python": {"entry": "g:G"}, "max_batch_size": 4,
            **TEXT_IO, "generate": {}, "text": {"input": "text_input", "output": "text_output"}, **fields}


def problems(doc: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as caught:
        ModelConfig.model_validate(doc)
    return str(caught.value)


def test_a_generative_text_model_loads_with_its_defaults() -> None:
    config = ModelConfig.model_validate(generative())
    assert config.generate is not None and config.generate.batching == "continuous"
    assert config.generate.max_state_bytes <= MAX_STATE_BYTES
    assert config.text is not None and config.text.output == "text_output"


def test_an_embedding_model_names_only_its_text_input() -> None:
    doc = generative(outputs=[{"name": "embedding", "datatype": "FP32", "shape": [8]}], text={"input": "text_input"})
    doc.pop("generate")
    assert ModelConfig.model_validate(doc).generate is None


@pytest.mark.parametrize(("change", "named"), [
    ({"runtime": "onnx", "artifact": "g.onnx", "python": None}, "generate"),
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"text": {"input": "nope", "output": "text_output"}}, "text.input"),
    ({"inputs": [{"name": "text_input", "datatype": "FP32", "shape": [-1]}]}, "text.input"),
    ({"outputs": [{"name": "text_output", "datatype": "UINT8", "shape": [4, -1]}]}, "text.output"),
    ({"cache": {}}, "cache"),
    ({"generate": {"max_state_bytes": MAX_STATE_BYTES + 1}}, "max_state_bytes"),
    ({"generate": {"batching": "sometimes"}}, "batching"),
    ({"generate": {"max_sequences": 0}}, "max_sequences"),
])
def test_what_does_not_fit_is_named_by_its_field(change: dict[str, Any], named: str) -> None:
    doc = generative(**change)
    if doc.get("python") is None:
        doc.pop("python")
    assert named in problems(doc)


def test_a_text_output_needs_a_generative_model() -> None:
    doc = generative()
    doc.pop("generate")
    assert "text.output" in problems(doc)
