"""A servewell started by `servewell bench MODEL_DIR` or `servewell tune`: `servewell serve` as a
child process on free loopback ports, with its log in a file, stopped by its own pid.

The user's model directory is never written: the server gets a repository in a temporary
directory whose model entry links back to the user's files (and, for `tune`, holds its own
rewritten `model.yaml`).
"""

from __future__ import annotations

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

HOST = "127.0.0.1"
MODEL_FILE = "model.yaml"


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
    """`servewell serve --model-repository REPO` on free ports, ready when every model is."""

    def __init__(self, repository: Path, log_path: Path, *, grpc: bool = False,
                 extra_args: tuple[str, ...] = ()) -> None:
        if grpc and not grpc_supported():
            raise LocalServerError("this servewell has no gRPC listener (no --grpc-port); benchmark over HTTP")
        self.repository = repository
        self.log_path = log_path
        self.port = free_port()
        self.grpc_port = free_port() if grpc else 0
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

    def argv(self) -> list[str]:
        """The command line it runs."""
        argv = [sys.executable, "-m", "servewell", "serve", "--model-repository", str(self.repository),
                "--host", HOST, "--port", str(self.port), "--log-format", "json", *self._extra]
        if grpc_supported():  # its default port (8001) may be taken, and only --protocol grpc needs it
            argv += ["--grpc-port", str(self.grpc_port)]
        return argv

    def start(self, timeout_s: float = 180.0) -> float:
        """Start and wait until every model is ready; returns the seconds it took."""
        began = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            self._wait_ready(began + timeout_s)
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - began
        return self.started_s

    def _wait_ready(self, deadline: float) -> None:
        assert self._process is not None
        while time.monotonic() < deadline:
            code = self._process.poll()
            if code is not None:
                raise LocalServerError(f"servewell exited with code {code} while starting:\n{self.log_tail()}")
            try:
                status, health = _get(self.port, "/healthz")
            except OSError:
                time.sleep(0.2)
                continue
            if status == 200:
                return
            models = (health or {}).get("models", {}) if isinstance(health, dict) else {}
            broken = {n: m.get("reason") for n, m in models.items() if m.get("state") in ("failed", "invalid")}
            if broken:
                raise LocalServerError(f"models did not load: {broken}")
            time.sleep(0.2)
        raise LocalServerError(f"servewell was not ready in time:\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of its log (for error messages)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, wait for the drain, then SIGKILL; returns the exit code."""
        process = self._process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5.0)
        return process.returncode

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
