"""CPU a refused request costs the server, against a served one (issue 46: refuse before reading).

    flock /tmp/servewell-bench.lock .venv/bin/python -m bench.refusal_cost [--rounds 3] [--seconds 8]

One server (`servewell serve`, the default split: supervisor, engine, ingress processes) serves
two models with the same input, a [1, 512] FP32 row:

* `mlp`, the tiny MLP of `bench.frontend_cost` (ONNX, one instance, threads 1): every request is
  served;
* `held`, a Python model whose one instance sleeps `--hold-s` per batch of one, with
  `max_queue_size: 1`: two requests sent once per round (one computing, one queued) keep its
  lane full, so every other request to it is refused with 503 `overloaded`. The engine publishes
  whom its full lanes refuse, and an ingress process answers those requests before it reads
  their bodies.

Each round, a closed loop of `--clients` sends the MLP's OIP JSON bodies (about 6 KB) to each
model for `--seconds`, in alternating order, and the CPU of every process of the server (from
/proc, user + system) is divided by the requests sent: CPU per served request against CPU per
refused one, and the refusals' latency. The ratio within each round is the verdict (median over
rounds): the machine is shared and noisy. Goal (issue 46): a refused request costs at most 0.3x
of a served one. JSON: bench/results/refusal_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.processes import ServerProcess, TreeCpu, closed_loop, free_port, role_groups, run_module
from bench.workspace import RESULTS, WORK, ServedModel, prepare

#: Issue 46's goal: CPU per refused request / CPU per served request.
GOAL_RATIO = 0.3

HELD_MODEL = '''
import time

import numpy as np


class Held:
    """Sleeps `hold_s` per batch: its one instance is busy, and its lane of one stays full."""

    def setup(self, config):
        self.hold_s = float(config["settings"]["hold_s"])

    def execute(self, inputs):
        time.sleep(self.hold_s)
        return {"output": np.zeros_like(inputs["input"])}
'''


def write_held(repository: Path, hold_s: float) -> None:
    """The `held` model: one instance, batches of one, one queued request fills its lane."""
    directory = repository / "held"
    directory.mkdir(exist_ok=True)
    (directory / "held.py").write_text(HELD_MODEL)
    row = {"datatype": "FP32", "shape": [512]}
    long_ms = min(600_000.0, 2 * hold_s * 1000)
    (directory / "model.yaml").write_text(yaml.safe_dump({
        "runtime": "python", "artifact": "held.py", "python": {"entry": "held:Held", "settings": {"hold_s": hold_s}},
        "inputs": [{"name": "input", **row}], "outputs": [{"name": "output", **row}],
        "max_batch_size": 1, "warmup": False,
        "batching": {"max_queue_size": 1, "default_timeout_ms": long_ms, "compute_timeout_ms": long_ms},
    }))


def hold_lane(url: str, body: bytes, hold_s: float) -> list[threading.Thread]:
    """Send the two requests that keep `held`'s lane full (answered or dropped when the server stops)."""
    def send() -> None:
        try:
            httpx.post(f"{url}/v2/models/held/infer", content=body, headers={"content-type": "application/json"},
                       timeout=2 * hold_s + 30)
        except httpx.HTTPError:
            pass  # the server stopped with them in flight

    threads = []
    for _ in range(2):
        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        threads.append(thread)
        time.sleep(0.3)  # the first is computing before the second queues
    return threads


