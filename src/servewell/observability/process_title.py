"""Process titles: every process of a server says what it is in `ps` and `top`.

A worker used to be an anonymous `python -c "from multiprocessing.spawn import spawn_main..."`, so
an on-call engineer could not tell which model's worker used the CPU or the memory. Each process
now names itself, in two places:

- its command line (`ps`, `top -c`, `/proc/PID/cmdline`), through `setproctitle`, the library the
  field uses for this (PostgreSQL-style titles; it rewrites the process's argv area, which Python
  cannot do itself): `servewell engine`, `servewell ingress 0`, `servewell worker digits v1 #0`,
  `servewell spare worker`;
- its name (`top`'s default column, `/proc/PID/comm`, at most 15 bytes): `sw-engine`,
  `sw-ingress-0`, `sw-digits#0` (the model's name cut to fit), `sw-spare`; a standby engine keeps
  its `sw-standby` while it waits (engine_standby.py).

The supervisor keeps its own command line (`servewell serve ...`, the flags it was started with).
Without setproctitle (an older environment), only the name is set, through prctl.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("servewell.process")

#: /proc/PID/comm holds at most this many bytes.
COMM_BYTES = 15
_PR_SET_NAME = 15


def short_name(title: str) -> str:
    """The 15-byte name `top` shows for a title (`servewell worker digits v1 #0` -> `sw-digits#0`)."""
    words = title.split()
    if len(words) >= 2 and words[0] == "servewell":
        if words[1] == "worker" and len(words) >= 3 and words[-1].startswith("#"):
            model, instance = words[2], words[-1]
            return f"sw-{model[: COMM_BYTES - 3 - len(instance)]}{instance}"[:COMM_BYTES]
        return ("sw-" + "-".join(words[1:]))[:COMM_BYTES]
    return title[:COMM_BYTES]


def set_process_title(title: str) -> None:
    """Name this process `title` in its command line, and `short_name(title)` as its name; never
    raises (a process that cannot rename itself still serves)."""
    try:
        try:
            import setproctitle
        except ImportError:  # an environment installed before the dependency: the name at least
            _set_comm(short_name(title))
            return
        setproctitle.setproctitle(title)
        setproctitle.setthreadtitle(short_name(title))  # the main thread's name is the process's
    except Exception:  # a title is a convenience, never a reason to fail
        log.debug("could not set the process title %r", title, exc_info=True)


def _set_comm(name: str) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:COMM_BYTES]), 0, 0, 0)
