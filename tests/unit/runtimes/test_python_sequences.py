"""Generative python models in their worker's runtime (runtimes/python_sequences.py): a step-wise
model's sequences join and leave its batch at any step; a generator's batches run as cohorts; each
part is checked against model.yaml; a model error ends only the sequences it concerns. Each model is
written into a tmp dir and loaded by the real python runtime."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from servewell.config.model import ModelConfig
from servewell.runtimes import load_runtime
from servewell.workers.messages import SequenceJoin, SequencePart

COUNTER = '''
import numpy as np


class Counter:
    """Each sequence counts from its prompt's first byte up, one number a step, for its prompt's
    length in steps; `step` records how many states it got at once."""

    def setup(self, config):
        self.batches = []
        self.ended = 0

    def start(self, requests):
        return [{"next": int(r["x"][0, 0]), "left": r["x"].shape[1]} for r in requests]

    def step(self, states):
        self.batches.append(len(states))
        out = []
        for state in states:
            if state["next"] == 99:
                raise ValueError("99 is not counted")
            value = np.array([[state["next"]]], dtype=np.uint8)
            state["next"] += 1
            state["left"] -= 1
            out.append(({"y": value}, state["left"] == 0))
        return out

    def end(self, states):
        self.ended += len(states)
'''

GENERATOR = '''
import numpy as np


class Repeat:
    """Yields each row's first byte, once per step, as many steps as the batch's prompts are long."""

    def execute(self, inputs):
        x = inputs["x"]
        for _ in range(x.shape[1]):
            yield {"y": x[:, :1]}
'''


def model(root: Path, source: str, entry: str) -> Any:
    directory = root / "g"
    directory.mkdir()
    (directory / "g.py").write_text(textwrap.dedent(source))
    doc = {"name": "g", "runtime": "python", "artifact": "g.py", "python": {"entry": entry}, "max_batch_size": 8,
           "inputs": [{"name": "x", "datatype": "UINT8", "shape": [-1]}],
           "outputs": [{"name": "y", "datatype": "UINT8", "shape": [-1]}], "generate": {}}
    (directory / "model.yaml").write_text(yaml.safe_dump(doc))
    return load_runtime(ModelConfig.model_validate(doc), directory, lambda stage: None)


def join(seq_id: int, prompt: bytes) -> SequenceJoin:
    return SequenceJoin(seq_id, {"x": np.frombuffer(prompt, np.uint8)[None, :]})


def values(parts: list[SequencePart]) -> dict[int, tuple[int | None, bool]]:
    return {p.seq_id: (int(p.outputs["y"][0, 0]) if p.outputs is not None else None, p.done) for p in parts}


def test_step_wise_sequences_join_and_leave_the_running_batch(tmp_path: Path) -> None:
    runtime = model(tmp_path, COUNTER, "g:Counter")
    sequences = runtime.sequence_set()
    assert values(sequences.step((join(1, b"\x0a\x00\x00"),), ())) == {1: (10, False)}
    # a second sequence joins the running one: one step computes both
    assert values(sequences.step((join(2, b"\x14\x00"),), ())) == {1: (11, False), 2: (20, False)}
    assert values(sequences.step((), ())) == {1: (12, True), 2: (21, True)}
    assert sequences.running == 0
    assert values(sequences.step((join(3, b"\x1e\x00\x00\x00"),), ())) == {3: (30, False)}
    sequences.step((), (3,))  # the engine ends it (cancelled): no more parts, end() called
    assert sequences.running == 0 and sequences.step((), ()) == []


def test_a_part_that_breaks_model_yaml_ends_that_sequence_only(tmp_path: Path) -> None:
    runtime = model(tmp_path, COUNTER.replace('np.array([[state["next"]]], dtype=np.uint8)',
                                              'np.array([[state["next"]]], dtype=np.uint8) if state["next"] != 50 '
                                              'else "text"'), "g:Counter")
    sequences = runtime.sequence_set()
    parts = {p.seq_id: p for p in sequences.step((join(1, b"\x32\x00"), join(2, b"\x0a\x00")), ())}
    assert parts[1].done and parts[1].error is not None and "'y'" in parts[1].error
    assert parts[2].error is None and not parts[2].done
    assert sequences.running == 1


def test_an_error_in_step_fails_the_step_and_ends_every_sequence(tmp_path: Path) -> None:
    runtime = model(tmp_path, COUNTER, "g:Counter")
    sequences = runtime.sequence_set()
    sequences.step((join(1, b"\x0a\x00\x00\x00"),), ())
    with pytest.raises(ValueError, match="99"):
        sequences.step((join(2, b"\x63\x00"),), ())
    assert sequences.running == 0


def test_generator_batches_run_as_cohorts_that_share_steps(tmp_path: Path) -> None:
    runtime = model(tmp_path, GENERATOR, "g:Repeat")
    sequences = runtime.sequence_set()
    # two prompts of one shape start one cohort; a later one starts its own and shares the steps
    first = values(sequences.step((join(1, b"ab"), join(2, b"cd")), ()))
    assert first == {1: (ord("a"), False), 2: (ord("c"), False)}
    second = values(sequences.step((join(3, b"xyz"),), ()))
    assert second == {1: (ord("a"), False), 2: (ord("c"), False), 3: (ord("x"), False)}
    third = values(sequences.step((), ()))
    assert third == {1: (None, True), 2: (None, True), 3: (ord("x"), False)}
    sequences.step((), (3,))  # left: the generator is closed
    assert sequences.running == 0


def test_a_generative_models_first_part_answers_a_plain_run(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    stepwise = model(tmp_path / "a", COUNTER, "g:Counter")
    out = stepwise.run({"x": np.array([[5, 0], [7, 0]], dtype=np.uint8)})
    assert out["y"].reshape(-1).tolist() == [5, 7]
    (tmp_path / "b").mkdir()
    generator = model(tmp_path / "b", GENERATOR, "g:Repeat")
    assert generator.run({"x": np.array([[9, 1]], dtype=np.uint8)})["y"].tolist() == [[9]]
