"""Profile captures (`POST /admin/models/{name}/profile`) while the models serve: one capture at a
time per model (a clear 409 for the second), at most two at once across models, the model keeps
answering during its capture, and the trace names the Python functions its time went to.

Before, entering torch's profiler imported torch._inductor on the worker's compute thread (4 to
10 s): the frontend declared the busy worker hung and killed it, and the capture answered 503.
"""

from __future__ import annotations

import asyncio
import textwrap
import time

import httpx
import pytest

from error_bodies import error_of
from model_dirs import factory_model, infer_body, onnx_linear_model, slow_model
from waiting import eventually_async

#: A model whose forward spends its time in a Python function of the model's own code.
THINKER = textwrap.dedent('''
    import time

    import torch
    from torch import nn


    def wait_for_the_disk(x):
        time.sleep(0.02)
        return x


    class Thinker(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return wait_for_the_disk(x) * self.scale


    def build():
        return Thinker()
''')


@pytest.fixture(scope="module")
def server(tmp_path_factory, start_module_server):
    root = tmp_path_factory.mktemp("profiling")
    factory_model(root, "thinker", THINKER, max_batch_size=4)
    slow_model(root, "other", 0, max_batch_size=4)
    onnx_linear_model(root, "linear")
    srv = start_module_server(["--model-repository", str(root)])
    srv.wait_ready()
    return srv


async def closed_loop(client: httpx.AsyncClient, model: str, stop: asyncio.Event,
                      answers: list[tuple[float, int]]) -> None:
    """One user sending requests back to back until `stop`; (time answered, status) each."""
    while not stop.is_set():
        r = await client.post(f"/v2/models/{model}/infer", json=infer_body(1.0))
        answers.append((time.monotonic(), r.status_code))


def test_the_model_keeps_answering_during_its_capture_and_the_trace_names_its_python(server):
    # The worker's first capture (the one that paid for torch.profiler's lazy imports, before).
    async def main():
        stop = asyncio.Event()
        answers: list[tuple[float, int]] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            users = [asyncio.create_task(closed_loop(c, "thinker", stop, answers)) for _ in range(2)]
            while not answers:  # the loop runs before the capture starts
                await asyncio.sleep(0.05)
            sent = time.monotonic()
            capture = await c.post("/admin/models/thinker/profile", params={"seconds": 2})
            answered = time.monotonic()
            ahead = len(answers)
            while len(answers) < ahead + 2:  # and after it: every request of the window has come back
                await asyncio.sleep(0.05)
            stop.set()
            await asyncio.gather(*users)
        return capture, sent, answered, answers

    capture, sent, answered, answers = asyncio.run(main())
    assert capture.status_code == 200, capture.text
    assert [status for _, status in answers if status != 200] == []  # nothing failed, before, during or after
    during = [t for t, _ in answers if sent < t < answered]
    assert len(during) >= 5, f"{len(during)} answers during the capture"
    events = capture.json()["traceEvents"]
    assert any(e.get("name") == "aten::mul" for e in events)  # the model's op, run while profiling
    sampled = [e["name"] for e in events if e.get("cat") == "python_sample"]
    assert any(name.startswith("wait_for_the_disk (factory.py:") for name in sampled), sorted(set(sampled))[:40]
    assert any("Python stack" in str(e.get("args")) for e in events if e.get("ph") == "M")


def test_a_second_capture_of_the_same_model_is_409_with_a_json_reason(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            return await asyncio.gather(*(c.post("/admin/models/thinker/profile", params={"seconds": 1.5})
                                          for _ in range(2)))

    answers = sorted(asyncio.run(main()), key=lambda r: r.status_code)
    assert [r.status_code for r in answers] == [200, 409], [r.text[:200] for r in answers]
    error = error_of(answers[1])
    assert error["code"] == "conflict" and "already being captured" in error["message"]


def test_captures_of_two_models_run_at_once_and_a_third_is_409(server):
    async def main():
        stop = asyncio.Event()
        answers: list[tuple[float, int]] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            user = asyncio.create_task(closed_loop(c, "linear", stop, answers))  # onnxruntime traces runs
            offset = len(server.log())
            long = [asyncio.create_task(c.post(f"/admin/models/{m}/profile", params={"seconds": 4}))
                    for m in ("thinker", "linear")]

            async def both_running() -> bool:  # the engine logs each capture it starts
                return all(f"profiling model {m}," in server.log()[offset:] for m in ("thinker", "linear"))

            await eventually_async(both_running, 30, lambda: server.log()[-2000:], interval_s=0.05)
            third = await c.post("/admin/models/other/profile", params={"seconds": 0.1})
            done = await asyncio.gather(*long)
            stop.set()
            await user
        return done, third, answers

    (thinker, linear), third, answers = asyncio.run(main())
    assert thinker.status_code == 200 and linear.status_code == 200, (thinker.text, linear.text)
    assert third.status_code == 409, third.text
    assert "2 profile captures are running (linear, thinker)" in error_of(third)["message"]
    assert answers and {status for _, status in answers} == {200}
    # onnxruntime's own trace (a bare list of events), with the worker's sampled Python stack added.
    events = linear.json()
    assert isinstance(events, list) and any(e.get("cat") == "Node" for e in events)
    sampled = {e["name"] for e in events if e.get("cat") == "python_sample"}
    assert any(name.startswith("_serve (process_main.py:") for name in sampled), sorted(sampled)[:40]
