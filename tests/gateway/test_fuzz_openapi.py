"""schemathesis against the live /openapi.json (a gateway on a free port, mock engine, Redis, a
valid admin API key): every operation, positive and negative cases, chat requests also naming the
real engine, dashboard pages also signed in. No 5xx; every 4xx body is OpenAI's
{"error": {"message", "type", "param", "code"}} (the one HTML exception: a refused dashboard
sign-in shows the form again, as documented); no error logged.

Fast here (10 examples per operation and mode: about 1,000 cases over the 57 operations; at 20 it was
~2,000 cases and 28-39 s, and on a slower 2-core VM the whole suite passed its 15 minutes); the full
run (150 per mode): `pytest -m reliability` or `python -m tokenyard.bench.reliability fuzz`."""
from __future__ import annotations

import json

import pytest
from reliability_common import explain, full_run_selected
from reliability_fuzz import run_fuzz


def test_fuzz_openapi():
    report = run_fuzz(examples_per_mode=10)
    print(json.dumps(report.figures))
    assert not report.problems, explain(report)
    assert report.figures["cases"] >= 500


@pytest.mark.reliability
@pytest.mark.timeout(900)
def test_fuzz_openapi_full(request):
    if not full_run_selected(request.config):
        pytest.skip("full size: pytest -m reliability")
    report = run_fuzz(examples_per_mode=150, seed=1)
    print(json.dumps(report.figures))
    assert not report.problems, explain(report)
    assert report.figures["cases"] >= 3000
