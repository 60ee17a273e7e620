"""The `plan` extra: which packages it brings is read from the installed distribution's metadata,
and what of it is not installed is what `servewell plan` names before refusing to run."""

from __future__ import annotations

from pathlib import Path

import pytest

from servewell_plan.extra import INSTALL_PLAN_EXTRA, extra_requirements, missing_for_plan, not_installed

ABSENT = "servewell-test-no-such-distribution"


def test_the_plan_extras_requirements_are_read_from_requires_dist_lines():
    requires = [
        "numpy>=1.26",  # the core's
        'matplotlib>=3.8; extra == "bench"',
        'numpy>=1.26; extra == "plan"',
        "matplotlib>=3.8; extra == 'plan'",
        'servewell[onnx,torch]; extra == "all"',
        'scipy>=1.11; python_version >= "3.11" and extra == "plan"',
        'planar; extra == "planner"',  # another extra whose name starts with plan
    ]
    assert extra_requirements(requires, "plan") == ["numpy", "matplotlib", "scipy"]
    assert extra_requirements(requires, "bench") == ["matplotlib"]
    assert extra_requirements(requires, "docs") == []


def test_only_distributions_that_are_not_installed_are_missing():
    assert not_installed(["numpy", ABSENT, "pytest"]) == [ABSENT]


def test_this_environment_has_the_extra_and_a_source_tree_is_not_refused():
    assert missing_for_plan() == []  # `make install` installs the plan extra
    assert missing_for_plan(ABSENT) == []  # no metadata to read: the imports will say what is missing
    assert "servewell[plan]" in INSTALL_PLAN_EXTRA


def test_an_installed_distribution_whose_plan_extra_is_not_installed_names_what_is_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # a real installed distribution's metadata, as pip writes it, on the path
    info = tmp_path / "servewell_test_planned-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: servewell-test-planned\nVersion: 1.0\n"
                                   "Provides-Extra: plan\n"
                                   "Requires-Dist: numpy>=1.26\n"
                                   'Requires-Dist: numpy>=1.26; extra == "plan"\n'
                                   f'Requires-Dist: {ABSENT}>=1; extra == "plan"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert missing_for_plan("servewell-test-planned") == [ABSENT]
