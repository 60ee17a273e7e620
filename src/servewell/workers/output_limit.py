"""The bound on one request's answer (`max_output_bytes`), checked in the worker (pure, numpy only).

A model decides the size of an output with a free dimension (`[-1]`) itself: a python model
answering 200 MB a row had that answer copied into the worker's arena, out of it in the engine,
into the ingress's shared memory, then encoded on the ingress's event loop, and for the 38 s that
took every other model's requests through the same loops waited too (issue 45 H1). The worker
checks the answer right after compute, before it writes a byte of it anywhere: an answer over the
bound never leaves the worker, and its requests are answered 500 `output_too_large`, naming the
limit and the size.

An output's bytes are shared by the batch's requests in proportion to their rows (every output
has the batch's rows first, or the batch is one request), so the largest answer is the batch's
bytes times the largest request's share.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from servewell.errors import OutputTooLarge


def largest_answer_bytes(outputs: Mapping[str, np.ndarray], request_rows: Sequence[int]) -> tuple[int, int]:
    """(bytes, rows) of the largest answer among requests of `request_rows` rows each (one
    request of the whole batch when none are given)."""
    total = sum(int(array.nbytes) for array in outputs.values())
    rows = sum(request_rows)
    if len(request_rows) <= 1 or rows <= 0:
        return total, rows
    largest = max(request_rows)
    return -(-total * largest // rows), largest  # rounded up: never under the real figure


def answer_refusal(model: str, outputs: Mapping[str, np.ndarray], request_rows: Sequence[int],
                   limit: int) -> OutputTooLarge | None:
    """`OutputTooLarge` when a request's answer in `outputs` is over `limit` bytes (0: no bound)."""
    if limit <= 0:
        return None
    size, rows = largest_answer_bytes(outputs, request_rows)
    if size <= limit:
        return None
    advice = "raise max_output_bytes in its model.yaml (or the server's --max-output-bytes)"
    if rows > 1 and size // rows <= limit:
        advice += f", or send at most {limit // -(-size // rows)} rows per request"
    return OutputTooLarge(f"model '{model}' answered {size:,} bytes for one request ({rows} row"
                          f"{'' if rows == 1 else 's'}), over its max_output_bytes of {limit:,}; {advice}")
