"""`servewell tune MODEL_DIR --slo-p99-ms N`: serve the model with candidate settings, measure
each with the bench engine, recommend the highest throughput whose p99 meets the SLO.

Batching settings change live (`PATCH /admin/models/{name}/batching`, loopback needs no token);
instances, threads and dtype need a restart with a rewritten model.yaml in a temporary copy of
the model directory (links to the user's files plus its own model.yaml: the user's directory
is never written). Every measurement goes to the state file in --out as soon as it is made.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import yaml

from servewell.config.model import ModelConfig
from servewell.cpu_limit import usable_cpus
from servewell.observability.process import tree_cpu_seconds
from servewell.perf.bench_command import input_choice, parse_headers
from servewell.perf.httpclient import fetch
from servewell.perf.inputs import InputError, parse_shape_overrides
from servewell.perf.local_server import (
    HOST,
    LocalServer,
    LocalServerError,
    grpc_supported,
    model_name,
    read_model_yaml,
    stage_model,
)
from servewell.perf.loop import LoadShape, Recorder
from servewell.perf.oip_http import ServerError
from servewell.perf.progress import Progress
from servewell.perf.report import MissingDependency, ms, require_matplotlib, write_json
from servewell.perf.stop_signals import Stopped, stop_on_signals
from servewell.perf.sweep import measure
from servewell.perf.target import Endpoint, prepare_target
from servewell.perf.tune_config import ConfigEditError, apply, baseline_candidate, yaml_block
from servewell.perf.tune_report import candidates_table, plot, recommendation_text, results_json, write_csv
from servewell.perf.tune_state import TuneState
from servewell.perf.tuner import (
    Candidate,
    Climb,
    LadderPoint,
    Measurement,
    Search,
    SearchSpace,
    build_space,
    ladder_start,
    recommend,
)

#: Share of the budget kept for repeating the two best candidates.
REPEAT_SHARE = 0.25
#: Ladder steps a first measurement takes, typically (a repeat starts at the best level: fewer).
TYPICAL_STEPS = 3
#: Seconds a step costs beyond its duration (connecting, the grace wait, the live change).
STEP_OVERHEAD_S = 0.4


class TuneRunner:
    """Drives the search: servers, live changes, ladders, the state file and the budget."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, doc: dict[str, Any], space: SearchSpace,
                 state: TuneState, workdir: Path, progress: Progress, deadline: float) -> None:
        self.args = args
        self.model_dir = model_dir
        self.doc = doc
        self.name = model_name(model_dir, doc)  # as `serve` names it: the directory's, when doc has none
        self.space = space
        self.state = state
        self.workdir = workdir
        self.progress = progress
        self.deadline = deadline
        self.started = time.monotonic()
        self.budget_s = deadline - self.started
        self.server: LocalServer | None = None
        self.server_key: tuple[int, int, str | None] | None = None
        self.restart_s = 10.0  # until measured
        self.measured = 0
        self.headers = parse_headers(args.headers)

    def remaining(self) -> float:
        """Seconds of budget left."""
        return self.deadline - time.monotonic()

    def estimate(self, candidate: Candidate, repeat: bool) -> float:
        """What measuring `candidate` will probably cost, in seconds."""
        steps = TYPICAL_STEPS - 1 if repeat else TYPICAL_STEPS
        cost = steps * (float(self.args.step_s) + STEP_OVERHEAD_S)
        if candidate.server != self.server_key:
            cost += self.restart_s + 2.0
        return cost

    def run(self) -> str:
        """Measure until the search is done or the budget is spent; returns which."""
        search = Search(self.space)
        while True:
            explore = self.remaining() > REPEAT_SHARE * self.budget_s
            step = search.next(self.state.results, explore)
            if step is not None and self.estimate(step[1], step[0] == "repeat") > self.remaining() and explore:
                step = search.next(self.state.results, explore=False)  # what is left may still fit a repeat
            if step is None:
                return "done" if explore and search.next(self.state.results) is None else "budget"
            phase, candidate = step
            if self.estimate(candidate, phase == "repeat") > self.remaining():
                return "budget"
            self.measure(phase, candidate)

    def stop_server(self) -> None:
        """Stop the running server, if any."""
        if self.server is not None:
            self.server.stop()
            self.server, self.server_key = None, None

    def _ensure_server(self, candidate: Candidate) -> LocalServer:
        if self.server is not None and self.server_key == candidate.server:
            return self.server
        self.stop_server()  # two servers at once would share the cores being measured
        doc = apply(self.doc, candidate, self.space.slo_ms, max_batch_size=self.space.ceiling, name=self.name)
        repository = self.workdir / f"repo-{len(list(self.workdir.glob('repo-*')))}"
        stage_model(self.model_dir, repository, doc)
        server = LocalServer(repository, Path(self.args.out) / "servewell.log", grpc=self.args.protocol == "grpc",
                             load_timeout_s=self.args.load_timeout_s)
        self.progress.update(f"starting servewell with {candidate.instances}x{candidate.threads} threads"
                             + (f", {candidate.dtype}" if candidate.dtype else "") + " ...", force=True)
        began = time.monotonic()
        server.start()
        self.restart_s = time.monotonic() - began
        self.server, self.server_key = server, candidate.server
        return server

    def measure(self, phase: str, candidate: Candidate) -> None:
        """One run of `candidate` (its first, or a repeat), stored at once."""
        previous = self.state.results.get(candidate.key)
        self.measured += 1
        try:
            server = self._ensure_server(candidate)
            points = asyncio.run(self._ladder(server, candidate, previous, phase))
        except (ConfigEditError, LocalServerError, LiveChangeRefused) as exc:
            self.stop_server()
            self.state.record(Measurement(candidate, [], str(exc).splitlines()[0][:300]))
            self.progress.note(f"[{phase}] {candidate.describe()}: failed: {str(exc).splitlines()[0][:200]}")
            return
        measurement = previous if previous is not None else Measurement(candidate)
        measurement.runs.append(points)
        self.state.record(measurement)
        best = measurement.best_point(self.space.slo_ms, len(measurement.runs) - 1)
        verdict = (f"{best.throughput_rps:.1f} req/s at {best.concurrency} clients, p99 {ms(best.p99_ms)} ms"
                   if best else "never within the SLO")
        self.progress.clear()
        self.progress.note(f"[{phase}] {candidate.describe()}: {verdict} ({self._elapsed()})")

    def _elapsed(self) -> str:
        return f"{time.monotonic() - self.started:.0f}/{self.budget_s:.0f} s"

    async def _ladder(self, server: LocalServer, candidate: Candidate, previous: Measurement | None,
                      phase: str) -> list[LadderPoint]:
        args = self.args
        port = server.grpc_port if args.protocol == "grpc" else server.port
        endpoint = Endpoint(args.protocol or "http", HOST, port)
        model = self.name
        await self._patch(server.port, model, candidate.batching_patch(self.space.slo_ms))
        target, _ = await prepare_target(endpoint, model, None, args.fmt, input_choice(args), self.headers,
                                         args.timeout_ms / 1000.0)
        climb = Climb(self.space.slo_ms, ladder_start(candidate, previous, self.space.slo_ms), args.max_concurrency)
        pid = server.pid
        server_cpu = None if pid is None else lambda: tree_cpu_seconds(pid)
        try:
            while (level := climb.next_level()) is not None:
                shape = LoadShape("closed", concurrency=level, duration_s=args.step_s,
                                  warmup_s=min(args.warmup_s, args.step_s / 2), timeout_s=args.timeout_ms / 1000.0,
                                  grace_s=args.timeout_ms / 1000.0 + 1.0, seed=args.seed)
                label = f"[{phase}] {candidate.describe()}, {level} clients"
                # the server's CPU per request at this step: `servewell plan` reads it from the curve
                result = await measure(target, shape, self._tick(label), server_cpu)
                climb.record(LadderPoint(level, result.throughput_rps, result.p50_ms, result.p90_ms, result.p99_ms,
                                         result.errors + result.unfinished + result.client_saturated,
                                         result.server_cpu_ms_per_request))
                if self.remaining() < 0:
                    break  # over budget: what this run has is kept
        finally:
            await target.client.close()
        return climb.points

    def _tick(self, label: str) -> Callable[[Recorder, float], None]:
        """A progress callback that shows the whole search's share of the budget, not the step's."""
        def tick(recorder: Recorder, elapsed_s: float) -> None:
            spent = time.monotonic() - self.started
            self.progress.update(f"{label}: {recorder.ok_answers} ok, {self._elapsed()}",
                                 min(1.0, spent / self.budget_s))
        return tick

    async def _patch(self, port: int, model: str, changes: dict[str, object]) -> None:
        response = await fetch(HOST, port, "PATCH", f"/admin/models/{model}/batching", orjson.dumps(changes), 10.0)
        if response.status != 200:
            raise LiveChangeRefused(f"the live batching change {changes} was refused ({response.status}): "
                                    f"{response.body[:300].decode('utf-8', 'replace')}")


