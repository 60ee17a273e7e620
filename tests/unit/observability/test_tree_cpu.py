"""tree_cpu_seconds: the CPU of a process and everything under it, from /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from servewell.observability.process import tree_cpu_seconds

BUSY = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\ntime.sleep(30)"


def test_a_grandchilds_cpu_counts_in_its_ancestors_tree():
    # a child that starts a grandchild, which burns 0.6 s of CPU and then sleeps
    child = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys\n"
                              f"subprocess.run([sys.executable, '-c', {BUSY!r}])"], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while tree_cpu_seconds(child.pid) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tree_cpu_seconds(child.pid) >= 0.6
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the child and the grandchild, both started here
        child.wait()


def test_a_process_that_is_gone_has_none():
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()  # reaped: its pid names no process now
    assert tree_cpu_seconds(done.pid) == 0.0
