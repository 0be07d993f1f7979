"""Redis outage under traffic, on a PRIVATE redis-server (own port, append-only file) that the test
stops and starts again; the shared Redis on 6379 is never touched. Two gateways: one with
rate_limits.on_redis_error open, one closed. During the outage cached keys authenticate (open:
200 without limit headers, limits not applied; closed: 503 rate_limiter_unavailable with
Retry-After), keys unknown to the cache get 503 auth_unavailable, bad keys never get in. After
it, limits apply again (a key over its rpm is 429 again) and no spend is lost: one record per
served request, equal to the usage the client saw, rollups equal to the records.

Fast here (~2 s outage); full (30 s): `pytest -m reliability` or `python -m tokenyard.bench.reliability redis`."""
from __future__ import annotations

import json

import pytest
from reliability_common import explain, full_run_selected
from reliability_redis import run_redis_outage


def test_redis_outage_and_back():
    report = run_redis_outage(2.0)
    print(json.dumps(report.figures))
    assert not report.problems, explain(report)


@pytest.mark.reliability
@pytest.mark.timeout(600)
def test_redis_outage_full(request):
    if not full_run_selected(request.config):
        pytest.skip("full size: pytest -m reliability")
    report = run_redis_outage(30.0)
    print(json.dumps(report.figures))
    assert not report.problems, explain(report)
