"""servewell subclasses uvicorn's private HTTP protocol (api/http_limits.py): these checks fail fast,
with the name that moved, when the installed uvicorn is not the one the subclasses were written for."""

from __future__ import annotations

import importlib
import inspect
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

from servewell.api.http_limits import UVICORN_PRIVATE_NAMES, UVICORN_TESTED

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


def _minor(text: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def test_the_installed_uvicorn_is_in_the_tested_range():
    installed = version("uvicorn")
    first, end = UVICORN_TESTED
    assert first <= _minor(installed) < end, (
        f"uvicorn {installed} is installed, but api/http_limits.py subclasses uvicorn's private HTTP protocol "
        f"as of {first[0]}.{first[1]}.x up to (not including) {end[0]}.{end[1]}: install a release in that range "
        "(pyproject.toml pins it), or check every name of UVICORN_PRIVATE_NAMES against the new release and "
        "widen UVICORN_TESTED and the pin together")


def test_pyproject_pins_uvicorn_to_the_tested_range():
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (pin,) = [d for d in dependencies if d.startswith("uvicorn")]
    first, end = UVICORN_TESTED
    assert pin == f"uvicorn[standard]>={first[0]}.{first[1]},<{end[0]}.{end[1]}", (
        f"pyproject.toml says {pin!r} but api/http_limits.py's UVICORN_TESTED is {UVICORN_TESTED}: keep them one range")


def _owner(path: str) -> object:
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)


def _has(owner: object, name: str) -> bool:
    """A module or class attribute, or an instance attribute its class assigns (`self.name =` or an
    annotated `self.name: T =`) anywhere in its own source."""
    if hasattr(owner, name):
        return True
    return inspect.isclass(owner) and re.search(rf"\bself\.{name}\s*[:=]", inspect.getsource(owner)) is not None


@pytest.mark.parametrize("path", sorted(UVICORN_PRIVATE_NAMES))
def test_every_private_uvicorn_name_we_rely_on_still_exists(path):
    owner = _owner(path)
    missing = [name for name in UVICORN_PRIVATE_NAMES[path] if not _has(owner, name)]
    assert not missing, (f"uvicorn {version('uvicorn')}: {path} no longer has {missing}, which servewell's HTTP "
                         "protocol relies on (api/http_limits.py UVICORN_PRIVATE_NAMES)")


def test_the_check_notices_a_name_that_is_gone():
    """Proves `_has` can fail: a name uvicorn never had is reported missing."""
    assert not _has(_owner("uvicorn.protocols.http.httptools_impl.HttpToolsProtocol"), "no_such_name_in_uvicorn")
