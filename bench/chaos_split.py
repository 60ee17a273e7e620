"""The chaos suite's scenarios for a split server (issue 20): SIGKILL of one ingress process, and of the engine.

    kill-9-ingress   SIGKILL of one ingress process under the steady load, plus a closed loop of
                     `BUSY_CLIENTS` on digits from 1 s before the kill (its own row, `digits-8c`), so
                     that the killed process surely has requests in flight. The others keep serving;
                     the supervisor starts a new one in its place. Measured: seconds until the new
                     process exists and until it accepts (a fresh probe connection is accepted by
                     it: its fd table holds the connection's socket, found through /proc/net/tcp,
                     and it answers 200). Connection errors of requests in flight on the killed
                     process (within `IN_FLIGHT_WINDOW_S` of the kill) are expected and counted apart
                     (`KILLED_IN_FLIGHT`), never as lost; anything lost besides them is lost. The
                     load client resends once a request whose reused connection died before any
                     answer byte (`client_resends`): most in-flight requests of the killed process
                     end that way, answered by another ingress (a client that never retries a
                     POST would see a connection error for each instead).
    kill-9-engine    SIGKILL of the engine process under the steady load. Every ingress answers 503
                     `engine_unavailable` at once (probes on fresh connections until each ingress
                     process has answered /healthz with it), /healthz is not ready, the supervisor
                     starts a new engine, the models load again. Measured: seconds to the first 503,
                     to the new engine process, to /healthz 200 again and to each model ready on new
                     workers; no request may hang (a client timeout counts as lost); the old workers
                     must be gone and their shared-memory segments removed.

Both need a split server (`--ingress-processes` >= 2 for the first); on a single-process server
they are skipped with a line in the log. Called by `bench.chaos`.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from typing import Any

import orjson

from bench.chaos import CLIENT_TIMEOUT_S, HOST, Suite, health, pids_of, process_facts, segments, under_load
from bench.processes import ENGINE, INGRESS, ServerProcess, tree_roles
from servewell.perf import loop as load_loop
from servewell.perf.loop import LoadShape, Recorder
from servewell.perf.oip_http import HttpOipConnection, error_code

#: Connection errors this long after the kill are the killed ingress's in-flight requests (the
#: kernel resets all of its connections when it dies, within milliseconds).
IN_FLIGHT_WINDOW_S = 1.0
RESTART_WAIT_S = 30.0
BUSY_CLIENTS = 8
ENGINE_READY_WAIT_S = 60.0


def _server_side_inode(port: int, client_port: int) -> int:
    """Inode of the server's end of the loopback connection from `client_port`; 0 while it waits in
    the accept queue (no process holds it yet) or is not found."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote = fields[1], fields[2]
            if int(local.rsplit(":", 1)[1], 16) == port and int(remote.rsplit(":", 1)[1], 16) == client_port:
                return int(fields[9])
    return 0


def _holder(inode: int, pids: list[int]) -> int | None:
    """Which of `pids` has the socket `inode` open."""
    target = f"socket:[{inode}]"
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    return pid
            except OSError:
                continue
    return None


