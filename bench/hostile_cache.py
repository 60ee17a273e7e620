"""Hostile cases of the response cache (issue 45, H3, H4, H5), each with a server of its own: a
split server (one ingress process and the engine) with API keys for two tenants and an admin
token, serving python models that double their input after a fixed time per batch (one row a
batch, so each computation shows in the workers' `rows_computed`).

- `cache_tenants_apart` (H3): tenant a sends 20 inputs to a model with a cache; tenant b then
  sends the same 20. A hit would tell b that someone sent them, by `Server-Timing: cache;desc=hit`
  and by its speed (a hit answers in milliseconds, a computation takes 100 ms). Bound: b sees no
  hit and no answer faster than a computation. The controls: a's own repeats are hits (the cache
  works), and on a model declared `shared_across_tenants` the same probe sees every hit (the
  probe would have found them).
- `cache_leader_leaves` (H4): the issue's scenario: a 2 s computation, five identical requests
  waiting for it, and the request that started it disconnects at 0.3 s. Bound: the five get its
  answer, and it is the only computation (rows computed +1, not +6), within 2x its time. Then
  both requests of a computation still queued behind another leave: it is never computed.
- `cache_memory` (H5): 12,000 distinct small answers (4 floats) kept. Bound: the cache's counted
  bytes cover the engine's resident growth (counted >= 0.9x of it); then DELETE of the cache, what
  the engine gives back, and how much it grows when as many answers are kept again (reported, not
  bounded: the allocator decides; what it keeps it reuses).

    python -m bench.hostile --attacks "" --cases cache_tenants_apart,cache_leader_leaves,cache_memory
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.hostile_cases import CaseResult, case
from bench.processes import HOST, ServerProcess, free_port, tree_roles

ADMIN = "hostile-cache-admin-token-0123456789"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
KEYS = {"a": "tenant-a-cache-secret-0123456789", "b": "tenant-b-cache-secret-0123456789"}
KEYS_FILE = f"alpha:{KEYS['a']} tenant=a\nbravo:{KEYS['b']} tenant=b\n"
DOUBLER = textwrap.dedent('''
    import time


    class Doubler:
        def setup(self, config):
            self.execute_s = config["settings"]["execute_ms"] / 1000.0

        def execute(self, inputs):
            if self.execute_s:
                time.sleep(self.execute_s)
            return {"y": inputs["x"] * 2.0}
''')
#: What the probing tenant's timing is compared against: one computation of the probed model.
PROBE_COMPUTE_MS = 100
PROBE_INPUTS = 20
LEADER_COMPUTE_MS = 2000
MEMORY_ENTRIES = 12_000
MEMORY_WARMUP = 1_500


def _model(root: Path, name: str, execute_ms: int, **fields: Any) -> None:
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "doubler.py").write_text(DOUBLER)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "python", "artifact": "doubler.py", "max_batch_size": 1,
        "python": {"entry": "doubler:Doubler", "settings": {"execute_ms": execute_ms}},
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}], **fields}))


def _server(workdir: Path, name: str, models: dict[str, tuple[int, dict[str, Any]]]) -> ServerProcess:
    """A split server of `models` (name -> (execute_ms, cache section)) with the two tenants' keys."""
    root = workdir / "repository"
    for model, (execute_ms, cache) in models.items():
        _model(root, model, execute_ms, cache=cache)
    (workdir / "keys.txt").write_text(KEYS_FILE)
    port = free_port()
    server = ServerProcess(name, [
        sys.executable, "-m", "servewell", "serve", "--host", HOST, "--port", str(port),
        "--grpc-port", str(free_port()), "--model-repository", str(root), "--ingress-processes", "1",
        "--api-keys-file", str(workdir / "keys.txt"), "--admin-token", ADMIN,
        "--cache-dir", str(workdir / "cache")], port, workdir / "server.log")
    server.start()
    server.wait_ready(180)
    return server


def _body(value: float) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [value, value, -value, 1.0]}]}


def _cache_said(answer: httpx.Response) -> str | None:
    for part in answer.headers.get("server-timing", "").split(","):
        name, _, desc = part.strip().partition(";desc=")
        if name == "cache":
            return desc
    return None


