"""`--standby-engine`: after kill -9 of the engine, the standby engine (its imports done) takes over,
serves the models again, and a new standby is started; a clean stop leaves none of them behind
(issue 45 H15: most of a killed engine's recovery went to the new engine's imports)."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

import httpx
import yaml

from servers import ServerFactory
from waiting import eventually

MODEL = textwrap.dedent('''
    class Model:
        def execute(self, inputs):
            return {"y": inputs["x"]}
''')
BODY = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]}


def children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for task in tasks:
        try:
            found += [int(p) for p in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            continue
    return found


def engines(supervisor: int) -> tuple[list[int], list[int]]:
    """The supervisor's engine processes: (serving, standing by)."""
    serving: list[int] = []
    standing_by: list[int] = []
    for pid in children(supervisor):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if b"servewell.engine_main" in argv or argv.startswith(b"servewell engine") or \
                argv.startswith(b"servewell standby engine"):  # their process titles
            (standing_by if comm == "sw-standby" else serving).append(pid)
    return serving, standing_by


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_the_standby_engine_takes_over_after_kill_9_and_nothing_stays_after_a_stop(
        tmp_path: Path, start_server: ServerFactory) -> None:
    root = tmp_path / "models" / "echo"
    root.mkdir(parents=True)
    (root / "model.py").write_text(MODEL)
    (root / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "python", "artifact": "model.py", "python": {"entry": "model:Model"},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}], "max_batch_size": 4}))
    server = start_server(["--model-repository", str(tmp_path / "models"), "--config-poll-s", "0",
                           "--standby-engine", "true"])
    server.wait_ready()
    supervisor = server.proc.pid
    # Started 10 s after the engine, then it imports: give it time on a busy machine.
    eventually(lambda: len(engines(supervisor)[1]) == 1, 120, lambda: f"no standby:\n{server.log()[-3000:]}")
    (engine,), (standby,) = engines(supervisor)
    os.kill(engine, signal.SIGKILL)
    killed_at = time.monotonic()

    def answered() -> bool:
        try:
            return httpx.post(f"{server.url}/v2/models/echo/infer", json=BODY, timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    eventually(answered, 120, lambda: f"no answer after the kill:\n{server.log()[-3000:]}", 0.05)
    print(f"first 200 {time.monotonic() - killed_at:.2f} s after the kill")
    serving, _ = engines(supervisor)
    assert serving == [standby], (serving, standby)  # the standby is the engine now: nothing was started afresh
    assert "(a standby taking over): interpreter and imports took 0.00 s" in server.log()
    eventually(lambda: len(engines(supervisor)[1]) == 1, 120, "no new standby after the takeover")
    (new_standby,) = engines(supervisor)[1]
    assert new_standby not in (engine, standby)
    os.kill(supervisor, signal.SIGTERM)
    assert server.proc.wait(60) == 0
    eventually(lambda: not any(alive(p) for p in (standby, new_standby)), 10, "an engine outlived the stop")
