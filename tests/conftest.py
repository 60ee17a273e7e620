"""Markers come from the folder a test lives in: tests/unit, tests/integration, tests/e2e; the fleet
planner's own suite, tests/plan (marker `plan`), has unit/, slow/ (marker `slow`) and e2e/ below it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).parent
# Shared test code (tests/support) is importable from every test folder.
sys.path.insert(0, str(_ROOT / "support"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "support" in Path(item.fspath).parts:
            continue
        parts = Path(item.fspath).relative_to(_ROOT).parts
        if parts and parts[0] == "plan":  # its own package's suite: plan, then unit, slow or e2e
            item.add_marker("plan")
            parts = parts[1:]
        if parts and parts[0] in ("unit", "integration", "e2e", "slow"):
            item.add_marker(parts[0])
