"""The module dependency rules of docs/architecture.md, checked on the source with `ast`: every
import counts, at module level or inside a function, under TYPE_CHECKING or not.

- api never imports workers or runtimes;
- api and engine never import torch or onnxruntime (nor runtimes);
- engine imports workers only through the client side: workers.pool, .handle, .messages, .shm;
- workers import from engine only the leaf module engine.batch_runner;
- runtimes never import api or engine;
- engine never imports api (the direction is api -> engine);
- config imports nothing else of ours;
- observability imports nothing of ours but config;
- tenancy (keys and tenants, which api and engine both read) imports nothing of ours but config,
  errors and observability;
- nothing of servewell imports servewell_plan (the fleet planner, its own package) but the CLI's
  `servewell plan` dispatch;
- servewell_plan imports nothing of servewell's but perf.report, nor any framework.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "servewell"
#: The fleet planner: a package of its own beside servewell (the `plan` extra).
PLAN = "servewell_plan"


@dataclass(frozen=True)
class Import:
    importer: str  # the module that imports, e.g. servewell.api.routes_v2
    imported: str  # the module imported, e.g. servewell.engine.scheduler or numpy.linalg
    where: str  # file:line


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, root: Path = SRC) -> bool:
    """Whether `name` is one of our modules or packages (as opposed to a name inside one)."""
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path, root: Path = SRC) -> list[Import]:
    """Every module `path` imports; `root` is the directory that holds the servewell package."""
    importer = module_name(path, root)
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    found: list[Import] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [Import(importer, alias.name, where) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .x import y
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append(Import(importer, module, where))
            # `from servewell.workers import handle` imports the module servewell.workers.handle
            found += [Import(importer, f"{module}.{alias.name}", where) for alias in node.names
                      if module.startswith(PACKAGE) and is_module(f"{module}.{alias.name}", root)]
    return found


ALL_IMPORTS = [i for package in (PACKAGE, PLAN) for path in sorted((SRC / package).rglob("*.py"))
               for i in imports_of(path)]


def within(module: str, *prefixes: str) -> bool:
    """Whether `module` is one of `prefixes` or inside one of them (dotted names)."""
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def ours(module: str) -> bool:
    return within(module, PACKAGE)


WORKERS_CLIENT_SIDE = tuple(f"servewell.workers.{m}" for m in ("pool", "handle", "messages", "shm"))


@dataclass(frozen=True)
class Rule:
    name: str
    applies_to: tuple[str, ...]  # importer packages
    forbidden: Callable[[str], bool]  # is this imported module forbidden to them?
    exempt: tuple[str, ...] = ()  # importer modules the rule allows it


RULES = [
    Rule("api never imports workers or runtimes", ("servewell.api",),
         lambda m: within(m, "servewell.workers", "servewell.runtimes")),
    Rule("api and engine never import torch, onnxruntime or runtimes", ("servewell.api", "servewell.engine"),
         lambda m: within(m, "torch", "onnxruntime", "servewell.runtimes")),
    Rule("engine imports workers only through workers.pool, .handle, .messages, .shm", ("servewell.engine",),
         lambda m: within(m, "servewell.workers") and m != "servewell.workers" and not within(m, *WORKERS_CLIENT_SIDE)),
    Rule("workers import from engine only engine.batch_runner", ("servewell.workers",),
         lambda m: within(m, "servewell.engine") and m != "servewell.engine.batch_runner"),
    Rule("runtimes never import api or engine", ("servewell.runtimes",),
         lambda m: within(m, "servewell.api", "servewell.engine")),
    Rule("engine never imports api", ("servewell.engine",), lambda m: within(m, "servewell.api")),
    Rule("config imports nothing else of ours", ("servewell.config",),
         lambda m: ours(m) and m != PACKAGE and not within(m, "servewell.config")),
    Rule("observability imports nothing of ours but config", ("servewell.observability",),
         lambda m: ours(m) and m != PACKAGE and not within(m, "servewell.observability", "servewell.config")),
    Rule("tenancy imports nothing of ours but config, errors and observability", ("servewell.tenancy",),
         lambda m: ours(m) and m != PACKAGE and not within(m, "servewell.tenancy", "servewell.config",
                                                           "servewell.errors", "servewell.observability")),
    Rule("servewell never imports servewell_plan but in the CLI's plan dispatch", (PACKAGE,),
         lambda m: within(m, PLAN), exempt=("servewell.cli",)),
    Rule("servewell_plan imports nothing of servewell's but perf.report, nor any framework", (PLAN,),
         lambda m: (ours(m) and m != PACKAGE and not within(m, "servewell.perf.report"))
         or within(m, "torch", "onnxruntime")),
]


def violations(rule: Rule) -> list[str]:
    return [f"{i.where}: {i.importer} imports {i.imported}" for i in ALL_IMPORTS
            if within(i.importer, *rule.applies_to) and i.importer not in rule.exempt and rule.forbidden(i.imported)]


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_dependency_rule(rule: Rule):
    found = violations(rule)
    assert not found, f"{rule.name}:\n" + "\n".join(found)


def test_the_scanner_sees_imports_of_every_kind():
    """The rules above cannot pass by finding nothing: known imports of each form are found."""
    pairs = {(i.importer, i.imported) for i in ALL_IMPORTS}
    assert ("servewell.cli", "servewell.config.server") in pairs  # from x import y
    assert any(importer.startswith("servewell.runtimes") and imported == "torch" for importer, imported in pairs)
    assert any(within(importer, "servewell.workers") and within(imported, "servewell.runtimes")
               for importer, imported in pairs)  # inside a function, lazily
    assert len({i.importer for i in ALL_IMPORTS}) > 40
    # the planner's modules are scanned, and so is the one import of it the server may have
    assert ("servewell_plan.command", "servewell.perf.report") in pairs
    assert ("servewell.cli", "servewell_plan.commands") in pairs


def test_relative_and_package_imports_resolve_to_modules(tmp_path: Path):
    for module in ("__init__", "api/__init__", "api/routes", "workers/__init__", "workers/handle"):
        path = tmp_path / "servewell" / f"{module}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    routes = tmp_path / "servewell" / "api" / "routes.py"
    routes.write_text("from ..workers import handle\nfrom . import routes\nfrom .routes import thing\n"
                      "def lazy():\n    import torch.nn\n")
    imported = {i.imported for i in imports_of(routes, tmp_path)}
    assert imported == {"servewell.workers", "servewell.workers.handle", "servewell.api", "servewell.api.routes",
                        "torch.nn"}
    assert any(rule.forbidden("servewell.workers.handle") for rule in RULES if "servewell.api" in rule.applies_to)
    assert any(rule.forbidden("torch.nn") for rule in RULES if "servewell.api" in rule.applies_to)
