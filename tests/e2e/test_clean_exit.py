"""Every way a worker or the server ends leaves nothing behind, and a shutdown answers everything.

Shared memory: after kill -9 of workers, a reload, an unload and the server's exit, no segment of
a dead worker is left in /dev/shm and the log has no resource-tracker warning. Shutdown: a SIGTERM
to the whole process group under load gives only 200s (and refused connections once the listener
closed), no worker restarts, exit status 0; readiness turns false before the listener closes; a
drain is bounded, and a model that loses its last worker while draining answers its queue."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from error_bodies import error_code
from faults import SessionServer, closed_loop, segments_of, tally, workers_with_segments
from model_dirs import infer_body as body
from model_dirs import slow_model


def worker_pids(url: str, model: str = "slow") -> list[int]:
    return [i["pid"] for i in httpx.get(url + "/healthz", timeout=10).json()["models"][model]["instances"]]


def wait_all_ready(url: str, model: str, avoid: set[int], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = httpx.get(url + "/healthz", timeout=10).json()["models"][model]
        if health["state"] == "ready" and all(i["alive"] and i["pid"] not in avoid for i in health["instances"]):
            return
        time.sleep(0.2)
    raise AssertionError(f"{model} did not recover: {health}")


def warm(url: str, requests: int = 16) -> None:
    """Send batches to every instance, so that each has its input and output segments."""
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            answers = await asyncio.gather(*(c.post("/v2/models/slow/infer", json=body(1.0))
                                             for _ in range(requests)))
        assert {r.status_code for r in answers} == {200}

    asyncio.run(main())


def test_no_segment_outlives_its_worker_across_kills_reload_unload_and_shutdown(tmp_path, start_server):
    slow_model(tmp_path, "slow", 20, max_batch_size=2, instances=2)
    server = start_server(["--model-repository", str(tmp_path), "--admin-token", "t"])
    server.wait_ready()
    warm(server.url)
    assert len(workers_with_segments(server)) == 2  # each worker: heartbeat, input and output segments
    for _ in range(2):
        victim = worker_pids(server.url)[0]
        os.kill(victim, signal.SIGKILL)
        wait_all_ready(server.url, "slow", avoid={victim})
        warm(server.url)
        # Only live workers own segments: the killed one's (its output arena included, which it
        # made itself and could not remove) are gone.
        assert len(workers_with_segments(server)) == 2, segments_of(server)
    admin = {"Authorization": "Bearer t"}
    reload = httpx.post(server.url + "/v2/repository/models/slow/load", headers=admin, timeout=120)
    assert reload.status_code == 200, reload.text
    warm(server.url)
    assert len(workers_with_segments(server)) == 2, segments_of(server)
    unload = httpx.post(server.url + "/v2/repository/models/slow/unload", headers=admin, timeout=60)
    assert unload.status_code == 200
    assert segments_of(server) == []
    assert server.stop() in (0, -signal.SIGTERM)
    assert segments_of(server) == []
    log = server.log_path.read_text()
    assert "resource_tracker" not in log and "leaked" not in log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_whole_process_group_under_load_loses_nothing_and_restarts_nothing(tmp_path, sig):
    slow_model(tmp_path, "slow", 30, max_batch_size=4, instances=2)
    server = SessionServer(["--model-repository", str(tmp_path), "--shutdown-delay-s", "1"],
                           tmp_path / "server.log")
    try:
        server.wait_ready()
        warm(server.url)
        workers = worker_pids(server.url)
        readiness: list[tuple[float, int | str]] = []

        async def main():
            stop = asyncio.Event()

            async def probe():
                async with httpx.AsyncClient(base_url=server.url, timeout=5) as c:
                    while not stop.is_set():
                        try:
                            status: int | str = (await c.get("/v2/health/ready")).status_code
                        except httpx.TransportError as exc:
                            status = type(exc).__name__
                        readiness.append((time.monotonic(), status))
                        await asyncio.sleep(0.1)

            prober = asyncio.create_task(probe())
            load = asyncio.create_task(closed_loop(server.url, "slow", 5.0, users=12))
            await asyncio.sleep(1.5)
            signalled = time.monotonic()
            os.killpg(server.proc.pid, sig)  # systemd, make, a container runtime's stop, Ctrl-C
            answers = await load
            stop.set()
            await prober
            return signalled, answers

        signalled, answers = asyncio.run(main())
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
    counts = tally(answers)
    responses = {label for label in counts if label[0].isdigit()}
    assert responses == {"200"}, counts  # every accepted request answered; not one worker_lost
    # Refused or reset connections only once the listener closed: requests the server never read.
    assert set(counts) - {"200"} <= {"ConnectError", "RemoteProtocolError", "ReadError"}, counts
    log = server.log()
    assert "; restarting" not in log and "not restarted" not in log, log[-3000:]
    assert all(not os.path.exists(f"/proc/{w}") for w in workers)
    assert segments_of(server) == [] and "resource_tracker" not in log
    after = [status for at, status in readiness if at > signalled]
    if sig == signal.SIGTERM:
        # Readiness turned false while the listener still accepted: 503s before the refusals.
        assert 503 in after and after.index(503) < next(i for i, s in enumerate(after) if not isinstance(s, int))
        served_after_signal = [a for a in answers if a.sent_at > signalled + 0.2 and a.status == 200]
        assert served_after_signal  # the delay kept serving while load balancers caught up


@pytest.mark.parametrize("bound", ["second SIGTERM", "--shutdown-timeout-s"])
def test_the_drain_is_bounded_and_what_is_left_gets_503_shutting_down(tmp_path, bound):
    slow_model(tmp_path, "slow", 1000, max_batch_size=1, instances=1)
    timeout_s = "60" if bound == "second SIGTERM" else "1.5"
    server = SessionServer(["--model-repository", str(tmp_path), "--shutdown-timeout-s", timeout_s],
                           tmp_path / "server.log")
    try:
        server.wait_ready()

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                queued = [asyncio.create_task(c.post("/v2/models/slow/infer", json=body(float(i)))) for i in range(8)]
                await asyncio.sleep(1.5)  # one batch a second: most are still queued
                os.kill(server.proc.pid, signal.SIGTERM)
                if bound == "second SIGTERM":
                    await asyncio.sleep(1.0)
                    os.kill(server.proc.pid, signal.SIGTERM)  # the operator will not wait 8 s
                return await asyncio.gather(*queued)

        answers = asyncio.run(asyncio.wait_for(main(), 60))
        assert server.proc.wait(30) == 0
    finally:
        server.stop()
    codes = [r.status_code if r.status_code == 200 else error_code(r) for r in answers]
    assert set(codes) <= {200, "shutting_down"} and "shutting_down" in codes and 200 in codes, codes
    log = server.log()
    assert ("SIGTERM again" in log) if bound == "second SIGTERM" else ("longer than --shutdown-timeout-s" in log)
    assert segments_of(server) == []


def test_queued_requests_of_a_model_that_loses_its_last_worker_during_shutdown_are_answered(tmp_path):
    slow_model(tmp_path, "slow", 1000, max_batch_size=1, instances=1)
    server = SessionServer(["--model-repository", str(tmp_path)], tmp_path / "server.log")
    try:
        server.wait_ready()
        worker = worker_pids(server.url)[0]

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                queued = [asyncio.create_task(c.post("/v2/models/slow/infer", json=body(float(i)))) for i in range(6)]
                await asyncio.sleep(1.5)
                os.kill(server.proc.pid, signal.SIGTERM)
                await asyncio.sleep(0.5)
                os.kill(worker, signal.SIGKILL)  # the model's only worker dies while the server drains
                return await asyncio.gather(*queued)

        answers = asyncio.run(asyncio.wait_for(main(), 60))  # nothing hangs
        assert server.proc.wait(30) == 0
    finally:
        server.stop()
    codes = [r.status_code if r.status_code == 200 else error_code(r) for r in answers]
    assert set(codes) <= {200, "worker_lost", "shutting_down"} and "shutting_down" in codes, codes
    log = server.log()
    assert "during shutdown; not restarted" in log and "; restarting" not in log
    assert segments_of(server) == []


def test_keep_alive_clients_through_sigterm_see_closes_never_resets(tmp_path, servewell_cache):
    """From the moment readiness turns false every answer carries `Connection: close`, so a
    keep-alive client never sends on a connection the listener is about to close (6 of 7,365
    requests were reset before): each request is answered, or refused before it was sent."""
    server = SessionServer(["--cache-dir", str(servewell_cache)], tmp_path / "server.log",
                           env={"SERVEWELL_SHUTDOWN_DELAY_S": "2"})
    # (sent at, answered at, status or error, carried Connection: close)
    outcomes: list[tuple[float, float, str, bool]] = []
    try:
        server.wait_ready()

        async def user(stop: asyncio.Event) -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                while not stop.is_set():
                    sent = time.monotonic()
                    try:
                        response = await client.get("/v2/health/live")
                        closing = response.headers.get("connection", "").lower() == "close"
                        outcomes.append((sent, time.monotonic(), str(response.status_code), closing))
                    except httpx.TransportError as exc:
                        outcomes.append((sent, time.monotonic(), type(exc).__name__, False))
                        if isinstance(exc, httpx.ConnectError):
                            stop.set()  # the listener is gone: every user stops
                    await asyncio.sleep(0.005)

        async def main() -> float:
            stop = asyncio.Event()
            users = [asyncio.create_task(user(stop)) for _ in range(6)]
            await asyncio.sleep(1.0)
            signalled = time.monotonic()
            os.kill(server.proc.pid, signal.SIGTERM)
            await asyncio.wait_for(stop.wait(), 30)
            await asyncio.gather(*users)
            return signalled

        signalled = asyncio.run(main())
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
    # The listener closes on the first 0.1 s tick after the 2 s delay. A connection the kernel
    # accepted into the backlog just then is reset by the listener's close (no server can take it
    # back), so errors other than a refused connection are tolerated only in that instant. An error
    # is judged by when it arrived, not by when its coroutine started: on a loaded 2-core machine
    # this client's loop lagged 0.15 s between the two, and two connects stamped 1.845 s were
    # refused after the close (CI, stop 39). A reset on a connection the server closed while its
    # listener was open arrives at once, so it still lands in `early`.
    listener_closed = signalled + 2.0
    early = [(round(sent - signalled, 3), round(arrived - signalled, 3), label)
             for sent, arrived, label, _ in outcomes
             if label != "200" and arrived < listener_closed - 0.05]
    assert not early, early  # no ReadError or RemoteProtocolError while the listener was open
    late = {label for _, arrived, label, _ in outcomes if arrived >= listener_closed - 0.05}
    assert late <= {"200", "ConnectError", "ReadError", "RemoteProtocolError"}, late
    # Answered before the signal was sent (a request sent just before it may be answered after it,
    # rightly with a close: that raced on a loaded machine when this split on the sending time).
    before = [closing for _, answered, label, closing in outcomes if label == "200" and answered < signalled]
    during = [closing for sent, _, label, closing in outcomes if label == "200" and sent > signalled + 0.1]
    assert before and not any(before)  # keep-alive as usual until the signal
    assert during and all(during)  # then every answer closes its connection