class LiveChangeRefused(RuntimeError):
    """The server refused a batching change (a setting this model cannot take)."""


def _context(args: argparse.Namespace, doc_text: str, space: SearchSpace, cores: int) -> dict[str, Any]:
    """What measurements depend on: a rerun with another context starts afresh."""
    return {
        "model_yaml_sha256": hashlib.sha256(doc_text.encode()).hexdigest(), "slo_p99_ms": space.slo_ms,
        "step_s": args.step_s, "warmup_s": args.warmup_s, "protocol": args.protocol or "http", "format": args.fmt,
        "inputs": {"npy": args.npy, "images": [str(p) for p in args.images], "batch_size": args.batch_size,
                   "shapes": args.shapes, "dynamic_size": args.dynamic_size},
        "cores": cores, "max_concurrency": args.max_concurrency, "timeout_ms": args.timeout_ms,
        "space": {"batch_sizes": list(space.batch_sizes), "waits_ms": list(space.waits_ms),
                  "shapes": [list(s) for s in space.shapes], "dtypes": list(space.dtypes), "repeats": space.repeats},
    }


def _numbers(text: str | None, kind: type[int] | type[float], flag: str) -> list[Any] | None:
    if text is None:
        return None
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated numbers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise ValueError(f"{flag} takes positive numbers, got {text!r}")
    return values


