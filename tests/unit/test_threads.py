"""`call_at_lower_priority` (servewell/threads.py): the call runs on a thread of its own at a lower
CPU priority, the caller gets its result or its exception and keeps its own priority."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from servewell.threads import MAX_NICE, call_at_lower_priority, native_thread_ids


def where() -> tuple[int, int]:
    return threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0)


def test_the_call_runs_lower_on_another_thread_and_the_caller_keeps_its_priority():
    caller, normal = where()
    tid, nice = call_at_lower_priority(where, 3, "load")
    assert tid != caller and nice == min(MAX_NICE, normal + 3)
    assert where() == (caller, normal)


def test_no_steps_runs_it_in_the_caller():
    assert call_at_lower_priority(where, 0, "load") == where()


def test_the_lowest_priority_is_the_floor():
    assert call_at_lower_priority(where, MAX_NICE + 5, "load")[1] == MAX_NICE


def test_the_call_s_exception_is_raised_in_the_caller():
    def boom() -> None:
        raise ValueError("bad weights")

    with pytest.raises(ValueError, match="bad weights"):
        call_at_lower_priority(boom, 2, "load")
    with pytest.raises(SystemExit):  # what a model's own code may raise passes through unchanged
        call_at_lower_priority(lambda: sys.exit(3), 2, "load")


def test_the_thread_is_gone_once_the_call_returns():
    before = native_thread_ids()
    assert threading.get_native_id() in before
    call_at_lower_priority(lambda: None, 2, "load")
    assert native_thread_ids() <= before
