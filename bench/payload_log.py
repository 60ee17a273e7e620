"""The payload log's cost (issue 24): throughput of the tiny MLP with the log off and logging 100 %
of requests, and proof that its sinks got every record or counted it as dropped.

    flock /tmp/servewell-bench.lock .venv/bin/python -m bench.payload_log [--rounds 3] [--seconds 8]

One server (`servewell serve`, the split as in production) serves the MLP (512 -> 2048 -> 512,
ONNX, one instance, max batch 32). Its `payload_log` section is changed between phases through its
--config file (applied live, so every phase runs on the same processes); per round, in rotating
order, a closed loop of `--clients` clients for `--seconds` per phase:

* `off`: the log off (the default);
* `file`: 100 % of requests to a rotating JSONL file (`--content`: tensors, the default, or digests);
* `file_http`: the file and a CloudEvents receiver on 127.0.0.1 in binary mode (a request and a
  response event per request, one POST each, as KServe's logger);
* `file_http_batch`: the same receiver in batch mode (many events per POST).

The receiver runs in this process, on the same 2 cores: its CPU is counted against the server
(a real sink runs elsewhere). After each phase the queues are left to drain, then per sink:
written + dropped + failed (from /metrics) must equal the requests the server answered, the
file must hold as many new lines as were written, and the receiver as many request events.

Goal (median over rounds): throughput with the log on >= 0.95x off, for each phase.
JSON: bench/results/payload_log.json.
"""

from __future__ import annotations

import argparse
import resource
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.processes import ServerProcess, TreeCpu, closed_loop, free_port, role_groups, run_module
from bench.report import finish_rounds, median_over
from bench.workspace import RESULTS, WORK, ServedModel, prepare

GOAL_THROUGHPUT_RATIO = 0.95
PHASES = ("off", "file", "file_http", "file_http_batch")


