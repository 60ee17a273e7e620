"""Safe rollouts (issue 24): how fast a bad canary is taken back, and what shadow traffic costs.

    flock /tmp/servewell-bench.lock .venv/bin/python -m bench.rollout [--rounds 3] [--seconds 10]

One server (`servewell serve`, the split as in production, all CPU). Every model is the same
python-runtime MLP (numpy, 64 -> 256 -> 10, one instance, max batch 32), so the versions differ
only in what each scenario makes them do:

* `errors`: version 1, and versions/2 failing 20 % of its batches, at weight 90/10;
* `latency`: version 1 sleeping 3 ms a batch, and versions/2 sleeping 9 ms (3x), at 90/10;
  both with model.yaml's default rules (30 s window, 20 requests, +5 points of errors, 2x p99);
* `identical`: version 1 and versions/2 byte-identical (both sleeping 3 ms a batch), at 90/10;
* `plain` (version 1 alone) and `shadowed` (version 1 serving, versions/2 shadowing 100 %).

Rollback (once per round, each scenario): a closed loop of 8 clients until the rollout's state is
rolled_back (polled every 100 ms) and 2 s after. The clock starts at the first bad answer the
clients saw: the first 5xx (only the canary fails) or the first answer of the slow version. The
requests failed in that time are counted at the clients and by the server's
servewell_rollout_requests_total{outcome="error"}.

False rollbacks (issue 45 W10: a byte-identical canary was rolled back on a busy host): after the
rounds, `--identical-runs` runs (default 20) of the same closed loop against `identical` for
`--identical-seconds` each (default 45: past one 30 s window), with `--hog` processes spinning on
the CPU meanwhile (default: one per CPU, a busy host); the rollout is reset before each run. Goal:
no run rolled back.

Shadow cost (per round, alternating order): `plain` against `shadowed`, at an open-loop rate with
spare capacity (`--rate`, default 100/s) and at saturation (closed loop, 32 clients): the
primary's p99 and throughput, and how many shadow copies were compared or shed.

Goals: rollback within 30 s of the first bad answer, for both canaries (the worst round), and no
rollback of the identical canary in any run; shadow
p99 / plain p99 <= 1.05 with spare capacity, and at saturation shadowed throughput >= 0.95x plain
(the shadow is shed first; medians over the rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import yaml

from bench.processes import ServerProcess, free_port, http_json, oip_load
from bench.report import finish_rounds, median_over
from bench.workspace import RESULTS, WORK
from servewell.perf.httpclient import HttpConnection, encode_request
from servewell.perf.loop import LoadShape

WIDTH = 64
GOAL_ROLLBACK_S = 30.0
GOAL_SHADOW_P99_RATIO = 1.05
GOAL_SATURATED_RATIO = 0.95
ROLLBACK_CLIENTS = 8
ROLLBACK_LIMIT_S = 90.0

MLP = textwrap.dedent('''
    import random
    import time

    import numpy as np


    class MLP:
        def setup(self, config):
            rng = np.random.default_rng(24)
            self.w1 = rng.standard_normal((64, 256), dtype=np.float32) / 8
            self.w2 = rng.standard_normal((256, 10), dtype=np.float32) / 16
            settings = config["settings"]
            self.fail_rate = settings.get("fail_rate", 0.0)
            self.delay_s = settings.get("delay_ms", 0) / 1000.0

        def execute(self, inputs):
            if self.fail_rate and random.random() < self.fail_rate:
                raise RuntimeError("this canary fails on purpose")
            if self.delay_s:
                time.sleep(self.delay_s)
            h = np.maximum(inputs["x"] @ self.w1, 0)
            return {"logits": h @ self.w2}
''')


def _model(directory: Path, version: str, settings: dict[str, Any], **fields: Any) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "mlp.py").write_text(MLP)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "version": version, "runtime": "python", "artifact": "mlp.py",
        "python": {"entry": "mlp:MLP", "settings": settings}, "max_batch_size": 32,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [WIDTH]}],
        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [10]}], **fields}))


def build_repository(root: Path) -> Path:
    """errors, latency, plain and shadowed (see the module docstring)."""
    repository = root / "repository"
    split = {"traffic": {"1": 90, "2": 10}, "rollout": {"sticky": "none"}}
    _model(repository / "errors", "1", {}, **split)
    _model(repository / "errors" / "versions" / "2", "2", {"fail_rate": 0.2}, warmup=False)  # would fail its warm-up
    _model(repository / "latency", "1", {"delay_ms": 3}, **split)
    _model(repository / "latency" / "versions" / "2", "2", {"delay_ms": 9})
    _model(repository / "identical", "1", {"delay_ms": 3}, **split)
    _model(repository / "identical" / "versions" / "2", "2", {"delay_ms": 3})
    _model(repository / "plain", "1", {})
    _model(repository / "shadowed", "1", {}, rollout={"shadow": {"version": "2", "percent": 100}})
    _model(repository / "shadowed" / "versions" / "2", "2", {})
    return repository


def _request(port: int, model: str, values: list[float]) -> bytes:
    body = orjson.dumps({"inputs": [{"name": "x", "shape": [1, WIDTH], "datatype": "FP32", "data": values}]})
    return encode_request("POST", f"127.0.0.1:{port}", f"/v2/models/{model}/infer", body)


def _rollout(port: int, model: str) -> dict[str, Any]:
    status, doc = http_json(port, "GET", f"/admin/models/{model}/rollout")
    if status != 200:
        raise RuntimeError(f"GET /admin/models/{model}/rollout: HTTP {status} {doc}")
    return dict(doc)


def _canary_errors(port: int, model: str) -> float:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "servewell_rollout_requests_total" and s.labels.get("model") == model
               and s.labels.get("version") == "2" and s.labels.get("outcome") == "error")


async def _until_rolled_back(port: int, model: str) -> dict[str, Any]:
    """Load `model` until its rollout is rolled back; when, and what failed meanwhile."""
    stop = asyncio.Event()
    answers: list[tuple[float, int, str]] = []  # (wall time, status, version or error code)
    payload = _request(port, model, np.linspace(0, 1, WIDTH, dtype=np.float32).tolist())

    async def client() -> None:
        connection = HttpConnection("127.0.0.1", port)
        try:
            while not stop.is_set():
                reply = await connection.request(payload)
                try:
                    doc = orjson.loads(reply.body)
                except orjson.JSONDecodeError:
                    doc = {}
                error = doc.get("error")
                what = doc.get("model_version", "") if reply.status == 200 else (
                    error.get("code", "") if isinstance(error, dict) else str(error))
                answers.append((time.time(), reply.status, what))
        finally:
            connection.close()

    clients = [asyncio.ensure_future(client()) for _ in range(ROLLBACK_CLIENTS)]
    started = time.time()
    verdict: dict[str, Any] | None = None
    try:
        while time.time() - started < ROLLBACK_LIMIT_S:
            await asyncio.sleep(0.1)
            doc = await asyncio.to_thread(_rollout, port, model)
            if doc["state"] == "rolled_back":
                verdict = doc
                break
        await asyncio.sleep(2.0)
    finally:
        stop.set()
        await asyncio.gather(*clients, return_exceptions=True)
    bad = [a for a in answers if (a[1] >= 500 if model == "errors" else a[2] == "2")]
    if verdict is None or not bad:
        return {"rolled_back": False, "verdict": verdict, "answers": len(answers), "bad_answers": len(bad)}
    first_bad = bad[0][0]
    rolled_at = float(verdict["changed_at"])
    failed_before = sum(1 for a in answers if a[1] >= 500 and a[0] <= rolled_at)
    after = [a for a in answers if a[0] > rolled_at + 0.5]
    return {
        "rolled_back": True, "seconds_after_first_bad": rolled_at - first_bad, "rule": verdict["evidence"]["rule"],
        "reason": verdict["reason"], "answers": len(answers), "failed_before_rollback": failed_before,
        "failed_by_server_count": _canary_errors(port, model),
        "canary_answers_before": sum(1 for a in answers if a[2] == "2" and a[0] <= rolled_at),
        "answers_after": len(after), "canary_or_failed_after": sum(1 for a in after if a[1] >= 500 or a[2] == "2"),
    }


async def _identical_run(port: int, seconds: float) -> dict[str, Any]:
    """A closed loop against `identical` for `seconds`: whether (and why) its canary was rolled back."""
    stop = asyncio.Event()
    answered = {"1": 0, "2": 0, "failed": 0}
    payload = _request(port, "identical", np.linspace(0, 1, WIDTH, dtype=np.float32).tolist())

    async def client() -> None:
        connection = HttpConnection("127.0.0.1", port)
        try:
            while not stop.is_set():
                reply = await connection.request(payload)
                version = orjson.loads(reply.body).get("model_version", "") if reply.status == 200 else ""
                key = version if version in answered else "failed"
                answered[key] += 1
        finally:
            connection.close()

    clients = [asyncio.ensure_future(client()) for _ in range(ROLLBACK_CLIENTS)]
    started, verdict = time.time(), None
    try:
        while time.time() - started < seconds:
            await asyncio.sleep(0.5)
            doc = await asyncio.to_thread(_rollout, port, "identical")
            if doc["state"] == "rolled_back":
                verdict = doc
                break
    finally:
        stop.set()
        await asyncio.gather(*clients, return_exceptions=True)
    return {"rolled_back": verdict is not None, "after_s": None if verdict is None else time.time() - started,
            "reason": None if verdict is None else verdict["reason"], "answered": answered}


def _hogs(count: int) -> list[subprocess.Popen[bytes]]:
    """`count` processes spinning on the CPU: a busy host, as the server meets one beside other work."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def false_rollbacks(port: int, runs: int, seconds: float, hogs: int) -> list[dict[str, Any]]:
    """`runs` runs of the identical canary under load, each after a reset (see the module doc)."""
    results = []
    spinning = _hogs(hogs)
    try:
        for run in range(runs):
            _reset(port, "identical")
            results.append(result := asyncio.run(_identical_run(port, seconds)))
            print(f"identical run {run + 1}: {result}", flush=True)
    finally:
        for process in spinning:
            process.kill()
            process.wait()
    return results


