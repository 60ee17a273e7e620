"""A collector that accepts connections and never answers (black-holed) costs neither the requests
nor the shutdown: SIGTERM exits within the documented bound (it took 18-19 s), and the workers'
complaints about it are JSON lines like every other line of the log."""

from __future__ import annotations

import asyncio
import json
import signal
import socket

import httpx

from model_dirs import infer_body as body
from model_dirs import slow_model


def test_sigterm_with_a_black_holed_collector_exits_promptly_and_the_log_stays_json(tmp_path, start_server):
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(1024)  # connections complete in the kernel; nobody ever reads or answers
    try:
        slow_model(tmp_path, "slow", 1, max_batch_size=8)
        server = start_server(
            ["--model-repository", str(tmp_path), "--otlp-endpoint", f"http://127.0.0.1:{hole.getsockname()[1]}",
             "--trace-sample-ratio", "1"],
            # Each export may wait 10 s for an answer: without a bound on the final flush, SIGTERM then
            # waits 10 s per batch of queued spans (18-19 s was measured with the default 2 s).
            env={"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_EXPORTER_OTLP_TIMEOUT": "10000"},
        )
        server.wait_ready()

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
                for _ in range(10):  # spans pile up in the frontend's and the worker's export queues
                    answers = await asyncio.gather(*(c.post("/v2/models/slow/infer", json=body(1.0))
                                                     for _ in range(50)))
                    assert {r.status_code for r in answers} == {200}

        asyncio.run(main())
        server.proc.send_signal(signal.SIGTERM)
        # Shutdown gives queued spans 1 s (frontend and workers alike); 8 s is a generous bound.
        assert server.proc.wait(8) == 0
    finally:
        hole.close()
    lines = [line for line in server.log_path.read_text().splitlines() if line.strip()]
    not_json = []
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            not_json.append(line)
    assert not_json == [], not_json[:5]
    assert any("OTLP export" in json.loads(line)["message"] for line in lines)
