"""Writes docs/grafana/tokenyard.json, the Grafana dashboard for a Tokenyard gateway's /metrics.

    python docs/grafana/make_dashboard.py

Kept as code so each panel's PromQL is in one readable list; tests/gateway/test_grafana_dashboard.py checks
that every metric an expression names is one the gateway exports. Import the JSON in Grafana
(Dashboards > New > Import) and pick the Prometheus data source that scrapes the gateway.
"""
from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "tokenyard.json"
W5 = "[5m]"


def quantile(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le, engine) (rate({histogram}_bucket{W5})))"


# (title, unit, [(legend, PromQL)])
PANELS = [
    ("TTFT p50 / p99 by engine", "s", [
        ("p50 {{engine}}", quantile(0.5, "tokenyard_time_to_first_token_seconds")),
        ("p99 {{engine}}", quantile(0.99, "tokenyard_time_to_first_token_seconds"))]),
    ("ITL p50 / p99 by engine", "s", [
        ("p50 {{engine}}", quantile(0.5, "tokenyard_inter_token_latency_seconds")),
        ("p99 {{engine}}", quantile(0.99, "tokenyard_inter_token_latency_seconds"))]),
    ("TPOT p50 by engine", "s", [
        ("{{engine}}", quantile(0.5, "tokenyard_time_per_output_token_seconds"))]),
    ("SLO attainment by engine", "percentunit", [
        ("{{engine}}", f'sum by (engine) (rate(tokenyard_slo_requests_total{{outcome="met"}}{W5})) / '
                       f"sum by (engine) (rate(tokenyard_slo_requests_total{W5}))")]),
    ("Requests/s by engine and status", "reqps", [
        ("{{engine}} {{status}}", f"sum by (engine, status) (rate(tokenyard_requests_total{W5}))")]),
    ("Gateway queue depth", "short", [
        ("{{engine}} {{priority}}", "sum by (engine, priority) (tokenyard_admission_queue_depth)")]),
    ("Shed and rate-limited requests/s", "reqps", [
        ("shed {{reason}}", f"sum by (reason) (rate(tokenyard_admission_shed_total{W5}))"),
        ("rate limited", f"sum(rate(tokenyard_rate_limited_total{W5}))")]),
    ("KV-cache usage", "percentunit", [("{{engine}}", "tokenyard_engine_kv_usage_ratio")]),
    ("Engine busy fraction", "percentunit", [("{{engine}}", "rate(tokenyard_engine_busy_seconds_total[1m])")]),
    ("Engine tokens/s", "short", [
        ("output {{engine}}", "rate(tokenyard_engine_output_tokens_total[1m])"),
        ("prefill {{engine}}", "rate(tokenyard_engine_prefill_tokens_total[1m])")]),
    ("Sequences per step p50 / p90", "short", [
        ("p50 {{engine}}", quantile(0.5, "tokenyard_engine_batch_size")),
        ("p90 {{engine}}", quantile(0.9, "tokenyard_engine_batch_size"))]),
    ("Speculation acceptance", "percentunit", [("{{engine}}", "tokenyard_engine_spec_acceptance_ratio")]),
    ("Spend rate by model (currency units per hour)", "short", [
        ("{{engine}}", "sum by (engine) (rate(tokenyard_spend_micros_total[1h])) * 3600 / 1e6")]),
    # Per tenant: not here. /metrics never names tenants; the spend report (GET /v1/spend/report?group_by=
    # tenant, or the dashboard) has spend by tenant, key, user and tag.
    ("GPU utilisation (NVML)", "percentunit", [("gpu {{gpu}}", "tokenyard_gpu_utilization_ratio")]),
    ("GPU memory (NVML)", "bytes", [("used {{gpu}}", "tokenyard_gpu_memory_used_bytes"),
                                     ("total {{gpu}}", "tokenyard_gpu_memory_total_bytes")]),
    ("GPU power (NVML)", "watt", [("gpu {{gpu}}", "tokenyard_gpu_power_watts")]),
]


def dashboard() -> dict:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": (i % 2) * 12, "y": (i // 2) * 8},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend}
                        for j, (legend, expr) in enumerate(targets)]})
    return {
        "title": "Tokenyard gateway", "uid": "tokenyard-gateway", "schemaVersion": 39, "version": 1,
        "time": {"from": "now-6h", "to": "now"}, "refresh": "30s", "tags": ["tokenyard", "llm-serving"],
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus"}]},
        "panels": panels,
    }


if __name__ == "__main__":
    OUT.write_text(json.dumps(dashboard(), indent=1) + "\n")
    print(f"wrote {OUT}")
