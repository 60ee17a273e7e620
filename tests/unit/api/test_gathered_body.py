"""A deferred request body is joined once, in order, however it was chunked; tiny chunks from a
slow client are gathered, so they cost no object each."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from servewell.api.body import GatheredBody


@given(st.lists(st.binary(min_size=0, max_size=9000), max_size=60))
def test_any_chunking_gives_back_the_body_in_order(chunks: list[bytes]) -> None:
    body = GatheredBody()
    for chunk in chunks:
        body.add(chunk)
    assert body.take() == b"".join(chunks)
    assert body.take() == b""  # empty again


def test_one_whole_chunk_is_not_copied_and_tiny_ones_share_one_buffer() -> None:
    body = GatheredBody()
    whole = b"x" * 70_000
    body.add(whole)
    assert body.take() is whole
    for _ in range(10_000):
        body.add(b"y")
    assert len(body._parts) == 1  # noqa: SLF001 - the bound under test: one buffer, not 10,000 objects
    assert body.take() == b"y" * 10_000
