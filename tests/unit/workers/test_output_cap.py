"""What of a worker's stdout and stderr reaches the log: whole lines while the budget holds, then
drops counted (and told), a line too long cut and marked, lines split across reads joined, and a
flood of tiny lines bounded like one of long ones. Pure: time is passed in."""

from __future__ import annotations

from servewell.workers.output_cap import MIN_LINE_COST, OutputCap, OutputLimits

LIMITS = OutputLimits(rate_bytes_per_s=1000, burst_bytes=4000, line_max_bytes=300)


def line(n: int, char: bytes = b"x") -> bytes:
    """A line of `n` bytes, its newline included."""
    return char * (n - 1) + b"\n"


def test_lines_within_the_burst_go_on_whole_and_in_order():
    cap = OutputCap(LIMITS, now=0.0)
    data = line(100, b"a") + line(100, b"b") + line(100, b"c")
    assert b"".join(cap.feed(data, now=0.0)) == data
    assert not cap.dropping


def test_past_the_burst_lines_are_dropped_and_counted_then_the_rate_lets_more_through():
    cap = OutputCap(LIMITS, now=0.0)
    flood = line(100) * 100  # 10,000 bytes at once against a burst of 4,000
    passed = b"".join(cap.feed(flood, now=0.0))
    assert len(passed) == 4000 and passed.endswith(b"\n")
    assert cap.dropping
    dropped = cap.take_dropped()
    assert (dropped.bytes, dropped.lines, dropped.cut_bytes) == (6000, 60, 0)
    assert not cap.take_dropped()  # counted once
    # One second later the rate (1,000 bytes/s) lets ten more lines through, and no more.
    assert len(b"".join(cap.feed(flood, now=1.0))) == 1000
    assert cap.take_dropped().bytes == 9000


def test_a_line_too_long_is_cut_and_marked_and_the_next_line_is_whole():
    cap = OutputCap(LIMITS, now=0.0)
    out = b"".join(cap.feed(line(1000, b"L") + line(50, b"n"), now=0.0))
    first, second = out.split(b"\n")[:2]
    assert first.startswith(b"L" * 300) and b"line cut at 300 bytes" in first and len(first) < 360
    assert second == b"n" * 49
    assert cap.take_dropped().cut_bytes == 700


def test_a_line_split_across_reads_is_joined_and_the_last_one_is_flushed_at_the_end():
    cap = OutputCap(LIMITS, now=0.0)
    assert cap.feed(b"hel", now=0.0) == []
    assert cap.feed(b"lo\nwor", now=0.0) == [b"hello\n"]
    assert cap.finish(now=0.0) == [b"wor\n"]
    assert cap.finish(now=0.0) == []


def test_a_long_line_arriving_in_pieces_is_cut_once():
    cap = OutputCap(LIMITS, now=0.0)
    pieces = [cap.feed(b"z" * 100, now=0.0) for _ in range(10)] + [cap.feed(b"\nok\n", now=0.0)]
    out = b"".join(b"".join(p) for p in pieces)
    assert out.count(b"line cut") == 1 and out.endswith(b"\nok\n")
    assert cap.take_dropped().cut_bytes == 700 + 1  # the rest of the line and its newline


def test_a_flood_of_empty_lines_costs_the_budget_like_longer_ones():
    cap = OutputCap(LIMITS, now=0.0)
    passed = cap.feed(b"\n" * 100_000, now=0.0)
    assert len(passed) == LIMITS.burst_bytes // MIN_LINE_COST  # 62 records, not 4,000 (nor 100,000)
    dropped = cap.take_dropped()
    assert dropped.lines == 100_000 - len(passed)
