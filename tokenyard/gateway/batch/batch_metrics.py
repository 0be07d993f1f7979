"""The Batch API on /metrics: what this gateway's runner is doing (a collector read at scrape time).

    tokenyard_batch_runs                    batches this gateway is running now
    tokenyard_batch_lines_in_flight         batch lines running now
    tokenyard_batch_line_limit              the adaptive cap on them (adaptive_limit.py)
    tokenyard_batch_loop_lag_seconds        the event loop's mean lag the cap follows
    tokenyard_batch_lines_total{outcome}    lines this gateway answered: completed (200) or failed
"""
from __future__ import annotations

from typing import Any, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class BatchCollector(Collector):
    def __init__(self, runner: Any) -> None:
        self._runner = runner

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        r = self._runner
        yield GaugeMetricFamily("tokenyard_batch_runs", "Batches this gateway is running", value=len(r.runs))
        yield GaugeMetricFamily("tokenyard_batch_lines_in_flight", "Batch lines running in this gateway",
                                value=r.limit.running)
        yield GaugeMetricFamily("tokenyard_batch_line_limit", "The adaptive cap on batch lines in flight",
                                value=r.limit.limit)
        yield GaugeMetricFamily("tokenyard_batch_loop_lag_seconds",
                                "The event loop's mean lag over the last 100 ms (what the cap follows)",
                                value=r.limit.lag_s)
        lines = CounterMetricFamily("tokenyard_batch_lines", "Batch lines this gateway answered", labels=["outcome"])
        for outcome in ("completed", "failed"):
            lines.add_metric([outcome], r.answered[outcome])
        yield lines
