"""The supervisor's side of `servewell serve`'s process tree, the parts that hold no state: how many
ingress processes, their command lines, the restart backoff, the private run directory, the public
listening socket, and tying a child's life to the supervisor's (PR_SET_PDEATHSIG, before exec).

The supervisor (`supervisor.py`) puts them together; what the children share at start (the
settings file, the engine's socket names, `die_with_parent`) is in `child_process.py`.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from servewell.child_process import ENGINE_DOOR_SOCKET
from servewell.cpu_limit import usable_cpus

#: Most ingress processes chosen by default: past 8, one engine's event loop (envelopes in and
#: out for every request) is the likelier limit; more can still be asked for.
DEFAULT_MAX_INGRESS_PROCESSES = 8
#: uvicorn's default listen backlog: connections the kernel queues while no ingress accepts
#: (also while one restarts).
LISTEN_BACKLOG = 2048
ENGINE_MODULE_ARGV = ("-m", "servewell.engine_main")
INGRESS_MODULE_ARGV = ("-m", "servewell.ingress_main")
#: Restarts per role so far (`{"engine": 0, "ingress": 2}`), rewritten by the supervisor at each restart.
RESTARTS_FILE = "restarts.json"
_RUN_PREFIX = "servewell-run-"
#: Linux's sun_path holds 108 bytes; a run directory whose socket paths would not fit is made elsewhere.
_MAX_SOCKET_PATH = 100
_PR_SET_PDEATHSIG = 1


def ingress_process_count(configured: int | None, cpus: int | None = None) -> int:
    """How many ingress processes to run: `configured` when set (0: the single-process server),
    else one per usable CPU (`cpu_limit.usable_cpus`: the affinity mask, at most the container's
    CPU limit rounded up), at least 1 and at most `DEFAULT_MAX_INGRESS_PROCESSES`."""
    if configured is not None:
        return configured
    return max(1, min(DEFAULT_MAX_INGRESS_PROCESSES, usable_cpus() if cpus is None else cpus))


@dataclass(slots=True)
class RestartBackoff:
    """Seconds to wait before restarting a child that died: `first_s` after its first death (a
    child that served and died once, an engine killed by the OOM killer, comes back at once: every
    ingress answers 503 meanwhile), then `initial_s`, doubling per death up to `max_s`; a child
    that had run `reset_after_s` or longer before dying starts again from `first_s`."""

    first_s: float = 0.0
    initial_s: float = 0.1
    max_s: float = 5.0
    reset_after_s: float = 30.0
    _next_s: float | None = None  # None: the next death is a first one

    def delay_after(self, ran_s: float) -> float:
        """The wait before the next start of a child that ran `ran_s` seconds before it died."""
        if ran_s >= self.reset_after_s:
            self._next_s = None
        if self._next_s is None:
            self._next_s = self.initial_s
            return self.first_s
        delay_s = self._next_s
        self._next_s = min(self.max_s, self._next_s * 2)
        return delay_s


def engine_command(run_dir: Path, module_argv: Sequence[str] = ENGINE_MODULE_ARGV,
                   python: str = sys.executable) -> list[str]:
    """`python -m servewell.engine_main RUN`."""
    return [python, *module_argv, str(run_dir)]


def ingress_command(run_dir: Path, index: int, listen_fd: int, module_argv: Sequence[str] = INGRESS_MODULE_ARGV,
                    python: str = sys.executable) -> list[str]:
    """`python -m servewell.ingress_main RUN INDEX FD` (FD: the inherited listening socket)."""
    return [python, *module_argv, str(run_dir), str(index), str(listen_fd)]


def _run_parent_candidates() -> list[Path]:
    # XDG_RUNTIME_DIR is per user, private and emptied at logout: the right home for sockets.
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return [Path(p) for p in (runtime, tempfile.gettempdir(), "/tmp") if p and os.path.isdir(p)]


def make_run_dir(parent: Path | None = None) -> Path:
    """A fresh private directory (mode 0700) named after this process, under `parent`, else
    $XDG_RUNTIME_DIR, else the system temp dir (the first whose socket paths fit)."""
    candidates = [parent] if parent is not None else _run_parent_candidates()
    longest = len(ENGINE_DOOR_SOCKET) + len(_RUN_PREFIX) + 20
    for where in candidates:
        if parent is not None or len(str(where)) + longest <= _MAX_SOCKET_PATH:
            return Path(tempfile.mkdtemp(prefix=f"{_RUN_PREFIX}{os.getpid()}-", dir=where))
    return Path(tempfile.mkdtemp(prefix=f"{_RUN_PREFIX}{os.getpid()}-", dir="/tmp"))


def remove_run_dir(run_dir: Path) -> None:
    """Remove a run directory and what is in it (sockets, settings); gone already is fine."""
    shutil.rmtree(run_dir, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_run_dirs(parent: Path | None = None) -> list[Path]:
    """Remove the run directories of supervisors that no longer run (killed with kill -9), under
    `parent` or the default places; those of another user or a live process stay. The removed ones."""
    removed = []
    uid = os.getuid()
    for where in [parent] if parent is not None else _run_parent_candidates():
        for path in where.glob(f"{_RUN_PREFIX}*-*"):
            pid_text = path.name[len(_RUN_PREFIX):].split("-", 1)[0]
            try:
                owned = path.is_dir() and not path.is_symlink() and path.stat().st_uid == uid
            except OSError:
                continue
            if owned and pid_text.isdigit() and not _pid_alive(int(pid_text)):
                remove_run_dir(path)
                removed.append(path)
    return removed


def write_restart_counts(run_dir: Path, counts: dict[str, int]) -> None:
    """Replace RUN/restarts.json with `counts` at once (a reader never sees half a file)."""
    staging = run_dir / f".{RESTARTS_FILE}"
    staging.write_text(json.dumps(counts))
    os.replace(staging, run_dir / RESTARTS_FILE)


def read_restart_counts(run_dir: Path) -> dict[str, int]:
    """The supervisor's restarts per role (`engine`, `ingress`); none yet: an empty dict."""
    try:
        counts = json.loads((run_dir / RESTARTS_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return {str(role): int(n) for role, n in counts.items()} if isinstance(counts, dict) else {}


class ListenError(OSError):
    """The public port could not be bound (in use, no permission, bad address)."""


def bind_listener(host: str, port: int, backlog: int = LISTEN_BACKLOG) -> socket.socket:
    """The public HTTP socket, bound and listening once for every ingress, inheritable: as uvicorn
    binds it (SO_REUSEADDR; IPv6 when `host` is an IPv6 literal). Raises `ListenError` with
    uvicorn's wording when it cannot."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        reason = exc.strerror.lower() if exc.strerror else str(exc)
        raise ListenError(exc.errno or errno.EINVAL,
                          f"error while attempting to bind on address {(host, port)!r}: {reason}") from None
    sock.set_inheritable(True)
    return sock


def check_port_free(host: str, port: int) -> None:
    """Raise `ListenError` (as `bind_listener` words it) when something listens on `host:port`.
    For the gRPC port, which every ingress binds with SO_REUSEPORT: a second server of the same
    user that sets SO_REUSEPORT too (grpc's default on Linux) would otherwise share it silently,
    each server answering a share of the other's clients. A socket without SO_REUSEPORT cannot
    bind where one listens, with or without it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT is no owner
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as exc:
            reason = exc.strerror.lower() if exc.strerror else str(exc)
            raise ListenError(exc.errno or errno.EINVAL,
                              f"error while attempting to bind on address {(host, port)!r}: {reason}") from None


def death_signal_preexec(parent_pid: int) -> Callable[[], None]:
    """A `preexec_fn` for a child of `parent_pid`: in the forked child, before exec, ask the kernel
    for SIGKILL when the parent dies (survives exec), then exit at once if the parent died already
    (checked after, so no window is left). Everything it calls is looked up before the fork;
    `child_process.die_with_parent` at the top of the children's mains then only repeats it."""
    prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    getppid, exit_now = os.getppid, os._exit

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if getppid() != parent_pid:
            exit_now(1)

    return arm
