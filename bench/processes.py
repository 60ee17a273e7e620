"""Child processes of the benchmark: servers under test, load generators, offline timers.

Every child is started here and stopped by its own pid (terminate, then kill), never by name.
"""

from __future__ import annotations

import http.client
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from servewell.observability.process import child_pids

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def http_json(port: int, method: str, path: str, body: Any = None, timeout_s: float = 10.0) -> tuple[int, Any]:
    """One JSON request to loopback; returns (status, decoded body or None)."""
    connection = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        connection.request(method, path, body=payload, headers=headers)
        response = connection.getresponse()
        raw = response.read()
        try:
            return response.status, json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return response.status, None
    finally:
        connection.close()


class ServerProcess:
    """A server under test, started as a child process with its output in a log file."""

    def __init__(self, name: str, argv: list[str], port: int, log_path: Path, new_session: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.new_session = new_session  # its own process group, as a service manager starts it
        self.env = env
        self.argv = argv
        self.port = port
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None
        self._log: BinaryIO | None = None

    @property
    def pid(self) -> int:
        """Process id (once started)."""
        if self._process is None:
            raise RuntimeError(f"{self.name} is not started")
        return self._process.pid

    @property
    def url(self) -> str:
        """Base URL."""
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        """Start the process (returns at once; see `wait_ready`)."""
        self._log = open(self.log_path, "ab")
        self._process = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=self.new_session,
                                         env=None if self.env is None else {**os.environ, **self.env})

    def wait(self, timeout_s: float) -> int | None:
        """Wait for the process to exit; its exit code, or None if it is still running."""
        if self._process is None:
            return None
        try:
            return self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self._process is not None and self._process.poll() is None

    def wait_ready(self, timeout_s: float, path: str = "/healthz") -> float:
        """Poll `path` until it answers 200; returns the seconds waited. Raises when it dies or times out."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self._process is None or self._process.poll() is not None:
                code = None if self._process is None else self._process.returncode
                raise RuntimeError(f"{self.name} exited with code {code}; see {self.log_path}")
            try:
                status, _ = http_json(self.port, "GET", path, timeout_s=2.0)
                if status == 200:
                    return time.monotonic() - started
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} was not ready within {timeout_s:g} s; see {self.log_path}")

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        if self._process is None:
            return None
        if self._process.poll() is None:
            stop_process(self._process, timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self._process.returncode


def stop_process(process: subprocess.Popen[bytes], grace_s: float) -> int:
    """SIGTERM, wait up to `grace_s`, then SIGKILL; the exit code."""
    process.terminate()
    try:
        return process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(5.0)


def run_module(module: str, args: list[str], timeout_s: float, log_path: Path | None = None) -> None:
    """Run `python -m module args` to completion (killed after `timeout_s`); raises on failure."""
    log = open(log_path, "ab") if log_path else None
    try:
        process = subprocess.Popen([sys.executable, "-m", module, *args], stdout=log or None,
                                   stderr=subprocess.STDOUT if log else None)
        try:
            code = process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            stop_process(process, 5.0)
            raise RuntimeError(f"python -m {module} ran past {timeout_s:g} s and was stopped") from None
        if code != 0:
            raise RuntimeError(f"python -m {module} {' '.join(args)} failed with exit code {code}"
                               + (f"; see {log_path}" if log_path else ""))
    finally:
        if log is not None:
            log.close()


def closed_loop(url: str, path: str, bodies: list[Path], clients: int, seconds: float, warmup_s: float,
                out: Path, log_path: Path, headers: dict[str, str] | None = None, think_s: float = 0.0) -> dict:
    """Run `bench.loadgen` as a closed loop of `clients` for `seconds` after `warmup_s` (each
    request with `headers`, each client waiting `think_s` after an answer); its summary."""
    args = ["--url", url, "--path", path, "--mode", "closed", "--concurrency", str(clients),
            "--duration-s", f"{seconds:g}", "--warmup-s", f"{warmup_s:g}", "--out", str(out), "--grace-s", "15",
            "--think-ms", f"{think_s * 1000:g}"]
    for name, value in (headers or {}).items():
        args += ["--header", f"{name}:{value}"]
    for body in bodies:
        args += ["--body-file", str(body)]
    run_module("bench.loadgen", args, timeout_s=seconds + warmup_s + 60, log_path=log_path)
    return json.loads(out.read_text())


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def children_cpu_seconds() -> float:
    """CPU seconds of this process's finished children (the load generators)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def server_log_counts(path: Path) -> dict[str, int]:
    """Lines per level in the server's JSON log (errors and warnings tell of trouble under load)."""
    counts: dict[str, int] = {}
    if not path.is_file():
        return counts
    for line in path.read_text(errors="replace").splitlines():
        try:
            level = json.loads(line).get("level", "?")
        except (json.JSONDecodeError, AttributeError):
            level = "unstructured"
        counts[level] = counts.get(level, 0) + 1
    return counts


