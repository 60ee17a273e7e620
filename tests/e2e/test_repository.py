"""A repository built in the test: one model per runtime, plus broken ones that must not stop the rest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
import torch
import yaml
from safetensors.torch import save_file

from error_bodies import error_code, error_of
from waiting import eventually

FACTORY_SOURCE = textwrap.dedent('''
    import torch
    from torch import nn


    class Tiny(nn.Module):
        def __init__(self, hidden: int = 8):
            super().__init__()
            self.fc1 = nn.Linear(4, hidden)
            self.fc2 = nn.Linear(hidden, 3)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))


    def build(hidden: int = 8):
        return Tiny(hidden)
''')


# A factory that reads a file beside it which model.yaml does not list in extra_files.
READS_AN_UNLISTED_FILE = FACTORY_SOURCE.replace("def build(hidden: int = 8):", """def build():
    import json
    import pathlib
    hidden = json.loads((pathlib.Path(__file__).parent / "hidden.json").read_text())["hidden"]""")


def tiny_module() -> torch.nn.Module:
    namespace: dict = {}
    exec(FACTORY_SOURCE, namespace)  # the same source the server's factory imports
    torch.manual_seed(0)
    return namespace["build"](hidden=8).eval()


def write_config(directory: Path, **fields) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    base = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [3]}],
        "max_batch_size": 8,
    }
    (directory / "model.yaml").write_text(yaml.safe_dump({**base, **fields}))


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    root = tmp_path_factory.mktemp("repo")
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    module = tiny_module()
    example = torch.zeros(2, 4)

    onnx_dir = root / "tiny_onnx"
    write_config(onnx_dir, runtime="onnx", artifact="model.onnx", threads=1)
    torch.onnx.export(module, (example,), str(onnx_dir / "model.onnx"), dynamo=False, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})

    # Two instances, each pinned to its own CPU (the same one where the machine has only one).
    cpus = sorted(os.sched_getaffinity(0))
    pinned_dir = root / "pinned_onnx"
    write_config(pinned_dir, runtime="onnx", artifact="model.onnx", threads=1, instances=2,
                 cpu_affinity=[[cpus[0]], [cpus[-1]]])
    (pinned_dir / "model.onnx").symlink_to(onnx_dir / "model.onnx")

    # Weights in an external-data file in a subfolder, beside a big file and a linked data folder
    # the model does not use: the snapshot copies the three files the model uses, nothing else.
    external_dir = root / "external_onnx"
    write_config(external_dir, runtime="onnx", artifact="model.onnx", threads=1)
    (external_dir / "weights").mkdir()
    onnx.save_model(onnx.load(str(onnx_dir / "model.onnx")), str(external_dir / "model.onnx"),
                    save_as_external_data=True, location="weights/tiny.bin", size_threshold=0)
    (external_dir / "dataset.bin").write_bytes(bytes(4 << 20))
    (elsewhere / "data").mkdir()
    (elsewhere / "data" / "big.bin").write_bytes(bytes(4 << 20))
    (external_dir / "data").symlink_to(elsewhere / "data")

    # A model directory that is a symlink to a folder outside the repository (served, with a warning).
    write_config(elsewhere / "linked", runtime="onnx", artifact="model.onnx", threads=1)
    shutil.copyfile(onnx_dir / "model.onnx", elsewhere / "linked" / "model.onnx")
    (root / "outside_link").symlink_to(elsewhere / "linked")

    ts_dir = root / "tiny_ts"
    write_config(ts_dir, runtime="torchscript", artifact="model.pt", torchscript={"freeze": True})
    torch.jit.trace(module, example).save(str(ts_dir / "model.pt"))

    pt_dir = root / "tiny_pt"
    write_config(pt_dir, runtime="pytorch", artifact="model.safetensors",
                 pytorch={"factory": "tiny_factory:build", "factory_kwargs": {"hidden": 8}})
    (pt_dir / "tiny_factory.py").write_text(FACTORY_SOURCE)
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(pt_dir / "model.safetensors"))

    state_dir = root / "tiny_pt_statedict"
    write_config(state_dir, runtime="pytorch", artifact="weights.pt", pytorch={"factory": "tiny_factory:build"})
    (state_dir / "tiny_factory.py").write_text(FACTORY_SOURCE)
    torch.save(module.state_dict(), state_dir / "weights.pt")

    pickled_dir = root / "pickled"
    write_config(pickled_dir, runtime="pytorch", artifact="model.pt", pytorch={"factory": "tiny_factory:build"})
    (pickled_dir / "tiny_factory.py").write_text(FACTORY_SOURCE)
    whole = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    torch.save(whole, pickled_dir / "model.pt")  # a whole pickled module: refused by default

    write_config(root / "broken_yaml", runtime="onnx", artifact="model.onnx", max_batch_size="lots")
    (root / "broken_yaml" / "model.onnx").write_bytes(b"")

    write_config(root / "corrupt_onnx", runtime="onnx", artifact="model.onnx")
    (root / "corrupt_onnx" / "model.onnx").write_bytes(b"this is not an onnx file")
    return root, module


GOOD = ("tiny_onnx", "pinned_onnx", "tiny_ts", "tiny_pt", "tiny_pt_statedict", "external_onnx", "outside_link")
FAILING = ("corrupt_onnx", "pickled")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def server(repository, cache_dir, start_module_server):
    root, _ = repository
    srv = start_module_server(["--model-repository", str(root), "--cache-dir", str(cache_dir)])
    srv.wait_live()

    def settled() -> bool:
        srv.check_running()
        states = {m["name"]: m["state"] for m in httpx.post(srv.url + "/v2/repository/index", timeout=10).json()}
        return all(states.get(n) == "READY" for n in GOOD) and all(states.get(n) == "UNAVAILABLE" for n in FAILING)

    eventually(settled, 180, lambda: f"models not settled:\n{srv.log()[-3000:]}")
    return srv


@pytest.mark.parametrize("name", GOOD)
def test_each_runtime_serves_the_same_numbers_as_torch(server, repository, name):
    _, module = repository
    x = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)
    expected = module(torch.from_numpy(x)).detach().numpy()
    r = httpx.post(f"{server.url}/v2/models/{name}/infer", json={
        "inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32", "data": x.ravel().tolist()}],
    })
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["name"] == "y" and out["shape"] == [3, 3] and out["datatype"] == "FP32"
    np.testing.assert_allclose(np.array(out["data"]).reshape(3, 3), expected, rtol=1e-5, atol=1e-5)
    meta = httpx.get(f"{server.url}/v2/models/{name}").json()
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]


def test_broken_models_are_reported_with_file_field_and_reason(server, repository):
    root, _ = repository
    index = {m["name"]: m for m in httpx.post(server.url + "/v2/repository/index").json()}
    broken = index["broken_yaml"]
    assert broken["state"] == "UNAVAILABLE"
    assert "broken_yaml/model.yaml" in broken["reason"] and "max_batch_size" in broken["reason"]
    assert "unsafe_allow_pickle" in index["pickled"]["reason"]
    # The worker loaded the server's snapshot of the directory; the reason names the user's file.
    corrupt = index["corrupt_onnx"]["reason"]
    assert str(root / "corrupt_onnx" / "model.onnx") in corrupt and "snapshots" not in corrupt, corrupt


def test_requests_to_a_model_that_is_not_ready_get_503_with_retry_after(server):
    r = httpx.post(server.url + "/v2/models/corrupt_onnx/infer", json={
        "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0, 0, 0, 0]}]})
    assert r.status_code == 503 and error_code(r) == "model_not_ready"
    assert int(r.headers["retry-after"]) >= 1
    ready = httpx.get(server.url + "/v2/models/corrupt_onnx/ready")
    assert ready.status_code == 503
    # Readiness tells the truth per model: this one failed, and /healthz says the server is degraded...
    health = httpx.get(server.url + "/healthz").json()
    assert health["models"]["corrupt_onnx"]["state"] == "failed" and health["status"] == "degraded"
    assert health["models"]["tiny_onnx"]["state"] == "ready"
    # ...while the server stays in rotation (readiness policy `any`) and the healthy models keep serving.
    assert httpx.get(server.url + "/v2/health/ready").status_code == 200
    assert httpx.get(server.url + "/v2/models/tiny_onnx/ready").status_code == 200


def test_each_instance_runs_on_the_cpus_its_affinity_entry_names(server):
    cpus = sorted(os.sched_getaffinity(0))
    instances = httpx.get(server.url + "/healthz").json()["models"]["pinned_onnx"]["instances"]
    assert [os.sched_getaffinity(i["pid"]) for i in instances] == [{cpus[0]}, {cpus[-1]}]


def test_predict_on_a_tensor_model_says_to_use_infer(server):
    r = httpx.post(server.url + "/predict", json={"image_base64": "aGVsbG8=", "model": "tiny_onnx"})
    assert r.status_code == 422 and "/v2/models/tiny_onnx/infer" in error_of(r)["message"]


def test_models_command_lists_the_repository_and_why_models_are_invalid(repository):
    root, _ = repository
    done = subprocess.run([sys.executable, "-m", "servewell", "models", "--model-repository", str(root)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1  # some model is invalid
    heads = {line.split()[0]: line for line in done.stdout.splitlines()[1:] if not line.startswith(" " * 4)}
    assert "INVALID" in heads["broken_yaml"] and "broken_yaml/model.yaml" in heads["broken_yaml"]
    assert "field 'max_batch_size'" in done.stdout
    assert heads["tiny_pt"].split()[1] == "ok" and "pytorch model.safetensors" in heads["tiny_pt"]


def test_profile_of_an_onnx_worker_is_onnxruntime_s_own_trace(server):
    import asyncio

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            capture = asyncio.create_task(c.post("/admin/models/tiny_onnx/profile", params={"seconds": 1}))
            await asyncio.sleep(0.3)
            for _ in range(3):
                r = await c.post("/v2/models/tiny_onnx/infer", json={
                    "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]})
                assert r.status_code == 200
            return await capture

    r = asyncio.run(main())
    assert r.status_code == 200, r.text
    events = r.json()
    assert isinstance(events, list) and any(e.get("cat") == "Node" for e in events)  # onnxruntime's format


def test_healthz_reasons_name_no_absolute_path(server, repository):
    """/healthz is open to anyone: load errors show paths relative to the repository (the full
    text stays in the log and the authenticated answers)."""
    root, _ = repository
    models = httpx.get(server.url + "/healthz").json()["models"]
    reasons = {name: model["reason"] or "" for name, model in models.items()}
    assert "broken_yaml/model.yaml" in reasons["broken_yaml"], reasons
    for name, reason in reasons.items():
        assert str(root) not in reason and str(root.resolve()) not in reason, (name, reason)
        assert "/.cache/" not in reason and " /" not in reason and "'/" not in reason, (name, reason)


def test_a_snapshot_holds_only_the_files_the_model_uses(server, cache_dir):
    # The ONNX graph names weights/tiny.bin; the 4 MB sibling and the linked 4 MB folder stay out.
    (snapshot,) = (cache_dir / "snapshots").glob("*-external_onnx-1-*")
    files = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    assert files == ["model.onnx", "model.yaml", "weights/tiny.bin"]


def test_a_model_directory_outside_the_repository_serves_with_a_warning(server):
    assert "model directory outside_link resolves to" in server.log()  # and it serves: see GOOD


def test_a_model_directory_outside_the_repository_is_refused_by_the_setting_and_a_left_out_file_is_named(
        repository, tmp_path, start_server):
    root, module = repository
    repo = tmp_path / "repo"
    shutil.copytree(root / "tiny_onnx", repo / "tiny_onnx")
    (repo / "outside_link").symlink_to((root / "outside_link").resolve())
    unlisted_dir = repo / "unlisted_file"
    write_config(unlisted_dir, runtime="pytorch", artifact="model.safetensors", pytorch={"factory": "reads:build"})
    (unlisted_dir / "reads.py").write_text(READS_AN_UNLISTED_FILE)
    (unlisted_dir / "hidden.json").write_text('{"hidden": 8}')
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(unlisted_dir / "model.safetensors"))
    srv = start_server(["--model-repository", str(repo), "--models-outside-repository", "refuse", "--admin-token", "t",
                        "--cache-dir", str(tmp_path / "cache"), "--load-timeout-s", "120", "--config-poll-s", "0.2"])
    srv.wait_live()

    def index() -> dict:
        srv.check_running()
        return {m["name"]: m for m in httpx.post(srv.url + "/v2/repository/index", timeout=10).json()}

    eventually(lambda: index()["tiny_onnx"]["state"] == "READY" and index()["unlisted_file"]["state"] == "UNAVAILABLE",
               180, lambda: f"models not settled:\n{srv.log()[-3000:]}")
    models = index()
    assert models["outside_link"]["state"] == "UNAVAILABLE", models
    assert "outside the model repository" in models["outside_link"]["reason"], models
    assert "models_outside_repository: refuse" in models["outside_link"]["reason"], models
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    assert httpx.post(srv.url + "/v2/models/tiny_onnx/infer", json=body).status_code == 200
    r = httpx.post(srv.url + "/v2/models/outside_link/infer", json=body)
    assert r.status_code == 503 and error_code(r) == "model_not_ready", r.text
    load = httpx.post(srv.url + "/v2/repository/models/outside_link/load", headers={"Authorization": "Bearer t"},
                      timeout=60)
    assert load.status_code >= 400 and "models_outside_repository: refuse" in load.text, load.text
    # The factory reads hidden.json, which model.yaml does not list: the reason names it and the fix.
    reason = models["unlisted_file"]["reason"]
    assert "hidden.json" in reason and "extra_files" in reason and "snapshots" not in reason, reason
    assert str(repo / "unlisted_file" / "hidden.json") in reason, reason
    # A served model's directory swapped for a symlink out of the repository: the change is refused.
    shutil.copytree(repo / "tiny_onnx", tmp_path / "swapped")
    write_config(tmp_path / "swapped", runtime="onnx", artifact="model.onnx", version="2")
    shutil.rmtree(repo / "tiny_onnx")
    (repo / "tiny_onnx").symlink_to(tmp_path / "swapped")
    eventually(lambda: "models_outside_repository: refuse" in "".join(
        line for line in srv.log().splitlines() if "model.yaml rejected" in line and "tiny_onnx" in line), 30,
        lambda: f"no rejection of the swapped model.yaml:\n{srv.log()[-3000:]}")
    assert index()["tiny_onnx"]["version"] == "1"
    assert httpx.post(srv.url + "/v2/models/tiny_onnx/infer", json=body).status_code == 200
