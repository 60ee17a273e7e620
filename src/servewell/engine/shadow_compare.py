"""How far a shadow version's answer is from the primary's, per output: pure numpy, no I/O.

engine/rollout.py calls `compare_outputs` on every shadowed request with the request's own rows.
A batched model (max_batch_size > 0) answers with the rows on the first axis, so an output
declared as a scalar per row arrives 1-d and has no score axis; a model without batching answers
one row, whatever its shape. The numbers feed the shadow agreement metrics and the judge's
`min_shadow_agreement` rule.

Cost: a fixed number of whole-array numpy operations per output (O(size), no Python loop per
element or per row), so a large output costs a few passes over its memory and nothing more.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

#: dtype kind -> the family compared; families differ means the outputs disagree on every row.
#: Signed and unsigned integers are one family: a re-exported model answering uint8 labels
#: instead of int64 ones still answers the same thing.
_FAMILY = {"b": "bool", "i": "int", "u": "int", "f": "float", "c": "complex"}
#: Families with a meaningful absolute difference.
_NUMERIC = frozenset(_FAMILY.values())
#: Families whose last axis can hold scores with an argmax (top-1).
_SCORES = frozenset({"int", "float"})


@dataclass(frozen=True, slots=True)
class OutputAgreement:
    """One output of one shadowed request, primary against shadow."""

    #: The output's name.
    output: str
    #: Rows compared: the primary's first axis when batched (1 for a 0-d array), else 1.
    rows: int
    #: Rows whose argmax over the last axis agrees on every position; None when the output is not
    #: an int or float tensor with a last axis longer than 1 (a scalar per row, a string); 0 on a
    #: shape mismatch (every row counts as a disagreement).
    top1_matches: int | None
    #: Largest |primary - shadow| over the whole output (nan against nan counts as equal, nan
    #: against a number as an infinite difference); None when not numeric or on a shape mismatch.
    max_abs_diff: float | None
    #: Shapes or dtype families differ, or the output is missing on one side.
    shape_mismatch: bool


def compare_outputs(primary: Mapping[str, np.ndarray], shadow: Mapping[str, np.ndarray], *,
                    batched: bool = True) -> list[OutputAgreement]:
    """Compare the outputs of two answers by name: the primary's outputs in order, then the
    shadow's extra ones (each a mismatch). `batched`: the first axis is rows (the model's
    max_batch_size > 0). Never raises for any numeric, string or object array."""
    found = [_compare(name, np.asarray(array), shadow.get(name), batched) for name, array in primary.items()]
    for name, array in shadow.items():
        if name not in primary:
            found.append(OutputAgreement(name, _rows(np.asarray(array), batched), 0, None, True))
    return found


def _compare(name: str, primary: np.ndarray, other: np.ndarray | None, batched: bool) -> OutputAgreement:
    rows = _rows(primary, batched)
    if other is None:
        return OutputAgreement(name, rows, 0, None, True)
    shadow = np.asarray(other)
    family = _family(primary)
    if primary.shape != shadow.shape or family != _family(shadow):
        return OutputAgreement(name, rows, 0, None, True)
    if family not in _NUMERIC:
        return OutputAgreement(name, rows, None, None, False)
    top1 = _top1_matches(primary, shadow, rows, batched) if family in _SCORES else None
    return OutputAgreement(name, rows, top1, _max_abs_diff(primary, shadow), False)


def _rows(array: np.ndarray, batched: bool) -> int:
    return int(array.shape[0]) if batched and array.ndim >= 1 else 1


def _family(array: np.ndarray) -> str:
    # Strings, objects, dates: compared by shape and kind only.
    return _FAMILY.get(array.dtype.kind, "other:" + array.dtype.kind)


def _top1_matches(primary: np.ndarray, shadow: np.ndarray, rows: int, batched: bool) -> int | None:
    # A score axis is a last axis longer than 1 that is not the row axis.
    if primary.ndim < (2 if batched else 1) or primary.shape[-1] <= 1:
        return None
    if rows == 0:
        return 0
    # np.argmax takes the first nan as the maximum, so nan at the same place agrees.
    same = np.argmax(primary, axis=-1) == np.argmax(shadow, axis=-1)
    # A row of several positions (a sequence of tokens) agrees when every position does.
    return int(np.count_nonzero(np.reshape(same, (rows, -1)).all(axis=1)))


def _max_abs_diff(primary: np.ndarray, shadow: np.ndarray) -> float:
    if primary.size == 0:
        return 0.0
    wide = np.complex128 if primary.dtype.kind == "c" else np.float64
    a = np.ravel(primary).astype(wide, copy=False)  # 1-d, so a 0-d output can be indexed too
    b = np.ravel(shadow).astype(wide, copy=False)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a - b)
        # Equal values (inf included) and nan against nan differ by nothing; what is left as nan
        # (nan against a number) differs by an infinite amount.
        diff[(a == b) | (np.isnan(a) & np.isnan(b))] = 0.0
    diff[np.isnan(diff)] = np.inf
    return float(diff.max())
