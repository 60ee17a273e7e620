"""`servewell bench` and `servewell tune` as a user runs them, against the real server.

bench: against the running digits server (HTTP JSON closed loop, HTTP binary open loop with
images, gRPC when this server has its listener), and against a model directory, which it
serves itself. tune: the digits model with a small budget, a valid model.yaml block, and a
rerun that resumes from the state file. Speed is not asserted here (bench/ measures it);
these tests check that the numbers are consistent and the files right.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from model_dirs import factory_model, slow_model
from servewell.config.model import ModelConfig
from servewell.perf.local_server import free_port
from servewell_plan.curve import read_curves
from waiting import eventually

EXAMPLE_IMAGE = Path(__file__).parents[2] / "src/servewell/examples/images/digit-3-200px.jpg"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def servewell(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    """Run the servewell command (stderr is not a terminal here: progress must stay one line per step)."""
    return subprocess.run([sys.executable, "-m", "servewell", *args], capture_output=True, text=True,
                          timeout=timeout_s, check=False)


def successes(url: str) -> float:
    """The server's own count of successful digits requests."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "servewell_requests_total" and s.labels.get("model") == "digits"
               and s.labels.get("outcome") == "success")


def check_steps(doc: dict, levels: list[float]) -> None:
    """Counts add up and percentiles are ordered in every step."""
    steps = doc["steps"]
    assert [s["level"] for s in steps] == levels
    for s in steps:
        assert s["ok"] > 0 and s["throughput_rps"] > 0
        assert s["ok"] + s["errors"] == s["answered"] == sum(s["status_counts"].values())
        assert s["arrived"] == s["answered"] + s["unfinished"] + s["client_saturated"]
        assert s["answered"] <= s["sent"]
        assert s["p50_ms"] <= s["p90_ms"] <= s["p95_ms"] <= s["p99_ms"] <= s["max_ms"]
        assert s["mean_ms"] <= s["max_ms"]


def check_files(out: Path, doc: dict) -> None:
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["ok"]) for r in rows] == [s["ok"] for s in doc["steps"]]
    assert [float(r["p99_ms"]) for r in rows] == [s["p99_ms"] for s in doc["steps"]]
    assert (out / "latency_vs_throughput.png").read_bytes()[:8] == PNG_MAGIC


