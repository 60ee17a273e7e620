"""`servewell plan` as a user runs it: measure a model with `servewell bench`, plan a fleet from the
result, simulate it. The model sleeps 20 ms per batch of up to 4, so its capacity is known (about
200 req/s per replica) and the plan's figures can be checked against it.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from model_dirs import slow_model

BATCH_S = 0.02
MAX_BATCH = 4


def servewell(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "servewell", *args], capture_output=True, text=True,
                          timeout=timeout_s, check=False)


@pytest.fixture(scope="module")
def curve(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bench result of the slow model (the server bench starts for the model directory)."""
    root = tmp_path_factory.mktemp("plan")
    slow_model(root, "sleepy", BATCH_S * 1000, max_batch_size=MAX_BATCH)
    out = root / "bench"
    done = servewell("bench", str(root / "sleepy"), "--concurrency", "1,2,4,8,16", "--idle-ms", "20",
                     "--duration-s", "2", "--warmup-s", "0.5", "--out", str(out), "--no-plot")
    assert done.returncode == 0, done.stderr
    return out / "results.json"


def test_plan_sizes_a_fleet_that_meets_the_slo_in_simulation(curve, tmp_path):
    bench = json.loads(curve.read_text())
    assert bench["local_server_ready_s"] > 0  # the cold start plan uses
    assert 0 < bench["client_cpu_s_per_request"] < 0.05  # the load generator beside it, taken out of the fit
    out = tmp_path / "plan"
    # 500 req/s for 2 minutes at request level under four policies: the fleet, its failover replica and
    # the lost replica's requests show at this size (1,000 req/s for 4 minutes took 3.5 minutes here).
    rps, duration_s = 500, 120
    done = servewell("plan", str(curve), "--slo-p99-ms", "150", "--rps", str(rps), "--duration-s", str(duration_s),
                     "--simulate", "--fault", f"replica_lost@{duration_s // 2}", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads((out / "plan.json").read_text())
    plan = doc["plan"]
    measured_peak = max(s["throughput_rps"] for s in bench["steps"])
    # The fit reproduces what was measured, and the capacity is what the model can do.
    assert plan["fit_error"] < 0.35, done.stdout
    assert 0.8 * measured_peak <= plan["capacity_rps"] <= 1.2 * measured_peak
    assert plan["capacity_rps"] <= MAX_BATCH / BATCH_S * 1.05  # a batch never runs faster than its sleep
    # Replicas cover the peak at the operating point, plus one for a lost replica.
    per_replica = plan["operating_point"]["utilization"] * plan["capacity_rps"]
    assert plan["replicas_at_peak"] == math.ceil(rps / per_replica)
    assert plan["replicas_with_failover"] == plan["replicas_at_peak"] + 1
    assert plan["operating_point"]["p99_s"] <= 0.150
    assert 0 < plan["target_utilization"] <= plan["operating_point"]["utilization"]
    assert plan["pod"] == {"cpu": 2.0, "memory_mib": None, "instances": 1, "threads": 1, "max_batch_size": MAX_BATCH,
                           "max_wait_ms": 0.0}
    assert len(plan["reasoning"]) == 7 and "Little's law" in plan["reasoning"][5]
    assert "finds the replica idle costs more" in plan["reasoning"][0] and "after 20 ms" in plan["reasoning"][0]
    # The manifests' values are printed, and the simulation has every policy.
    shipped = re.search(r"servewell_queue_depth averageValue: (\S+)", done.stdout)
    assert shipped, done.stdout
    value = shipped.group(1)
    assert (float(value[:-1]) / 1000 if value.endswith("m") else float(value)) == \
        pytest.approx(plan["targets"]["queue_depth"], abs=0.001)
    sims = {s["policy"]: s for s in doc["simulation"]}
    assert set(sims) == {"fixed", "cpu", "queue_depth", "queue_wait"}
    fixed = sims["fixed"]
    assert fixed["fidelity"] == "request"
    assert fixed["arrivals"] == pytest.approx(rps * duration_s, rel=0.05)
    # The recommended fleet meets the SLO through a lost replica; what it loses is the lost replica's
    # requests in flight (a few), not a queue overflow.
    assert fixed["slo_attainment"] >= 0.99
    assert fixed["rejected_share"] <= 0.001
    assert 0 < fixed["failed_share"] < 0.001
    assert fixed["replica_hours"] == pytest.approx(plan["replicas_with_failover"] * duration_s / 3600, rel=0.1)
    assert (out / "simulation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("args", "problem"), [
    (["--rps", "-5"], "--rps"),
    (["--rps", "100", "--zones", "0"], "--zones"),
    (["--rps", "100", "--fault", "meteor@5"], "--fault"),
    (["--rps", "100", "--error-budget", "2"], "--error-budget"),
])
def test_plan_refuses_bad_arguments_by_name(curve, args, problem):
    done = servewell("plan", str(curve), "--slo-p99-ms", "100", *args)
    assert done.returncode == 2 and problem in done.stderr and "Traceback" not in done.stderr


def test_plan_refuses_a_file_that_is_not_a_curve_and_a_bad_trace(curve, tmp_path):
    junk = tmp_path / "junk.json"
    junk.write_text(json.dumps({"tool": "servewell tune", "candidates": [{"runs": [[{"concurrency": 1}]],
                                                                          "candidate": {}}]}))
    done = servewell("plan", str(junk), "--slo-p99-ms", "100", "--rps", "10")
    assert done.returncode == 2 and "throughput_rps" in done.stderr and "Traceback" not in done.stderr
    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,rate_rps\n0,10\n5,nan\n")
    done = servewell("plan", str(curve), "--slo-p99-ms", "100", "--trace", str(trace))
    assert done.returncode == 2 and "line 3" in done.stderr and "Traceback" not in done.stderr


def plain_curve(path: Path, *steps: tuple[int, float, float, float]) -> Path:
    """A `servewell curve` file of closed-loop steps (concurrency, req/s, p50 ms, p99 ms)."""
    path.write_text(json.dumps({"tool": "servewell curve", "model": "m", "settings": {"max_batch_size": 4},
                                "points": [{"concurrency": c, "throughput_rps": x, "p50_ms": p50, "p99_ms": p99}
                                           for c, x, p50, p99 in steps]}))
    return path


def test_plan_refuses_a_one_step_curve_at_once_saying_what_it_needs(tmp_path):
    one = plain_curve(tmp_path / "one.json", (4, 180.0, 21.0, 24.0))
    done = servewell("plan", str(one), "--slo-p99-ms", "100", "--rps", "500", timeout_s=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "the curve has 1 step(s) (concurrency 4); plan needs at least 2" in done.stderr
    assert "--concurrency 1,2,4,8,16,32" in done.stderr and done.stdout == ""  # no plan printed


def test_plan_refuses_an_slo_under_the_unloaded_p99_at_once_naming_the_floor(tmp_path):
    ladder = plain_curve(tmp_path / "ladder.json", (1, 45.0, 21.0, 24.0), (2, 90.0, 21.5, 25.0),
                         (4, 180.0, 22.0, 27.0), (8, 190.0, 41.0, 48.0))
    done = servewell("plan", str(ladder), "--slo-p99-ms", "20", "--rps", "500", timeout_s=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "unloaded p99 (the 1-client step) is 24.0 ms" in done.stderr
    assert "the lowest SLO it can plan for is 26.7 ms" in done.stderr