def _rows_computed(http: httpx.Client, model: str) -> int:
    health = http.get("/healthz", headers=ADMIN_AUTH).json()
    return int(sum(i["rows_computed"] for i in health["models"][model]["instances"]))


def _probe(http: httpx.Client, model: str, tenant: str, values: list[float]) -> dict[str, Any]:
    """Send `values` as `tenant`, one at a time: hit ratio and latencies (ms) seen by that tenant."""
    hits, latencies = 0, []
    for value in values:
        started = time.perf_counter()
        answer = http.post(f"/v2/models/{model}/infer", json=_body(value), headers={"X-API-Key": KEYS[tenant]})
        latencies.append((time.perf_counter() - started) * 1000)
        answer.raise_for_status()
        hits += _cache_said(answer) == "hit"
    return {"hit_ratio": hits / len(values), "median_ms": round(statistics.median(latencies), 2),
            "fastest_ms": round(min(latencies), 2)}


@case("cache_tenants_apart")
def cache_tenants_apart(workdir: Path) -> CaseResult:
    """H3: tenant b learns nothing, by Server-Timing or by timing, of the inputs tenant a sent."""
    server = _server(workdir, "servewell-hostile-cache-tenants", {
        "private": (PROBE_COMPUTE_MS, {"max_bytes": 1 << 20}),
        "public": (PROBE_COMPUTE_MS, {"max_bytes": 1 << 20, "shared_across_tenants": True})})
    values = [1000.0 + i for i in range(PROBE_INPUTS)]
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            _probe(http, "private", "a", values)
            _probe(http, "public", "a", values)
            b_private = _probe(http, "private", "b", values)
            a_repeats = _probe(http, "private", "a", values)
            b_public = _probe(http, "public", "b", values)
    finally:
        server.stop()
    closed = b_private["hit_ratio"] == 0 and b_private["fastest_ms"] >= 0.8 * PROBE_COMPUTE_MS
    controls = (a_repeats["hit_ratio"] == 1 and b_public["hit_ratio"] == 1
                and b_public["median_ms"] < PROBE_COMPUTE_MS / 2)
    return CaseResult(
        "cache_tenants_apart",
        f"tenant b, sending the {PROBE_INPUTS} inputs tenant a sent to a cached model, sees no cache;desc=hit and no "
        f"answer faster than 0.8x a computation ({PROBE_COMPUTE_MS} ms); controls: a's own repeats are all hits, and "
        "on a model with shared_across_tenants b's probe sees every hit",
        passed=closed and controls,
        figures={"b_on_private": b_private, "a_repeats_on_private": a_repeats, "b_on_shared_model": b_public,
                 "compute_ms": PROBE_COMPUTE_MS})


async def _leader_leaves(url: str) -> dict[str, Any]:
    key = {"X-API-Key": KEYS["a"]}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        leader = asyncio.ensure_future(client.post("/v2/models/slow/infer", json=_body(7.0), headers=key))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        followers = [asyncio.ensure_future(client.post("/v2/models/slow/infer", json=_body(7.0), headers=key))
                     for _ in range(5)]
        await asyncio.sleep(0.2)  # 0.3 s after the leader
        leader.cancel()
        answers = await asyncio.gather(*followers)
        elapsed_s = time.monotonic() - started
    return {"statuses": [a.status_code for a in answers], "cache": [_cache_said(a) for a in answers],
            "followers_s": round(elapsed_s, 2)}


async def _all_leave_while_queued(url: str) -> dict[str, Any]:
    key = {"X-API-Key": KEYS["a"]}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        blocker = asyncio.ensure_future(client.post("/v2/models/slow/infer", json=_body(8.0), headers=key))
        await asyncio.sleep(0.1)  # the blocker runs; the next computation queues behind it
        queued = [asyncio.ensure_future(client.post("/v2/models/slow/infer", json=_body(9.0), headers=key))
                  for _ in range(2)]
        await asyncio.sleep(0.3)
        for request in queued:
            request.cancel()
        answer = await blocker
    return {"blocker_status": answer.status_code}


