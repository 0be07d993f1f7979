"""Sustained overload: 3x the mock engine's capacity (a set service rate: slots / (output_len x
token_ms)) against a `tokenyard serve` process with keys and limits in Redis. No 5xx other than
the intended 503 sheds, no hung request (each finishes or is shed within deadline + service time
+ 1 s), shed replies p99 <= 5 ms with Retry-After, admitted requests' TTFT p99 within the SLO
(the request deadline), the engine drains to zero KV blocks afterwards. Shed latency is measured
by the client (send to reply read) and by the gateway (its access log's duration_ms).

Fast here (4 s); the full run is 60 s: `pytest -m reliability` or `python -m tokenyard.bench.reliability overload`."""
from __future__ import annotations

import json

import pytest
from reliability_common import explain, full_run_selected
from reliability_overload import run_overload


def test_overload_3x_capacity_sheds_fast_and_keeps_slo():
    # The short run checks behaviour (only intended sheds, Retry-After, no hung or late-expired
    # request, KV drained); its latency figures are printed but judged only in the full run, since a
    # 4 s p99 on a shared 2-core machine measures the neighbours as much as the gateway.
    report = run_overload(seconds=4.0, timing_goals=False)
    print(json.dumps(report.figures))
    assert not report.problems, explain(report)


@pytest.mark.reliability
@pytest.mark.timeout(600)
def test_overload_3x_capacity_full(request):
    if not full_run_selected(request.config):
        pytest.skip("full size: pytest -m reliability")
    report = run_overload(seconds=60.0)
    print(json.dumps(report.figures))
    assert not report.problems, explain(report)
