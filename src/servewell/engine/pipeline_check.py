"""A pipeline checked against its step models' configs, when it loads (and again for a step whose
model was reloaded since): every step model exists and is a model, every input of it is fed by a
tensor of the same dtype and a compatible shape, and every pipeline output names an output its step's
model has, of the dtype and shape the pipeline declares.

What the pipeline's own model.yaml can say alone is checked in config/pipeline.py; what needs the
step models is checked here, and each problem names the step, the tensor and both sides.
"""

from __future__ import annotations

from collections.abc import Callable

from servewell.config.model import ModelConfig
from servewell.config.pipeline import PipelineStep, split_source
from servewell.config.tensors import TensorSpec

#: A step model's config by name: the config, or None with why it cannot serve a step.
StepConfigs = Callable[[str], tuple[ModelConfig | None, str]]


def shapes_fit(a: list[int], b: list[int]) -> bool:
    """Whether two declared shapes can hold the same tensor (-1 fits any size)."""
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b, strict=True))


def check_pipeline(config: ModelConfig, configs: StepConfigs) -> list[str]:
    """Every mismatch between the pipeline `config` and its step models (empty: it fits)."""
    spec = config.pipeline
    assert spec is not None
    problems: list[str] = []
    tensors: dict[str, TensorSpec] = {t.name: t for t in config.inputs}
    for step in spec.steps:
        step_config = check_step(config, step, tensors, configs, problems)
        if step_config is not None:
            for out in step_config.outputs:
                tensors[f"{step.name}.{out.name}"] = out
    models = {step.name: step.model for step in spec.steps}
    for output in config.outputs:
        for source in spec.alternatives(output.name):
            # A source naming an output its step's model lacks is refused here: served, it made every
            # request a 422 "skipped by their conditions" (issue 45 W6).
            given = _source_spec(source, tensors, problems, f"output {output.name!r}", models)
            if given is None:
                continue  # named just now, or its step failed a check above (said there)
            if given.datatype != output.datatype or not shapes_fit(given.shape, output.shape):
                problems.append(f"output {output.name!r} is declared {output.datatype} {output.shape}, but its "
                                f"source {source!r} gives {given.datatype} {given.shape}")
    return problems


def check_step(config: ModelConfig, step: PipelineStep, tensors: dict[str, TensorSpec], configs: StepConfigs,
               problems: list[str]) -> ModelConfig | None:
    """Check one step against its model; its config when the model can serve it (even if some of its
    inputs do not fit: the steps after it are then still checked against its outputs)."""
    where = f"step {step.name!r} (model {step.model!r})"
    spec = config.pipeline
    models = {} if spec is None else {s.name: s.model for s in spec.steps}
    step_config, why = configs(step.model)
    if step_config is None:
        problems.append(f"{where}: {why}")
        return None
    if step.version is not None and step_config.version != step.version:
        problems.append(f"{where} asks for version {step.version!r}; the model serves version "
                        f"{step_config.version!r}")
    if (step_config.max_batch_size == 0) != (config.max_batch_size == 0):
        problems.append(f"{where}: max_batch_size {step_config.max_batch_size} and the pipeline's "
                        f"{config.max_batch_size} disagree on a batch dimension (0 means none)")
    elif step_config.max_batch_size < config.max_batch_size:
        problems.append(f"{where} takes batches of at most {step_config.max_batch_size} rows; the pipeline's "
                        f"max_batch_size {config.max_batch_size} would let a request send more (lower it)")
    wanted = {t.name: t for t in step_config.inputs}
    for name in wanted:
        if name not in step.inputs:
            problems.append(f"{where}: input {name!r} is not fed (add it to the step's inputs)")
    for name, source in step.inputs.items():
        target = wanted.get(name)
        if target is None:
            problems.append(f"{where} has no input {name!r}; its inputs are {sorted(wanted)}")
            continue
        given = _source_spec(source, tensors, problems, f"{where} input {name!r}", models)
        if given is not None and (given.datatype != target.datatype or not shapes_fit(given.shape, target.shape)):
            problems.append(f"{where} input {name!r} is {target.datatype} {target.shape}, but its source "
                            f"{source!r} is {given.datatype} {given.shape}")
    if step.when is not None:
        _source_spec(step.when.tensor, tensors, problems, f"{where} condition", models)
    return step_config


def _source_spec(source: str, tensors: dict[str, TensorSpec], problems: list[str], what: str,
                 models: dict[str, str]) -> TensorSpec | None:
    """The spec of the tensor `source` names; None, with the problem added, when its step's model has
    no such output (None without a problem when the step itself failed: said already)."""
    given = tensors.get(source)
    step, tensor = split_source(source)
    if given is None and step is not None and not any(name.startswith(step + ".") for name in tensors):
        return None  # the source step's own problem is reported already
    if given is None:
        outputs = sorted(name.partition(".")[2] for name in tensors if name.startswith(f"{step}."))
        model = f" (model {models[step]!r})" if step in models else ""
        problems.append(f"{what}: step {step!r}{model} has no output {tensor!r}; its outputs are {outputs}")
    return given
