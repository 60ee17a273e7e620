"""What the engine and ingress processes of a split server share at start (`supervisor.py`
starts them): the settings the supervisor wrote into its private run directory, and dying with
the supervisor so a `kill -9` of it leaves nothing running."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pickle
import signal
import sys
from pathlib import Path

from servewell.config.server import ConfigSource, ServerConfig

#: The settings file in the run directory (pickled `(ServerConfig, ConfigSource)`).
SETTINGS_FILE = "settings.pickle"
#: The engine's door: envelopes and control operations (engine/door.py), its only socket.
ENGINE_DOOR_SOCKET = "engine-door.sock"

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Get SIGKILL when the parent (the supervisor) dies; exit now if it already has."""
    parent = os.getppid()
    libc_name = ctypes.util.find_library("c")
    if libc_name is not None:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent or parent == 1:
        sys.exit(1)


def read_settings(run_dir: Path) -> tuple[ServerConfig, ConfigSource]:
    """The settings the supervisor wrote for its children (its own private, 0700 directory)."""
    with open(run_dir / SETTINGS_FILE, "rb") as file:
        settings, source = pickle.load(file)
    assert isinstance(settings, ServerConfig) and isinstance(source, ConfigSource)
    return settings, source


def write_settings(run_dir: Path, settings: ServerConfig, source: ConfigSource) -> None:
    """Write the children's settings (the supervisor does this before starting them)."""
    path = run_dir / SETTINGS_FILE
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as file:
        pickle.dump((settings, source), file, protocol=pickle.HIGHEST_PROTOCOL)
