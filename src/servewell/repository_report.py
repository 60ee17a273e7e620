"""What `servewell models` says about a repository: would the server serve each model, and with what.

For every model directory, in the order the server loads them: every problem of its model.yaml
(file, field, reason); its CPU affinity against the CPUs of this machine; its runtime's
pre-flight check in a child process, as the runtime's descriptor names it (config/runtimes.py
`RuntimeCheck`; runtimes/check_child.py): for the pytorch runtime, the factory built on the meta
device (the lazy submodules must exist, the parameter names and shapes must be the weights
file's); for the python runtime, the entry class imported (not instantiated); for the onnx
runtime, the graph opened by onnxruntime (names, datatypes and shapes against model.yaml, a
corrupt file); and the memory estimate against the budget as the server's repository mode uses
it (`engine.memory_budget`, `engine.model_pool`): eager, every model reserved in load order, so a
model the server would refuse at start is reported as refused, not `ok`; lazy, the pinned models
reserved at start and every other model loadable on demand when it fits beside them (idle models
are evicted to make room), refused only when it could never fit. Valid models show their effective
settings in two or three short lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from servewell.config.model import ModelConfig, TensorSpec
from servewell.config.model_file import CONFIG_FILE, ModelConfigError, read_model_yaml, version_problems
from servewell.engine.memory_budget import MemoryEstimate, MiB, estimate_model_memory
from servewell.engine.model_pool import RepositoryMode
from servewell.engine.pipeline_check import check_pipeline
from servewell.engine.repository import scan_repository

#: A check that takes longer than this (a factory built on meta, a graph opened) would also stall a load.
CHECK_TIMEOUT_S = 60.0
#: Child checks running at once: each is mostly one core importing a framework.
CHILD_CHECKS_AT_ONCE = max(1, min(4, os.cpu_count() or 1))
_IO_FIELDS = {"name", "version", "runtime", "artifact", "inputs", "outputs", "max_batch_size", "instances",
              "threads", "device", "preprocess", "postprocess", "metadata"}


@dataclass(slots=True)
class ModelReport:
    """One model: its model.yaml and problems in it (each naming its field), whether the budget
    refuses it, its effective settings."""

    name: str
    file: Path
    problems: list[str] = field(default_factory=list)
    refused: str | None = None
    settings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cpu_threads: int = 0  # instances x threads of a model on the CPU (0 for a GPU model or a pipeline)
    on_demand: bool = False  # lazy mode: loads on its first request (not at start), evicting idle models
    estimated_bytes: int | None = None  # the memory estimate the budget counts (None: invalid, or no estimate)

    @property
    def status(self) -> str:
        """ok, INVALID (a problem in the config or on this machine) or REFUSED (over the memory budget;
        in lazy mode, only a model that could never fit)."""
        if self.problems:
            return "INVALID"
        return "REFUSED" if self.refused else "ok"


def report_repository(
    root: Path, budget_bytes: int, available_cpus: set[int], check_factories: bool = True, check_graphs: bool = True,
    mode: RepositoryMode = "eager",
) -> list[ModelReport]:
    """A report per model directory of `root`, in the server's load order (`check_factories`,
    `check_graphs`: run the checks that `--no-factory-check` (pytorch, python) and `--no-graph-check`
    (onnx) skip, each in a child process; `mode`: the server's repository mode, which decides what the
    memory budget refuses)."""
    skipped = frozenset(flag for flag, run in (("--no-factory-check", check_factories),
                                               ("--no-graph-check", check_graphs)) if not run)
    reports = []
    budget = BudgetCheck(budget_bytes, mode)
    sources = list(scan_repository(root))
    # The child processes run side by side: each spends seconds importing torch or onnxruntime
    # (5 pytorch models took 42 s one after another on a busy 2-core machine).
    with ThreadPoolExecutor(max_workers=CHILD_CHECKS_AT_ONCE) as pool:
        checks = [pool.submit(runtime_check, source.config, source.directory, skipped)
                  if source.config is not None else None for source in sources]
        results = [check.result() if check is not None else ([], []) for check in checks]
    configs = {source.name: source.config for source in sources}
    for source, (found, notes) in zip(sources, results, strict=True):
        report = ModelReport(source.name, source.directory / CONFIG_FILE)
        reports.append(report)
        if source.config is None:
            report.problems.extend(_config_problems(source.directory, source.error))
            continue
        config = source.config
        report.problems.extend(affinity_problems(config, available_cpus))
        report.problems.extend(found)
        report.problems.extend(version_problems(source.directory, config))  # versions/<v>/ of a traffic split
        if config.kind == "pipeline":  # against its step models, as the server checks it when it loads
            report.problems.extend(f"pipeline: {p}" for p in check_pipeline(config, partial(_step_config, configs)))
        report.notes.extend(notes)
        try:
            estimate = estimate_model_memory(config, source.directory)
        except (OSError, ValueError) as exc:
            report.refused = f"would be refused before loading: {exc}"
            continue
        report.estimated_bytes = estimate.total_bytes
        budget.add(report, config, estimate)
        memory = f"~{_mib(estimate.total_bytes)} ({estimate.basis})"
        report.settings = effective_settings(config, memory + (", loads on demand" if report.on_demand else ""))
        if config.kind != "pipeline" and config.device == "cpu":
            report.cpu_threads = config.instances * config.threads
    budget.finish()
    return reports


class BudgetCheck:
    """The memory budget as the server's repository mode applies it to the models of one report.

    eager: every valid model's estimate is reserved before any load finishes, in load order, so a
    model past what is left is refused. lazy (`engine/model_pool.py`): the pinned models (model.yaml's
    `pinned`, a model with other versions, a pipeline) load at start and are never evicted; every
    other model loads on its first request, evicting idle ones to make room, so it is refused only
    when it could never fit: bigger than what the pinned models leave of the whole budget.
    """

    def __init__(self, budget_bytes: int, mode: RepositoryMode) -> None:
        self.budget_bytes = budget_bytes
        self.mode = mode
        self.reserved_bytes = 0  # eager: every model so far; lazy: the pinned ones
        self._on_demand: list[tuple[ModelReport, MemoryEstimate]] = []

    def add(self, report: ModelReport, config: ModelConfig, estimate: MemoryEstimate) -> None:
        """Reserve `estimate` now (eager, or a pinned model in lazy mode) or after the pinned ones (lazy)."""
        if self.mode == "lazy" and not (config.pinned or config.other_versions or config.kind == "pipeline"):
            report.on_demand = True
            self._on_demand.append((report, estimate))
            return
        left = self.budget_bytes - self.reserved_bytes
        if estimate.total_bytes > left:
            report.refused = (
                f"would be refused: needs {_mib(estimate.total_bytes)}, budget {_mib(self.budget_bytes)}"
                + (f" ({_mib(max(left, 0))} left after the {'pinned ' if self.mode == 'lazy' else ''}models "
                   "before it)" if self.reserved_bytes else "")
                + f"; estimate from the {estimate.basis}"
            )
        else:
            self.reserved_bytes += estimate.total_bytes

    def finish(self) -> None:
        """Judge the on-demand models (lazy mode) against what every pinned model leaves: the pinned
        ones load at start wherever they stand in the load order."""
        left = self.budget_bytes - self.reserved_bytes
        for report, estimate in self._on_demand:
            if estimate.total_bytes > self.budget_bytes:
                report.refused = (f"would be refused on every request: needs {_mib(estimate.total_bytes)}, more "
                                  f"than the whole budget of {_mib(self.budget_bytes)}; estimate from the "
                                  f"{estimate.basis}")
            elif estimate.total_bytes > left:
                report.refused = (f"would be refused on every request: needs {_mib(estimate.total_bytes)}, but the "
                                  f"pinned models (never evicted) leave {_mib(max(left, 0))} of the "
                                  f"{_mib(self.budget_bytes)} budget; estimate from the {estimate.basis}")


def _step_config(configs: dict[str, ModelConfig | None], name: str) -> tuple[ModelConfig | None, str]:
    """A step model's config from the repository read here (the server's `step_config`)."""
    if name not in configs:
        return None, f"the repository has no model {name!r}"
    config = configs[name]
    if config is None:
        return None, f"model {name!r} is invalid (see its own report)"
    if config.kind == "pipeline":
        return None, f"model {name!r} is a pipeline; a step must be a model"
    return config, ""


def runtime_check(config: ModelConfig, directory: Path, skipped: frozenset[str] = frozenset()) -> tuple[
        list[str], list[str]]:
    """Problems and notes from the pre-flight check of `config`'s runtime, run in a child process
    (none for a runtime without one: torchscript); a note instead where the `servewell models` flag
    that skips it is in `skipped`."""
    check = config.runtime_descriptor.check
    if check is None:
        return [], []
    if check.skipped_by in skipped:
        return [], [f"{check.checks} not checked ({check.skipped_by})"]
    done = _run_check(config, directory)
    doing = check.doing.format(artifact=config.artifact)
    if done.timed_out:
        return [f"field '{check.field}': {doing} took over {CHECK_TIMEOUT_S:.0f} s (a load would stall the "
                "same way)"], []
    if done.answer is None:
        package = config.runtime_descriptor.package
        if package and f"No module named '{package}'" in done.stderr:
            return [], [f"{check.checks} not checked: {package} is not installed here"]
        # A check that crashes (a signal: a negative code) would crash the worker too.
        return [f"field '{check.field}': {doing} exited with code {done.returncode}: {done.tail}"], []
    return done.problems(), [str(note) for note in done.answer.get("notes", [])]


def _config_problems(directory: Path, error: str | None) -> list[str]:
    try:
        read_model_yaml(directory)
    except ModelConfigError as exc:
        return [str(problem) for problem in exc.problems]
    return [error or "invalid"]


def affinity_problems(config: ModelConfig, available_cpus: set[int]) -> list[str]:
    """`cpu_affinity` entries naming CPUs this process cannot run on (the worker would fail to pin)."""
    problems = []
    for instance in range(config.instances):
        cpus = config.affinity_of(instance) or []
        missing = sorted(set(cpus) - available_cpus)
        if missing:
            problems.append(f"field 'cpu_affinity': instance {instance} names CPU(s) {missing}, which this machine "
                            f"does not offer (available: {_ranges(available_cpus)})")
        if cpus and config.cpu_affinity and not isinstance(config.cpu_affinity[0], list):
            break  # one list for every instance: said once
    return problems


@dataclass(slots=True, frozen=True)
class _ChildCheck:
    """How a runtime's check in a child process ended: its answer, or why there is none."""

    answer: dict[str, Any] | None  # the last line of its output, as JSON
    timed_out: bool = False
    returncode: int = 0
    stderr: str = ""

    @property
    def tail(self) -> str:
        """The last line it wrote to stderr."""
        return (self.stderr.strip().splitlines()[-1:] or ["no output"])[0]

    def problems(self) -> list[str]:
        """Its answer's problems, each naming its field."""
        return [f"field '{p['field']}': {p['reason']}" for p in (self.answer or {}).get("problems", [])]


