"""Spend reports and drill-down: tenant isolation on every spend endpoint, paging, CSV shape, the CLI table,
and the pure report arithmetic (integer money, rounding)."""
from __future__ import annotations

import csv
import io
import json

import pytest
import redis
import yaml
from gateway_helpers import ROOT, SHARED_REDIS, delete_prefix, mock_deployment, running_gateway, unique_prefix, wait_ledger

from tokenyard.cli.main import main as cli_main
from tokenyard.gateway.auth.api_keys import KeyStore
from tokenyard.gateway.spend import reports as reports
from tokenyard.gateway.spend.store import RollupRow, encode_cursor

PER_TENANT = {"acme": 5, "globex": 3}


@pytest.fixture(scope="module")
def world():
    prefix = unique_prefix("reports")
    client = redis.Redis.from_url(SHARED_REDIS)
    store = KeyStore(client, prefix)
    keys = {t: store.create(t)[0] for t in PER_TENANT}
    keys["admin"] = store.create("ops", role="admin")[0]
    doc = {**mock_deployment(prices={"input": 100_000, "output": 400_000}), "redis_url": SHARED_REDIS,
           "redis_prefix": prefix}
    try:
        with running_gateway(doc) as srv:
            for tenant, n in PER_TENANT.items():
                for i in range(n):
                    status, _, _ = srv.chat({"model": "mock", "messages": [{"role": "user", "content": f"q{i}"}]},
                                            {"Authorization": f"Bearer {keys[tenant]}"})
                    assert status == 200
            wait_ledger(srv)
            yield srv, keys, prefix
    finally:
        client.close()
        delete_prefix(SHARED_REDIS, prefix)


def _get(srv, path: str, key: str, **headers: str):
    status, hdrs, body = srv.request("GET", path, headers={"Authorization": f"Bearer {key}", **headers})
    return status, hdrs, body


def _json(srv, path: str, key: str):
    status, _, body = _get(srv, path, key)
    return status, json.loads(body)


def _all_pages(srv, key: str, query: str = "") -> list[dict]:
    out, cursor = [], None
    for _ in range(50):
        path = f"/v1/spend/requests?limit=2{query}" + (f"&cursor={cursor}" if cursor else "")
        status, page = _json(srv, path, key)
        assert status == 200, page
        out += page["data"]
        cursor = page["next_cursor"]
        if not page["has_more"]:
            return out
    raise AssertionError("paging did not end")


def test_tenant_sees_only_its_own_spend(world):
    srv, keys, _ = world
    for tenant, n in PER_TENANT.items():
        status, rep = _json(srv, "/v1/spend/report?group_by=tenant", keys[tenant])
        assert status == 200 and [r["tenant"] for r in rep["data"]] == [tenant]
        assert rep["total"]["requests"] == n and rep["tenant"] == tenant
        other = next(t for t in PER_TENANT if t != tenant)
        for path in (f"/v1/spend/report?tenant={other}", f"/v1/spend/requests?tenant={other}"):
            status, err = _json(srv, path, keys[tenant])
            assert status == 403 and err["error"]["code"] == "tenant_forbidden" and err["error"]["type"]
        records = _all_pages(srv, keys[tenant])
        assert len(records) == n and {r["tenant"] for r in records} == {tenant}
        assert len({r["request_id"] for r in records}) == n
        # A cursor naming another tenant does not widen the view.
        status, page = _json(srv, "/v1/spend/requests?cursor=" + encode_cursor((2**62, 0), other), keys[tenant])
        assert status == 200 and {r["tenant"] for r in page["data"]} == {tenant}
        status, _, body = _get(srv, "/v1/spend/report?group_by=tenant&format=csv", keys[tenant])
        assert status == 200 and other not in body.decode()


def test_admin_sees_all_or_one_tenant(world):
    srv, keys, _ = world
    status, rep = _json(srv, "/v1/spend/report?group_by=tenant", keys["admin"])
    assert status == 200 and {r["tenant"]: r["requests"] for r in rep["data"]} == PER_TENANT
    status, rep = _json(srv, "/v1/spend/report?group_by=tenant&tenant=globex", keys["admin"])
    assert [r["tenant"] for r in rep["data"]] == ["globex"]
    records = _all_pages(srv, keys["admin"])
    assert len(records) == sum(PER_TENANT.values()) == len({r["request_id"] for r in records})
    times = [r["time"] for r in records]
    assert times == sorted(times, reverse=True)          # newest first across tenants
    assert {r["tenant"] for r in _all_pages(srv, keys["admin"], "&tenant=acme")} == {"acme"}