def wait_refusing(url: str, body: bytes, timeout_s: float = 30.0) -> dict[str, Any]:
    """Wait until a request to `held` is refused with `overloaded` (its full lane); the error."""
    ends = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < ends:
        response = httpx.post(f"{url}/v2/models/held/infer", content=body,
                              headers={"content-type": "application/json"}, timeout=5)
        last = response.text
        if response.status_code == 503 and "overloaded" in last:
            doc: dict[str, Any] = response.json()
            return doc
        time.sleep(0.2)
    raise RuntimeError(f"the held model's lane never refused a request as overloaded; last answer: {last}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--hold-s", type=float, default=300.0, help="how long the held model sleeps per batch")
    parser.add_argument("--out", type=Path, default=RESULTS / "refusal_cost.json")
    args = parser.parse_args(argv)
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    run_module("bench.models", ["--work", str(WORK), "--skip-resnet"], timeout_s=300,
               log_path=RESULTS / "logs" / "build.log")
    workspace = prepare([ServedModel("mlp", "mlp", {"threads": 1, "instances": 1, "max_batch_size": 32})])
    write_held(workspace.repository, args.hold_s)
    bodies = workspace.bodies["mlp"]
    port = free_port()
    server = ServerProcess("refusal_cost", [sys.executable, "-m", "servewell", "serve", "--host", "127.0.0.1",
                                            "--port", str(port), "--model-repository", str(workspace.repository),
                                            "--log-format", "json"],
                           port, RESULTS / "logs" / "refusal_cost_server.log", env={"SERVEWELL_GRPC_PORT": "0"})
    server.start()
    rounds: list[dict[str, Any]] = []
    try:
        server.wait_ready(180)
        hold_lane(server.url, bodies[0].read_bytes(), args.hold_s)
        refusal = wait_refusing(server.url, bodies[0].read_bytes())
        print(f"held's lane is full: {refusal.get('error', refusal)}", flush=True)
        for r in range(args.rounds):
            row: dict[str, Any] = {}
            for key in ("served", "refused") if r % 2 == 0 else ("refused", "served"):
                model = "mlp" if key == "served" else "held"
                meter = TreeCpu(server.pid).start()
                summary = closed_loop(server.url, f"/v2/models/{model}/infer", bodies, args.clients, args.seconds,
                                      1.0, RESULTS / f"refusal_cost_{key}_{r}.json", RESULTS / "logs" / "loadgen.log")
                spent = meter.stop()
                groups = role_groups(spent)
                sent = max(1, summary["sent"])
                statuses = summary["status_counts"]
                row[key] = {"requests": summary["sent"], "statuses": statuses,
                            "answered_per_s": round(summary["answered_in_window"] / summary["window_s"], 1),
                            "all_us_per_request": round(1e6 * groups["total"] / sent, 1),
                            "roles_us_per_request": {k: round(1e6 * v / sent, 1) for k, v in spent.items()},
                            "latency_ms": summary["classes"]["normal"]["latency_ms"],
                            "refusal_latency_ms": summary["classes"]["normal"]["refusal_latency_ms"]}
            for key, status in (("served", "200"), ("refused", "503")):
                others = {s: n for s, n in row[key]["statuses"].items() if s != status}
                if others:
                    raise RuntimeError(f"round {r + 1}: {key} requests got {others} besides {status}")
            refused_as = row["refused"]["refusal_latency_ms"]["n"]  # answered 503 overloaded, in the window
            if refused_as != sum(row["refused"]["statuses"].values()):
                raise RuntimeError(f"round {r + 1}: not every refusal was 'overloaded': {row['refused']}")
            row["ratio"] = row["refused"]["all_us_per_request"] / row["served"]["all_us_per_request"]
            rounds.append(row)
            print(f"round {r + 1}: served {row['served']['all_us_per_request']:.0f} us/request "
                  f"({row['served']['answered_per_s']:.0f}/s), refused {row['refused']['all_us_per_request']:.0f} "
                  f"us/request ({row['refused']['answered_per_s']:.0f}/s): {row['ratio']:.3f}x", flush=True)
    finally:
        server.stop()
    report = {"goal_ratio": GOAL_RATIO, "clients": args.clients, "seconds": args.seconds, "rounds": rounds,
              "median_ratio": statistics.median(r["ratio"] for r in rounds)}
    print_table(report)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"written to {args.out}")
    return 0


def print_table(report: dict[str, Any]) -> None:
    """Medians of the rounds, the goal beside the ratio."""
    rows = report["rounds"]

    def median(key: str, field: str) -> float:
        return statistics.median(r[key][field] for r in rows)

    def refusal_ms(stat: str) -> float:
        return statistics.median(r["refused"]["refusal_latency_ms"][stat] for r in rows)

    ratio = report["median_ratio"]
    print(f"\nmedian of {len(rows)} round(s), {report['clients']} clients; CPU of every server process per request")
    print(f"served  (mlp, 200):  {median('served', 'all_us_per_request'):8.1f} us/request, "
          f"{median('served', 'answered_per_s'):.0f}/s")
    print(f"refused (held, 503): {median('refused', 'all_us_per_request'):8.1f} us/request, "
          f"{median('refused', 'answered_per_s'):.0f}/s, p50 {refusal_ms('p50'):.2f} ms, "
          f"p99 {refusal_ms('p99'):.2f} ms")
    roles = sorted({role for r in rows for role in r["refused"]["roles_us_per_request"]})
    print("refused, by process: " + ", ".join(
        f"{role} {statistics.median(r['refused']['roles_us_per_request'].get(role, 0.0) for r in rows):.0f}"
        for role in roles))
    verdict = "PASS" if ratio <= GOAL_RATIO else "FAIL"
    print(f"refused / served: {ratio:.3f}x   goal <= {GOAL_RATIO}x  {verdict}")


if __name__ == "__main__":
    sys.exit(main())
