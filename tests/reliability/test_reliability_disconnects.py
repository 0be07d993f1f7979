"""Random client disconnects at random points (before the request is fully sent, before the
response headers, mid-stream, during a non-streamed request), mixed with requests that complete:
no KV block leaks (engine stats back to all-free, nothing in flight in the engine, admission or
gateway), and the spend ledger equals the usage (one record per request that reached the engine,
records equal to what complete clients saw, hourly rollups equal to the sum of the records).

Fast sizes here; full sizes (10,000 mock / 1,000 demo-small) with `pytest -m reliability` or
`python -m tokenyard.bench.reliability disconnects`."""
from __future__ import annotations

import pytest
from reliability_common import explain, full_run_selected
from reliability_disconnects import run_disconnects


def test_random_disconnects_mock_engine():
    report = run_disconnects(300, "mock", seed=11)
    assert not report.problems, explain(report)
    print(report.figures)


def test_random_disconnects_demo_small_engine():
    report = run_disconnects(50, "demo-small", concurrency=16, seed=12)
    assert not report.problems, explain(report)
    print(report.figures)


@pytest.mark.reliability
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("engine,n", [("mock", 10_000), ("demo-small", 1_000)])
def test_random_disconnects_full(request, engine, n):
    if not full_run_selected(request.config):
        pytest.skip("full size: pytest -m reliability")
    report = run_disconnects(n, engine, concurrency=32 if engine == "mock" else 16, seed=21)
    assert not report.problems, explain(report)
    print(report.figures)