def _prepare(args: argparse.Namespace) -> tuple[Path, dict[str, Any], SearchSpace, TuneState, int]:
    model_dir = Path(args.model_dir).resolve()
    if not (model_dir / "model.yaml").is_file():
        raise ValueError(f"{args.model_dir} is not a model directory (no model.yaml)")
    if args.slo_p99_ms <= 0 or args.budget_s <= 0 or args.step_s <= 0:
        raise ValueError("--slo-p99-ms, --budget-s and --step-s must be positive")
    if args.protocol == "grpc" and not grpc_supported():
        raise ValueError("this servewell has no gRPC listener (no --grpc-port); tune over HTTP")
    doc_text = (model_dir / "model.yaml").read_text(encoding="utf-8")
    doc = read_model_yaml(model_dir)
    try:  # named as `serve` names it: after its directory, when model.yaml names no model
        config = ModelConfig.model_validate({"name": model_name(model_dir, doc), **doc})
    except ValueError as exc:
        raise ValueError(f"{model_dir / 'model.yaml'} is not valid: {exc}") from None
    parse_shape_overrides(args.shapes)
    parse_headers(args.headers)
    cores = args.cores or usable_cpus()  # the affinity mask, at most the container's CPU limit
    baseline = baseline_candidate(config)
    dtypes = [d for d in (args.dtypes.split(",") if args.dtypes else ("auto",)) if d] \
        if baseline.dtype is not None else []
    space = build_space(baseline, args.slo_p99_ms, cores,
                        batch_sizes=_numbers(args.batch_sizes, int, "--batch-sizes"),
                        waits_ms=_numbers(args.waits_ms, float, "--waits-ms") or (2.0, 5.0, 10.0),
                        dtypes=dtypes, tune_servers=not args.no_instances, repeats=args.repeats)
    if args.out is None:
        args.out = Path(f"servewell-tune-{config.name}")
    state = TuneState.open(Path(args.out) / "tune-state.json", _context(args, doc_text, space, cores))
    return model_dir, doc, space, state, cores


def run_tune(args: argparse.Namespace) -> int:
    """Entry point of `servewell tune`: on SIGTERM or SIGINT the server it runs is stopped and its
    temporary directory removed (what it measured is in its state file already: a rerun resumes)."""
    try:
        with stop_on_signals():
            return _run_tune(args)
    except Stopped as stopped:
        print(f"servewell tune: stopped by {stopped.name}", file=sys.stderr)
        return 128 + stopped.signum


