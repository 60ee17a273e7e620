"""Starts the real server (`python -m servewell serve ...`) as a user would, and stops it by pid.

Servers live as long as the tests that use them: a module's shared server stops when the
module's tests are done, a test's own server when the test is done, so a run never holds more
than a few servers and their workers at a time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from servers import ServerFactory, ServerProcess


@pytest.fixture(scope="session")
def servewell_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache directory per test run, so the built-in model is built once: under pytest-xdist the
    processes share it (the build takes a lock per model and checks its stamp, as servers sharing
    a user's cache do; it took 20 to 30 s of each process's first test)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each process's own
    cache = root / "servewell-cache"
    cache.mkdir(exist_ok=True)
    return cache


@pytest.fixture(scope="module")
def start_module_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerFactory]:
    """Factory for servers shared by a module's tests (module-scoped fixtures); stopped after them."""
    factory = ServerFactory(tmp_path_factory.mktemp("logs"))
    yield factory
    factory.stop_all()


@pytest.fixture()
def start_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerFactory]:
    """Factory for a test's own servers; stopped when the test ends."""
    factory = ServerFactory(tmp_path_factory.mktemp("logs"))
    yield factory
    factory.stop_all()


@pytest.fixture(scope="module")
def digits_server(servewell_cache: Path, start_module_server: ServerFactory) -> ServerProcess:
    """The default server: `servewell serve` with the built-in digits model (one per module)."""
    server = start_module_server(["--cache-dir", str(servewell_cache)])
    server.wait_ready()
    return server
