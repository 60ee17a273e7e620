"""What `servewell models` reports: problems by field, affinity on this machine, the memory budget, settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from servewell.config.runtimes import runtime_descriptor
from servewell.engine.memory_budget import WORKING_SET_FACTOR
from servewell.repository_report import render, report_repository

MiB = 1 << 20


def onnx_model(root: Path, name: str, size_bytes: int = 1000, **changes: Any) -> None:
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "model.onnx").write_bytes(b"\0" * size_bytes)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "onnx", "artifact": "model.onnx",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}], **changes,
    }))


def need(size_bytes: int, instances: int = 1) -> int:
    """What engine.memory_budget estimates for an onnx file of `size_bytes`."""
    return (int(size_bytes * WORKING_SET_FACTOR) + runtime_descriptor("onnx").base_bytes) * instances


def test_a_valid_model_is_ok_with_its_effective_settings(tmp_path: Path) -> None:
    onnx_model(tmp_path, "tiny", batching={"policy": "window", "max_wait_ms": 5})
    (report,) = report_repository(tmp_path, 1 << 40, {0, 1}, check_graphs=False)
    assert report.status == "ok" and not report.problems
    assert report.settings[0].startswith("version 1, onnx model.onnx, 1 instance x 1 thread on cpu, max_batch_size 16")
    assert report.settings[1] == "tensors: x FP32[4] -> y FP32[3]"
    assert report.settings[2] == 'settings: batching.policy="window", batching.max_wait_ms=5.0'


def test_models_over_the_budget_are_refused_in_load_order(tmp_path: Path) -> None:
    onnx_model(tmp_path, "a_first", size_bytes=8 * MiB)
    onnx_model(tmp_path, "b_second", size_bytes=8 * MiB)
    onnx_model(tmp_path, "c_small", size_bytes=1000)
    budget = need(8 * MiB) + need(1000)  # room for the first and the small one, not for both big ones
    first, second, small = report_repository(tmp_path, budget, {0}, check_graphs=False)
    assert first.status == "ok" and small.status == "ok"
    assert second.status == "REFUSED" and second.refused is not None
    assert second.refused.startswith(f"would be refused: needs {need(8 * MiB) / MiB:,.0f} MiB, budget "
                                     f"{budget / MiB:,.0f} MiB")
    assert "file size of model.onnx" in second.refused


def test_every_validation_problem_is_listed_with_file_and_field(tmp_path: Path) -> None:
    onnx_model(tmp_path, "old", spin_wait=True, max_batch_size="lots")
    (report,) = report_repository(tmp_path, 1 << 40, {0}, check_graphs=False)
    assert report.status == "INVALID"
    assert report.problems == ["field 'spin_wait': moved to 'onnx.spin_wait'",
                               "field 'max_batch_size': Input should be a valid integer, unable to parse string as an "
                               "integer"]
    text = render(tmp_path, 1 << 40, "test", [report])
    assert f"old                  INVALID  {tmp_path / 'old' / 'model.yaml'}:" in text
    lines = text.splitlines()
    assert lines[2] == " " * 34 + "field 'spin_wait': moved to 'onnx.spin_wait'"  # under the file, indented


def test_cpus_this_machine_lacks_are_a_problem(tmp_path: Path) -> None:
    onnx_model(tmp_path, "pinned", instances=2, cpu_affinity=[[0], [3]])
    (report,) = report_repository(tmp_path, 1 << 40, {0, 1}, check_graphs=False)
    assert report.problems == ["field 'cpu_affinity': instance 1 names CPU(s) [3], which this machine does not offer "
                               "(available: 0-1)"]


def test_pytorch_factories_can_be_left_unchecked(tmp_path: Path) -> None:
    directory = tmp_path / "pt"
    directory.mkdir()
    (directory / "model.pt").write_bytes(b"\0" * 100)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "pytorch", "artifact": "model.pt", "pytorch": {"factory": "absent:build"},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}],
    }))
    (report,) = report_repository(tmp_path, 1 << 40, {0}, check_factories=False)
    assert report.status == "ok" and report.notes == ["factory not checked (--no-factory-check)"]


def test_a_pipeline_is_checked_against_its_step_models(tmp_path: Path) -> None:
    onnx_model(tmp_path, "mlp")
    for name, source in (("good", "x"), ("wrong", "z")):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "model.yaml").write_text(yaml.safe_dump({
            "kind": "pipeline", "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]},
                                           {"name": "z", "datatype": "INT64", "shape": [4]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}],
            "pipeline": {"steps": [{"name": "one", "model": "mlp", "inputs": {"x": source}}],
                         "outputs": {"y": "one.y"}}}))
    good, mlp, wrong = report_repository(tmp_path, 1 << 40, {0}, check_graphs=False)
    assert good.status == "ok" and mlp.status == "ok"
    assert good.settings[0] == "version 1, pipeline of 1 steps: one (mlp); max_batch_size 16"
    assert wrong.status == "INVALID"
    assert wrong.problems == [
        "pipeline: step 'one' (model 'mlp') input 'x' is FP32 [4], but its source 'z' is INT64 [4]"]


def test_the_versions_a_traffic_split_names_are_checked_as_the_server_reads_them(tmp_path: Path) -> None:
    onnx_model(tmp_path, "split", traffic={"1": 90, "2": 5, "3": 5}, rollout={"shadow": {"version": "4"}})
    onnx_model(tmp_path / "split" / "versions", "2")  # fine: same tensors (name and version from the path)
    onnx_model(tmp_path / "split" / "versions", "3",
               inputs=[{"name": "x", "datatype": "FP32", "shape": [5]}])  # other tensors
    (report,) = report_repository(tmp_path, 1 << 40, {0}, check_graphs=False)
    assert len(report.problems) == 2, report.problems
    assert report.problems[0].startswith("version '3': its inputs") and "differ from stable version '1'" in \
        report.problems[0]
    assert report.problems[1].startswith("version '4': ") and "missing" in report.problems[1]


def test_more_cpu_worker_threads_than_usable_cpus_is_a_warning_for_the_whole_repository(tmp_path: Path) -> None:
    from servewell.repository_report import cpu_warning

    onnx_model(tmp_path, "a", instances=2, threads=2)
    onnx_model(tmp_path, "b", threads=1)
    onnx_model(tmp_path, "gpu", device="cuda", threads=8)  # its threads feed a GPU: not counted
    onnx_model(tmp_path, "broken", threads=64, max_batch_size="lots")  # would not serve: not counted
    reports = report_repository(tmp_path, 1 << 40, {0, 1}, check_graphs=False)
    assert [r.cpu_threads for r in reports if r.status == "ok"] == [4, 1, 0]
    assert cpu_warning(reports, 5, "x") is None
    warning = cpu_warning(reports, 3, "4 in its affinity mask, CPU limit 2.5 from its control group")
    assert warning is not None
    assert warning.startswith("warning: the CPU models' worker threads add up to 5 (instances x threads), more than "
                              "the 3 CPU(s) this server may use (4 in its affinity mask, CPU limit 2.5")
    text = render(tmp_path, 1 << 40, "test", reports, [warning])
    assert text.splitlines()[1] == "  " + warning  # right under the header, before the models


def test_lazy_mode_loads_on_demand_what_the_eager_budget_refuses(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        onnx_model(tmp_path, name, size_bytes=8 * MiB)
    budget = need(8 * MiB) + need(1000)  # room for one of them at a time
    eager = report_repository(tmp_path, budget, {0}, check_graphs=False)
    assert [r.status for r in eager] == ["ok", "REFUSED", "REFUSED"]
    lazy = report_repository(tmp_path, budget, {0}, check_graphs=False, mode="lazy")
    assert [r.status for r in lazy] == ["ok", "ok", "ok"]  # each loads on its request, evicting the idle one
    assert all(r.on_demand and r.refused is None for r in lazy)
    assert lazy[0].settings[0].endswith(f"memory ~{need(8 * MiB) / MiB:,.0f} MiB (file size of model.onnx), "
                                        "loads on demand")
    text = render(tmp_path, budget, "test", lazy, mode="lazy")
    assert text.splitlines()[1] == ("  lazy mode: 0 pinned model(s) load at start (0 MiB), 3 load on their first "
                                    "request, evicting idle models to make room")


def test_lazy_mode_refuses_only_a_model_that_could_never_fit(tmp_path: Path) -> None:
    onnx_model(tmp_path, "a_small", size_bytes=1000)
    onnx_model(tmp_path, "b_huge", size_bytes=8 * MiB, instances=4)
    onnx_model(tmp_path, "c_beside_the_pinned", size_bytes=8 * MiB)
    onnx_model(tmp_path, "d_pinned", size_bytes=8 * MiB, pinned=True)  # loads at start, wherever it stands
    budget = need(8 * MiB) + need(1000)
    small, huge, beside, pinned = report_repository(tmp_path, budget, {0}, check_graphs=False, mode="lazy")
    assert (small.status, pinned.status) == ("ok", "ok")
    assert small.on_demand and not pinned.on_demand
    assert huge.status == "REFUSED" and huge.refused is not None
    assert huge.refused.startswith(f"would be refused on every request: needs {need(8 * MiB, 4) / MiB:,.0f} MiB, more "
                                   f"than the whole budget of {budget / MiB:,.0f} MiB")
    assert beside.status == "REFUSED" and beside.refused is not None  # fits the budget, not beside the pinned one
    assert "the pinned models (never evicted) leave" in beside.refused
    text = render(tmp_path, budget, "test", [small, huge, beside, pinned], mode="lazy")
    assert text.splitlines()[1].startswith("  lazy mode: 1 pinned model(s) load at start "
                                           f"({need(8 * MiB) / MiB:,.0f} MiB), 1 load on their first request")
