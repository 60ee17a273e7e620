"""A standby engine: a second engine process with its imports done, waiting to take over.

After `kill -9` (or an out-of-memory kill) of the engine, most of the time until requests were
answered again went to the new engine's interpreter and imports: about 1.5 s of CPU (FastAPI,
pydantic, numpy, uvicorn, the server's modules), 8 s at a load of 13 on a 2-core machine, before
it even read its repository (issue 45 H15; `bench.engine_recovery` measures it). With
`--standby-engine` the supervisor keeps one more engine process that has imported all of that,
and started its worker fork server (`spare.start_fork_server`), and waits; when the engine dies,
it is told to take over and goes on from there: reads the settings, builds its app, opens the
door, loads the models (each worker a fork). A new standby is started `STANDBY_AFTER_S` after
each engine (re)start, not sooner, so that it never competes with a starting engine for the
cores. It costs its memory while it waits (about 95 MB RSS, 62 MB PSS, measured, and its fork
server's), which is why it is not the default. Measured with `bench.engine_recovery` (4 python
models, 2 ingress processes, this 2-core machine shared at a load of 4-9): the first 200 came
0.91 s after the kill with it, 5.6 s without (3.6 s of it the new engine's imports).

The contract, both sides: the standby is `python -m servewell.engine_main RUN --standby FD`,
FD the read end of a pipe the supervisor holds the write end of. One byte on it: take over.
End of file (the supervisor stopped or died): exit. While it waits its process name (comm) is
`STANDBY_COMM`, so tools that tell the engine by its command line can tell a standby apart.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from collections.abc import Sequence

from servewell.process_tree import death_signal_preexec

#: Seconds after an engine's (re)start before its standby is started.
STANDBY_AFTER_S = 10.0
#: The command line's flag before the pipe's descriptor.
STANDBY_FLAG = "--standby"
#: /proc/PID/comm of a standby while it waits (at most 15 bytes).
STANDBY_COMM = "sw-standby"
_TAKE_OVER = b"\x01"
_PR_SET_NAME = 15


class StandbyEngine:
    """The supervisor's side: one standby engine process, started, then promoted or ended."""

    def __init__(self, command: Sequence[str]) -> None:
        self._command = list(command)
        self.process: subprocess.Popen[bytes] | None = None
        self._go: int | None = None

    @property
    def pid(self) -> int | None:
        """Its process id while it waits (None: none waiting)."""
        return self.process.pid if self.process is not None and self.process.poll() is None else None

    def start(self) -> int:
        """Start the standby (its own process group, killed with the supervisor); its pid."""
        read_fd, write_fd = os.pipe()
        try:
            self.process = subprocess.Popen([*self._command, STANDBY_FLAG, str(read_fd)], stdin=subprocess.DEVNULL,
                                            pass_fds=(read_fd,), preexec_fn=death_signal_preexec(os.getpid()),
                                            process_group=0)
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        self._go = write_fd
        return self.process.pid

    def promote(self) -> subprocess.Popen[bytes] | None:
        """Tell the standby to take over: the process that is now the engine, or None when there was
        no standby alive to take over (the caller starts an engine as before)."""
        process, go = self.process, self._go
        self.process, self._go = None, None
        if process is None or go is None:
            return None
        try:
            if process.poll() is not None:
                return None
            os.write(go, _TAKE_OVER)
            return process
        except OSError:  # it died just now
            return None
        finally:
            os.close(go)

    def release(self) -> None:
        """Let a waiting standby go: its pipe closes and it exits on end of file (never blocks)."""
        if self._go is not None:
            os.close(self._go)
            self._go = None

    def end(self) -> None:
        """End a waiting standby: its pipe closes, then SIGKILL, then it is reaped (blocks up to 5 s)."""
        self.release()
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5.0)


def standby_fd(argv: Sequence[str]) -> int | None:
    """The pipe's descriptor when `argv` (the engine's) says this process is a standby."""
    if STANDBY_FLAG in argv:
        at = list(argv).index(STANDBY_FLAG)
        if at + 1 < len(argv) and argv[at + 1].isdigit():
            return int(argv[at + 1])
    return None


def wait_to_take_over(fd: int) -> bool:
    """The standby's side: wait until told to take over (True) or until the supervisor is gone or
    ends it (False). Its process name says standby meanwhile."""
    original = _comm()
    _set_comm(STANDBY_COMM)
    try:
        while True:
            try:
                told = os.read(fd, 1)
            except InterruptedError:
                continue
            return told == _TAKE_OVER
    finally:
        os.close(fd)
        _set_comm(original)


def _comm() -> str:
    try:
        with open("/proc/self/comm") as f:
            return f.read().strip()
    except OSError:
        return "python"


def _set_comm(name: str) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