def _run_check(config: ModelConfig, directory: Path) -> _ChildCheck:
    """Run `python -m servewell.runtimes.check_child DIRECTORY` with the config on stdin."""
    command = [sys.executable, "-m", "servewell.runtimes.check_child", str(directory)]
    try:
        done = subprocess.run(command, input=config.model_dump_json(), capture_output=True, text=True,
                              timeout=CHECK_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return _ChildCheck(None, timed_out=True)
    try:
        answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return _ChildCheck(None, returncode=done.returncode, stderr=done.stderr)
    return _ChildCheck(answer)


def effective_settings(config: ModelConfig, memory: str) -> list[str]:
    """Two or three lines: what runs where, the tensors, and every setting that is not its default."""
    instances = f"{config.instances} instance{'s' if config.instances > 1 else ''}"
    if config.pipeline is not None:
        steps = " -> ".join(f"{s.name} ({s.model})" for s in config.pipeline.steps)
        head = f"version {config.version}, pipeline of {len(config.pipeline.steps)} steps: {steps}; max_batch_size " \
            f"{config.max_batch_size}"
        tensors = "tensors: " + ", ".join(_tensor(t) for t in config.inputs) + " -> " + \
            ", ".join(_tensor(t) for t in config.outputs)
        return [head, tensors]
    lines = [
        f"version {config.version}, {config.runtime} {config.artifact}, {instances} x {config.threads} "
        f"thread{'s' if config.threads > 1 else ''} on {config.device}, max_batch_size {config.max_batch_size}, "
        f"memory {memory}",
        "tensors: " + ", ".join(_tensor(t) for t in config.inputs) + " -> "
        + ", ".join(_tensor(t) for t in config.outputs)
        + (f"; images {list(config.preprocess.size)} x{config.preprocess.channels} into '{config.image_input}'"
           if config.preprocess else ""),
    ]
    changed = _flatten(config.model_dump(mode="json", exclude_defaults=True, exclude=_IO_FIELDS))
    if changed:
        lines.append("settings: " + ", ".join(f"{key}={value}" for key, value in changed))
    return lines


def _tensor(spec: TensorSpec) -> str:
    return f"{spec.name} {spec.datatype}{spec.shape}".replace(", ", ",")


def _flatten(values: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    flat: list[tuple[str, str]] = []
    for key, value in values.items():
        if isinstance(value, dict) and value:
            flat.extend(_flatten(value, f"{prefix}{key}."))
        elif value != {}:
            flat.append((prefix + key, json.dumps(value, separators=(",", ":"))))
    return flat


def _mib(value: int) -> str:
    return f"{value / MiB:,.0f} MiB"


def _ranges(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 5} as `0-2,5`."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs) or "none"


def available_cpus() -> set[int]:
    """CPUs this process (and so a worker it starts) may run on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def cpu_warning(reports: list[ModelReport], cpus: int, why: str) -> str | None:
    """A warning when the CPU models that would serve have more worker threads than the `cpus`
    this server may use (`why`: where that number comes from), else None."""
    threads = sum(report.cpu_threads for report in reports if report.status == "ok")
    if threads <= cpus:
        return None
    return (f"warning: the CPU models' worker threads add up to {threads} (instances x threads), more than the {cpus} "
            f"CPU(s) this server may use ({why}): their batches will take turns on the cores and every model's "
            "latency grows with the others' load; lower threads or instances, or give the server more CPUs")


def lazy_summary(reports: list[ModelReport]) -> str:
    """What lazy mode does with these models: which load at start, which on their first request."""
    serving = [r for r in reports if r.status == "ok"]
    pinned = [r for r in serving if not r.on_demand]
    on_demand = len(serving) - len(pinned)
    return (f"lazy mode: {len(pinned)} pinned model(s) load at start "
            f"({_mib(sum(r.estimated_bytes or 0 for r in pinned))}), {on_demand} load on their first request, "
            "evicting idle models to make room")


def render(root: Path, budget_bytes: int, budget_source: str, reports: list[ModelReport],
           warnings: Iterable[str] = (), mode: RepositoryMode = "eager") -> str:
    """The text `servewell models` prints (`warnings`: lines about the whole repository; `mode`: the
    repository mode the reports were made for, said under the header when lazy)."""
    width = max([20] + [len(r.name) for r in reports])
    lines = [f"model repository {root}: {len(reports)} model(s); memory budget {_mib(budget_bytes)} ({budget_source})"]
    if mode == "lazy":
        lines.append(f"  {lazy_summary(reports)}")
    lines += [f"  {line}" for line in warnings]
    for report in reports:
        head = f"  {report.name:<{width}} {report.status:<8} "
        body = report.problems + ([report.refused] if report.refused else []) + report.settings + report.notes
        if report.problems:
            body.insert(0, f"{report.file}:")  # the file once, then each problem with its field
        lines.append(head + (body[0] if body else ""))
        lines.extend(" " * len(head) + ("  " if report.problems and 0 < i <= len(report.problems) else "") + line
                     for i, line in enumerate(body[1:], start=1))
    return "\n".join(lines)
