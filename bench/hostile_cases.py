"""Hostile cases that need a server of their own (a python model with huge answers, keys and
tenants, a response cache, a lazy repository ...), run by `bench.hostile --cases ...` after the
shared-server attacks.

Each case is one function registered with `@case("name")` in a module of `CASE_MODULES`: it
starts what it needs under `workdir` (traffic to 127.0.0.1 only, bounded in time), stops every
process it started, and returns a `CaseResult` whose `bound` says in words what must hold and
whose `passed` says whether it held, with the figures behind the verdict. A case that cannot be
run here (a missing program) raises; `bench.hostile` reports that as a failure, never a pass.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Modules whose `@case` functions are the cases (each module owns its cases and their servers).
CASE_MODULES: tuple[str, ...] = ("bench.hostile_pool", "bench.hostile_grpc_flood", "bench.hostile_tenants",
                                 "bench.hostile_cache", "bench.hostile_answers",
                                 "bench.hostile_loads", "bench.hostile_streams")


@dataclass(slots=True)
class CaseResult:
    """What one hostile case measured, against the bound it checks."""

    name: str
    bound: str  # what must hold, e.g. "a 4-float model's p99 <= 2x its baseline while another answers 200 MB"
    passed: bool
    figures: dict[str, Any] = field(default_factory=dict)  # the numbers behind the verdict (JSON-able)


Case = Callable[[Path], CaseResult]
_CASES: dict[str, Case] = {}


def case(name: str) -> Callable[[Case], Case]:
    """Register a hostile case under `name` (unique)."""
    def register(function: Case) -> Case:
        if name in _CASES:
            raise ValueError(f"two hostile cases are named {name!r}")
        _CASES[name] = function
        return function
    return register


def cases() -> dict[str, Case]:
    """Every registered case, by name, in the order their modules list them."""
    for module in CASE_MODULES:
        importlib.import_module(module)
    return dict(_CASES)
