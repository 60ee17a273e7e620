"""The stack sampler finds where a thread waits by function name, and its events land on the
trace file's own clock (kineto's base time for torch, the session's start for onnxruntime)."""

from __future__ import annotations

import json
import threading

from servewell.workers.stack_sampler import SAMPLE_TRACK, StackSampler, add_to_trace


def parked_in_a_named_function(ready: threading.Event, release: threading.Event) -> None:
    ready.set()
    release.wait(5)


def sampled_while_parked(samples: int = 5) -> StackSampler:
    """A sampler on a thread that waits inside `parked_in_a_named_function` until `samples` were taken."""
    ready, release = threading.Event(), threading.Event()
    thread = threading.Thread(target=parked_in_a_named_function, args=(ready, release))
    thread.start()
    ready.wait(5)
    assert thread.ident is not None
    sampler = StackSampler(thread.ident, hz=1000.0)
    sampler.start()
    while sampler.samples < samples and thread.is_alive():
        release.wait(0.001)
    sampler.stop()
    release.set()
    thread.join()
    return sampler


def test_a_waiting_thread_is_found_by_its_function_and_callers():
    sampler = sampled_while_parked()
    names = [e["name"] for e in sampler.events]
    parked = [e for e in sampler.events if e["name"].startswith("parked_in_a_named_function (test_stack_sampler.py:")]
    assert len(parked) == 1, names  # consecutive samples of one frame make one event, not one each
    # Its callers enclose it (a flame chart): Thread.run started before it and ended after it.
    (run,) = [e for e in sampler.events if e["name"].startswith("Thread.run (")]
    assert run["ts"] <= parked[0]["ts"] and parked[0]["ts"] + parked[0]["dur"] <= run["ts"] + run["dur"]
    assert all(e["ph"] == "X" and e["tid"] == SAMPLE_TRACK and e["dur"] >= 0 for e in sampler.events)


def test_samples_join_a_kineto_trace_on_its_base_time(tmp_path):
    sampler = sampled_while_parked()
    base_ns = int(sampler.started_us * 1000) - 5_000_000_000  # the trace's clock began 5 s before the sampler
    path = tmp_path / "torch.json"
    path.write_text(json.dumps({"baseTimeNanoseconds": base_ns, "traceEvents": [{"name": "aten::mul", "ph": "X"}]}))
    add_to_trace(str(path), sampler)
    events = json.loads(path.read_text())["traceEvents"]
    assert events[-1]["name"] == "aten::mul"  # the profiler's events are all kept
    track = [e for e in events if e.get("ph") == "M"]
    assert track and "Python stack" in track[0]["args"]["name"]
    samples = [e for e in events if e.get("cat") == "python_sample"]
    assert samples and all(5_000_000 <= e["ts"] < 6_000_000 for e in samples)  # microseconds after the base


def test_samples_join_an_onnxruntime_trace_from_the_sampler_start(tmp_path):
    sampler = sampled_while_parked()
    path = tmp_path / "onnxruntime.json"
    path.write_text(json.dumps([{"name": "model_run", "cat": "Session", "ph": "X", "ts": 10}]))
    add_to_trace(str(path), sampler)
    events = json.loads(path.read_text())
    assert isinstance(events, list) and events[-1]["name"] == "model_run"
    samples = [e for e in events if e.get("cat") == "python_sample"]
    assert samples and all(0 <= e["ts"] < 1_000_000 for e in samples)


def test_samples_join_traces_without_events_and_kineto_s_indented_layout(tmp_path):
    sampler = sampled_while_parked()
    empty = tmp_path / "empty.json"
    empty.write_text("[ ]")
    add_to_trace(str(empty), sampler)
    assert json.loads(empty.read_text())[0]["name"] == "thread_name"
    indented = tmp_path / "kineto.json"
    indented.write_text('{\n    "baseTimeNanoseconds": 1000,\n    "traceEvents": [\n  \n  {\n    "ph": "X"\n  }\n  ],'
                        '"traceName": "x" }')
    add_to_trace(str(indented), sampler)
    doc = json.loads(indented.read_text())
    assert doc["traceName"] == "x" and doc["traceEvents"][-1] == {"ph": "X"} and len(doc["traceEvents"]) > 2