# -- a server's whole process tree ----------------------------------------------------------------

#: Roles of a server's processes, by what their command line runs (`role_of`).
SUPERVISOR, ENGINE, INGRESS, WORKER, OTHER = "supervisor", "engine", "ingress", "worker", "other"


def tree_pids(root: int) -> list[int]:
    """`root` and every descendant alive now (breadth first); [] when `root` is gone."""
    if not Path(f"/proc/{root}").exists():
        return []
    order, queue, seen = [], [root], {root}
    while queue:
        pid = queue.pop(0)
        order.append(pid)
        for child in child_pids(pid):
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return order


def cmdline(pid: int) -> list[str]:
    """The argv of `pid`; [] when it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def role_of(pid: int, root: int) -> str:
    """What a process of the tree rooted at `root` is: `supervisor` (the root of a split server),
    `engine`, `ingress-<i>`, `worker` (a model worker or spare, started by multiprocessing's spawn
    or forked from the spares' fork server), `other` (multiprocessing's resource tracker, the fork
    server itself, helpers). The root of a single-process server
    (no engine child) is reported as `supervisor` too: `role_of` sees one process at a time;
    `TreeCpu` renames it `server` when the tree has no engine."""
    argv = cmdline(pid)
    text = " ".join(argv)
    # A process names itself (observability/process_title.py): servewell engine, servewell ingress N,
    # servewell worker MODEL vV #I, servewell spare worker; an older checkout's by its command line.
    if text.startswith(("servewell engine", "servewell standby engine")):
        return ENGINE
    if text.startswith("servewell ingress "):
        return f"{INGRESS}-{text.split()[2]}" if len(text.split()) > 2 else INGRESS
    if text.startswith(("servewell worker ", "servewell spare worker")):
        return WORKER
    if "servewell.engine_main" in text:
        return ENGINE
    if "servewell.ingress_main" in text:
        # python -m servewell.ingress_main RUN INDEX FD
        at = argv.index("servewell.ingress_main") if "servewell.ingress_main" in argv else -1
        index = argv[at + 2] if at >= 0 and len(argv) > at + 2 else "?"
        return f"{INGRESS}-{index}"
    if pid == root:
        return SUPERVISOR
    if "resource_tracker" in text:
        return OTHER
    if "multiprocessing.forkserver" in text and "multiprocessing.forkserver" not in " ".join(cmdline(_parent(pid))):
        return OTHER  # the fork server (its children, the spares and workers, share its command line)
    if "multiprocessing" in text or "spawn_main" in text:
        return WORKER
    return OTHER


def _parent(pid: int) -> int:
    """The parent of `pid` (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            return int(file.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _stat(pid: int) -> tuple[float, int] | None:
    """(user + system CPU seconds, start time in clock ticks) of `pid`; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


class TreeCpu:
    """User + system CPU of a server's whole process tree over a window, per process role.

    `start()` reads /proc for the root and every descendant, `stop()` reads again and returns
    the CPU seconds each role spent in between. A sampler thread reads the tree every
    `interval_s` too, so a process that ends inside the window keeps the CPU it was last seen
    with (at most `interval_s` of its last work is missed), and one that appears inside the
    window counts from 0 (its whole life is in the window). Processes are told apart by (pid,
    start time), so a reused pid is a new process. CPU of processes reaped before the first
    sample is invisible: keep `interval_s` short against the life of what is measured.
    """

    def __init__(self, root: int, interval_s: float = 0.25) -> None:
        self.root = root
        self.interval_s = interval_s
        self._first: dict[tuple[int, int], float] = {}
        self._last: dict[tuple[int, int], tuple[str, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: After `stop()`: CPU seconds per process in the window, keyed `role:pid`.
        self.processes: dict[str, float] = {}

    def _sample(self, first: bool) -> None:
        seen = []
        for pid in tree_pids(self.root):
            stat = _stat(pid)
            if stat is None:
                continue
            key = (pid, stat[1])
            seen.append((key, stat[0], pid))
        with self._lock:
            for key, cpu, pid in seen:
                if key not in self._last:
                    self._first[key] = cpu if first else 0.0
                    self._last[key] = (role_of(pid, self.root), cpu)
                else:
                    self._last[key] = (self._last[key][0], cpu)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample(first=False)

    def start(self) -> TreeCpu:
        """Take the first reading and start the sampler."""
        self._sample(first=True)
        self._thread = threading.Thread(target=self._run, name="tree-cpu", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        """Take the last reading; CPU seconds per role (ingress processes each as `ingress-<i>`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample(first=False)
        spent: dict[str, float] = {}
        with self._lock:
            split = any(role == ENGINE for role, _ in self._last.values())
            for key, (role, cpu) in self._last.items():
                if role == SUPERVISOR and not split:
                    role = "server"  # a single-process server: the root does everything
                spent[role] = spent.get(role, 0.0) + max(0.0, cpu - self._first[key])
            self.processes = {f"{role}:{pid}": round(cpu - self._first[(pid, t)], 3)
                              for (pid, t), (role, cpu) in self._last.items()}
        return spent


def role_groups(spent: dict[str, float]) -> dict[str, float]:
    """Per-role CPU folded into groups: every `ingress-<i>` into `ingress`, plus `total`, and
    `frontend` = everything but the model workers (supervisor, engine, ingress, other; for a
    single-process server: the server process) -- the part the process split changes."""
    groups: dict[str, float] = {}
    for role, seconds in spent.items():
        group = INGRESS if role.startswith(f"{INGRESS}-") else role
        groups[group] = groups.get(group, 0.0) + seconds
    groups["total"] = sum(spent.values())
    groups["frontend"] = groups["total"] - groups.get(WORKER, 0.0)
    return groups


def tree_roles(root: int) -> dict[str, list[int]]:
    """The pids of a server's tree by role now, e.g. {"engine": [..], "ingress-0": [..], "worker": [..]}."""
    roles: dict[str, list[int]] = {}
    for pid in tree_pids(root):
        roles.setdefault(role_of(pid, root), []).append(pid)
    return roles


class SameRequest:
    """A load loop's request source: one pre-encoded request over and over."""

    def __init__(self, payload: bytes) -> None:
        self._payload = payload

    def next(self) -> tuple[str, bytes]:
        """The same request again."""
        return "same", self._payload


def oip_load(port: int, payload: bytes, shape: Any) -> tuple[Any, dict[str, Any]]:
    """One load step (`servewell.perf.loop.LoadShape`) of `payload` against loopback `port`: the
    recorder, and answered per second, errors and latency over the measured window."""
    import asyncio

    from servewell.perf import loop as load_loop
    from servewell.perf.oip_http import HttpOipConnection
    from servewell.perf.stats import summarize_ms

    recorder = asyncio.run(load_loop.run_load(shape, lambda: HttpOipConnection(HOST, port), SameRequest(payload)))
    window = [o for o in recorder.outcomes if recorder.in_window(o.arrival)]
    ok = [o for o in window if o.ok]
    span = recorder.window_end - recorder.window_start
    return recorder, {"ok_per_s": len(ok) / span if span > 0 else 0.0, "errors": len(window) - len(ok),
                      "latency_ms": summarize_ms([o.latency_ms for o in ok])}
