"""model.yaml sections of models that answer in parts (`generate:`) or in text (`text:`).

A model with a `generate:` section is generative: each request is one *sequence* whose outcome
arrives in parts, and the engine runs its sequences with continuous (iteration-level) batching:
at every step, sequences join the running batch (up to `max_sequences`) and the finished, expired,
cancelled or too-slow ones leave (engine/sequences.py). Its code is a python model that is either
step-wise (`start`, `step`, `end`) or a generator (`execute` yields each part for its batch):
runtimes/python_sequences.py.

A `text:` section names the UINT8 tensors that carry UTF-8 text, so that the text endpoints (OIP
`generate`, the OpenAI-compatible `/v1/...`) can turn a prompt into an input tensor and the
output tensor back into text; a model needs no tokenizer in the server.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from servewell.config.strict import StrictModel

#: The most bytes of inputs the sequences that join at one step bring together (and so the most
#: one sequence may bring): a step's message crosses to the worker whole, without the engine's
#: event loop ever waiting on the pipe (a Unix socket pair buffers about 208 KiB).
MAX_STATE_BYTES = 1 << 17


class GenerateSettings(StrictModel):
    """How the engine runs a generative model's sequences (continuous batching)."""

    batching: Literal["continuous", "static"] = Field(
        "continuous", description="continuous: a waiting sequence joins the running batch at the next step; static: "
        "only when no sequence runs (every sequence of a batch waits for the longest; the baseline bench.streams "
        "compares against).",
    )
    max_sequences: int = Field(
        32, ge=1, le=4096, description="Sequences one instance runs at once (each step computes all of them); "
        "more wait to join.",
    )
    urgent_sequences: int | None = Field(
        None, ge=0, description="Places of max_sequences that only the first lane may take, so that an urgent "
        "sequence joins at the next step however many others run (default: an eighth of max_sequences, at "
        "least 1; 0 with a single lane).",
    )
    max_waiting: int = Field(
        256, ge=0, le=100_000, description="Sequences that may wait to join, per lane of the model; more are "
        "refused 503 overloaded (a flood in one lane never shuts out another).",
    )
    max_outputs: int = Field(
        512, ge=1, le=1_000_000, description="Most parts one sequence may produce; a request may ask for fewer "
        "(OpenAI max_tokens, OIP parameters.max_tokens). The sequence ends there (finish_reason length).",
    )
    stream_buffer_parts: int = Field(
        256, ge=1, le=100_000, description="Parts buffered for a client that reads more slowly than the model "
        "writes; past this its stream ends with 408 stream_too_slow and its sequence is freed at the next step.",
    )
    step_timeout_ms: float = Field(
        30_000.0, gt=0, description="Longest one step may take (the model's start and step for every running "
        "sequence): past it the worker is declared hung and replaced, and its sequences answered 503 worker_hung.",
    )
    max_state_bytes: int = Field(
        1 << 16, ge=1, le=MAX_STATE_BYTES, description="Largest inputs one sequence may bring (its prompt's tensors, "
        "in bytes; at most 128 KiB: they cross to the worker inside the step's message, which must fit the worker "
        "pipe's buffer whole); a sequence's memory in the worker is bounded by what it starts from plus its parts.",
    )


class TextSettings(StrictModel):
    """Which tensors carry UTF-8 text for the text endpoints (OIP generate, the OpenAI-compatible API)."""

    input: str = Field(description="The UINT8 input [-1] that receives the prompt's UTF-8 bytes.")
    output: str | None = Field(
        None, description="The UINT8 output [-1] whose parts are UTF-8 text (a generative model); an embedding "
        "model leaves it out and answers its first FP32 output as the embedding.",
    )


def generate_problems(config: object) -> list[tuple[tuple[str | int, ...], str]]:
    """What is wrong with a model.yaml's `generate:` and `text:` sections given the rest of it
    (`config` is the `ModelConfig` being validated): (field location, reason) pairs."""
    problems: list[tuple[tuple[str | int, ...], str]] = []
    generate: GenerateSettings | None = getattr(config, "generate", None)
    text: TextSettings | None = getattr(config, "text", None)
    runtime = getattr(config, "runtime", "")
    if generate is not None and runtime != "python":
        problems.append((("generate",), f"a generative model runs as a python model (step-wise or a generator); "
                         f"this model's runtime is {runtime}"))
    if generate is not None and getattr(config, "max_batch_size", 0) <= 0:
        problems.append((("max_batch_size",), "a generative model takes one row per sequence: give max_batch_size "
                         ">= 1"))
    if generate is not None and getattr(config, "cache", None) is not None:
        problems.append((("cache",), "a generative model's answers arrive in parts and are not cached; remove cache"))
    if text is None:
        return problems
    for group, name in (("inputs", text.input), ("outputs", text.output)):
        if name is None:
            continue
        spec = next((s for s in getattr(config, group) if s.name == name), None)
        where = ("text", "input" if group == "inputs" else "output")
        if spec is None:
            problems.append((where, f"names {name!r}, which is not one of the declared {group}"))
        elif spec.datatype != "UINT8" or list(spec.shape) != [-1]:
            problems.append((where, f"{name!r} must be UINT8 with shape [-1] (UTF-8 bytes); it is {spec.datatype} "
                             f"{list(spec.shape)}"))
    if text.output is not None and generate is None:
        problems.append((("text", "output"), "text output is for a generative model (a generate: section); an "
                         "embedding model leaves it out"))
    return problems
