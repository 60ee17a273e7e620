"""Pieces of `bench.model_pool`: the Zipf sampler, open-loop OIP traffic, the memory sampler, and
readers of the server's metrics and log lines about loads and evictions.

The sampler, the histogram quantile and the readers are pure (tested in tests/unit/bench/);
the traffic runs on one asyncio loop with httpx to 127.0.0.1, bounded in rate, in requests in
flight and in time.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import math
import multiprocessing
import random
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.processes import WORKER, role_of, tree_pids
from servewell.perf.httpclient import parse_server_timing

# -- the Zipf sampler ---------------------------------------------------------------------------------


def zipf_weights(count: int, s: float) -> list[float]:
    """Probabilities of ranks 1..count under Zipf's law with exponent `s` (p(k) ~ 1 / k^s), summing to 1."""
    if count < 1 or s < 0:
        raise ValueError("Zipf needs count >= 1 and s >= 0")
    raw = [1.0 / (k ** s) for k in range(1, count + 1)]
    total = sum(raw)
    return [w / total for w in raw]


class ZipfSampler:
    """Draws items with Zipf-distributed popularity: the first item is rank 1 (the most popular).

    Seeded, so two runs send the same sequence of models.
    """

    def __init__(self, items: list[str], s: float, seed: int) -> None:
        self.items = list(items)
        self.probabilities = zipf_weights(len(self.items), s)
        cumulative, running = [], 0.0
        for p in self.probabilities:
            running += p
            cumulative.append(running)
        cumulative[-1] = 1.0  # float sums can fall a hair short; the last rank takes the rest
        self._cumulative = cumulative
        self._rng = random.Random(seed)

    def draw(self) -> str:
        """One item."""
        return self.items[bisect.bisect_left(self._cumulative, self._rng.random())]

    def share_of_top(self, k: int) -> float:
        """Probability that a draw is one of the `k` most popular items (the best hit rate a cache of
        `k` of them could reach)."""
        return sum(self.probabilities[:k])


def lru_hit_rate(requests: list[str], cost: dict[str, int], budget: int, pinned: set[str]) -> float | None:
    """The hit rate of an ideal LRU pool on `requests`: loads take no time, a miss evicts the least
    recently used models until the new one fits (`cost` each, `budget` in all, `pinned` always
    resident and counted as hits). What the server's policy would reach without load latency."""
    if not requests:
        return None
    room = budget - sum(cost[name] for name in pinned)
    resident: OrderedDict[str, int] = OrderedDict()
    used = hits = 0
    for name in requests:
        if name in pinned or name in resident:
            hits += 1
            if name in resident:
                resident.move_to_end(name)
            continue
        while resident and used + cost[name] > room:
            used -= resident.popitem(last=False)[1]
        if used + cost[name] <= room:
            resident[name] = cost[name]
            used += cost[name]
    return hits / len(requests)


# -- resident memory of a process tree ------------------------------------------------------------------


