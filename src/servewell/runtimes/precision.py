"""How far reduced-precision outputs are from an fp32 reference. Pure numpy, no framework."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True, frozen=True)
class PrecisionCheck:
    """Outcome of comparing a reduced-precision runtime with its fp32 reference."""

    checked_dtype: str
    """The reduced dtype that was checked (bf16, fp16)."""
    serving_dtype: str
    """The dtype the runtime serves in after the check (the checked one, or fp32)."""
    max_relative_difference: float | None
    """Largest difference found, relative to the reference's magnitude; None if not measured."""
    skipped_reason: str = ""
    """Why no comparison was made (e.g. no room for an fp32 copy); empty when one was."""

    @property
    def fell_back_to_fp32(self) -> bool:
        """True when the check switched the runtime to fp32."""
        return self.serving_dtype == "fp32" and self.checked_dtype != "fp32"


def max_relative_difference(outputs: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> float:
    """Largest |output - reference| over all floating outputs, each divided by max |reference|.

    Dividing by the output's largest magnitude rather than element by element keeps values
    near zero from blowing the ratio up. NaN or infinity where the reference has a finite
    value counts as an infinite difference; equal non-finite values count as equal. Outputs
    that are not floating point (class ids, masks) are not compared: reduced precision may
    legitimately flip a near-tie.
    """
    worst = 0.0
    for name, expected in reference.items():
        if not np.issubdtype(expected.dtype, np.floating):
            continue
        got = np.asarray(outputs[name], dtype=np.float64)
        want = np.asarray(expected, dtype=np.float64)
        if got.shape != want.shape:
            return float("inf")
        with np.errstate(invalid="ignore", over="ignore"):
            same = (got == want) | (np.isnan(got) & np.isnan(want))
            difference = np.where(same, 0.0, np.abs(got - want))
        if not np.all(np.isfinite(difference)):
            return float("inf")
        finite = want[np.isfinite(want)]
        scale = float(np.max(np.abs(finite))) if finite.size else 0.0
        peak = float(np.max(difference)) if difference.size else 0.0
        if peak == 0.0:
            continue
        worst = max(worst, peak / scale if scale > 0 else float("inf"))
    return worst
