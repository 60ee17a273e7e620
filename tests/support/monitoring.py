"""What the monitoring files in deploy/ contain, and what servewell exposes, for the tests of
the rules, the dashboard and a real Prometheus."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]  # the repository
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
ALERTS = PROMETHEUS_DIR / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "servewell-dashboard.json"

#: Metric families servewell exposes at /metrics (observability/metrics.py), by type.
HISTOGRAMS = (
    "servewell_request_duration_seconds", "servewell_queue_wait_seconds", "servewell_preprocess_seconds",
    "servewell_batch_compute_seconds", "servewell_batch_transport_seconds", "servewell_postprocess_seconds",
    "servewell_batch_size", "servewell_trace_step_seconds", "servewell_batch_compute_by_size_seconds",
)
COUNTERS = ("servewell_requests", "servewell_model_loads", "servewell_worker_restarts", "servewell_config_reloads",
            "servewell_process_restarts")
#: Counters for diagnosis only: exposed, deliberately on neither the dashboard nor the rules.
DIAGNOSTIC_COUNTERS = ("servewell_http_fast_path_requests",)
GAUGES = (
    "servewell_queue_depth", "servewell_inflight_requests", "servewell_model_state", "servewell_worker_up",
    "servewell_effective_max_batch_size", "servewell_worker_resident_memory_bytes",
    "servewell_worker_private_memory_bytes", "servewell_worker_mapped_file_memory_bytes",
    "servewell_worker_cpu_seconds", "servewell_worker_threads", "servewell_memory_budget_bytes", "servewell_ready",
    "servewell_config_rejected_files",
)
#: The model pool's families (issue 21), on the dashboard's "Model pool" row.
POOL_FAMILIES = (
    "servewell_model_resident", "servewell_model_pinned", "servewell_model_last_used_timestamp_seconds",
    "servewell_model_estimated_bytes", "servewell_model_pool_models", "servewell_model_evictions_total",
    "servewell_model_pool_requests_total",
    *(f"servewell_model_cold_start_seconds{suffix}" for suffix in ("_bucket", "_sum", "_count")),
)
#: Tenants and the response cache (issue 22), on the dashboard's "Tenants and response cache" row.
TENANT_CACHE_FAMILIES = (
    "servewell_tenant_requests_total", "servewell_response_cache_requests_total",
    "servewell_response_cache_evictions_total", "servewell_response_cache_bytes", "servewell_response_cache_entries",
    *(f"servewell_tenant_request_duration_seconds{suffix}" for suffix in ("_bucket", "_sum", "_count")),
)
#: Pipelines (issue 23), on the dashboard's "Pipelines" row.
PIPELINE_FAMILIES = (
    "servewell_pipeline_steps_total",
    *(f"servewell_pipeline_step_duration_seconds{suffix}" for suffix in ("_bucket", "_sum", "_count")),
)
#: Safe rollouts (issue 24), on the dashboard's "Rollouts" row and in the rollout alerts.
ROLLOUT_FAMILIES = (
    "servewell_rollout_requests_total", "servewell_rollout_events_total", "servewell_shadow_requests_total",
    "servewell_shadow_rows_total", "servewell_shadow_top1_matches_total", "servewell_rollout_weight",
    "servewell_rollout_rolled_back", "servewell_rollout_state",
    *(f"{histogram}{suffix}" for histogram in ("servewell_shadow_max_abs_diff", "servewell_shadow_latency_seconds")
      for suffix in ("_bucket", "_sum", "_count")),
)
#: The payload log (issue 24), on the dashboard's "Payload log" row.
PAYLOAD_LOG_FAMILIES = (
    "servewell_payload_log_records_total", "servewell_payload_log_drops_total", "servewell_payload_log_queue_depth",
    "servewell_payload_log_sink_failing",
)
#: Streams of generative models (issue 48): in the time-to-first-output alert.
STREAM_FAMILIES = (
    "servewell_stream_outputs_total", "servewell_sequences_ended_total",
    *(f"{histogram}{suffix}" for histogram in ("servewell_time_to_first_output_seconds",
                                              "servewell_time_between_outputs_seconds", "servewell_sequences_per_step")
      for suffix in ("_bucket", "_sum", "_count")),
)
#: The on-call views (issue 47): each model's diagnosis (the rules' advice defers to it), the server's
#: own processes' memory, the response cache's repeats against its TTL.
ONCALL_FAMILIES = (
    "servewell_diagnosis", "servewell_process_resident_memory_bytes", "servewell_response_cache_reuses_total",
    *(f"servewell_response_cache_reuse_interval_seconds{suffix}" for suffix in ("_bucket", "_sum", "_count")),
)
GPU_GAUGES = (
    "servewell_gpu_utilization_ratio", "servewell_gpu_memory_used_bytes", "servewell_gpu_memory_total_bytes",
    "servewell_gpu_power_watts", "servewell_gpu_temperature_celsius",
)
#: Series names as Prometheus stores them.
SERIES = frozenset(
    [f"{h}{suffix}" for h in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")]
    + [f"{c}_total" for c in COUNTERS + DIAGNOSTIC_COUNTERS] + list(GAUGES) + list(GPU_GAUGES) + list(POOL_FAMILIES)
    + list(TENANT_CACHE_FAMILIES) + list(PIPELINE_FAMILIES) + list(ROLLOUT_FAMILIES) + list(PAYLOAD_LOG_FAMILIES)
    + list(STREAM_FAMILIES) + list(ONCALL_FAMILIES)
)
METRIC_NAME = re.compile(r"\bservewell_[a-z0-9_]+")
RECORDED_NAME = re.compile(r"\bservewell:[a-z0-9_:]+")



def rules() -> list[dict[str, Any]]:
    """Every rule of deploy/prometheus/alerts.yml (recording and alerting)."""
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def alerts() -> list[dict[str, Any]]:
    """The alerting rules."""
    return [rule for rule in rules() if "alert" in rule]


def dashboard() -> dict[str, Any]:
    """The Grafana dashboard's JSON model."""
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def panels() -> list[dict[str, Any]]:
    """The dashboard's panels, without its row headers."""
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def scraped_total(url: str, name: str, headers: dict[str, str] | None = None, **labels: str) -> float:
    """The sum of the samples of `name` with these labels in `url`/metrics (0 when there is none);
    `headers`: the scrape's credentials (with API keys configured, /metrics is an operator's)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(url + "/metrics", headers=headers, timeout=10)
    response.raise_for_status()
    total = 0.0
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