class CountingReceiver:
    """Counts the request events POSTed to it (binary or batch mode), answering 200 at once."""

    def __init__(self) -> None:
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                kind = self.headers.get("ce-type", "")
                n = body.count(b'"org.kubeflow.serving.inference.request"') if not kind else \
                    int(kind.endswith(".request"))
                with receiver._lock:
                    receiver.requests += n
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/events"
        threading.Thread(target=self.server.serve_forever, args=(0.1,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def phase_settings(phase: str, log_path: Path, receiver: CountingReceiver, content: str) -> dict[str, Any]:
    # A file of its own per phase (1 GiB before rotating): its lines are that phase's records.
    section: dict[str, Any] = {"enabled": phase != "off", "content": content,
                               "file": {"path": str(log_path), "max_bytes": 1 << 30}}
    if phase.startswith("file_http"):
        section["http"] = {"url": receiver.url, "mode": "batch" if phase.endswith("batch") else "binary"}
    return {"config_poll_s": 0.5, "payload_log": section}


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name.startswith(("servewell_payload_log", "servewell_requests_total")):
                samples[s.name, tuple(sorted(s.labels.items()))] = s.value
    return samples


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def apply_phase(server: ServerProcess, config: Path, settings: dict[str, Any]) -> None:
    config.write_text(yaml.safe_dump(settings))
    want = settings["payload_log"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        live = httpx.get(server.url + "/admin/config", timeout=10).json()["server"]["settings"]["payload_log"]
        if (live["enabled"] == want["enabled"] and live["file"]["path"] == want["file"]["path"]
                and (live["http"] or {}).get("mode") == want.get("http", {}).get("mode")):
            return
        time.sleep(0.2)
    raise RuntimeError(f"the payload_log section was not applied within 30 s; see {server.log_path}")


def drained(server: ServerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The metrics once the log's queues are empty and its counts stopped moving."""
    last = None
    for _ in range(200):
        samples = scrape(server.url)
        waiting = total(samples, "servewell_payload_log_queue_depth")
        counts = {k: v for k, v in samples.items() if k[0] == "servewell_payload_log_records_total"}
        if waiting == 0 and counts == last:
            return samples
        last = counts
        time.sleep(0.3)
    raise RuntimeError("the payload log did not drain within a minute")


def lines_in(path: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in path.parent.glob(path.name + "*"))


def run_phase(server: ServerProcess, phase: str, args: argparse.Namespace, bodies: list[Path], log_path: Path,
              receiver: CountingReceiver, r: int) -> dict[str, Any]:
    before, events_before = drained(server), receiver.requests
    meter, own = TreeCpu(server.pid).start(), resource.getrusage(resource.RUSAGE_SELF)
    summary = closed_loop(server.url, "/v2/models/mlp/infer", bodies, args.clients, args.seconds, 1.0,
                          RESULTS / f"payload_log_{phase}_{r}.json", RESULTS / "logs" / "loadgen.log")
    spent, now = role_groups(meter.stop()), resource.getrusage(resource.RUSAGE_SELF)
    receiver_s = now.ru_utime + now.ru_stime - own.ru_utime - own.ru_stime  # this process: the receiver
    after = drained(server)

    def delta(name: str, **labels: str) -> int:
        return round(total(after, name, **labels) - total(before, name, **labels))

    answered = delta("servewell_requests_total", model="mlp")
    per_request = 1e6 / max(1, answered)
    row: dict[str, Any] = {"ok_per_s": summary["throughput_rps"], "statuses": summary["status_counts"],
                           "answered": answered,
                           "cpu_us_per_request": {k: round(v * per_request, 1) for k, v in spent.items()
                                                  if k in ("engine", "ingress", "worker", "total")},
                           "receiver_cpu_us_per_request": round(receiver_s * per_request, 1)}
    if phase != "off":
        sinks = ("file", "http") if phase.startswith("file_http") else ("file",)
        for sink in sinks:
            outcomes = {o: delta("servewell_payload_log_records_total", sink=sink, outcome=o)
                        for o in ("written", "dropped", "failed")}
            received = lines_in(log_path) if sink == "file" else receiver.requests - events_before
            row[sink] = {**outcomes, "received": received,
                         "accounted": sum(outcomes.values()) == answered and received == outcomes["written"]}
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--content", choices=("tensors", "digests"), default="tensors")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, from {', '.join(PHASES)}")
    parser.add_argument("--out", type=Path, default=RESULTS / "payload_log.json")
    args = parser.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if "off" not in phases or set(phases) - set(PHASES):
        parser.error(f"--phases takes off and any of {', '.join(PHASES)}")
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    run_module("bench.models", ["--work", str(WORK), "--skip-resnet"], timeout_s=300,
               log_path=RESULTS / "logs" / "build.log")
    workspace = prepare([ServedModel("mlp", "mlp", {"threads": 1, "instances": 1, "max_batch_size": 32})])
    logs = WORK / "payload_log"
    logs.mkdir(parents=True, exist_ok=True)
    for old in logs.iterdir():
        old.unlink()
    log_path, config = logs / "payload.jsonl", logs / "server.yaml"
    receiver = CountingReceiver()
    config.write_text(yaml.safe_dump(phase_settings("off", log_path, receiver, args.content)))
    port = free_port()
    server = ServerProcess("payload_log", [sys.executable, "-m", "servewell", "serve", "--host", "127.0.0.1",
                                           "--port", str(port), "--model-repository", str(workspace.repository),
                                           "--config", str(config), "--grpc-port", "0"],
                           port, RESULTS / "logs" / "payload_log_server.log")
    rounds: list[dict[str, Any]] = []
    try:
        server.start()
        server.wait_ready(180)
        for r in range(args.rounds):
            row: dict[str, Any] = {}
            for phase in phases[r % len(phases):] + phases[:r % len(phases)]:
                phase_log = logs / f"{phase}_{r}.jsonl"
                apply_phase(server, config, phase_settings(phase, phase_log, receiver, args.content))
                row[phase] = run_phase(server, phase, args, workspace.bodies["mlp"], phase_log, receiver, r)
                for written in logs.glob("*.jsonl*"):  # counted: the disk is not for keeping them
                    if written.name.split(".")[0] != f"{phase}_{r}":
                        written.unlink()
            for phase in phases[1:]:
                row[phase]["throughput_ratio"] = row[phase]["ok_per_s"] / row["off"]["ok_per_s"]
            rounds.append(row)
            print(f"round {r + 1}: " + ", ".join(f"{p} {row[p]['ok_per_s']:.0f}/s" for p in phases), flush=True)
    finally:
        server.stop()
        receiver.close()
    median_of = median_over(rounds)

    def median(*path: str) -> float:
        """The median over rounds of row[path[0]][path[1]]... (0 where a round lacks it)."""
        def value(row: dict[str, Any]) -> float:
            node: Any = row
            for key in path:
                node = node.get(key, 0.0) if isinstance(node, dict) else 0.0
            return float(node)
        return median_of(value)

    report: dict[str, Any] = {"goal_throughput_ratio": GOAL_THROUGHPUT_RATIO, "content": args.content,
                              "clients": args.clients, "seconds": args.seconds, "phases": phases}
    for phase in phases:
        report[f"{phase}_ok_per_s"] = median(phase, "ok_per_s")
        if phase != "off":
            report[f"{phase}_throughput_ratio"] = median(phase, "throughput_ratio")
            report[f"{phase}_accounted"] = all(row[phase][s]["accounted"] for row in rounds
                                               for s in ("file", "http") if s in row[phase])

    def print_table(doc: dict[str, Any]) -> None:
        print(f"\nmedian of {len(rounds)} round(s), {args.clients} clients, content {args.content}")
        print(f"{'phase':<17} {'ok/s':>8} {'vs off':>8}  {'goal':<8} {'every record accounted':<24}")
        for phase in phases:
            if phase == "off":
                print(f"{phase:<17} {doc['off_ok_per_s']:>8.0f}")
                continue
            ratio = doc[f"{phase}_throughput_ratio"]
            verdict = "PASS" if ratio >= GOAL_THROUGHPUT_RATIO else "FAIL"
            accounted = "yes" if doc[f"{phase}_accounted"] else "NO"
            print(f"{phase:<17} {doc[f'{phase}_ok_per_s']:>8.0f} {ratio:>7.3f}x  >= {GOAL_THROUGHPUT_RATIO} "
                  f"{verdict}  {accounted}")
        print("\nCPU us per request (median): engine, ingress (all), worker, server total; the receiver (this "
              "process)")
        for phase in phases:
            cpu = {k: median(phase, "cpu_us_per_request", k)
                   for k in ("engine", "ingress", "worker", "total")}
            receiver_us = median(phase, "receiver_cpu_us_per_request")
            print(f"{phase:<17} " + "  ".join(f"{k} {v:.0f}" for k, v in cpu.items()) + f"  receiver {receiver_us:.0f}")

    finish_rounds(report, rounds, print_table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
