"""Reading one model directory's `model.yaml` into a `ModelConfig`, with every problem named.

The server (through `engine.repository`) and `servewell models` read a model the same way;
`ModelConfigError` keeps each problem's field and reason, so the CLI can list them one a line
while the server reports them in one sentence.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from servewell.config.model import ModelConfig
from servewell.config.problems import TOP_LEVEL, FieldProblem, field_problems

CONFIG_FILE = "model.yaml"


class ModelConfigError(ValueError):
    """A model.yaml that cannot be served: its path and each problem with its field and reason.

    `str()` is one line: `<path>: field 'a': reason; field 'b': reason`.
    """

    def __init__(self, path: Path, problems: list[FieldProblem]) -> None:
        self.path = path
        self.problems = tuple(problems)
        super().__init__(f"{path}: " + "; ".join(str(p) for p in self.problems))


def read_model_yaml(directory: Path) -> ModelConfig:
    """Parse and check `<directory>/model.yaml`, the artifact's presence included.

    Raises `ModelConfigError` naming the file and, for each problem, the field and the reason.
    """
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise ModelConfigError(path, [FieldProblem(TOP_LEVEL, f"missing (each model directory needs a {CONFIG_FILE})")])
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ModelConfigError(path, [FieldProblem(TOP_LEVEL, f"not valid YAML: {exc}")]) from None
    if not isinstance(raw, dict):
        got = type(raw).__name__
        raise ModelConfigError(path, [FieldProblem(TOP_LEVEL, f"expected a mapping of fields, got {got}")])
    raw.setdefault("name", directory.name)
    try:
        config = ModelConfig.model_validate(raw)
    except ValidationError as exc:
        raise ModelConfigError(path, field_problems(exc)) from None
    problems = []
    if config.name != directory.name:
        problems.append(FieldProblem("name", f"'{config.name}' must match the directory name '{directory.name}'"))
    artifact = directory / config.artifact
    if not artifact.is_file():
        problems.append(FieldProblem("artifact", f"file {artifact} does not exist"))
    if problems:
        raise ModelConfigError(path, problems)
    return config