def status_rss_bytes(status_text: str) -> int | None:
    """VmRSS of a /proc/<pid>/status text in bytes; None when absent (a zombie)."""
    match = re.search(r"^VmRSS:\s+(\d+)\s+kB", status_text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def rollup_pss_bytes(rollup_text: str) -> int | None:
    """Pss of a /proc/<pid>/smaps_rollup text in bytes (shared pages divided among their users)."""
    match = re.search(r"^Pss:\s+(\d+)\s+kB", rollup_text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


@dataclass(slots=True)
class MemoryPeak:
    """The largest sums seen, in bytes, and when (seconds since the sampler started)."""

    workers_rss: int = 0
    all_rss: int = 0
    workers_pss: int = 0
    all_pss: int = 0
    workers_rss_at_s: float = 0.0
    workers_max_count: int = 0
    samples: int = 0
    series: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, workers rss, all rss, workers)


class TreeMemorySampler:
    """Samples RSS and PSS of a server's whole process tree from /proc every `interval_s` on a thread:
    the sum over the model workers (role `worker`: what the memory budget is for) and over every
    process (supervisor, engine, ingress processes too). RSS counts a shared library page in every
    process that maps it, so the RSS sums are the conservative figure; PSS shares those pages out."""

    def __init__(self, root: int, interval_s: float = 0.5) -> None:
        self.root = root
        self.interval_s = interval_s
        self.peak = MemoryPeak()
        self._roles: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0

    def sample(self) -> tuple[int, int, int, int, int]:
        """One reading: (workers RSS, all RSS, workers PSS, all PSS, number of workers)."""
        workers_rss = all_rss = workers_pss = all_pss = workers = 0
        for pid in tree_pids(self.root):
            rss = status_rss_bytes(_read(f"/proc/{pid}/status") or "")
            if rss is None:
                continue
            pss = rollup_pss_bytes(_read(f"/proc/{pid}/smaps_rollup") or "") or 0
            role = self._roles.get(pid)
            if role is None:  # a pid keeps its role while it lives; reused pids are rare within a run
                role = self._roles[pid] = role_of(pid, self.root)
            all_rss += rss
            all_pss += pss
            if role == WORKER:
                workers_rss += rss
                workers_pss += pss
                workers += 1
        return workers_rss, all_rss, workers_pss, all_pss, workers

    def _record(self) -> None:
        workers_rss, all_rss, workers_pss, all_pss, workers = self.sample()
        peak, now = self.peak, time.monotonic() - self._started
        peak.samples += 1
        if workers_rss > peak.workers_rss:
            peak.workers_rss, peak.workers_rss_at_s = workers_rss, now
        peak.all_rss = max(peak.all_rss, all_rss)
        peak.workers_pss = max(peak.workers_pss, workers_pss)
        peak.all_pss = max(peak.all_pss, all_pss)
        peak.workers_max_count = max(peak.workers_max_count, workers)
        peak.series.append((round(now, 2), workers_rss, all_rss, workers))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._record()

    def start(self) -> TreeMemorySampler:
        """Take a first reading and start the thread."""
        self._started = time.monotonic()
        self._record()
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> MemoryPeak:
        """Stop the thread (after a last reading); the peaks."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._record()
        return self.peak


def machine_cpu_ticks(stat_text: str) -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs from a /proc/stat text: busy is everything but idle and
    iowait. Two readings give the cores busy in between: cores x delta busy / delta total."""
    fields = [int(v) for v in stat_text.split("\n", 1)[0].split()[1:]]
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - fields[3] - fields[4], total


def read_machine_cpu_ticks() -> tuple[int, int]:
    """`machine_cpu_ticks` of this machine now."""
    return machine_cpu_ticks(_read("/proc/stat") or "cpu 0 0 0 0 0 0 0 0")


# -- the server's metrics and log lines -----------------------------------------------------------------


@dataclass(slots=True)
class PoolMetrics:
    """What /metrics says about the pool, summed over processes (the server already merges them)."""

    evictions: dict[str, float] = field(default_factory=dict)  # reason -> count
    evictions_by_model: dict[str, float] = field(default_factory=dict)
    cold_start_count: float = 0.0
    cold_start_sum_s: float = 0.0
    cold_start_buckets: dict[float, float] = field(default_factory=dict)  # le -> cumulative count
    pool_requests: dict[str, float] = field(default_factory=dict)  # hit|miss -> count (the server's own count)


def parse_pool_metrics(text: str) -> PoolMetrics:
    """Read `servewell_model_evictions_total` and `servewell_model_cold_start_seconds` from a /metrics text."""
    out = PoolMetrics()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "servewell_model_evictions_total":
                reason = sample.labels.get("reason", "?")
                model = sample.labels.get("model", "?")
                out.evictions[reason] = out.evictions.get(reason, 0.0) + sample.value
                out.evictions_by_model[model] = out.evictions_by_model.get(model, 0.0) + sample.value
            elif sample.name == "servewell_model_cold_start_seconds_count":
                out.cold_start_count += sample.value
            elif sample.name == "servewell_model_cold_start_seconds_sum":
                out.cold_start_sum_s += sample.value
            elif sample.name == "servewell_model_pool_requests_total":
                result = sample.labels.get("result", "?")
                out.pool_requests[result] = out.pool_requests.get(result, 0.0) + sample.value
            elif sample.name == "servewell_model_cold_start_seconds_bucket":
                le = float(sample.labels["le"])
                out.cold_start_buckets[le] = out.cold_start_buckets.get(le, 0.0) + sample.value
    return out


def metrics_delta(after: PoolMetrics, before: PoolMetrics) -> PoolMetrics:
    """What happened between two readings."""
    return PoolMetrics(
        {k: v - before.evictions.get(k, 0.0) for k, v in after.evictions.items()},
        {k: v - before.evictions_by_model.get(k, 0.0) for k, v in after.evictions_by_model.items()},
        after.cold_start_count - before.cold_start_count,
        after.cold_start_sum_s - before.cold_start_sum_s,
        {le: v - before.cold_start_buckets.get(le, 0.0) for le, v in after.cold_start_buckets.items()},
        {k: v - before.pool_requests.get(k, 0.0) for k, v in after.pool_requests.items()},
    )


def histogram_quantile(buckets: dict[float, float], q: float) -> float | None:
    """Prometheus' histogram_quantile: the q-quantile (0..1) of cumulative `le -> count` buckets,
    linear inside the bucket it falls in; None without observations. A quantile in the +Inf
    bucket is reported as the largest finite bound (as Prometheus does)."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower_bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound


_COLD_START = re.compile(r"cold start of (\S+): ([0-9.]+) s \(waited by (\d+) request")
_EVICTED = re.compile(r"evicted (\S+) \((\w+)\)")


@dataclass(slots=True, frozen=True)
class ColdStart:
    """One load triggered by requests, from the server's log line."""

    model: str
    seconds: float
    waiters: int


def read_log_events(lines: Iterable[str]) -> tuple[list[ColdStart], list[tuple[str, str]]]:
    """Cold starts and evictions (model, reason) in JSON log lines: the messages of the engine's
    "cold start of <model>: <s> s (waited by N requests)" and "evicted <model> (<reason>): ..."
    (other lines and unparsable ones are skipped)."""
    starts: list[ColdStart] = []
    evictions: list[tuple[str, str]] = []
    for line in lines:
        if "cold start of" not in line and "evicted" not in line:
            continue
        try:
            message = str(json.loads(line).get("message", ""))
        except (json.JSONDecodeError, AttributeError):
            continue
        if match := _COLD_START.search(message):
            starts.append(ColdStart(match.group(1), float(match.group(2)), int(match.group(3))))
        elif match := _EVICTED.match(message):
            evictions.append((match.group(1), match.group(2)))
    return starts, evictions


def read_log_from(path: Path, offset: int) -> tuple[list[str], int]:
    """The complete lines of `path` from byte `offset`, and the offset after them."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    return data[:end].decode(errors="replace").splitlines(), offset + end


# -- open-loop traffic ----------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Answer:
    """One request's outcome: `status` 0 when no HTTP answer came (then `code` says why)."""

    stream: str  # "probe" or "zipf"
    model: str
    sent_at_s: float  # since the phase started
    status: int
    code: str
    latency_ms: float
    retry_after: str | None
    timing: dict[str, float] | None = None  # the answer's Server-Timing entries (ms), when it sent them


@dataclass(slots=True)
class StreamStats:
    """Bookkeeping of one open loop."""

    skipped: int = 0  # arrivals not sent: `max_in_flight` requests were already waiting
    unfinished: int = 0  # requests still waiting when the phase's grace ran out (cancelled)


def _error_code(response: httpx.Response) -> str:
    """The stable error code: the `X-Error-Code` header, else the body's (`{"error": "...", "code"}` on
    the OIP routes, `{"error": {"code"}}` elsewhere)."""
    header = response.headers.get("x-error-code")
    if header:
        return header
    try:
        doc = response.json()
        return str(doc["code"] if "code" in doc else doc["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"


async def _one(client: httpx.AsyncClient, stream: str, model: str, body: bytes, t0: float,
               answers: list[Answer]) -> None:
    sent = time.perf_counter()
    try:
        response = await client.post(f"/v2/models/{model}/infer", content=body,
                                     headers={"Content-Type": "application/json"})
        code = "" if response.status_code == 200 else _error_code(response)
        timing = response.headers.get("server-timing")
        answers.append(Answer(stream, model, sent - t0, response.status_code, code,
                              (time.perf_counter() - sent) * 1e3, response.headers.get("retry-after"),
                              parse_server_timing(timing.encode("latin-1")) if timing else None))
    except httpx.HTTPError as exc:
        answers.append(Answer(stream, model, sent - t0, 0, type(exc).__name__, (time.perf_counter() - sent) * 1e3,
                              None))


async def open_loop(client: httpx.AsyncClient, stream: str, pick: Callable[[], str], body: bytes,
                    rate_per_s: float, duration_s: float, max_in_flight: int, seed: int, t0: float,
                    answers: list[Answer], tasks: set[asyncio.Task[None]], stats: StreamStats) -> None:
    """Send requests at Poisson arrivals of `rate_per_s` for `duration_s` (each to the model `pick()`
    names), never more than `max_in_flight` waiting at once (an arrival beyond is counted as skipped).
    Returns when the last arrival is sent; the requests still waiting stay in `tasks`."""
    rng = random.Random(seed)
    in_flight: set[asyncio.Task[None]] = set()
    start = time.perf_counter()
    next_at = 0.0
    while True:
        next_at += rng.expovariate(rate_per_s)
        if next_at >= duration_s:
            return
        delay = start + next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(in_flight) >= max_in_flight:
            stats.skipped += 1
            continue
        task = asyncio.create_task(_one(client, stream, pick(), body, t0, answers))
        in_flight.add(task)
        tasks.add(task)
        task.add_done_callback(in_flight.discard)
        task.add_done_callback(tasks.discard)


async def drain(tasks: set[asyncio.Task[None]], grace_s: float) -> int:
    """Wait up to `grace_s` for the requests still waiting; cancel the rest; how many were cancelled."""
    pending = set(tasks)
    if not pending:
        return 0
    _, still = await asyncio.wait(pending, timeout=grace_s)
    for task in still:
        task.cancel()
    if still:
        await asyncio.wait(still, timeout=5.0)
    return len(still)


# -- the probe in a process of its own ------------------------------------------------------------------


class ProbeProcess:
    """The pinned-model probe's open loop in its own process: its latencies must not include the
    load generator's own pauses (in one event loop with the Zipf stream, two probe answers that the
    server gave in 3 ms read 45 ms, the client busy with Zipf answers)."""

    def __init__(self, url: str, model: str, body: bytes, rate_per_s: float, grace_s: float) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_probe_main, args=(child, url, model, body, rate_per_s, grace_s),
                                         name="pool-probe", daemon=True)
        self._process.start()
        child.close()

    def start(self, duration_s: float, seed: int) -> None:
        """Begin one block of `duration_s`; `result` waits for it."""
        self._conn.send((duration_s, seed))

    def result(self, timeout_s: float) -> tuple[list[Answer], StreamStats]:
        """The block's answers and bookkeeping (`RuntimeError` when the probe does not answer)."""
        if not self._conn.poll(timeout_s):
            raise RuntimeError(f"the probe process did not finish its block in {timeout_s:.0f} s")
        answers, stats = self._conn.recv()
        return answers, stats

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._conn.close()


def _probe_main(conn: Connection, url: str, model: str, body: bytes, rate_per_s: float, grace_s: float) -> None:
    while (block := conn.recv()) is not None:
        duration_s, seed = block
        conn.send(asyncio.run(_probe_block(url, model, body, rate_per_s, duration_s, seed, grace_s)))


async def _probe_block(url: str, model: str, body: bytes, rate_per_s: float, duration_s: float, seed: int,
                       grace_s: float) -> tuple[list[Answer], StreamStats]:
    answers: list[Answer] = []
    tasks: set[asyncio.Task[None]] = set()
    stats = StreamStats()
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60.0),
                                 limits=httpx.Limits(max_connections=32)) as client:
        await open_loop(client, "probe", lambda: model, body, rate_per_s, duration_s, 32, seed,
                        time.perf_counter(), answers, tasks, stats)
        stats.unfinished = await drain(tasks, grace_s)
    return answers, stats
