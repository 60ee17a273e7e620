"""What `servewell plan` needs beyond servewell's core install: the `plan` extra.

The fleet planner ships in servewell's distribution but is only usable with its own extra
(`pip install 'servewell[plan]'`), so that the server's install never carries the planner's
dependencies. Which packages the extra brings is read from the installed distribution's own
metadata (pyproject.toml's `[project.optional-dependencies] plan`), so the list lives in one place.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from importlib import metadata

#: The extra, and the command that installs it (the CLI prints it when the extra is missing).
PLAN_EXTRA = "plan"
INSTALL_PLAN_EXTRA = f"pip install 'servewell[{PLAN_EXTRA}]'"

_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def extra_requirements(requires: Iterable[str], extra: str) -> list[str]:
    """The distribution names that `requires` (a distribution's `Requires-Dist` lines, such as
    `matplotlib>=3.8; extra == "plan"`) lists for `extra`, in order."""
    marker = re.compile(r"\bextra\s*==\s*['\"]" + re.escape(extra) + r"['\"]")
    names = []
    for line in requires:
        requirement, _, markers = line.partition(";")
        found = _NAME.match(requirement)
        if found is not None and marker.search(markers):
            names.append(found.group(1))
    return names


def not_installed(names: Iterable[str]) -> list[str]:
    """Those of the distributions `names` that are not installed in this environment."""
    missing = []
    for name in names:
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def missing_for_plan(distribution: str = "servewell") -> list[str]:
    """The packages of the `plan` extra that are not installed; none when `distribution` itself is
    not installed (a source tree on the path: its own imports will say what is missing)."""
    try:
        requires = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        return []
    return not_installed(extra_requirements(requires, PLAN_EXTRA))
