"""Tenants on one model at saturation (issue 22): weighted fair queuing against first in, first out.

    flock /tmp/servewell-bench.lock .venv/bin/python -m bench.tenant_fairness [--seconds 20]

One server (`servewell serve`, the split as in production) with a keys file, serving `paced`: a
PyTorch model that sleeps `--batch-ms` (20) per batch of up to 4 rows, one instance, so it
serves at most 200 rows/s whatever the machine does (the model, not the front end, is the
bottleneck; its queue holds 4096 per lane). Load comes from this process: open-loop arrivals
(latency from the scheduled arrival), one keep-alive connection per request in flight. Phases:

* weights: three tenants of weights 1, 2 and 4, each a closed loop of 16 clients: rows
  answered per tenant, and in all: the model's capacity C as served here;
* alone: the light tenant alone, Poisson at C / 11 (so light + heavy below offer C: the model is
  saturated, and the heavy tenant's backlog does not grow without end);
* fair: the light tenant as above plus the heavy tenant (another tenant, equal weight) sending
  10x as much in bursts: every second, its arrivals spread over the first 250 ms;
* fifo (the baseline, today's first-in-first-out inside a lane): the same two loads with two
  keys of one tenant (one tenant is exactly the queue before tenants);
* admission (issue 46, fair admission): on `paced_default`, the same model with the default
  batching settings (its default lane bound, no `queue=` quotas), the light tenant at 0.4 C
  alone, then with the heavy tenant sending 4 C: the lane is full most of the time, and a tenant
  within its share must still be admitted (goal: light answered >= 99 %, p99 <= 1.3x alone);
* fault: the fair phase again; halfway, the model's worker is killed (SIGKILL). Counted per
  tenant: requests lost in flight (503 `worker_lost`: the batch the worker held, at most 4
  rows) and requests refused while no worker could serve (503 `model_not_ready`, the
  documented answer while the model restarts: each tenant's arrivals during the restart).

Between phases the server's queues drain. Goals: light p99 in fair <= 1.3x alone, light
answered/s in fair within 5 % of what it sent; shares within 5 % of 1:2:4 (each share /
expected); in the fault phase no tenant loses more in flight than the batch (4). The fifo
numbers are printed beside the fair ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import yaml

from bench.processes import ServerProcess, free_port, http_json
from bench.workspace import RESULTS, WORK
from servewell.perf.httpclient import encode_request
from servewell.perf.loop import collector_paused
from servewell.perf.oip_http import HttpOipConnection
from servewell.perf.stats import summarize_ms

GOAL_P99_RATIO = 1.3
GOAL_ADMITTED = 0.99  # issue 46: a tenant within its share keeps its requests while another floods
GOAL_SHARE_ERROR = 0.05
BATCH = 4
PACED = textwrap.dedent('''
    import time

    import torch
    from torch import nn


    class Paced(nn.Module):
        """Echoes its input after a fixed time per batch: a model that serves N rows/s on any machine."""

        def __init__(self, batch_ms: float = 20.0):
            super().__init__()
            self.delay_s = batch_ms / 1000.0
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, x):
            time.sleep(self.delay_s)
            return x * self.scale


    def build(batch_ms: float = 20.0):
        return Paced(batch_ms)
''')
SECRETS = {name: f"{name}-bench-secret-0123456789" for name in
           ("light", "heavy", "light-pooled", "heavy-pooled", "w1", "w2", "w4")}
KEYS_FILE = "\n".join([
    f"light:{SECRETS['light']} tenant=light",
    f"heavy:{SECRETS['heavy']} tenant=heavy",
    f"light-pooled:{SECRETS['light-pooled']} tenant=pooled",
    f"heavy-pooled:{SECRETS['heavy-pooled']} tenant=pooled",
    f"w1:{SECRETS['w1']} tenant=w1 weight=1",
    f"w2:{SECRETS['w2']} tenant=w2 weight=2",
    f"w4:{SECRETS['w4']} tenant=w4 weight=4",
]) + "\n"
BODY = b'{"inputs":[{"name":"x","shape":[1,1],"datatype":"FP32","data":[1.0]}]}'


def build_repository(root: Path, batch_ms: float) -> Path:
    """The `paced` model (a safetensors file of one weight and its factory)."""
    import torch
    from safetensors.torch import save_file

    for name, batching in (("paced", {"max_queue_size": 4096, "default_timeout_ms": 60000}),
                           ("paced_default", None)):  # the second: the default batching settings
        directory = root / "repository" / name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "paced_factory.py").write_text(PACED)
        save_file({"scale": torch.ones(1)}, str(directory / "model.safetensors"))
        config: dict[str, Any] = {
            "runtime": "pytorch", "artifact": "model.safetensors", "max_batch_size": BATCH, "warmup": False,
            "pytorch": {"factory": "paced_factory:build", "factory_kwargs": {"batch_ms": batch_ms}},
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}]}
        if batching is not None:
            config["batching"] = batching
        (directory / "model.yaml").write_text(yaml.safe_dump(config))
    (root / "keys.txt").write_text(KEYS_FILE)
    return root / "repository"


class Client:
    """Requests of one key: latency from each scheduled arrival, status counts; connections reused."""

    def __init__(self, port: int, key: str, model: str = "paced") -> None:
        self.port = port
        self.request = encode_request("POST", f"127.0.0.1:{port}", f"/v2/models/{model}/infer", BODY,
                                      {"X-API-Key": SECRETS[key]})
        self._idle: list[HttpOipConnection] = []
        self.latencies_ms: list[float] = []
        self.statuses: dict[str, int] = {}
        self.sent = 0

    async def send(self, arrival: float) -> None:
        connection = self._idle.pop() if self._idle else HttpOipConnection("127.0.0.1", self.port)
        self.sent += 1
        try:
            reply = await connection.send(self.request)
            status = reply.status if reply.ok else f"{reply.status} {reply.code}"
        except OSError as exc:
            connection.close()
            self.statuses[type(exc).__name__] = self.statuses.get(type(exc).__name__, 0) + 1
            return
        self._idle.append(connection)
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if reply.ok:
            self.latencies_ms.append((time.monotonic() - arrival) * 1000)

    def close(self) -> None:
        for connection in self._idle:
            connection.close()

    def summary(self, seconds: float) -> dict[str, Any]:
        ok = self.statuses.get("200", 0)
        return {"sent": self.sent, "ok": ok, "ok_per_s": ok / seconds, "statuses": dict(self.statuses),
                "latency_ms": summarize_ms(self.latencies_ms)}


def poisson(rate: float, seconds: float, rng: random.Random) -> list[float]:
    times, t = [], rng.expovariate(rate)
    while t < seconds:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def bursts(rate: float, seconds: float, rng: random.Random, on_s: float = 0.25) -> list[float]:
    """`rate` per second on average, all of each second's arrivals inside its first `on_s`."""
    times = []
    for second in range(int(seconds)):
        times += sorted(second + rng.uniform(0, on_s) for _ in range(round(rate)))
    return times


