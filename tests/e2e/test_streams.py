"""Streams from generative models, end to end (issue 48): the generative examples
(`python -m servewell.examples.build generative`: charlm step-wise, charlm_gen a generator, char_embed)
served by the real server, read with curl's protocol (SSE over httpx), tritonclient's gRPC stream and
the official `openai` client; a deadline and a disconnect mid-stream; hostile OpenAI bodies."""

from __future__ import annotations

import contextlib
import json
import queue
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as triton_grpc
import yaml
from tritonclient.utils import InferenceServerException

from browser import console_problems, headless_chromium
from error_bodies import error_code, error_of
from monitoring import scraped_total
from servers import ServerFactory, ServerProcess
from waiting import eventually

PROMPT = "The batcher"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, start_module_server: ServerFactory) -> ServerProcess:
    root = tmp_path_factory.mktemp("generative")
    subprocess.run([sys.executable, "-m", "servewell.examples.build", "generative", "--out", str(root)], check=True,
                   capture_output=True)
    slow_copy(root)
    served = start_module_server(["--model-repository", str(root), "--max-body-bytes", str(1 << 20)])
    served.wait_ready()
    return served


def slow_copy(root: Path) -> None:
    """`charlm_slow`: charlm taking 2 ms a step (its step_ms setting), so that a stream lasts long
    enough to be cut by a deadline, a disconnect or a second request (charlm's own step is ~0.1 ms)."""
    shutil.copytree(root / "charlm", root / "charlm_slow")
    doc = yaml.safe_load((root / "charlm_slow" / "model.yaml").read_text())
    doc["name"] = "charlm_slow"
    doc["python"]["settings"] = {"step_ms": 2}
    (root / "charlm_slow" / "model.yaml").write_text(yaml.safe_dump(doc))


