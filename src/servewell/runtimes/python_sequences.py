"""The sequences one worker of a generative python model runs, one step at a time.

The engine decides which sequences join and which leave (done, cancelled, expired, too slow:
engine/sequences.py); the worker applies those changes before its next step (`SequenceSet.apply`)
and steps on its own while any sequence runs (`SequenceSet.advance`), with the model's own code, in
one of two shapes:

**Step-wise** (continuous batching inside the model's own batch): the class defines

    def start(self, requests: list[dict[str, np.ndarray]]) -> list[object]
        # one state per request that joins (its inputs keep their row axis)
    def step(self, states: list[object]) -> list[tuple[dict[str, np.ndarray] | None, bool]]
        # per state, in order: this step's outputs (None: nothing this step) and whether it is done
    def end(self, states: list[object]) -> None        # optional: these sequences have left

`step` is called with every running sequence's state at once, so a model batches its compute
across sequences that started at different times (`examples/generative.py` shows it).

**Generator**: `execute(inputs)` is a generator that yields each part of its batch's outputs (all
rows; the batch ends when it returns). The requests that join at one step with inputs of the same
shapes form one batch (a cohort); every running cohort advances one part per step, so cohorts
that started at different steps still share steps. An `execute` that returns a dict is one part.

Every part is converted to and checked against model.yaml's outputs like any python model's
answer (`python_runtime.checked_outputs`). A model error in one sequence's `start` or in one
cohort ends those sequences only; an error in `step` (which runs them all) ends every sequence.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servewell.runtimes.base import describe_failure
from servewell.workers.messages import SequenceJoin, SequencePart

Outputs = dict[str, np.ndarray]


@dataclass(slots=True)
class _Cohort:
    """The sequences one generator call runs: their ids and rows, in batch order."""

    parts: Iterator[object]
    ids: list[int]
    rows: list[int]
    live: set[int] = field(default_factory=set)


class SequenceSet:
    """The running sequences of one worker (`model` is the python runtime: `python_runtime.PythonModelRuntime`)."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._states: dict[int, object] = {}  # step-wise: seq id -> its state, in join order
        self._rows: dict[int, int] = {}  # seq id -> rows of its request
        self._left: dict[int, int] = {}  # seq id -> parts it may still make (absent: no bound)
        self._cohorts: list[_Cohort] = []  # generator models

    @property
    def running(self) -> int:
        """Sequences started and not yet ended."""
        return len(self._rows)

    def apply(self, joins: tuple[SequenceJoin, ...], leaves: tuple[int, ...]) -> list[SequencePart]:
        """End `leaves`, start `joins`; the parts of the joins that failed to start (done, with the error)."""
        self._leave(leaves)
        for join in joins:
            if join.limit > 0:
                self._left[join.seq_id] = join.limit
        failed = self._start(joins) if self._model.stepwise else self._join_cohorts(joins)
        for part in failed:
            self._left.pop(part.seq_id, None)
        return failed

    def advance(self) -> list[SequencePart]:
        """Every running sequence's next part; a sequence's last allowed part is done. Raises when
        the step as a whole failed (every sequence has then ended)."""
        parts = self._step() if self._model.stepwise else self._advance()
        if not self._left:
            return parts
        limited: list[int] = []
        for index, part in enumerate(parts):
            left = self._left.get(part.seq_id)
            if left is None:
                continue
            if part.done:
                del self._left[part.seq_id]
            elif part.outputs is not None:
                if left <= 1:  # its last part: it is done, and leaves now
                    parts[index] = SequencePart(part.seq_id, part.outputs, True)
                    limited.append(part.seq_id)
                else:
                    self._left[part.seq_id] = left - 1
        self._leave(tuple(limited))
        return parts

    def step(self, joins: tuple[SequenceJoin, ...] = (), leaves: tuple[int, ...] = ()) -> list[SequencePart]:
        """`apply` then `advance`: one step with these changes."""
        failed = self.apply(joins, leaves)
        return failed + (self.advance() if self.running else [])

    def close(self) -> None:
        """End every sequence (the worker stops)."""
        self._leave(tuple(self._rows))

    # --- step-wise ---------------------------------------------------------------------------

    def _start(self, joins: tuple[SequenceJoin, ...]) -> list[SequencePart]:
        if not joins:
            return []
        requests = [dict(join.inputs) for join in joins]
        try:
            states = list(self._model.start_sequences(requests))
            if len(states) != len(joins):
                raise ValueError(f"start returned {len(states)} states for {len(joins)} requests; it returns one "
                                 "state per request, in order")
        except Exception as exc:
            message = describe_failure(exc)
            return [SequencePart(join.seq_id, None, True, message) for join in joins]
        for join, state in zip(joins, states, strict=True):
            self._states[join.seq_id] = state
            self._rows[join.seq_id] = _rows_of(join.inputs)
        return []

    def _step(self) -> list[SequencePart]:
        if not self._states:
            return []
        ids = list(self._states)
        try:
            results = list(self._model.step_sequences([self._states[i] for i in ids]))
            if len(results) != len(ids):
                raise ValueError(f"step returned {len(results)} results for {len(ids)} states; it returns one "
                                 "(outputs, done) per state, in order")
        except Exception:
            self._leave(tuple(ids))
            raise
        parts: list[SequencePart] = []
        finished: list[int] = []
        for seq_id, result in zip(ids, results, strict=True):
            try:
                outputs, done = _outputs_and_done(result)
                checked = self._model.checked_part(outputs, self._rows[seq_id]) if outputs is not None else None
            except Exception as exc:
                parts.append(SequencePart(seq_id, None, True, describe_failure(exc)))
                finished.append(seq_id)
                continue
            parts.append(SequencePart(seq_id, checked, done))
            if done:
                finished.append(seq_id)
        self._leave(tuple(finished))
        return parts

    # --- generators --------------------------------------------------------------------------

    def _join_cohorts(self, joins: tuple[SequenceJoin, ...]) -> list[SequencePart]:
        groups: dict[tuple[Any, ...], list[SequenceJoin]] = {}
        for join in joins:
            key = tuple((name, np.shape(value), str(np.asarray(value).dtype))
                        for name, value in sorted(join.inputs.items()))
            groups.setdefault(key, []).append(join)
        parts: list[SequencePart] = []
        for group in groups.values():
            rows = [_rows_of(join.inputs) for join in group]
            names = list(group[0].inputs)
            batch = {name: np.concatenate([np.asarray(join.inputs[name]) for join in group]) for name in names} \
                if self._model.batched else dict(group[0].inputs)
            if not self._model.batched and len(group) > 1:  # no row axis: one request per call
                for join in group:
                    parts.extend(self._join_cohorts((join,)))
                continue
            ids = [join.seq_id for join in group]
            try:
                returned = self._model.execute_batch(batch)
            except Exception as exc:
                message = describe_failure(exc)
                parts.extend(SequencePart(i, None, True, message) for i in ids)
                continue
            for seq_id, count in zip(ids, rows, strict=True):
                self._rows[seq_id] = count
            if isinstance(returned, Generator) or (isinstance(returned, Iterator) and not isinstance(returned,
                                                                                                      Mapping)):
                self._cohorts.append(_Cohort(returned, ids, rows, set(ids)))
            else:  # a plain answer: the stream's one part
                self._cohorts.append(_Cohort(iter((returned,)), ids, rows, set(ids)))
        return parts

    def _advance(self) -> list[SequencePart]:
        parts: list[SequencePart] = []
        for cohort in list(self._cohorts):
            try:
                value = next(cohort.parts)
            except StopIteration:
                parts.extend(SequencePart(i, None, True) for i in cohort.ids if i in cohort.live)
                self._end_cohort(cohort)
                continue
            except Exception as exc:
                message = describe_failure(exc)
                parts.extend(SequencePart(i, None, True, message) for i in cohort.ids if i in cohort.live)
                self._end_cohort(cohort)
                continue
            try:
                outputs = self._model.checked_part(value, sum(cohort.rows))
            except Exception as exc:
                message = describe_failure(exc)
                parts.extend(SequencePart(i, None, True, message) for i in cohort.ids if i in cohort.live)
                self._end_cohort(cohort)
                continue
            start = 0
            for seq_id, count in zip(cohort.ids, cohort.rows, strict=True):
                if seq_id in cohort.live:
                    own = {name: array[start:start + count] for name, array in outputs.items()} \
                        if self._model.batched else outputs
                    parts.append(SequencePart(seq_id, own, False))
                start += count
        return parts

    def _end_cohort(self, cohort: _Cohort) -> None:
        self._cohorts.remove(cohort)
        for seq_id in cohort.ids:
            self._rows.pop(seq_id, None)
            self._left.pop(seq_id, None)
        close = getattr(cohort.parts, "close", None)
        if callable(close):
            try:
                close()
            except Exception:
                pass

    # --- leaving -----------------------------------------------------------------------------

    def _leave(self, leaves: tuple[int, ...]) -> None:
        if not leaves:
            return
        gone = [seq_id for seq_id in leaves if seq_id in self._rows]
        for seq_id in leaves:
            self._left.pop(seq_id, None)
        for seq_id in gone:
            self._rows.pop(seq_id, None)
        if self._model.stepwise:
            states = [self._states.pop(seq_id) for seq_id in gone if seq_id in self._states]
            if states:
                self._model.end_sequences(states)
            return
        for cohort in list(self._cohorts):
            cohort.live.difference_update(gone)
            if not cohort.live:
                self._end_cohort(cohort)


def _rows_of(inputs: Mapping[str, Any]) -> int:
    first = next(iter(inputs.values()), None)
    shape = np.shape(first) if first is not None else ()
    return int(shape[0]) if shape else 1


def _outputs_and_done(result: object) -> tuple[Mapping[str, Any] | None, bool]:
    if not isinstance(result, tuple) or len(result) != 2:
        raise ValueError(f"step returned {type(result).__name__} for a sequence; it returns (outputs, done) per "
                         "state, outputs a dict of arrays (or None) and done a bool")
    outputs, done = result
    if outputs is not None and not isinstance(outputs, Mapping):
        raise ValueError(f"step returned outputs of type {type(outputs).__name__}; a dict of name -> array, or None")
    return outputs, bool(done)