async def open_loop(clients: dict[str, tuple[Client, list[float]]], on_half: Any = None) -> None:
    """Send each client's arrivals on time (each in a task); `on_half()` is called halfway."""
    with collector_paused():  # its pauses would count as the server's latency (servewell.perf.loop)
        await _open_loop(clients, on_half)


async def _open_loop(clients: dict[str, tuple[Client, list[float]]], on_half: Any) -> None:
    start = time.monotonic() + 0.05
    tasks: list[asyncio.Task[None]] = []
    span = max((times[-1] for _, times in clients.values() if times), default=0.0)

    async def schedule(client: Client, times: list[float]) -> None:
        for t in times:
            delay = start + t - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(client.send(start + t)))

    async def halfway() -> None:
        await asyncio.sleep(max(0.0, start + span / 2 - time.monotonic()))
        on_half()

    extra = [asyncio.create_task(halfway())] if on_half is not None else []
    await asyncio.gather(*(schedule(c, times) for c, times in clients.values()), *extra)
    await asyncio.gather(*tasks)


async def closed_loop(clients: dict[str, Client], per_tenant: int, seconds: float) -> None:
    stop_at = time.monotonic() + seconds

    async def one(client: Client) -> None:
        while time.monotonic() < stop_at:
            await client.send(time.monotonic())

    await asyncio.gather(*(one(c) for c in clients.values() for _ in range(per_tenant)))


