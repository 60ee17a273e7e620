"""Cost of the process hop per batch against compute, for ResNet-50 served at saturation.

    python -m bench.transport

Serves ResNet-50 (two 1-thread instances, max batch 8), drives it with a closed loop for a
fixed time, then reads the server's own histograms: `servewell_batch_transport_seconds`
(round trip to the worker minus the compute the worker measured: shared-memory writes and
reads, the pipe, the wake-ups) against `servewell_batch_compute_seconds`. Target: under 5%.
Writes bench/results/transport.json.
"""

from __future__ import annotations

import json
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from bench.processes import HOST, ServerProcess, closed_loop, free_port, http_json, run_module
from bench.workspace import RESULTS, WORK, ServedModel, prepare

MODEL = ServedModel("resnet50", "resnet50", {"threads": 1, "instances": 2, "max_batch_size": 8})


def sums(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") == "resnet50" and sample.name.endswith(("_sum", "_count")):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def main() -> int:
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    (RESULTS / "runs").mkdir(parents=True, exist_ok=True)
    run_module("bench.models", ["--work", str(WORK)], timeout_s=300, log_path=RESULTS / "logs" / "build.log")
    workspace = prepare([MODEL])
    port = free_port()
    server = ServerProcess("servewell-transport", [
        sys.executable, "-m", "servewell", "serve", "--grpc-port", "0", "--model-repository", str(workspace.repository),
        "--host", HOST, "--port", str(port), "--load-timeout-s", "180",
    ], port, RESULTS / "logs" / "servewell-transport.log")
    server.start()
    try:
        server.wait_ready(240)
        http_json(port, "GET", "/healthz")
        load = closed_loop(server.url, "/predict", workspace.bodies["resnet50"], 16, 15, 3,
                           RESULTS / "runs" / "transport_resnet50.json", RESULTS / "logs" / "loadgen.log")
        served = load["throughput_rps"]
        totals = sums(server.url)
    finally:
        server.stop()
    compute = totals["servewell_batch_compute_seconds_sum"]
    transport = totals["servewell_batch_transport_seconds_sum"]
    batches = totals["servewell_batch_compute_seconds_count"]
    doc = {"batches": batches, "compute_ms_per_batch": 1000 * compute / batches,
           "transport_ms_per_batch": 1000 * transport / batches, "transport_vs_compute": transport / compute,
           "served_img_s": served}
    (RESULTS / "transport.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"batches {batches:.0f}; compute {doc['compute_ms_per_batch']:.1f} ms/batch; transport "
          f"{doc['transport_ms_per_batch']:.2f} ms/batch; transport/compute {100 * doc['transport_vs_compute']:.2f}% "
          f"(target < 5%); served {served:.1f} img/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