@case("cache_leader_leaves")
def cache_leader_leaves(workdir: Path) -> CaseResult:
    """H4: a leader that disconnects hands its computation to the requests waiting for it."""
    server = _server(workdir, "servewell-hostile-cache-leader", {"slow": (LEADER_COMPUTE_MS, {"max_bytes": 1 << 20})})
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            before = _rows_computed(http, "slow")
            handed = asyncio.run(_leader_leaves(server.url))
            time.sleep(0.5)
            handed["computations"] = _rows_computed(http, "slow") - before
            before = _rows_computed(http, "slow")
            dropped = asyncio.run(_all_leave_while_queued(server.url))
            time.sleep(LEADER_COMPUTE_MS / 1000 + 0.5)  # a computation of the queued inputs would have ended by now
            dropped["computations"] = _rows_computed(http, "slow") - before
    finally:
        server.stop()
    held = (handed["statuses"] == [200] * 5 and handed["computations"] == 1
            and handed["followers_s"] < 2 * LEADER_COMPUTE_MS / 1000)
    return CaseResult(
        "cache_leader_leaves",
        f"five requests waiting for a {LEADER_COMPUTE_MS} ms computation whose leader disconnects at 0.3 s all get "
        "its answer from that one computation (rows computed +1), within 2x its time; a computation whose every "
        "request left while it was queued is never computed (+1: only the one it queued behind)",
        passed=held and dropped["computations"] == 1,
        figures={"leader_leaves": handed, "all_leave_while_queued": dropped, "compute_ms": LEADER_COMPUTE_MS})


async def _fill(url: str, first: int, count: int, concurrency: int = 8) -> None:
    """`count` distinct inputs to `small` as tenant a, `concurrency` at a time."""
    key = {"X-API-Key": KEYS["a"]}
    values = iter(range(first, first + count))

    async def client_loop(client: httpx.AsyncClient) -> None:
        for value in values:
            (await client.post("/v2/models/small/infer", json=_body(float(value)), headers=key)).raise_for_status()

    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=concurrency)) as c:
        await asyncio.gather(*(client_loop(c) for _ in range(concurrency)))


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@case("cache_memory")
def cache_memory(workdir: Path) -> CaseResult:
    """H5: max_bytes bounds the engine's real memory: what the cache counts covers what it holds."""
    server = _server(workdir, "servewell-hostile-cache-memory", {"small": (0, {"max_bytes": 64 << 20, "ttl_s": 7200})})
    try:
        engine = tree_roles(server.pid)["engine"][0]
        with httpx.Client(base_url=server.url, timeout=60, headers=ADMIN_AUTH) as http:
            asyncio.run(_fill(server.url, 10_000_000, MEMORY_WARMUP))  # the engine's own first allocations
            http.delete("/admin/models/small/cache").raise_for_status()
            time.sleep(1.0)
            baseline = _rss_bytes(engine)
            started = time.monotonic()
            asyncio.run(_fill(server.url, 0, MEMORY_ENTRIES))
            fill_s = time.monotonic() - started
            kept = http.get("/admin/models/small/cache").json()["cache"]
            full = _rss_bytes(engine)
            cleared = http.delete("/admin/models/small/cache").json()
            time.sleep(1.0)
            after_delete = _rss_bytes(engine)
            asyncio.run(_fill(server.url, 20_000_000, MEMORY_ENTRIES))  # as many again: what was kept is reused
            refilled = _rss_bytes(engine)
    finally:
        server.stop()
    grown = full - baseline
    counted = kept["bytes"]
    return CaseResult(
        "cache_memory",
        f"{MEMORY_ENTRIES} distinct answers of 4 floats: the bytes the cache counts are at least 0.9x the engine's "
        "resident growth (max_bytes bounds real memory); after DELETE its counters are 0 (the memory the engine "
        "gives back is reported: the allocator decides)",
        passed=kept["entries"] == MEMORY_ENTRIES and counted >= 0.9 * grown and cleared["cache"]["bytes"] == 0
        and cleared["cache"]["entries"] == 0,
        figures={"entries": kept["entries"], "counted_bytes": counted,
                 "counted_per_entry": round(counted / max(1, kept["entries"])),
                 "engine_rss_growth_bytes": grown, "rss_growth_per_entry": round(grown / MEMORY_ENTRIES),
                 "counted_over_growth": round(counted / grown, 2) if grown > 0 else None,
                 "returned_after_delete_bytes": full - after_delete,
                 "kept_after_delete_bytes": after_delete - baseline,
                 "growth_when_filled_again_bytes": refilled - after_delete, "fill_s": round(fill_s, 1)})
