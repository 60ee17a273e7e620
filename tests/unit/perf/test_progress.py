"""Progress: redrawn on a terminal, one line per step in a log, nothing at all when quiet."""

from __future__ import annotations

import io

from servewell.perf.progress import LineSink, Progress, bar


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_off_a_terminal_only_notes_are_written():
    stream = io.StringIO()
    progress = Progress(stream)
    assert not progress.live  # a StringIO is no terminal
    for i in range(100):
        progress.update(f"step {i}", i / 100)
    progress.note("step 1/3 concurrency 1: 10 req/s")
    progress.clear()
    assert stream.getvalue() == "step 1/3 concurrency 1: 10 req/s\n"


def test_quiet_off_a_terminal_writes_nothing():
    stream = io.StringIO()
    progress = Progress(stream, quiet=True)
    progress.update("x", 0.5)
    progress.note("done")
    assert stream.getvalue() == ""


def test_on_a_terminal_the_status_line_is_redrawn_at_most_ten_times_a_second():
    stream, clock = io.StringIO(), Clock()
    progress = Progress(stream, live=True, clock=clock)
    for i in range(50):
        clock.now = i * 0.01  # 50 updates in half a second
        progress.update(f"{i} ok", i / 50)
    assert 4 <= stream.getvalue().count("\r") <= 6
    progress.note("step done")
    assert "step done\n" in stream.getvalue()


def test_a_note_on_a_terminal_scrolls_above_the_status_line():
    stream, clock = io.StringIO(), Clock()
    progress = Progress(stream, live=True, clock=clock)
    progress.update("running", 0.5, force=True)
    progress.note("finished step")
    assert stream.getvalue().endswith("\r\x1b[2Kfinished step\n" + "[##########----------]  50% running")


def test_the_bar_is_clamped():
    assert bar(1.7, width=4) == "[####] 100%"
    assert bar(-1.0, width=4) == "[----]   0%"


def test_a_line_sink_prints_lines_off_a_terminal():
    stream = io.StringIO()
    sink = LineSink(stream)
    sink("digits: training epoch 1/6")
    sink("digits: training epoch 2/6")
    sink.close()
    assert stream.getvalue() == "digits: training epoch 1/6\ndigits: training epoch 2/6\n"