def test_bench_closed_loop_over_http_json(digits_server, tmp_path):
    before = successes(digits_server.url)
    done = servewell("bench", digits_server.url, "--concurrency", "1,4", "--duration-s", "2", "--warmup-s", "0.5",
                     "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    doc = json.loads((tmp_path / "results.json").read_text())
    check_steps(doc, [1.0, 4.0])
    check_files(tmp_path, doc)
    assert all(s["status_counts"] == {"200": s["ok"]} for s in doc["steps"])
    assert all(s["server_cpu_ms_per_request"] is None for s in doc["steps"])  # a server bench did not start
    assert doc["model"]["name"] == "digits" and doc["inputs"]["source"] == "generated"
    assert doc["inputs"]["tensors"] == [{"name": "input", "datatype": "FP32", "shape": [1, 1, 8, 8]}]
    # The server answered at least what the window counted, and no more than was sent.
    served = successes(digits_server.url) - before
    assert sum(s["ok"] for s in doc["steps"]) <= served <= sum(s["sent"] for s in doc["steps"])
    # The table on stdout, one progress line per step on stderr (not a terminal: no bars).
    assert "p99 ms" in done.stdout and done.stdout.count("\n") >= 4
    assert "\r" not in done.stderr and done.stderr.count("step ") == 2


def test_bench_open_loop_of_images_over_binary_http(digits_server, tmp_path):
    done = servewell("bench", digits_server.url, "--rate", "20,40", "--duration-s", "1.5", "--warmup-s", "0.3",
                     "--format", "binary", "--image", str(EXAMPLE_IMAGE), "--requests", "200", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    doc = json.loads((tmp_path / "results.json").read_text())
    check_steps(doc, [20.0, 40.0])
    check_files(tmp_path, doc)
    assert doc["target"]["format"] == "binary" and doc["inputs"]["source"] == "images"
    assert doc["inputs"]["tensors"] == [{"name": "input", "datatype": "BYTES", "shape": [1]}]
    assert all(s["mode"] == "open" and s["sent"] <= 200 for s in doc["steps"])


def test_bench_reports_errors_by_status_instead_of_failing(digits_server, tmp_path):
    """Shapes the model refuses: every request is a 422, counted, and the exit code says none succeeded."""
    done = servewell("bench", digits_server.url, "--concurrency", "2", "--duration-s", "1", "--warmup-s", "0",
                     "--batch-size", "100", "--out", str(tmp_path), "--no-plot")
    assert done.returncode == 1 and "no request succeeded" in done.stderr
    (step,) = json.loads((tmp_path / "results.json").read_text())["steps"]
    assert step["ok"] == 0 and step["errors"] == step["answered"] > 0
    assert set(step["status_counts"]) <= {"413", "422"} and step["p99_ms"] is None


def test_bench_of_a_model_directory_serves_it_for_the_run(servewell_cache, digits_server, tmp_path):
    model_dir = servewell_cache / "models" / "digits"
    assert (model_dir / "model.yaml").is_file()
    done = servewell("bench", str(model_dir), "--concurrency", "2", "--duration-s", "1.5", "--warmup-s", "0.3",
                     "--idle-ms", "20", "--out", str(tmp_path), "--no-plot")
    assert done.returncode == 0, done.stderr + (tmp_path / "servewell.log").read_text()[-2000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["local_server"] is True
    check_steps(doc, [2.0])  # the idle step is not a step of the ladder
    # the CPUs this run could use (affinity, a container's CPU limit), not the node's count
    from servewell.cpu_limit import cpu_quota, usable_cpus

    assert doc["machine"] == {"cpus": usable_cpus(), "machine_cpus": os.cpu_count(), "cpu_limit": cpu_quota()}
    # the server it started ran in this machine's /proc: its CPU per request, for `servewell plan`
    assert 0 < doc["steps"][0]["server_cpu_ms_per_request"] < 1000
    # one client waiting 20 ms after each answer: what a request that finds the server idle costs
    (idle,) = doc["idle"]
    assert doc["settings"]["levels"] == [2.0] and doc["settings"]["idle_ms"] == [20.0]
    assert idle["idle_ms"] == 20 and 0 < idle["p50_ms"] <= idle["p99_ms"] and 0 < idle["server_cpu_ms_per_request"]
    assert "idle 20 ms between requests" in done.stdout
    assert read_curves(tmp_path / "results.json")[0].idle_points[0].idle_s == pytest.approx(0.02)
    url = doc["target"]["url"]
    with pytest.raises(httpx.ConnectError):  # the server it started is gone
        httpx.get(url + "/v2/health/live", timeout=2)
    assert not (tmp_path / "latency_vs_throughput.png").exists()


def test_bench_over_grpc(digits_server, tmp_path):
    done = servewell("bench", f"grpc://{digits_server.grpc_url}", "--concurrency", "1,4", "--duration-s", "1.5",
                     "--warmup-s", "0.3", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    doc = json.loads((tmp_path / "results.json").read_text())
    check_steps(doc, [1.0, 4.0])
    assert doc["target"]["protocol"] == "grpc"
    assert all(s["status_counts"] == {"OK": s["ok"]} for s in doc["steps"])


def _tree_digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_tune_recommends_a_valid_model_yaml_block_and_resumes(servewell_cache, digits_server, tmp_path):
    model_dir = servewell_cache / "models" / "digits"
    before = _tree_digest(model_dir)
    out = tmp_path / "tune"
    done = servewell("tune", str(model_dir), "--slo-p99-ms", "250", "--budget-s", "35", "--step-s", "1",
                     "--warmup-s", "0.3", "--max-concurrency", "32", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert _tree_digest(model_dir) == before  # the user's model directory is never written
    summary = json.loads((out / "tune-results.json").read_text())
    measured = [c for c in summary["candidates"] if c["runs"]]
    assert len(measured) >= 3  # the baseline and at least two batch sizes, even on a slow machine
    # every step has the tuned server's CPU per request, which `servewell plan` fits
    assert all(0 < point["server_cpu_ms_per_request"] < 1000 for c in measured for run in c["runs"] for point in run)
    assert summary["candidates"][-1]["setting"]  # every row names its setting
    rec = summary["recommendation"]
    best = next(c for c in summary["candidates"] if c["key"] == rec["key"])
    assert rec["score_rps"] == max(c["score_rps"] for c in summary["candidates"]) > 0
    assert best["quoted_point"]["p99_ms"] <= 250 and best["quoted_point"]["errors"] == 0
    # The block pasted into the user's model.yaml gives a valid config with the recommended settings.
    original = yaml.safe_load((model_dir / "model.yaml").read_text())
    pasted = {**copy.deepcopy(original), **yaml.safe_load(rec["model_yaml_block"])}
    config = ModelConfig.model_validate(pasted)
    chosen = best["candidate"]
    assert (config.max_batch_size, config.batching.policy, config.instances, config.threads) == \
        (chosen["max_batch_size"], chosen["policy"], chosen["instances"], chosen["threads"])
    assert ModelConfig.model_validate(yaml.safe_load((out / "recommended-model.yaml").read_text())) == config
    assert "recommended:" in done.stdout and "max_batch_size:" in done.stdout
    assert (out / "tune.png").read_bytes()[:8] == PNG_MAGIC
    assert "\r" not in done.stderr  # not a terminal: one line per measurement, no bars

    # A rerun with a tiny budget starts no server: it resumes every measurement from the state file.
    again = servewell("tune", str(model_dir), "--slo-p99-ms", "250", "--budget-s", "3", "--step-s", "1",
                      "--warmup-s", "0.3", "--max-concurrency", "32", "--out", str(out))
    assert again.returncode == 0, again.stdout + again.stderr
    resumed = json.loads((out / "tune-results.json").read_text())
    assert resumed["resumed"] == len(summary["candidates"]) and resumed["measured_this_run"] == 0
    assert resumed["recommendation"]["key"] == rec["key"]
    assert f"resuming: {len(summary['candidates'])} setting(s)" in again.stderr


def test_bench_and_tune_take_a_model_yaml_without_a_name(tmp_path):
    """The README's model.yaml has no `name:`; `serve` names the model after its directory, and so
    must bench and tune (both refused it: "is not a model.yaml with a 'name'")."""
    model_dir = tmp_path / "echo_model"
    slow_model(tmp_path, "echo_model", 0, max_batch_size=4)
    assert "name" not in yaml.safe_load((model_dir / "model.yaml").read_text())
    before = _tree_digest(model_dir)
    out = tmp_path / "bench"
    done = servewell("bench", str(model_dir), "--concurrency", "2", "--duration-s", "1", "--warmup-s", "0.2",
                     "--out", str(out), "--no-plot")
    assert done.returncode == 0, done.stderr
    doc = json.loads((out / "results.json").read_text())
    assert doc["model"]["name"] == "echo_model" and doc["steps"][0]["ok"] > 0

    out = tmp_path / "tune"
    done = servewell("tune", str(model_dir), "--slo-p99-ms", "500", "--budget-s", "30", "--step-s", "0.5",
                     "--warmup-s", "0.1", "--max-concurrency", "4", "--batch-sizes", "1,4", "--waits-ms", "2",
                     "--no-instances", "--repeats", "1", "--no-plot", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "tune-results.json").read_text())
    assert summary["model"] == "echo_model" and summary["recommendation"] is not None
    recommended = yaml.safe_load((out / "recommended-model.yaml").read_text())
    assert "name" not in recommended  # the user's file, tuned: nothing added that they did not write
    ModelConfig.model_validate({"name": "echo_model", **recommended})
    assert _tree_digest(model_dir) == before


def servewell_alive(pid: int) -> bool:
    """Whether `pid` is a live (not zombie) servewell process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z" and b"servewell" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return False


def test_bench_stopped_by_sigterm_stops_the_server_it_started_and_removes_its_directory(
        servewell_cache, digits_server, tmp_path):
    """SIGTERM mid-run left the server bench started running (on its port) and its temporary
    directory behind; `--port` and `--load-timeout-s` go to that server."""
    model_dir = servewell_cache / "models" / "digits"
    temp = tmp_path / "tmp"
    temp.mkdir()
    port = free_port()
    log = tmp_path / "bench.log"
    with open(log, "wb") as out:
        bench = subprocess.Popen([sys.executable, "-m", "servewell", "bench", str(model_dir), "--concurrency", "2",
                                  "--duration-s", "300", "--warmup-s", "0.2", "--port", str(port),
                                  "--load-timeout-s", "120"],
                                 stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": str(temp)})
    server_pid = None

    def said() -> str:
        return log.read_text(errors="replace")

    try:
        ready = eventually(lambda: re.search(r"servewell ready in \S+ s \(pid (\d+)\)", said()), 180,
                           lambda: f"bench never said its server was ready:\n{said()[-3000:]}")
        server_pid = int(ready.group(1))
        eventually(lambda: "benchmarking model 'digits'" in said(), 60, lambda: said()[-3000:])
        # mid-run: the server serves on the port asked for, and its directory exists (what is checked below)
        assert httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=10).status_code == 200
        assert servewell_alive(server_pid)
        assert [p.name for p in temp.iterdir() if p.name.startswith("servewell-bench-")], list(temp.iterdir())
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(90) == 128 + signal.SIGTERM, said()[-3000:]
        assert "servewell bench: stopped by SIGTERM" in said()
        assert not servewell_alive(server_pid)
        assert list(temp.iterdir()) == []
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/v2/health/live", timeout=5)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(30)
        if server_pid is not None and servewell_alive(server_pid):  # what the bug left: stop it here
            os.kill(server_pid, signal.SIGTERM)
            eventually(lambda: not servewell_alive(server_pid), 60, "the left server did not stop")


SLOW_LOAD = textwrap.dedent('''
    import time

    import torch


    def build():
        time.sleep(6)  # a model slow to build: longer than the 1 s load timeout given below
        return torch.nn.Linear(1, 1)
''')


def test_bench_gives_the_server_it_starts_the_load_timeout_asked_for(tmp_path):
    factory_model(tmp_path, "slow_load", SLOW_LOAD)
    done = servewell("bench", str(tmp_path / "slow_load"), "--concurrency", "1", "--duration-s", "1",
                     "--load-timeout-s", "1", "--out", str(tmp_path / "out"), "--no-plot")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "load did not finish within 1 s" in done.stderr, done.stderr
    assert "may need longer: --load-timeout-s" in done.stderr