def _reset(port: int, model: str) -> None:
    status, doc = http_json(port, "PATCH", f"/admin/models/{model}/rollout", {"traffic": None})
    if status != 200:
        raise RuntimeError(f"PATCH rollout of {model}: HTTP {status} {doc}")


def _shadow_counts(port: int) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "servewell_shadow_requests_total" and s.labels.get("model") == "shadowed":
                counts[s.labels["outcome"]] = counts.get(s.labels["outcome"], 0.0) + s.value
    return counts


def load(port: int, model: str, shape: LoadShape) -> dict[str, Any]:
    """One load step against `model`: answered per second, p50/p99, shadow copies meanwhile."""
    payload = _request(port, model, np.linspace(0, 1, WIDTH, dtype=np.float32).tolist())
    before = _shadow_counts(port)
    _, figures = oip_load(port, payload, shape)
    after = _shadow_counts(port)
    return {**figures, "shadow": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--shadow-only", action="store_true", help="skip the rollback scenarios (a quick look)")
    parser.add_argument("--identical-runs", type=int, default=20, help="runs of the identical canary (0: none)")
    parser.add_argument("--identical-seconds", type=float, default=45.0)
    parser.add_argument("--hog", type=int, default=os.cpu_count() or 1,
                        help="processes spinning on the CPU during the identical runs (a busy host)")
    parser.add_argument("--out", type=Path, default=RESULTS / "rollout.json")
    args = parser.parse_args(argv)
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    repository = build_repository(WORK / "rollout")
    port = free_port()
    server = ServerProcess("rollout", [sys.executable, "-m", "servewell", "serve", "--host", "127.0.0.1",
                                       "--port", str(port), "--model-repository", str(repository),
                                       "--log-format", "json"],
                           port, RESULTS / "logs" / "rollout.log", env={"SERVEWELL_GRPC_PORT": "0"})
    server.start()
    server.wait_ready(180)
    rounds: list[dict[str, Any]] = []
    spare = LoadShape("open", rate=args.rate, duration_s=args.seconds, warmup_s=1.0, grace_s=15, max_requests=1_000_000)
    saturated = LoadShape("closed", concurrency=args.clients, duration_s=args.seconds, warmup_s=1.0, grace_s=15,
                          max_requests=1_000_000)
    try:
        for r in range(args.rounds):
            row: dict[str, Any] = {}
            for model in () if args.shadow_only else ("errors", "latency"):
                if r:
                    _reset(port, model)  # the canary takes its 10 % again
                row[model] = result = asyncio.run(_until_rolled_back(port, model))
                print(f"round {r + 1} {model}: {result}", flush=True)
            for phase, shape in (("spare", spare), ("saturated", saturated)):
                for model in (("plain", "shadowed") if r % 2 == 0 else ("shadowed", "plain")):
                    row[f"{phase}_{model}"] = result = load(port, model, shape)
                    print(f"round {r + 1} {phase} {model}: {result['ok_per_s']:.0f} ok/s, p50 "
                          f"{result['latency_ms']['p50']:.2f} ms, p99 {result['latency_ms']['p99']:.2f} ms, "
                          f"{result['errors']} errors, shadow {result['shadow']}", flush=True)
            rounds.append(row)
        identical = [] if args.shadow_only else false_rollbacks(port, args.identical_runs, args.identical_seconds,
                                                                args.hog)
    finally:
        server.stop()
    report = summarize(rounds)
    report["identical"] = {"runs": len(identical), "rolled_back": sum(r["rolled_back"] for r in identical),
                           "hog_processes": args.hog, "seconds_per_run": args.identical_seconds,
                           "reasons": [r["reason"] for r in identical if r["rolled_back"]], "each": identical}
    finish_rounds(report, rounds, print_table, args.out)
    return 0


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The worst rollback over the rounds, and the shadow ratios' medians."""
    median = median_over(rounds)

    def worst(model: str) -> float | None:
        if model not in rounds[0]:
            return None  # --shadow-only
        return max(r[model]["seconds_after_first_bad"] if r[model]["rolled_back"] else float("inf") for r in rounds)

    return {
        "rollback_s": {m: worst(m) for m in ("errors", "latency")},
        "failed_before_rollback": {m: [r[m].get("failed_before_rollback") for r in rounds if m in r]
                                   for m in ("errors", "latency")},
        "spare_p99_ratio": median(lambda r: r["spare_shadowed"]["latency_ms"]["p99"]
                                  / r["spare_plain"]["latency_ms"]["p99"]),
        "spare_p50_ratio": median(lambda r: r["spare_shadowed"]["latency_ms"]["p50"]
                                  / r["spare_plain"]["latency_ms"]["p50"]),
        "saturated_ok_ratio": median(lambda r: r["saturated_shadowed"]["ok_per_s"] / r["saturated_plain"]["ok_per_s"]),
        "saturated_p99_ratio": median(lambda r: r["saturated_shadowed"]["latency_ms"]["p99"]
                                      / r["saturated_plain"]["latency_ms"]["p99"]),
        "shadow": {phase: {k: statistics.median(r[f"{phase}_shadowed"]["shadow"].get(k, 0.0) for r in rounds)
                           for k in ("compared", "shed", "failed")} for phase in ("spare", "saturated")},
    }


def print_table(report: dict[str, Any]) -> None:
    """Each goal beside its figure."""
    print(f"failed requests before the rollback, per round: {report['failed_before_rollback']}; shadow copies "
          f"(median per phase): {report['shadow']}; spare p50 ratio {report['spare_p50_ratio']:.3f}, saturated p99 "
          f"ratio {report['saturated_p99_ratio']:.3f}")
    rollback = report["rollback_s"]
    rows: list[tuple[str, float | None, str, str, bool]] = [
        ("rollback after the first bad answer: 20 % errors (worst round)", rollback["errors"], " s",
         f"<= {GOAL_ROLLBACK_S:g} s", rollback["errors"] is not None and rollback["errors"] <= GOAL_ROLLBACK_S),
        ("rollback after the first bad answer: 3x latency (worst round)", rollback["latency"], " s",
         f"<= {GOAL_ROLLBACK_S:g} s", rollback["latency"] is not None and rollback["latency"] <= GOAL_ROLLBACK_S),
        ("spare capacity: primary p99 shadowed / plain", report["spare_p99_ratio"], "x",
         f"<= {GOAL_SHADOW_P99_RATIO:g}x", report["spare_p99_ratio"] <= GOAL_SHADOW_P99_RATIO),
        ("saturation: ok/s shadowed / plain", report["saturated_ok_ratio"], "x",
         f">= {GOAL_SATURATED_RATIO:g}x", report["saturated_ok_ratio"] >= GOAL_SATURATED_RATIO),
    ]
    identical = report.get("identical", {})
    if identical.get("runs"):
        rows.append((f"identical canary rolled back (runs of {identical['runs']}, {identical['hog_processes']} hogs)",
                     float(identical["rolled_back"]), "", "0", identical["rolled_back"] == 0))
    rows = [row for row in rows if row[1] is not None]
    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  {'value':>9}  {'goal':<9} verdict")
    for figure, value, unit, goal, passed in rows:
        print(f"{figure:<{width}}  {value or 0.0:>7.3f}{unit:<2} {goal:<9} {'PASS' if passed else 'FAIL'}")


if __name__ == "__main__":
    raise SystemExit(main())