def _run_tune(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        if not args.no_plot:
            require_matplotlib()
        model_dir, doc, space, state, cores = _prepare(args)
    except (ValueError, MissingDependency, LocalServerError, InputError, OSError) as exc:
        print(f"servewell tune: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    progress = Progress(quiet=args.quiet)
    if state.note:
        progress.note(state.note)
    if state.resumed:
        progress.note(f"resuming: {state.resumed} setting(s) already measured in {state.path}")
    name = model_name(model_dir, doc)
    progress.note(f"tuning '{name}' for p99 <= {space.slo_ms:g} ms within {args.budget_s:g} s on {cores} "
                  f"cores: batch sizes {list(space.batch_sizes)}, window waits {list(space.waits_ms)} ms, "
                  f"instances x threads {[f'{i}x{t}' for i, t in space.shapes]}"
                  + (f", dtypes {list(space.dtypes)}" if space.dtypes else ""))
    with progress, tempfile.TemporaryDirectory(prefix="servewell-tune-") as work:
        runner = TuneRunner(args, model_dir, doc, space, state, Path(work), progress, started + args.budget_s)
        try:
            ended = runner.run()
        except (ServerError, InputError, OSError) as exc:
            progress.clear()
            print(f"servewell tune: {exc}", file=sys.stderr)
            return 1
        finally:
            runner.stop_server()
    return _report(args, doc, space, state, ended, runner.measured, out, cores, time.monotonic() - started)


def _report(args: argparse.Namespace, doc: dict[str, Any], space: SearchSpace, state: TuneState, ended: str,
            measured: int, out: Path, cores: int, wall_s: float) -> int:
    slo = space.slo_ms
    name = model_name(Path(args.model_dir), doc)
    rec = recommend(state.results, slo, space.baseline)
    print(candidates_table(state.results, slo, space.baseline, rec.best.candidate if rec else None))
    print()
    print(recommendation_text(rec, slo, state.results))
    left = Search(space).next(state.results)
    if ended == "budget" and left is not None:
        print(f"\nthe budget ({args.budget_s:g} s) ended the search before '{left[0]}' ({left[1].describe()}); "
              f"rerun the same command to continue (measured settings are kept in {state.path})")
    summary: dict[str, Any] = {
        "tool": "servewell tune", "model": name, "model_dir": str(Path(args.model_dir).resolve()),
        "slo_p99_ms": slo, "budget_s": args.budget_s, "wall_s": round(wall_s, 1), "cores": cores,
        "ended": ended, "measured_this_run": measured, "resumed": state.resumed, "context": state.context,
        "candidates": results_json(state.results, slo), "recommendation": None,
    }
    code = 1
    if rec is not None:
        block = yaml_block(doc, rec.best.candidate, slo, name=name)
        full = apply(doc, rec.best.candidate, slo, name=name)
        print(f"\nmodel.yaml settings to paste into {Path(args.model_dir) / 'model.yaml'}:\n")
        print("\n".join("    " + line for line in block.rstrip().splitlines()))
        (out / "recommended-model.yaml").write_text(yaml.safe_dump(full, sort_keys=False), encoding="utf-8")
        summary["recommendation"] = {"key": rec.best.candidate.key, "setting": rec.best.candidate.describe(),
                                     "score_rps": rec.best.score(slo), "model_yaml_block": block,
                                     "baseline_score_rps": rec.baseline_score, "within_noise": rec.within_noise,
                                     "spread": rec.spread}
        code = 0
    out.mkdir(parents=True, exist_ok=True)
    write_json(summary, out / "tune-results.json")
    write_csv(state.results, slo, out / "tune-results.csv")
    written = ["tune-results.json", "tune-results.csv", "tune-state.json"]
    if rec is not None:
        written.append("recommended-model.yaml")
    if not args.no_plot and any(m.runs for m in state.results.values()):
        title = f"servewell tune {name}: p99 vs throughput per setting, {cores} cores, SLO {slo:g} ms"
        plot(state.results, slo, space.baseline, title, out / "tune.png")
        written.append("tune.png")
    print(f"\nwrote {', '.join(str(out / w) for w in written)}")
    return code