def sse(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON events of a server-sent event stream, in order."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events


def generate(server: ServerProcess, model: str, max_tokens: int, **extra: Any) -> str:
    response = httpx.post(f"{server.url}/v2/models/{model}/generate", timeout=30,
                          json={"text_input": PROMPT, "parameters": {"max_tokens": max_tokens}, **extra})
    assert response.status_code == 200, response.text
    assert "first_output;dur=" in response.headers["server-timing"]
    text: str = response.json()["text_output"]
    return text


def test_generate_stream_sends_each_part_then_a_final_event_with_server_timing(server: ServerProcess) -> None:
    with httpx.stream("POST", f"{server.url}/v2/models/charlm/generate_stream", timeout=30,
                      json={"text_input": PROMPT, "parameters": {"max_tokens": 24}}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse(response)
    parts, final = events[:-1], events[-1]
    assert final["final"] is True and final["finish_reason"] == "length" and final["parts"] == 24
    assert "first_output;dur=" in final["server_timing"] and "compute;dur=" in final["server_timing"]
    streamed = "".join(event["text_output"] for event in parts)
    assert len(streamed) == 24
    assert streamed == generate(server, "charlm", 24)  # the whole answer is the parts joined
    # greedy decoding of the same weights: the generator model writes the same text
    assert generate(server, "charlm_gen", 24) == streamed


def test_infer_stream_answers_oip_responses_and_a_plain_model_in_one_part(server: ServerProcess) -> None:
    data = list(PROMPT.encode())
    body = {"inputs": [{"name": "text_input", "datatype": "UINT8", "shape": [1, len(data)], "data": data}],
            "parameters": {"max_tokens": 3}, "id": "r-1"}
    with httpx.stream("POST", f"{server.url}/v2/models/charlm/infer_stream", json=body, timeout=30) as response:
        events = sse(response)
    assert [e["outputs"][0]["name"] for e in events[:-1]] == ["text_output"] * 3
    assert all(e["id"] == "r-1" for e in events)
    assert events[-1]["final"] and events[-1]["parts"] == 3
    with httpx.stream("POST", f"{server.url}/v2/models/char_embed/infer_stream", json=body, timeout=30) as response:
        events = sse(response)
    assert len(events) == 2 and events[0]["outputs"][0]["shape"] == [1, 64] and events[1]["finish_reason"] == "stop"


def test_a_deadline_mid_stream_ends_it_with_a_final_event_naming_deadline_exceeded(server: ServerProcess) -> None:
    with httpx.stream("POST", f"{server.url}/v2/models/charlm_slow/generate_stream", timeout=30,
                      headers={"X-Request-Timeout-Ms": "40"},
                      json={"text_input": PROMPT, "parameters": {"max_tokens": 100000}}) as response:
        events = sse(response)
    final = events[-1]
    assert final["final"] and final["error"]["code"] == "deadline_exceeded", final
    assert 0 < final["parts"] < 512  # parts came, then the deadline ended it


def test_a_1_ms_deadline_on_a_stream_is_answered_deadline_exceeded(server: ServerProcess) -> None:
    with httpx.stream("POST", f"{server.url}/v2/models/charlm_slow/generate_stream", timeout=30,
                      headers={"X-Request-Timeout-Ms": "1"},
                      json={"text_input": PROMPT, "parameters": {"max_tokens": 500}}) as response:
        if response.status_code == 200:  # admitted within the millisecond: the stream ends at its next step
            events = sse(response)
            assert events[-1]["error"]["code"] == "deadline_exceeded"
        else:
            response.read()
            assert response.status_code == 503 and error_code(response) == "deadline_exceeded"


def test_a_client_that_disconnects_mid_stream_frees_its_sequence(server: ServerProcess) -> None:
    before = scraped_total(server.url, "servewell_sequences_ended_total", model="charlm_slow", reason="cancelled")
    with httpx.stream("POST", f"{server.url}/v2/models/charlm_slow/generate_stream", timeout=30,
                      json={"text_input": PROMPT, "parameters": {"max_tokens": 100000}}) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break  # one part read: the stream is running; leave
    eventually(lambda: scraped_total(server.url, "servewell_sequences_ended_total", model="charlm_slow",
                                     reason="cancelled") > before, 10, "the sequence was never freed")
    parts = scraped_total(server.url, "servewell_stream_outputs_total", model="charlm_slow")
    assert parts < 512  # it was cut short, not finished
    # freed: nothing more is made for it (a later scrape sees the same count of parts)
    eventually(lambda: scraped_total(server.url, "servewell_stream_outputs_total", model="charlm_slow") == parts, 5,
               "parts are still being made")


def test_tritonclient_grpc_stream_unchanged(server: ServerProcess) -> None:
    client = triton_grpc.InferenceServerClient(server.grpc_url)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        prompt = np.frombuffer(PROMPT.encode(), np.uint8)[None, :].copy()
        tensor = triton_grpc.InferInput("text_input", list(prompt.shape), "UINT8")
        tensor.set_data_from_numpy(prompt)
        for request_id in ("a", "b"):
            client.async_stream_infer("charlm", [tensor], request_id=request_id, enable_empty_final_response=True,
                                      parameters={"max_tokens": 6})
        client.async_stream_infer("no-such-model", [tensor], request_id="c")
        text: dict[str, bytes] = {"a": b"", "b": b""}
        finals: set[str] = set()
        errors: list[str] = []
        while len(finals) < 2 or not errors:
            result, error = answers.get(timeout=30)
            if error is not None:
                errors.append(str(error))
                continue
            response = result.get_response()
            if "triton_final_response" in response.parameters:
                finals.add(response.id)
                assert "first_output;dur=" in response.parameters["server_timing"].string_param
                continue
            text[response.id] += result.as_numpy("text_output").tobytes()
    finally:
        client.stop_stream()
    assert text["a"] == text["b"] == generate(server, "charlm", 6).encode()
    assert "[not_found]" in errors[0]


def openai_client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none needed without keys", max_retries=0)


def test_openai_client_lists_completes_chats_and_embeds(server: ServerProcess) -> None:
    client = openai_client(server)
    assert {"charlm", "char_embed"} <= {m.id for m in client.models.list()}
    completion = client.completions.create(model="charlm", prompt=PROMPT, max_tokens=12)
    assert completion.choices[0].text == generate(server, "charlm", 12)
    assert completion.choices[0].finish_reason == "length" and completion.usage is not None
    assert completion.usage.completion_tokens == 12
    chat = client.chat.completions.create(model="charlm", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=10)
    assert chat.choices[0].message.role == "assistant" and len(chat.choices[0].message.content or "") == 10
    chunks = list(client.chat.completions.create(model="charlm", messages=[{"role": "user", "content": "hello"}],
                                                 max_tokens=10, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(model="charlm", prompt=PROMPT,
                                                                             max_tokens=12, stream=True))
    assert streamed == completion.choices[0].text
    embeddings = client.embeddings.create(model="char_embed", input=["a server", "a server", "tenants"])
    vectors = [np.array(item.embedding) for item in embeddings.data]
    assert len(vectors[0]) == 64 and np.allclose(vectors[0], vectors[1])
    assert abs(float(np.linalg.norm(vectors[2])) - 1.0) < 1e-5


def test_openai_errors_reach_the_client_with_their_code(server: ServerProcess) -> None:
    client = openai_client(server)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=3)
    stream = client.chat.completions.create(model="charlm_slow", messages=[{"role": "user", "content": "x"}],
                                            max_tokens=100000, stream=True,
                                            extra_headers={"X-Request-Timeout-Ms": "40"})
    with pytest.raises(openai.APIError, match="deadline"):
        for _ in stream:
            pass


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/chat/completions", {"model": "charlm"}, "messages"),
    ("/v1/chat/completions", {"model": "charlm", "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"model": "charlm", "messages": [{"role": "wizard", "content": "x"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"model": "charlm", "messages": [{"role": "user", "content": 5}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "model"),
    ("/v1/chat/completions", {"model": "charlm", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
     "max_tokens"),
    ("/v1/chat/completions", {"model": "charlm", "messages": [{"role": "user", "content": "x"}], "stream": "yes"},
     "stream"),
    ("/v1/chat/completions", {"model": "charlm", "messages": [{"role": "user", "content": "x"}], "n": 3}, "n"),
    ("/v1/completions", {"model": "charlm", "prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"model": "charlm", "prompt": 7}, "prompt"),
    ("/v1/embeddings", {"model": "char_embed", "input": []}, "input"),
    ("/v1/embeddings", {"model": "char_embed", "input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"model": "charlm", "input": "x"}, "generative"),
    ("/v1/completions", {"model": "char_embed", "prompt": "x"}, "answers no text"),
])
def test_malformed_openai_bodies_are_4xx_naming_the_field(server: ServerProcess, path: str, body: dict[str, Any],
                                                           field: str) -> None:
    response = httpx.post(server.url + path, json=body, timeout=10)
    assert 400 <= response.status_code < 500, response.text
    assert field in error_of(response)["message"], response.text


def test_openai_bodies_that_are_not_json_objects_are_400(server: ServerProcess) -> None:
    for content in (b"{", b"[1, 2]", b"\xff\xfe"):
        response = httpx.post(server.url + "/v1/chat/completions", content=content, timeout=10,
                              headers={"Content-Type": "application/json"})
        assert response.status_code == 400, response.text


def test_a_chat_request_of_10_mb_is_refused_before_it_costs_memory(server: ServerProcess) -> None:
    body = json.dumps({"model": "charlm", "messages": [{"role": "user", "content": "x" * (10 << 20)}]})
    response = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and error_code(response) == "payload_too_large"
    # a prompt within the body limit but beyond the model's generate.max_state_bytes is refused by name too
    big = json.dumps({"text_input": "y" * 200_000})
    response = httpx.post(server.url + "/v2/models/charlm/generate", content=big, timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 422 and "max_state_bytes" in error_of(response)["message"]


def test_generate_refuses_what_it_cannot_serve(server: ServerProcess) -> None:
    response = httpx.post(f"{server.url}/v2/models/charlm/generate", json={"text_input": 3}, timeout=10)
    assert response.status_code == 422 and "text_input" in error_of(response)["message"]
    response = httpx.post(f"{server.url}/v2/models/char_embed/generate", json={"text_input": "x"}, timeout=10)
    assert response.status_code == 422 and "answers no text" in error_of(response)["message"]
    response = httpx.post(f"{server.url}/v2/models/charlm/generate", timeout=10,
                          json={"text_input": "x", "parameters": {"max_tokens": 0}})
    assert response.status_code == 422 and "max_tokens" in error_of(response)["message"]


def test_the_console_shows_a_generative_models_live_streams(server: ServerProcess, tmp_path: Path) -> None:
    """Issue 48: the console's model row says how many streams run and wait and how many parts they
    sent, live; the state document carries the same counts for any reader of the models."""
    stop = threading.Event()

    def streaming() -> None:  # streams of about a second each (charlm_slow: 2 ms a step), one after another
        while not stop.is_set():
            with httpx.stream("POST", f"{server.url}/v2/models/charlm_slow/generate_stream", timeout=30,
                              json={"text_input": PROMPT, "parameters": {"max_tokens": 400}}) as response:
                for _ in response.iter_lines():
                    if stop.is_set():
                        break

    clients = [threading.Thread(target=streaming, daemon=True) for _ in range(3)]
    for client in clients:
        client.start()
    driver = headless_chromium(tmp_path / "chromium-profile")
    try:
        driver.get(server.url + "/")
        row = '#models tr[data-model="charlm_slow"] .stream-line'
        eventually(lambda: int(driver.execute_script(
            "const l = document.querySelector(arguments[0]); return l ? l.dataset.streamsRunning : 0", row)) or None,
            30, "the console never showed a running stream")
        text = driver.execute_script("return document.querySelector(arguments[0]).innerText", row)
        assert re.search(r"\d+ streams? of \d+", text) and re.search(r"[\d.]+ parts", text), text
        doc = httpx.get(f"{server.url}/console/api/state", timeout=10).json()
        streams = next(m for m in doc["models"] if m["name"] == "charlm_slow")["streams"]
        assert streams["parts"] > 0 and streams["started"] >= 1 and streams["batching"] == "continuous", streams
        assert next(m for m in doc["models"] if m["name"] == "char_embed")["streams"] is None  # not generative
        stop.set()
        for client in clients:
            client.join(timeout=10)
        eventually(lambda: driver.execute_script(
            "const l = document.querySelector(arguments[0]); return l && l.dataset.streamsRunning === '0'", row),
            30, "the console still shows streams running after every client left")
        assert console_problems(driver) == []
    finally:
        stop.set()
        driver.quit()


def test_stream_figures_are_in_the_metrics(server: ServerProcess) -> None:
    generate(server, "charlm", 5)
    assert scraped_total(server.url, "servewell_time_to_first_output_seconds_count", model="charlm") >= 1
    assert scraped_total(server.url, "servewell_time_between_outputs_seconds_count", model="charlm") >= 4
    assert scraped_total(server.url, "servewell_sequences_per_step_count", model="charlm") >= 5


def test_the_openai_api_takes_servewells_keys_tenants_and_quotas(tmp_path_factory: pytest.TempPathFactory,
                                                                  start_server: ServerFactory) -> None:
    root = tmp_path_factory.mktemp("generative-keys")
    subprocess.run([sys.executable, "-m", "servewell.examples.build", "charlm", "--out", str(root)], check=True,
                   capture_output=True)
    slow_copy(root)
    key = "solo-secret-0123456789abcdef"
    keys_file = root.parent / "keys.txt"
    keys_file.write_text(f"solo:{key} tenant=solo concurrency=1\n")
    served = start_server(["--model-repository", str(root), "--api-keys-file", str(keys_file)])
    served.wait_ready()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.url + "/v1", api_key="not-a-key", max_retries=0).models.list()
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=key, max_retries=0)
    stream = client.completions.create(model="charlm_slow", prompt=PROMPT, max_tokens=500, stream=True)
    first = next(iter(stream))  # the tenant's one stream is running: a second one is over its quota
    assert first.choices[0].text
    with pytest.raises(openai.RateLimitError, match="concurrency"):
        client.completions.create(model="charlm_slow", prompt=PROMPT, max_tokens=3)
    stream.close()  # the stream ends (its sequence freed at the next step) and its place is given back

    def served_again() -> bool:
        try:
            return client.completions.create(model="charlm_slow", prompt=PROMPT, max_tokens=3).choices[0].text != ""
        except openai.RateLimitError:
            return False

    eventually(served_again, 10, "the tenant's place never came back")
    # gRPC's stream checks the key when the call opens, as every call does
    grpc_client = triton_grpc.InferenceServerClient(served.grpc_url)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    prompt = np.frombuffer(PROMPT.encode(), np.uint8)[None, :].copy()
    tensor = triton_grpc.InferInput("text_input", list(prompt.shape), "UINT8")
    tensor.set_data_from_numpy(prompt)
    for headers, expected in (({}, "UNAUTHENTICATED"), ({"authorization": f"Bearer {key}"}, None)):
        grpc_client.start_stream(callback=lambda result, error: answers.put((result, error)), headers=headers)
        with contextlib.suppress(InferenceServerException):  # refused already: the callback has the reason
            grpc_client.async_stream_infer("charlm", [tensor], request_id="k", parameters={"max_tokens": 2})
        result, error = answers.get(timeout=30)
        grpc_client.stop_stream()
        if expected is None:
            assert error is None and result.as_numpy("text_output") is not None
        else:
            assert error is not None and expected in str(error.status())
