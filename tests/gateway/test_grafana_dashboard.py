"""The Grafana board in docs/grafana: it is what make_dashboard.py writes, and every metric its
PromQL names is one a running gateway exports (the NVML gauges: the names device_metrics emits on
a GPU host), so a renamed metric cannot leave a panel silently empty."""
from __future__ import annotations

import json
import re
import sys

from gateway_helpers import ROOT, mock_deployment, running_gateway

from tokenyard.gateway.observability.device_metrics import NAMES as GPU_NAMES

BOARD = ROOT / "docs" / "grafana" / "tokenyard.json"
SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


def _exported(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            names.add(name)
            names.update(name + s for s in SUFFIXES if kind in ("counter", "histogram") or s == "_total")
    return names


def test_the_committed_board_is_what_the_script_writes():
    sys.path.insert(0, str(ROOT / "docs" / "grafana"))
    try:
        import make_dashboard
    finally:
        sys.path.pop(0)
    assert json.loads(BOARD.read_text()) == make_dashboard.dashboard()


def test_every_metric_the_board_names_is_exported():
    board = json.loads(BOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    named = {m for e in exprs for m in re.findall(r"\btokenyard_[a-z0-9_]+", e)}
    with running_gateway(mock_deployment()) as srv:
        status, _, _ = srv.chat({"model": "mock", "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200
        status, _, body = srv.request("GET", "/metrics")
        assert status == 200
    exported = _exported(body.decode()) | set(GPU_NAMES)
    assert len(named) >= 15
    assert not named - exported, sorted(named - exported)
    for name in ("tokenyard_engine_busy_seconds_total", "tokenyard_engine_batch_size_bucket",
                 "tokenyard_slo_requests_total", "tokenyard_spend_micros_total"):
        assert name in body.decode(), name     # the load and SLO metrics are there with samples