def test_report_equals_records_and_csv_shape(world):
    srv, keys, _ = world
    records = _all_pages(srv, keys["admin"])
    status, rep = _json(srv, "/v1/spend/report?group_by=day,model&start=1d", keys["admin"])
    assert status == 200 and rep["group_by"] == ["day", "model"]
    assert rep["total"]["cost_micros"] == sum(r["cost_micros"] for r in records)
    assert rep["total"]["completion_tokens"] == sum(r["completion_tokens"] for r in records)
    for accept in ({"Accept": "text/csv"}, {}):
        path = "/v1/spend/report?group_by=model,tenant" + ("" if accept else "&format=csv")
        status, hdrs, body = _get(srv, path, keys["admin"], **accept)
        assert status == 200 and hdrs["content-type"].startswith("text/csv")
        rows = list(csv.reader(io.StringIO(body.decode())))
        assert rows[0] == ["model", "tenant", *reports.COLUMNS]
        assert len(rows) == 1 + len(PER_TENANT) and all(len(r) == len(rows[0]) for r in rows)
        assert sum(int(r[rows[0].index("cost_micros")]) for r in rows[1:]) == rep["total"]["cost_micros"]
        assert all(r[rows[0].index("requests")].isdigit() for r in rows[1:])


@pytest.mark.parametrize("query, param", [("group_by=week", "group_by"), ("start=yesterday", "start"),
                                          ("start=2d&end=1970-01-02", "start"), ("end=3d", "end"),
                                          ("format=xml", "format")])
def test_bad_report_parameters_are_openai_shaped_400s(world, query, param):
    srv, keys, _ = world
    status, err = _json(srv, "/v1/spend/report?" + query, keys["acme"])
    assert status == 400 and err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error"


def test_spend_endpoints_need_a_key(world):
    srv, _, _ = world
    for path in ("/v1/spend/report", "/v1/spend/requests"):
        status, _, body = srv.request("GET", path, headers={"Authorization": ""})
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    status, err = _json(srv, "/v1/spend/requests?cursor=nonsense", world[1]["acme"])
    assert status == 400 and err["error"]["code"] == "invalid_cursor"


def test_cli_report_table(world, tmp_path, capsys):
    srv, _, prefix = world
    cfg = tmp_path / "d.yaml"
    cfg.write_text(yaml.safe_dump({"redis_prefix": prefix, "engines": {
        "mock": {"type": "mock", "model": str(ROOT / "models" / "demo-small")}}}))
    assert cli_main(["spend", "--config", str(cfg), "--redis-url", SHARED_REDIS, "report", "--by", "model",
                     "--since", "7d"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(out) if line.startswith("model"))
    assert out[header].split()[:3] == ["model", "requests", "prompt"]
    assert out[header + 1].split()[:2] == ["mock", str(sum(PER_TENANT.values()))]
    assert out[-1].split()[:2] == ["TOTAL", str(sum(PER_TENANT.values()))]
    assert cli_main(["spend", "--config", str(cfg), "--redis-url", SHARED_REDIS, "report", "--by", "tenant",
                     "--format", "csv"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert [r[0] for r in rows[1:]] == sorted(PER_TENANT)
    assert cli_main(["spend", "--config", str(cfg), "report", "--by", "nope"]) == 2


def test_report_arithmetic_is_integer_and_exact():
    rows = [RollupRow("a", "small", 100, 2, 30, 10, 7, 5, 40, 0), RollupRow("a", "large", 100, 1, 3, 0, 1, 9, 9, 1),
            RollupRow("b", "small", 125, 1, 1, 0, 0, 1, 2, 0)]
    by_model = {r["model"]: r for r in reports.aggregate(rows, ["model"])}
    assert by_model["small"]["cost_micros"] == 6 and by_model["small"]["savings_micros"] == 36
    assert by_model["small"]["total_tokens"] == 38
    assert by_model["small"]["cost_per_million_tokens_micros"] == (6 * 1_000_000 + 19) // 38
    days = reports.aggregate(rows, ["day"])
    assert [d["day"] for d in days] == ["1970-01-05", "1970-01-06"]
    assert reports.money(1_234_567) == "1.234567" and reports.money(-5) == "-0.000005"
    assert reports.money(0) == "0.000000"
    assert reports.hour_range(3600, 7201) == (1, 3) and reports.hour_range(3601, 7200) == (2, 2)
    assert reports.parse_since("2h", now=10_000) == 2800 and reports.parse_time("1970-01-01T01:00:00Z") == 3600
    assert reports.totals(rows)["errors"] == 1
    assert reports.aggregate([], ["model"]) == [] and reports.totals([])["cost_per_million_tokens_micros"] is None
