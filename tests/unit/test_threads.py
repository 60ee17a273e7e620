"""`lower_every_thread` and `idle_every_thread` (servewell/threads.py): every thread of the
process is lowered, those started before too, not only the caller (as `os.nice` does on Linux)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent('''
    import os, threading
    from servewell.threads import lower_every_thread, native_thread_ids

    seen, go = {}, threading.Event()

    def idle():
        go.wait()
        seen["idle"] = os.getpriority(os.PRIO_PROCESS, 0)

    early = threading.Thread(target=idle)
    early.start()
    before = os.getpriority(os.PRIO_PROCESS, 0)
    threads = len(native_thread_ids())  # this one and `early` at least
    lower_every_thread(3)
    late = threading.Thread(target=lambda: seen.update(late=os.getpriority(os.PRIO_PROCESS, 0)))
    late.start(); late.join()
    go.set(); early.join()
    print(before, os.getpriority(os.PRIO_PROCESS, 0), seen["idle"], seen["late"], threads)
''')


def test_threads_started_before_and_after_are_lowered_with_the_caller():
    # In a child: the test process's own threads must keep their priority.
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    before, caller, early, late, threads = map(int, done.stdout.split())
    assert caller == early == late == min(19, before + 3)
    assert threads >= 2


IDLE_CHILD = textwrap.dedent('''
    import os, threading
    from servewell.threads import idle_every_thread

    seen, go = {}, threading.Event()

    def waiting():
        go.wait()
        seen["early"] = os.sched_getscheduler(0)

    early = threading.Thread(target=waiting)
    early.start()
    before = os.sched_getscheduler(0)
    moved = idle_every_thread()
    go.set(); early.join()
    print(before, os.sched_getscheduler(0), seen["early"], int(moved), os.SCHED_IDLE, os.SCHED_OTHER)
''')


def test_a_stopping_process_moves_every_thread_to_idle_priority():
    done = subprocess.run([sys.executable, "-c", IDLE_CHILD], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    before, caller, early, moved, idle, other = map(int, done.stdout.split())
    assert before == other and moved == 1
    assert caller == early == idle  # the thread started before the call too, not only the caller
