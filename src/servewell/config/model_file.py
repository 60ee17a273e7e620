"""Reading one model directory's `model.yaml` into a `ModelConfig`, with every problem named.

The server (through `engine.repository`) and `servewell models` read a model the same way;
`ModelConfigError` keeps each problem's field and reason, so the CLI can list them one a line
while the server reports them in one sentence.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from servewell.config.bounded_yaml import cut, load_bounded, short_yaml_error
from servewell.config.file_read import DEFAULT_MAX_CONFIG_BYTES, ConfigReadError, read_config_bytes
from servewell.config.model import ModelConfig, is_pattern
from servewell.config.problems import TOP_LEVEL, FieldProblem, field_problems
from servewell.config.rollout import VERSIONS_DIRECTORY

CONFIG_FILE = "model.yaml"
#: Problems kept per file, and characters per field name and reason: pydantic messages can echo
#: the input, and a 979-byte file of anchors once made /healthz 4.2 MB per request.
MAX_PROBLEMS = 10
MAX_FIELD_CHARS = 120
MAX_REASON_CHARS = 300


def bounded(problems: list[FieldProblem]) -> list[FieldProblem]:
    """At most `MAX_PROBLEMS` problems, each field and reason cut short."""
    kept = [FieldProblem(cut(p.field, MAX_FIELD_CHARS), cut(p.reason, MAX_REASON_CHARS))
            for p in problems[:MAX_PROBLEMS]]
    if len(problems) > MAX_PROBLEMS:
        kept.append(FieldProblem(TOP_LEVEL, f"and {len(problems) - MAX_PROBLEMS} more problems"))
    return kept


class ModelConfigError(ValueError):
    """A model.yaml that cannot be served: its path and each problem with its field and reason.

    `str()` is one line: `<path>: field 'a': reason; field 'b': reason`.
    """

    def __init__(self, path: Path, problems: list[FieldProblem]) -> None:
        self.path = path
        self.problems = tuple(bounded(problems))
        super().__init__(f"{path}: " + "; ".join(str(p) for p in self.problems))


def read_model_yaml(directory: Path, max_bytes: int = DEFAULT_MAX_CONFIG_BYTES, *,
                    version_of: str | None = None) -> ModelConfig:
    """Parse and check `<directory>/model.yaml`, the artifact's presence included. Only a regular
    file of at most `max_bytes` is read, and its YAML is bounded (`config.bounded_yaml`).
    `version_of`: `directory` is `<model>/versions/<v>/` of model `version_of`: the name defaults
    to it and the version to `<v>`, which it must be, and a version splits no traffic of its own.

    Raises `ModelConfigError` naming the file and, for each problem, the field and the reason.
    """
    path = directory / CONFIG_FILE
    if not path.exists():
        raise ModelConfigError(path, [FieldProblem(TOP_LEVEL, f"missing (each model directory needs a {CONFIG_FILE})")])
    try:
        raw = load_bounded(read_config_bytes(path, max_bytes))
    except ConfigReadError as exc:
        raise ModelConfigError(path, [FieldProblem(TOP_LEVEL, str(exc))]) from None
    except yaml.YAMLError as exc:
        raise ModelConfigError(path, [FieldProblem(TOP_LEVEL, f"not valid YAML: {short_yaml_error(exc)}")]) from None
    if not isinstance(raw, dict):
        got = type(raw).__name__
        raise ModelConfigError(path, [FieldProblem(TOP_LEVEL, f"expected a mapping of fields, got {got}")])
    expected = version_of or directory.name
    raw.setdefault("name", expected)
    if version_of is not None:
        raw.setdefault("version", directory.name)
    try:
        config = ModelConfig.model_validate(raw)
    except ValidationError as exc:
        raise ModelConfigError(path, field_problems(exc)) from None
    problems = []
    if config.name != expected:
        problems.append(FieldProblem("name", f"'{cut(config.name, 100)}' must match the "
                                             f"{'model' if version_of else 'directory'} name '{expected}'"))
    if version_of is not None and config.version != directory.name:
        problems.append(FieldProblem("version", f"'{cut(config.version, 100)}' must match its directory "
                                                f"versions/{directory.name}"))
    if version_of is not None and (config.traffic is not None or config.rollout is not None):
        problems.append(FieldProblem("traffic", "a version under versions/ splits no traffic: the model's own "
                                                "model.yaml holds traffic and rollout"))
    artifact = directory / config.artifact
    if not artifact.is_file():
        problems.append(FieldProblem("artifact", f"file {artifact} does not exist"))
    for index, entry in enumerate(config.extra_files):
        if not is_pattern(entry) and not (directory / entry).exists():
            problems.append(FieldProblem(f"extra_files.{index}", f"{directory / entry} does not exist (a glob "
                                         "pattern may match nothing; a named file must exist)"))
    if problems:
        raise ModelConfigError(path, problems)
    return config


def signature_problem(stable: ModelConfig, other: ModelConfig) -> str | None:
    """Why version `other` cannot share `stable`'s requests (None: it can): every version of a
    model takes the same inputs and gives the same outputs (names, datatypes, shapes)."""
    for group in ("inputs", "outputs"):
        mine = [(t.name, t.datatype, tuple(t.shape)) for t in getattr(stable, group)]
        theirs = [(t.name, t.datatype, tuple(t.shape)) for t in getattr(other, group)]
        if sorted(mine) != sorted(theirs):
            return (f"its {group} {theirs} differ from stable version '{stable.version}''s {mine}: every version of "
                    "a model takes the same requests and gives the same outputs")
    if (stable.max_batch_size == 0) != (other.max_batch_size == 0):
        return "max_batch_size 0 (no batch dimension) must be the same for every version"
    return None


def version_problems(directory: Path, config: ModelConfig) -> list[str]:
    """Problems of the other versions `config` (a model's stable model.yaml in `directory`) names
    in `traffic` or as its shadow, each read from `versions/<v>/` as the server reads it."""
    problems = []
    for version in sorted(config.other_versions):
        try:
            other = read_model_yaml(directory / VERSIONS_DIRECTORY / version, version_of=config.name)
        except ModelConfigError as exc:
            problems.append(f"version {version!r}: {exc}")
            continue
        mismatch = signature_problem(config, other)
        if mismatch is not None:
            problems.append(f"version {version!r}: {mismatch}")
    return problems
