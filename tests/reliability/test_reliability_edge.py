"""The edge scenarios of tests/reliability_edge.py: an unauthenticated flood next to real tenants
(with 1,000 concurrent clients) and thousands of slow-header connections next to a normal client,
each against `tokenyard serve` in a process of its own.

Fast here (2 s phases; 6,000 slow connections with the gateway's open-file limit at 4,096, so
without the connection guard it runs out of descriptors); full size: `pytest -m reliability` or
`python -m tokenyard.bench.reliability flood` / `slow-connections`."""
from __future__ import annotations

import json

import pytest
from reliability_common import explain, full_run_selected
from reliability_edge import run_slow_connections, run_unauth_flood


def test_unauthenticated_flood_and_1000_clients():
    report = run_unauth_flood(2.0, flooders=400, clients=1000, pool_size=16)
    print(json.dumps(report.figures))
    assert not report.problems, explain(report)


def test_slow_connections():
    report = run_slow_connections(6000, 4000, max_connections=1024, fd_limit=4096, header_timeout_s=1.0)
    print(json.dumps(report.figures))
    assert not report.problems, explain(report)


@pytest.mark.reliability
@pytest.mark.timeout(600)
def test_unauthenticated_flood_full(request):
    if not full_run_selected(request.config):
        pytest.skip("full size: pytest -m reliability")
    report = run_unauth_flood(30.0, flooders=400, clients=1000, pool_size=64)
    print(json.dumps(report.figures))
    assert not report.problems, explain(report)


@pytest.mark.reliability
@pytest.mark.timeout(600)
def test_slow_connections_full(request):
    if not full_run_selected(request.config):
        pytest.skip("full size: pytest -m reliability")
    report = run_slow_connections(20_400, 18_000, max_connections=4096, fd_limit=None, header_timeout_s=10.0)
    print(json.dumps(report.figures))
    assert not report.problems, explain(report)
