"""Writing model artifacts shared by the example builders: ONNX export and a validated `model.yaml`."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from servewell.config.model import ModelConfig

if TYPE_CHECKING:  # torch is imported only when a builder runs
    import torch

#: Receives one human-readable progress line from a builder ("training epoch 3/8 ...").
ProgressFn = Callable[[str], None]


def export_onnx(model: torch.nn.Module, item_shape: tuple[int, ...], path: Path) -> None:
    """Export `model` (in eval mode) to ONNX with input "input" and output "logits", batch axis dynamic.

    Uses the TorchScript-based exporter (`dynamo=False`): the dynamo exporter needs onnxscript,
    which servewell does not depend on. Its deprecation warning is silenced for that reason.
    """
    import torch

    example = torch.zeros((2, *item_shape), dtype=torch.float32)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        torch.onnx.export(
            model,
            (example,),
            str(path),
            dynamo=False,
            input_names=["input"],
            output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
            opset_version=17,
            do_constant_folding=True,
        )


def write_model_yaml(model_dir: Path, config: dict[str, object]) -> ModelConfig:
    """Validate `config` as a `ModelConfig`, then write it to `model_dir/model.yaml`; returns the config.

    Validating first means a builder bug fails the build instead of producing a model the
    server would refuse to load.
    """
    validated = ModelConfig.model_validate(config)
    text = yaml.safe_dump(config, sort_keys=False, allow_unicode=True)
    # Round-trip through YAML too: what the server reads must be what was validated.
    if ModelConfig.model_validate(yaml.safe_load(text)) != validated:
        raise ValueError("model.yaml does not round-trip through YAML")
    (model_dir / "model.yaml").write_text(text, encoding="utf-8")
    return validated
