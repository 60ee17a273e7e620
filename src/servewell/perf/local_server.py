"""A servewell started by `servewell bench MODEL_DIR` or `servewell tune`: `servewell serve` as a
child process on loopback ports (free ones unless given), with its log in a file, in a process
group of its own, stopped by its own pid (SIGTERM: it drains and ends its engine, ingress and
workers), then its group (SIGKILL: whatever of it is left, a server that would not stop in time).

The user's model directory is never written: the server gets a repository in a temporary
directory whose model entry links back to the user's files (and, for `tune`, holds its own
rewritten `model.yaml`).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from servewell.config.server import ServerConfig
from servewell.perf.stop_signals import signals_held

HOST = "127.0.0.1"
MODEL_FILE = "model.yaml"
#: How long a server may take to start and have every model ready, at least; a longer load timeout
#: adds to it (the server marks a model failed only when its load timeout has passed).
READY_TIMEOUT_S = 180.0
#: How often the start-up and the stop look at the server again.
POLL_S = 0.2


class LocalServerError(RuntimeError):
    """The local server did not start, or a model in it did not load."""


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def grpc_supported() -> bool:
    """Whether this servewell has a gRPC listener (`--grpc-port`)."""
    return "grpc_port" in ServerConfig.model_fields


def read_model_yaml(model_dir: Path) -> dict[str, Any]:
    """The raw `model.yaml` of a model directory as a mapping (as written: `name` may be absent)."""
    path = model_dir / MODEL_FILE
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise LocalServerError(f"cannot read {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise LocalServerError(f"{path} is not a model.yaml (a mapping of fields)")
    if "name" in doc and not isinstance(doc["name"], str):
        raise LocalServerError(f"{path}: 'name' must be a string")
    return doc


def model_name(model_dir: Path, doc: dict[str, Any]) -> str:
    """The name `serve` gives the model: its `name`, or else its directory's name (the README's
    model.yaml has none)."""
    name = doc.get("name")
    return name if isinstance(name, str) else model_dir.resolve().name


def stage_model(model_dir: Path, repository: Path, model_yaml: dict[str, Any] | None = None) -> str:
    """Put `model_dir` into `repository` under its model name; returns the name.

    Without `model_yaml` the entry is a link to the user's directory; with it, the entry is a
    directory of links to each of the user's files plus its own `model.yaml` (so a rewritten
    config never touches the user's copy, and large artifacts are not copied).
    """
    model_dir = model_dir.resolve()
    name = model_name(model_dir, read_model_yaml(model_dir))
    entry = repository / name
    repository.mkdir(parents=True, exist_ok=True)
    if entry.is_symlink() or entry.is_file():
        entry.unlink()
    if model_yaml is None:
        if not entry.exists():
            entry.symlink_to(model_dir, target_is_directory=True)
        return name
    entry.mkdir(exist_ok=True)
    for child in model_dir.iterdir():
        link = entry / child.name
        if child.name == MODEL_FILE or child.name == "__pycache__" or link.exists() or link.is_symlink():
            continue
        link.symlink_to(child, target_is_directory=child.is_dir())
    (entry / MODEL_FILE).write_text(yaml.safe_dump(model_yaml, sort_keys=False), encoding="utf-8")
    return name


def exit_status(pid: int) -> int | None:
    """The exit status of our child `pid` once it has exited (a negative signal number when a signal
    ended it), else None; it is left unreaped, so its pid, which names its process group, cannot be
    reused meanwhile."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return 0  # reaped already
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _get(port: int, path: str, timeout_s: float = 3.0) -> tuple[int, Any]:
    connection = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        raw = response.read()
        try:
            return response.status, json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return response.status, None
    finally:
        connection.close()


class LocalServer:
    """`servewell serve --model-repository REPO` on loopback ports, ready when every model is.

    `port` and `grpc_port` (0: a free port; the gRPC listener is off unless `grpc` or a `grpc_port`
    asks for it), `load_timeout_s` (None: the server's default) go to the server's command line."""

    def __init__(self, repository: Path, log_path: Path, *, grpc: bool = False,
                 extra_args: tuple[str, ...] = (), port: int = 0, grpc_port: int = 0,
                 load_timeout_s: float | None = None) -> None:
        if (grpc or grpc_port) and not grpc_supported():
            raise LocalServerError("this servewell has no gRPC listener (no --grpc-port); benchmark over HTTP")
        self.repository = repository
        self.log_path = log_path
        self.port = port or free_port()
        self.grpc_port = grpc_port or (free_port() if grpc else 0)
        self.load_timeout_s = load_timeout_s
        self._extra = extra_args
        self._process: subprocess.Popen[bytes] | None = None
        self.started_s: float | None = None  # seconds from start to ready

    @property
    def url(self) -> str:
        """Base URL of its HTTP listener."""
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Process id, once started."""
        return self._process.pid if self._process is not None else None

    @property
    def ready_timeout_s(self) -> float:
        """How long `start` waits for every model to be ready."""
        return max(READY_TIMEOUT_S, (self.load_timeout_s or 0.0) + 120.0)

    def argv(self) -> list[str]:
        """The command line it runs."""
        argv = [sys.executable, "-m", "servewell", "serve", "--model-repository", str(self.repository),
                "--host", HOST, "--port", str(self.port), "--log-format", "json", *self._extra]
        if self.load_timeout_s is not None:
            argv += ["--load-timeout-s", f"{self.load_timeout_s:g}"]
        if grpc_supported():  # its default port (8001) may be taken, and only --protocol grpc needs it
            argv += ["--grpc-port", str(self.grpc_port)]
        return argv

    def start(self, timeout_s: float | None = None) -> float:
        """Start and wait until every model is ready (`timeout_s`, default `ready_timeout_s`);
        returns the seconds it took."""
        began = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log, signals_held():  # a stop signal waits until its pid is known
            # its own process group: a stop reaches what it left behind, and a Ctrl-C meant for the
            # bench does not cut its drain short (the bench stops it)
            self._process = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                             process_group=0)
        try:
            self._wait_ready(began + (self.ready_timeout_s if timeout_s is None else timeout_s))
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - began
        return self.started_s

    def _wait_ready(self, deadline: float) -> None:
        assert self._process is not None
        while time.monotonic() < deadline:
            code = exit_status(self._process.pid)
            if code is not None:
                raise LocalServerError(f"servewell exited with code {code} while starting:\n{self.log_tail()}")
            try:
                status, health = _get(self.port, "/healthz")
            except OSError:
                time.sleep(POLL_S)
                continue
            if status == 200:
                return
            models = (health or {}).get("models", {}) if isinstance(health, dict) else {}
            broken = {n: m.get("reason") for n, m in models.items() if m.get("state") in ("failed", "invalid")}
            if broken:
                slow = any("did not finish within" in str(reason) for reason in broken.values())
                raise LocalServerError(f"models did not load: {broken}" + (
                    "; a large model on a busy machine may need longer: --load-timeout-s" if slow else ""))
            time.sleep(POLL_S)
        raise LocalServerError(f"servewell was not ready in time:\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of its log (for error messages)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, wait for the drain, then SIGKILL to its process group (the server if it is still
        there, and whatever it left in its group); returns the exit code. A stop signal meanwhile waits."""
        with signals_held():
            process = self._process
            if process is None or process.returncode is not None:
                return None if process is None else process.returncode
            pid = process.pid
            # until it is reaped below, `pid` stays ours, and so does the group it names
            if exit_status(pid) is None:
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while exit_status(pid) is None and time.monotonic() < deadline:
                time.sleep(POLL_S / 4)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            return process.wait(5.0)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