def drain(port: int, model: str = "paced", timeout_s: float = 120.0) -> None:
    """Wait until the model has nothing queued or running."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, doc = http_json(port, "GET", "/healthz")
        if not doc["models"][model]["queue_depth"]:
            time.sleep(1.0)  # the batch in hand (and answers on their way) too
            return
        time.sleep(0.5)
    raise RuntimeError("the model's queue did not drain")


def worker_pid(port: int) -> int:
    _, doc = http_json(port, "GET", "/healthz")
    return int(doc["models"]["paced"]["instances"][0]["pid"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--batch-ms", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=22)
    parser.add_argument("--out", type=Path, default=RESULTS / "tenant_fairness.json")
    args = parser.parse_args(argv)
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    work = WORK / "tenant_fairness"
    repository = build_repository(work, args.batch_ms)
    port = free_port()
    server = ServerProcess("tenant_fairness", [
        sys.executable, "-m", "servewell", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--model-repository", str(repository), "--api-keys-file", str(work / "keys.txt"), "--log-format", "json"],
        port, RESULTS / "logs" / "tenant_fairness.log", env={"SERVEWELL_GRPC_PORT": "0"})
    server.start()
    server.wait_ready(180)
    rng = random.Random(args.seed)
    seconds = args.seconds
    report: dict[str, Any] = {"seconds": seconds, "nominal_capacity_rows_per_s": BATCH * 1000 / args.batch_ms}
    try:
        weighted = {name: Client(port, name) for name in ("w1", "w2", "w4")}
        asyncio.run(closed_loop(weighted, 16, seconds))
        total = sum(c.statuses.get("200", 0) for c in weighted.values())
        report["weights"] = {name: {**c.summary(seconds), "share": c.statuses.get("200", 0) / max(1, total)}
                             for name, c in weighted.items()}
        report["capacity_rows_per_s"] = capacity = total / seconds
        rate = capacity / 11
        report.update(light_rate=rate, heavy_rate=10 * rate)
        shares = ", ".join(f"{name} {doc['share']:.3f}" for name, doc in report["weights"].items())
        print(f"weights: {shares}; capacity {capacity:.0f} rows/s; light {rate:.1f}/s, heavy {10 * rate:.1f}/s",
              flush=True)
        drain(port)
        for phase, light_key, heavy_key in (("alone", "light", None), ("fair", "light", "heavy"),
                                            ("fifo", "light-pooled", "heavy-pooled")):
            load = {"light": (Client(port, light_key), poisson(rate, seconds, rng))}
            if heavy_key is not None:
                load["heavy"] = (Client(port, heavy_key), bursts(10 * rate, seconds, rng))
            asyncio.run(open_loop(load))
            report[phase] = {name: client.summary(seconds) for name, (client, _) in load.items()}
            print(f"{phase}: " + "; ".join(f"{n} {d['ok_per_s']:.1f} ok/s of {d['sent'] / seconds:.1f} sent, p99 "
                                           f"{d['latency_ms']['p99']} ms" for n, d in report[phase].items()),
                  flush=True)
            drain(port)
        admission_rate = 0.4 * capacity
        report.update(admission_light_rate=admission_rate, admission_heavy_rate=4 * capacity)
        for phase, heavy_key in (("admission_alone", None), ("admission", "heavy")):
            load = {"light": (Client(port, "light", "paced_default"), poisson(admission_rate, seconds, rng))}
            if heavy_key is not None:
                load["heavy"] = (Client(port, heavy_key, "paced_default"), poisson(4 * capacity, seconds, rng))
            asyncio.run(open_loop(load))
            report[phase] = {name: client.summary(seconds) for name, (client, _) in load.items()}
            print(f"{phase}: " + "; ".join(f"{n} {d['ok_per_s']:.1f} ok/s of {d['sent'] / seconds:.1f} sent, p99 "
                                           f"{d['latency_ms']['p99']} ms" for n, d in report[phase].items()),
                  flush=True)
            drain(port, "paced_default")
        victim = worker_pid(port)
        load = {"light": (Client(port, "light"), poisson(rate, seconds, rng)),
                "heavy": (Client(port, "heavy"), bursts(10 * rate, seconds, rng))}
        asyncio.run(open_loop(load, on_half=lambda: os.kill(victim, signal.SIGKILL)))
        report["fault"] = {name: client.summary(seconds) for name, (client, _) in load.items()}
        print("fault: " + "; ".join(f"{n} {d['statuses']}" for n, d in report["fault"].items()), flush=True)
        drain(port)
    finally:
        server.stop()
    verdicts = judge(report)
    report["verdicts"] = verdicts
    print_table(report, verdicts)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"written to {args.out}")
    return 0


def judge(report: dict[str, Any]) -> dict[str, Any]:
    """The goals' figures."""
    alone, fair, fifo = report["alone"]["light"], report["fair"]["light"], report["fifo"]["light"]
    expected = {"w1": 1 / 7, "w2": 2 / 7, "w4": 4 / 7}
    failed = {name: d["statuses"].get("503 worker_lost", 0) for name, d in report["fault"].items()}
    refused = {name: d["statuses"].get("503 model_not_ready", 0) for name, d in report["fault"].items()}
    admitted_alone, admitted = report["admission_alone"]["light"], report["admission"]["light"]
    return {
        "admission_light_served": admitted["ok"] / max(1, admitted["sent"]),
        "admission_light_p99_ratio": admitted["latency_ms"]["p99"] / admitted_alone["latency_ms"]["p99"],
        "admission_light_p90_ratio": admitted["latency_ms"]["p90"] / admitted_alone["latency_ms"]["p90"],
        "admission_heavy_statuses": report["admission"]["heavy"]["statuses"],
        "light_p99_ratio_fair": fair["latency_ms"]["p99"] / alone["latency_ms"]["p99"],
        "light_p99_ratio_fifo": fifo["latency_ms"]["p99"] / alone["latency_ms"]["p99"],
        "light_served_fair": fair["ok"] / max(1, fair["sent"]),
        "light_served_fifo": fifo["ok"] / max(1, fifo["sent"]),
        "share_errors": {n: report["weights"][n]["share"] / expected[n] - 1 for n in expected},
        "fault_failed": failed,
        "fault_refused_while_restarting": refused,
        "fault_other": {name: d["sent"] - d["ok"] - failed[name] - refused[name]
                        for name, d in report["fault"].items()},
        "heavy_p50_fair_ms": report["fair"]["heavy"]["latency_ms"]["p50"],
        "heavy_p50_fifo_ms": report["fifo"]["heavy"]["latency_ms"]["p50"],
        "median_share_error": statistics.median(abs(v) for v in
                                                (report["weights"][n]["share"] / expected[n] - 1 for n in expected)),
    }


