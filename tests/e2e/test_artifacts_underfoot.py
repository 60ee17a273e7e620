"""Weights overwritten in place while they serve: `cp new.safetensors model.safetensors` keeps the
inode and rewrites it, under a worker that memory-mapped it. The worker serves from the server's
own snapshot, so this costs nothing: every request gets 200 from the version that was loaded, and
the new file serves after a load."""

from __future__ import annotations

import asyncio
import os
import shutil
import textwrap

import httpx
import torch
import yaml
from safetensors.torch import save_file

from faults import closed_loop, tally

MEAN_OF_WEIGHTS = textwrap.dedent('''
    import torch
    from torch import nn


    class MeanOfWeights(nn.Module):
        """y = x * mean(w): every batch reads all 64 MB of w, which stays memory-mapped (fp32 served
        as stored), so a file rewritten under it would show at once."""

        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4096, 4096))

        def forward(self, x):
            return x * self.w.mean()


    def build():
        return MeanOfWeights()
''')


def weights(path, value: float) -> None:
    save_file({"w": torch.full((4096, 4096), value)}, str(path))


def test_overwriting_served_weights_in_place_under_load_fails_no_request(tmp_path, start_server):
    repo = tmp_path / "repo"
    model = repo / "mean"
    model.mkdir(parents=True)
    (model / "mean_factory.py").write_text(MEAN_OF_WEIGHTS)
    (model / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "pytorch", "artifact": "model.safetensors", "pytorch": {"factory": "mean_factory:build"},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}], "max_batch_size": 4,
    }))
    served = model / "model.safetensors"
    weights(served, 1.0)
    weights(tmp_path / "twos.safetensors", 2.0)
    weights(tmp_path / "threes.safetensors", 3.0)
    server = start_server(["--model-repository", str(repo), "--admin-token", "t"])
    server.wait_ready()
    inode = os.stat(served).st_ino

    async def main():
        load = asyncio.create_task(closed_loop(server.url, "mean", 8.0, users=6))
        for new in ("twos", "threes", "twos"):
            await asyncio.sleep(2.0)
            # What `cp new.safetensors model.safetensors` does: truncate and rewrite the same inode.
            await asyncio.to_thread(shutil.copyfile, tmp_path / f"{new}.safetensors", served)
        return await load

    answers = asyncio.run(main())
    assert os.stat(served).st_ino == inode  # the file was rewritten in place, not replaced
    counts = tally(answers)
    assert set(counts) == {"200"}, counts  # before: SIGBUS, 503 worker_lost until the next version loaded
    assert {a.value for a in answers} == {1.0}  # every answer from the version that was loaded
    health = httpx.get(server.url + "/healthz").json()["models"]["mean"]
    assert health["restarts"] == 0, health
    reload = httpx.post(server.url + "/v2/repository/models/mean/load", headers={"Authorization": "Bearer t"},
                        timeout=120)
    assert reload.status_code == 200, reload.text
    r = httpx.post(server.url + "/v2/models/mean/infer",
                   json={"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]})
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2.0]  # the new file, after a load
