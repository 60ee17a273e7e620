"""The `pipeline:` section of a model.yaml of `kind: pipeline`: steps that are served models, wired
by tensor names.

A source names a tensor: a pipeline input (`page`) or a step's output (`crop.digit`). Steps are
listed so that every source comes from a pipeline input or an earlier step, which rules out
cycles; steps whose sources are ready run at once (a fan-out), and a step that takes several
steps' outputs joins them (a fan-in). A step with `when:` runs only when its condition holds for
the request (a switch); a step fed by a skipped step is skipped too, and a pipeline output may
name alternatives, the first whose step ran answering.

Everything checkable from this file alone is checked here; what needs the step models' own
configs (their inputs, outputs, dtypes and shapes) is checked when the pipeline loads
(engine/pipeline.py).
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from servewell.config.problems import Problems, config_error
from servewell.config.strict import StrictModel

#: Steps of one pipeline, and alternatives of one output: a graph, not a program.
MAX_STEPS = 32
MAX_ALTERNATIVES = 8
#: Longest step name, model name or source.
MAX_NAME_CHARS = 200


def _is_name(text: str) -> bool:
    return 0 < len(text) <= MAX_NAME_CHARS and all(c.isalnum() or c in "-_" for c in text)


def split_source(source: str) -> tuple[str | None, str]:
    """(step, tensor) of a source: `crop.digit` is step `crop`'s output `digit`; `page` (no dot) is
    the pipeline's input `page`, with step None."""
    step, dot, tensor = source.partition(".")
    return (step, tensor) if dot else (None, source)


class StepCondition(StrictModel):
    """When a step runs: every element of `tensor` equals `equals` (a switch on a tensor)."""

    tensor: str = Field(description="Source of the tensor tested: a pipeline input or 'step.output'.")
    equals: float | bool = Field(description="The value every element of the tensor must equal for the step to run.")


class PipelineStep(StrictModel):
    """One step: a served model, and where each of its inputs comes from."""

    name: str = Field(description="The step's name: letters, digits, '-' or '_'; other steps' sources use it.")
    model: str = Field(description="The served model that runs this step (any runtime, python included).")
    version: str | None = Field(None, description="The version that must serve it; unset: whichever serves.")
    inputs: dict[str, str] = Field(
        min_length=1, max_length=64,
        description="The step model's input name -> source: a pipeline input ('page') or an earlier step's output "
        "('crop.digit'). Every input of the step model must be fed.",
    )
    when: StepCondition | None = Field(None, description="Run only when this holds; unset: always.")

    @field_validator("name")
    @classmethod
    def _step_name(cls, value: str) -> str:
        if not _is_name(value):
            raise config_error(f"{value[:MAX_NAME_CHARS]!r}: use letters, digits, '-' or '_'")
        return value

    @field_validator("model")
    @classmethod
    def _model_name(cls, value: str) -> str:
        if not 0 < len(value) <= MAX_NAME_CHARS or not all(c.isalnum() or c in "-_." for c in value):
            raise config_error(f"{value[:MAX_NAME_CHARS]!r} is not a model name: use letters, digits, '-', '_' or '.'")
        return value


class PipelineSpec(StrictModel):
    """The steps of a pipeline and where its outputs come from."""

    steps: list[PipelineStep] = Field(min_length=1, max_length=MAX_STEPS,
                                      description="The steps, each after the steps it takes outputs from.")
    outputs: dict[str, str | list[str]] = Field(
        min_length=1, max_length=64,
        description="Pipeline output name -> the source that answers it, or a list of alternatives (for a switch): "
        "the first whose step ran for the request.",
    )

    @model_validator(mode="after")
    def _wired(self) -> PipelineSpec:
        problems = Problems(type(self).__name__)
        seen: set[str] = set()
        for index, step in enumerate(self.steps):
            if step.name in seen:
                problems.add(("steps", index, "name"), f"step name {step.name!r} is used twice")
            for target, source in step.inputs.items():
                where = ("steps", index, "inputs", target)
                reason = self._source_problem(source, seen)
                if reason is not None:
                    problems.add(where, reason, source)
            if step.when is not None:
                reason = self._source_problem(step.when.tensor, seen)
                if reason is not None:
                    problems.add(("steps", index, "when", "tensor"), reason, step.when.tensor)
            seen.add(step.name)
        for output, choice in self.outputs.items():
            alternatives = [choice] if isinstance(choice, str) else choice
            if not alternatives or len(alternatives) > MAX_ALTERNATIVES:
                problems.add(("outputs", output), f"give one source or 1 to {MAX_ALTERNATIVES} alternatives")
            for source in alternatives:
                reason = self._source_problem(source, seen, from_step=True)
                if reason is not None:
                    problems.add(("outputs", output), reason, source)
        problems.raise_if_any()
        return self

    @staticmethod
    def _source_problem(source: str, earlier: set[str], from_step: bool = False) -> str | None:
        """Why `source` cannot feed a step (or a pipeline output); None when it can."""
        if len(source) > MAX_NAME_CHARS or source.count(".") > 1 or not all(_is_name(p) for p in source.split(".")):
            return f"{source[:MAX_NAME_CHARS]!r} is not a source: give an input name or 'step.output'"
        step, _ = split_source(source)
        if step is None:
            return "must be a step's output ('step.output')" if from_step else None
        if step not in earlier:
            return f"{source!r} names step {step!r}, which is not an earlier step (list steps after their sources)"
        return None

    def alternatives(self, output: str) -> list[str]:
        """The sources of pipeline output `output`, first choice first."""
        choice = self.outputs[output]
        return [choice] if isinstance(choice, str) else list(choice)

    def step(self, name: str) -> PipelineStep:
        """The step called `name`."""
        return next(step for step in self.steps if step.name == name)