def print_table(report: dict[str, Any], v: dict[str, Any]) -> None:
    """Each goal beside its figure; the FIFO baseline beside the fair figure."""
    worst_share = max(abs(e) for e in v["share_errors"].values())
    rows = [
        ("light p99, with heavy / alone", f"{v['light_p99_ratio_fair']:.2f}x (fifo {v['light_p99_ratio_fifo']:.2f}x)",
         f"<= {GOAL_P99_RATIO}x", v["light_p99_ratio_fair"] <= GOAL_P99_RATIO),
        ("light answered / sent, with heavy", f"{v['light_served_fair']:.3f} (fifo {v['light_served_fifo']:.3f})",
         ">= 0.95", v["light_served_fair"] >= 1 - GOAL_SHARE_ERROR),
        ("shares 1:2:4, worst error",
         f"{worst_share:.3f} ({', '.join(f'{k} {e:+.3f}' for k, e in v['share_errors'].items())})",
         f"<= {GOAL_SHARE_ERROR}", worst_share <= GOAL_SHARE_ERROR),
        ("admission (default lane bound): light answered / sent", f"{v['admission_light_served']:.3f}",
         f">= {GOAL_ADMITTED}", v["admission_light_served"] >= GOAL_ADMITTED),
        ("admission: light p99, with heavy at 4 C / alone", f"{v['admission_light_p99_ratio']:.2f}x",
         f"<= {GOAL_P99_RATIO}x", v["admission_light_p99_ratio"] <= GOAL_P99_RATIO),
        ("  light p90, with heavy at 4 C / alone", f"{v['admission_light_p90_ratio']:.2f}x", "(reference)", None),
        ("  heavy's answers", str(v["admission_heavy_statuses"]), "(reference)", None),
        ("worker killed: lost in flight per tenant", str(v["fault_failed"]), f"<= {BATCH} each",
         all(n <= BATCH for n in v["fault_failed"].values()) and not any(v["fault_other"].values())),
        ("  refused while it restarted (model_not_ready)", str(v["fault_refused_while_restarting"]), "(reference)",
         None),
        ("heavy p50, fair / fifo", f"{v['heavy_p50_fair_ms']} / {v['heavy_p50_fifo_ms']} ms", "(reference)", None),
    ]
    alone = report["alone"]["light"]["latency_ms"]["p99"]
    print(f"light alone: p99 {alone} ms; capacity {report['capacity_rows_per_s']:.0f} rows/s as served, offered "
          f"{report['light_rate'] + report['heavy_rate']:.0f}/s")
    width = max(len(r[0]) for r in rows)
    for figure, value, goal, ok in rows:
        verdict = "-" if ok is None else ("PASS" if ok else "FAIL")
        print(f"{figure:<{width}}  {goal:<12} {verdict:<5} {value}")


if __name__ == "__main__":
    raise SystemExit(main())
