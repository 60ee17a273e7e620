"""Reading measured curves: tune, bench and plain curve files, and what a hostile file gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servewell_plan.curve import MAX_CURVE_BYTES, MAX_POINTS, CurveSettings, read_curves


def write(tmp_path: Path, doc: object) -> Path:
    path = tmp_path / "curve.json"
    path.write_text(json.dumps(doc))
    return path


def ladder(*rows: tuple[int, float, float, float]) -> list[dict[str, float]]:
    return [{"concurrency": c, "throughput_rps": x, "p50_ms": p50, "p99_ms": p99, "errors": 0}
            for c, x, p50, p99 in rows]


def tune_doc() -> dict:
    def cand(key: str, batch: int, runs: list) -> dict:
        return {"key": key, "candidate": {"max_batch_size": batch, "policy": "window", "max_wait_ms": 2.0,
                                          "instances": 2, "threads": 1}, "runs": runs, "failure": None}
    return {"tool": "servewell tune", "model": "m", "cores": 8, "recommendation": {"key": "b8"},
            "candidates": [cand("b1", 1, [ladder((1, 100, 10, 12), (4, 300, 13, 20))]),
                           cand("b8", 8, [ladder((1, 100, 10, 12), (4, 380, 11, 15)),
                                          ladder((1, 90, 11, 13), (4, 400, 10, 14))]),
                           {"key": "bad", "candidate": {}, "runs": [], "failure": "refused"}]}


def test_tune_result_gives_the_recommended_candidate_first_with_its_settings(tmp_path):
    curves = read_curves(write(tmp_path, tune_doc()))
    assert [c.settings.max_batch_size for c in curves] == [8, 1]  # the failed candidate is skipped
    best = curves[0]
    assert best.settings == CurveSettings(8, 0.002, 2, 1, "window")
    assert best.machine_cores == 8 and best.cores == 3.0
    # A concurrency measured twice keeps its slower run: plan on the pessimistic figure.
    assert [(p.concurrency, p.throughput_rps) for p in best.points] == [(1, 90), (4, 380)]
    assert best.points[0].p50_s == pytest.approx(0.011)
    assert best.peak.concurrency == 4


def test_bench_result_needs_a_closed_loop_and_keeps_the_measured_cold_start(tmp_path):
    steps = [{"level": 1.0, "throughput_rps": 50.0, "p50_ms": 20.0, "p99_ms": 25.0, "errors": 0},
             {"level": 8.0, "throughput_rps": 0.0, "p50_ms": None, "p99_ms": None, "errors": 3}]
    doc = {"tool": "servewell bench", "settings": {"mode": "closed"}, "model": {"name": "digits",
           "max_batch_size": 64}, "machine": {"cpus": 2}, "local_server_ready_s": 4.5, "steps": steps}
    (curve,) = read_curves(write(tmp_path, doc))
    assert curve.model == "digits" and curve.ready_s == 4.5 and curve.machine_cores == 2
    assert curve.settings.max_batch_size == 64 and curve.settings.policy == "idle" and curve.settings.max_wait_s == 0
    assert [p.concurrency for p in curve.points] == [1]  # a step that answered nothing is no point
    assert curve.client_cpu_s is None  # not recorded
    doc.update(client_cpu_s_per_request=0.0003, local_server=True)
    assert read_curves(write(tmp_path, doc))[0].client_cpu_s == pytest.approx(0.0003)
    doc["local_server"] = False  # a remote server did not share the load generator's cores
    assert read_curves(write(tmp_path, doc))[0].client_cpu_s is None
    doc["settings"]["mode"] = "open"
    with pytest.raises(ValueError, match="closed-loop"):
        read_curves(write(tmp_path, doc))


def test_plain_curve_file(tmp_path):
    doc = {"tool": "servewell curve", "model": "x", "settings": {"max_batch_size": 4, "policy": "window",
           "max_wait_ms": 10}, "points": ladder((2, 10, 100, 150))}
    (curve,) = read_curves(write(tmp_path, doc))
    assert curve.settings.max_wait_s == pytest.approx(0.01) and curve.points[0].p99_s == pytest.approx(0.15)
    assert curve.points[0].server_cpu_s is None  # not measured


def test_a_curve_may_say_its_workers_niceness(tmp_path):
    doc = {"tool": "servewell curve", "settings": {"max_batch_size": 4, "nice": 5}, "points": ladder((2, 10, 1, 2))}
    assert read_curves(write(tmp_path, doc))[0].settings.nice == 5
    del doc["settings"]["nice"]
    assert read_curves(write(tmp_path, doc))[0].settings.nice is None  # not said: no weights


def test_a_plain_curve_point_may_say_the_servers_cpu_per_request(tmp_path):
    points = ladder((1, 500, 1.6, 3.3), (32, 2700, 11.2, 24))
    points[0]["server_cpu_ms_per_request"] = 1.665
    doc = {"tool": "servewell curve", "settings": {"max_batch_size": 32}, "points": points}
    (curve,) = read_curves(write(tmp_path, doc))
    assert curve.points[0].server_cpu_s == pytest.approx(0.001665) and curve.points[1].server_cpu_s is None


def test_a_curve_may_say_what_requests_cost_after_the_server_sat_idle(tmp_path):
    doc = {"tool": "servewell curve", "points": ladder((1, 500, 1.6, 3.3)),
           "idle": [{"idle_ms": 20, "p50_ms": 3.0, "server_cpu_ms_per_request": 2.9}, {"idle_ms": 2, "p50_ms": 1.7}]}
    (curve,) = read_curves(write(tmp_path, doc))
    assert [(p.idle_s, p.p50_s, p.server_cpu_s) for p in curve.idle_points] == [
        (0.002, pytest.approx(0.0017), None), (0.02, pytest.approx(0.003), pytest.approx(0.0029))]
    plain = {"tool": "servewell curve", "points": ladder((1, 5, 1, 2))}
    assert read_curves(write(tmp_path, plain))[0].idle_points == ()


@pytest.mark.parametrize(("doc", "problem"), [
    ({"tool": "servewell curve", "points": ladder((1, 5, 1, 2)), "idle": {"idle_ms": 2}}, "idle: not a list"),
    ({"tool": "servewell curve", "points": ladder((1, 5, 1, 2)), "idle": [{"idle_ms": 0, "p50_ms": 1}]},
     r"idle\[0\].idle_ms"),
    ({"tool": "servewell curve", "points": ladder((1, 5, 1, 2)), "idle": [{"idle_ms": 2, "p50_ms": "slow"}]},
     r"idle\[0\].p50_ms"),
    ({"tool": "servewell curve", "points": ladder((1, 5, 1, 2)), "idle": [{"idle_ms": 2, "p50_ms": 1}] * 33},
     "at most 32"),
    ([], "not a JSON object"),
    ({"tool": "other"}, "not a servewell"),
    ({"tool": "servewell curve", "points": []}, "no measured points"),
    ({"tool": "servewell curve", "points": ladder((1, float("nan"), 1, 2))}, "not a finite number"),
    ({"tool": "servewell curve", "points": ladder((1, -5, 1, 2))}, "outside"),
    ({"tool": "servewell curve", "points": ladder((1, 5, 3, 2))}, "p99 is below p50"),
    ({"tool": "servewell curve", "points": ladder((0, 5, 1, 2))}, "concurrency"),
    ({"tool": "servewell curve", "points": [{"concurrency": 1, "throughput_rps": "9", "p50_ms": 1, "p99_ms": 2}]},
     "not a finite number"),
    ({"tool": "servewell curve", "points": ladder(*[(i + 1, 5, 1, 2) for i in range(MAX_POINTS + 1)])},
     "points"),
    ({"tool": "servewell curve", "settings": {"policy": "fastest"}, "points": ladder((1, 5, 1, 2))}, "policy"),
    ({"tool": "servewell curve", "settings": {"max_batch_size": 10**9}, "points": ladder((1, 5, 1, 2))},
     "max_batch_size"),
    ({"tool": "servewell curve", "settings": {"nice": 20}, "points": ladder((1, 5, 1, 2))}, "settings.nice"),
    ({"tool": "servewell curve", "settings": {"nice": -1}, "points": ladder((1, 5, 1, 2))}, "settings.nice"),
    ({"tool": "servewell curve", "client_cpu_s_per_request": 2.0, "points": ladder((1, 5, 1, 2))},
     "client_cpu_s_per_request"),
    ({"tool": "servewell curve", "client_cpu_s_per_request": "x" * 10_000, "points": ladder((1, 5, 1, 2))},
     "client_cpu_s_per_request: 'xxxx"),
    ({"tool": "servewell curve", "points": [{"concurrency": 1, "throughput_rps": 5, "p50_ms": 1, "p99_ms": 2,
                                             "server_cpu_ms_per_request": -1}]}, "server_cpu_ms_per_request"),
    ({"tool": "servewell tune", "candidates": "all"}, "not a list"),
    ({"tool": "servewell tune", "candidates": []}, "no candidate"),
])
def test_hostile_curve_files_are_refused_by_name(tmp_path, doc, problem):
    with pytest.raises(ValueError, match=problem) as refused:
        read_curves(write(tmp_path, doc))
    assert len(str(refused.value)) < 300  # what the file says is not echoed whole


def test_oversized_and_non_json_files_are_refused(tmp_path):
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (MAX_CURVE_BYTES + 1))
    with pytest.raises(ValueError, match="bytes"):
        read_curves(big)
    junk = tmp_path / "junk.json"
    junk.write_bytes(b"\xff\xfe{")
    with pytest.raises(ValueError, match="not JSON"):
        read_curves(junk)
