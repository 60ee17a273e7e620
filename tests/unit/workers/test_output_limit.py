"""The bound on one request's answer, as the worker checks it before writing the outputs."""

from __future__ import annotations

import numpy as np

from servewell.errors import OutputTooLarge
from servewell.workers.output_limit import answer_refusal, largest_answer_bytes


def test_an_answer_within_the_bound_passes_and_a_larger_one_names_the_limit_and_the_size() -> None:
    outputs = {"y": np.zeros((1, 1000), np.float32)}  # 4,000 bytes
    assert answer_refusal("big", outputs, [1], 4000) is None
    refusal = answer_refusal("big", outputs, [1], 3999)
    assert isinstance(refusal, OutputTooLarge)
    assert refusal.status == 500 and refusal.code == "output_too_large"
    assert "model 'big' answered 4,000 bytes for one request (1 row), over its max_output_bytes of 3,999" \
        in refusal.message
    assert "rows per request" not in refusal.message  # one row is already too large: fewer rows cannot help


def test_the_largest_request_of_a_batch_is_judged_by_its_share_of_the_rows() -> None:
    outputs: dict[str, np.ndarray] = {"y": np.zeros((6, 100), np.float32),
                                      "z": np.zeros((6, 25), np.float64)}  # 600 bytes a row
    assert largest_answer_bytes(outputs, [1, 4, 1]) == (2400, 4)
    assert answer_refusal("m", outputs, [1, 4, 1], 2400) is None
    refusal = answer_refusal("m", outputs, [1, 4, 1], 2000)
    assert refusal is not None
    assert "2,400 bytes for one request (4 rows)" in refusal.message
    assert "send at most 3 rows per request" in refusal.message


def test_without_a_bound_nothing_is_refused_and_an_unbatched_answer_counts_whole() -> None:
    assert answer_refusal("m", {"y": np.zeros(10**6, np.uint8)}, [1], 0) is None
    assert largest_answer_bytes({"y": np.zeros((3, 3), np.float32)}, []) == (36, 0)
    assert largest_answer_bytes({"y": np.zeros((3, 3), np.float32)}, [3]) == (36, 3)