async def probe(port: int, candidates: list[int], path: str = "/healthz") -> tuple[int | None, int, str | None]:
    """GET `path` on a fresh connection: (the pid among `candidates` that accepted it, or None;
    the status, 0 without an answer; the error code of a refusal)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 2.0)
    except (OSError, TimeoutError):
        return None, 0, None
    holder = None
    try:
        client_port = writer.get_extra_info("sockname")[1]
        for _ in range(50):  # up to about a second for some process to accept it
            inode = _server_side_inode(port, client_port)
            holder = _holder(inode, candidates) if inode else None
            if holder is not None:
                break
            await asyncio.sleep(0.02)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nConnection: close\r\n\r\n".encode())
        raw = await asyncio.wait_for(reader.read(), 5.0)
        head, _, body = raw.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1]) if head else 0
        code = error_code(body) if status >= 400 and body else None
        return holder, status, code
    except (OSError, TimeoutError, ValueError, IndexError, orjson.JSONDecodeError):
        return holder, 0, None
    finally:
        writer.close()


def _in_flight_on_kill(killed_at: list[float]) -> Any:
    def excused(outcome: load_loop.Outcome) -> bool:
        return (outcome.status == "client" and bool(killed_at)
                and killed_at[0] - 0.05 <= outcome.done <= killed_at[0] + IN_FLIGHT_WINDOW_S)
    return excused


async def kill_ingress(suite: Suite, server: ServerProcess) -> None:
    """`kill -9` of one ingress process under load (see the module docstring)."""
    root, port = server.pid, server.port
    roles = tree_roles(root)
    ingress = sorted(r for r in roles if r.startswith(f"{INGRESS}-"))
    if len(ingress) < 2:
        suite.log("  kill-9-ingress skipped: the server runs fewer than 2 ingress processes")
        return
    victim_role = ingress[0]
    victim = roles[victim_role][0]
    loop = asyncio.get_running_loop()
    killed_at: list[float] = []
    busy: list[Recorder] = []

    async def fault() -> dict[str, Any]:
        # The open loop at 30% keeps well under one request in flight per ingress; a closed loop of
        # BUSY_CLIENTS makes sure the killed process has some, so the table shows what they get.
        shape = LoadShape("closed", concurrency=BUSY_CLIENTS, duration_s=8.0, warmup_s=0.0,
                          timeout_s=CLIENT_TIMEOUT_S, grace_s=CLIENT_TIMEOUT_S + 2)
        closed = asyncio.create_task(load_loop.run_load(shape, lambda: HttpOipConnection(HOST, port),
                                                        suite.sources["digits"]))
        await asyncio.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
        killed_at.append(loop.time())
        facts: dict[str, Any] = {"killed": victim_role, "killed_pid": victim, "restarted_after_s": None,
                                 "accepts_after_s": None}
        landed: Counter[str] = Counter()
        new_pid = None
        while loop.time() - killed_at[0] < RESTART_WAIT_S:
            now = tree_roles(root)
            if new_pid is None:
                fresh = [p for p in now.get(victim_role, []) if p != victim]
                if not fresh:
                    await asyncio.sleep(0.02)
                    continue
                new_pid = fresh[0]
                facts.update(new_pid=new_pid, restarted_after_s=round(loop.time() - killed_at[0], 3))
            everyone = [p for role, pids in now.items() if role.startswith(f"{INGRESS}-") for p in pids]
            holder, status, _ = await probe(port, everyone)
            landed["new" if holder == new_pid else "none" if holder is None else "others"] += 1
            if holder == new_pid and status == 200:
                facts["accepts_after_s"] = round(loop.time() - killed_at[0], 3)
                break
            await asyncio.sleep(0.05)
        facts["probes_accepted_by"] = dict(landed)
        busy.append(await closed)
        return facts

    run = await under_load(port, suite.steady(), 12.0, fault)
    run.recorders[f"digits-{BUSY_CLIENTS}c"] = busy[0]  # its own row in the table
    # The load client resends a request once when a reused connection dies before any byte of the
    # answer (as HTTP clients do for a keep-alive race): the killed ingress's in-flight requests
    # mostly show up here, answered by a surviving ingress, not as errors.
    retries = sum(c.retries for r in run.recorders.values() for c in r.connections)
    # The killed ingress's shared-memory tensor blocks (ResNet-50's decoded images are 588 KiB) go
    # with it: the supervisor sweeps them when it reaps the process.
    suite.record("kill-9-ingress", run, {"in_flight_window_s": IN_FLIGHT_WINDOW_S, "client_resends": retries,
                                         "leaked_segments": segments([victim])["count"]},
                 excused=_in_flight_on_kill(killed_at))


async def kill_engine(suite: Suite, server: ServerProcess) -> None:
    """`kill -9` of the engine process under load (see the module docstring)."""
    root, port = server.pid, server.port
    engines = tree_roles(root).get(ENGINE, [])
    if not engines:
        suite.log("  kill-9-engine skipped: a single-process server has no engine process")
        return
    engine = engines[0]
    doc = await health(port)
    victims = {m: set(pids_of(doc, m)) for m in ("digits", "resnet50")}
    old_workers = [p for name in doc["models"] for p in pids_of(doc, name)]
    loop = asyncio.get_running_loop()

    async def fault() -> dict[str, Any]:
        os.kill(engine, signal.SIGKILL)
        killed_at = loop.time()
        facts: dict[str, Any] = {"killed_pid": engine, "engine_restarted_after_s": None}
        # Every ingress process refuses at once: probe fresh connections until each has answered.
        answered: dict[int, dict[str, Any]] = {}
        while loop.time() - killed_at < 5.0:
            ingress = [p for role, pids in tree_roles(root).items() if role.startswith(f"{INGRESS}-") for p in pids]
            if ingress and all(p in answered for p in ingress):
                break
            holder, status, code = await probe(port, ingress)
            if holder is not None and holder not in answered and status != 200:
                answered[holder] = {"status": status, "code": code, "after_s": round(loop.time() - killed_at, 3)}
            elif holder is not None and status == 200 and holder not in answered:
                answered[holder] = {"status": 200, "code": None, "after_s": round(loop.time() - killed_at, 3)}
        facts["ingress_healthz_after_kill"] = {str(k): v for k, v in answered.items()}
        while loop.time() - killed_at < ENGINE_READY_WAIT_S:
            fresh = [p for p in tree_roles(root).get(ENGINE, []) if p != engine]
            if fresh:
                facts.update(new_engine_pid=fresh[0],
                             engine_restarted_after_s=round(loop.time() - killed_at, 3))
                break
            await asyncio.sleep(0.02)
        return facts

    run = await under_load(port, suite.steady(), 30.0, fault)
    samples = [s for s in run.watch.samples if s.at >= run.t0]
    first_unready = next((s.at - run.t0 for s in samples if s.status != 200), None)
    ready_again = next((s.at - run.t0 for s in samples
                        if first_unready is not None and s.at - run.t0 > first_unready and s.status == 200), None)
    await asyncio.sleep(1.0)  # the supervisor sweeps the dead engine's segments when it reaps it
    suite.record("kill-9-engine", run, {
        "healthz_not_ready_after_s": None if first_unready is None else round(first_unready, 3),
        "healthz_ready_again_after_s": None if ready_again is None else round(ready_again, 3),
        "old_workers_left_running": sum(1 for p in old_workers if process_facts(p) is not None),
        "leaked_segments": segments([engine])["count"],
    }, victims=victims)
