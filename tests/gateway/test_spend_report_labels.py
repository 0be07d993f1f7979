"""Report labels and the operator page's small things (issue 45.9): spend by key names its keys (id as
a second column), the untagged group is "(none)" everywhere (JSON, CSV, CLI, dashboard), the operator
page offers no rollback to a version with the current version's content, its simulation shows per-tenant
rows, and /favicon.ico answers without auth."""
from __future__ import annotations

import csv
import io
import json
import re
import struct
from urllib.parse import urlencode

import pytest
import redis
import yaml
from gateway_helpers import ROOT, SHARED_REDIS, delete_prefix, running_gateway, unique_prefix, wait_ledger
from policy_gateway_helpers import BASE_POLICY, bearer, put_policy, two_engine_deployment

from tokenyard.cli.main import main as cli_main
from tokenyard.gateway.auth.api_keys import KeyStore
from tokenyard.gateway.routes.policy_admin import comparison_rows

COOKIE = "ty_session"
FORM = {"Content-Type": "application/x-www-form-urlencoded"}
POLICY_B = BASE_POLICY.replace("description: test policy", "description: policy B")


@pytest.fixture(scope="module")
def world():
    prefix = unique_prefix("labels")
    client = redis.Redis.from_url(SHARED_REDIS)
    store = KeyStore(client, prefix)
    made = {"named": store.create("acme", name="acme-web"), "unnamed": store.create("acme"),
            "globex": store.create("globex", name="globex-batch"),
            "admin": store.create("ops", role="admin", name="ops-admin")}
    keys = {k: key for k, (key, _) in made.items()}
    ids = {k: rec.key_id for k, (_, rec) in made.items()}
    try:
        with running_gateway(two_engine_deployment(prefix)) as srv:
            for who, tags in (("named", {"team": "search"}), ("named", {}), ("unnamed", {}), ("globex", {})):
                status, _, body = srv.chat({"model": "small", "metadata": tags,
                                            "messages": [{"role": "user", "content": "hi"}]}, bearer(keys[who]))
                assert status == 200, body
            wait_ledger(srv)
            yield srv, keys, ids, prefix
    finally:
        client.close()
        delete_prefix(SHARED_REDIS, prefix)


def _report(srv, key: str, query: str) -> dict:
    status, _, body = srv.request("GET", f"/v1/spend/report?{query}", headers=bearer(key))
    assert status == 200, body
    return json.loads(body)


def test_spend_by_key_names_the_keys(world):
    srv, keys, ids, _ = world
    data = _report(srv, keys["admin"], "group_by=key")["data"]
    by_id = {r["key"]: r for r in data}
    assert by_id[ids["named"]]["key_name"] == "acme-web" and by_id[ids["named"]]["requests"] == 2
    assert by_id[ids["globex"]]["key_name"] == "globex-batch"
    assert by_id[ids["unnamed"]]["key_name"] == ""          # a key without a name: its id only
    # A tenant's key sees its own tenant's keys (and names) only.
    own = _report(srv, keys["named"], "group_by=key")["data"]
    assert {r["key_name"] for r in own} == {"acme-web", ""} and ids["globex"] not in {r["key"] for r in own}
    # CSV: the name first, the id as the second column.
    status, _, body = srv.request("GET", "/v1/spend/report?group_by=key&format=csv", headers=bearer(keys["admin"]))
    rows = list(csv.reader(io.StringIO(body.decode())))
    assert rows[0][:3] == ["key_name", "key", "requests"]
    assert ["acme-web", ids["named"], "2"] == rows[1 + sorted(by_id).index(ids["named"])][:3]
    # From the stream too (two dimensions).
    data = _report(srv, keys["admin"], "group_by=key,tag:team")["data"]
    assert {(r["key_name"], r["tag:team"]) for r in data} >= {("acme-web", "search"), ("acme-web", "(none)")}


def test_the_untagged_group_is_none_everywhere(world, tmp_path, capsys):
    srv, keys, _, prefix = world
    data = _report(srv, keys["admin"], "group_by=tag:team")["data"]
    assert {r["tag:team"]: r["requests"] for r in data} == {"search": 1, "(none)": 3}
    status, _, body = srv.request("GET", "/v1/spend/report?group_by=tag:team&format=csv", headers=bearer(keys["admin"]))
    assert sorted(r[0] for r in list(csv.reader(io.StringIO(body.decode())))[1:]) == ["(none)", "search"]
    cfg = tmp_path / "d.yaml"
    cfg.write_text(yaml.safe_dump({"redis_prefix": prefix, "engines": {
        "mock": {"type": "mock", "model": str(ROOT / "models" / "demo-small")}}}))
    assert cli_main(["spend", "--config", str(cfg), "--redis-url", SHARED_REDIS, "report", "--by", "tag:team"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:2] == ["(none)", "3"] for line in lines), lines
    # The CLI by key: the name column first, then the id.
    assert cli_main(["spend", "--config", str(cfg), "--redis-url", SHARED_REDIS, "report", "--by", "key",
                     "--format", "csv"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows[0][:2] == ["key_name", "key"] and "acme-web" in {r[0] for r in rows[1:]}
    # The dashboard's breakdown: the same "(none)", and key names with the id beside them.
    sid = _sign_in(srv, "/dashboard", keys["admin"])[0]
    page = srv.request("GET", "/dashboard?by=tag&tag=team", headers={"Authorization": "", "Cookie": f"{COOKIE}={sid}"})
    assert page[0] == 200 and b"<td>(none)</td>" in page[2]
    page = srv.request("GET", "/dashboard?by=key", headers={"Authorization": "", "Cookie": f"{COOKIE}={sid}"})[2]
    assert re.search(rb"<td>acme-web</td><td><code>[0-9a-f]{16}</code></td>", page)


def _sign_in(srv, home: str, key: str) -> tuple[str, str]:
    """(session id, csrf token) of a signed-in session on /dashboard or /admin."""
    status, headers, body = srv.request("GET", f"{home}/login", headers={"Authorization": ""})
    sid = re.match(rf"{COOKIE}=([^;]*)", headers["set-cookie"]).group(1)
    token = re.search(rb'name="csrf_token" value="([^"]+)"', body).group(1).decode()
    status, headers, _ = srv.request("POST", f"{home}/login", urlencode({"api_key": key, "csrf_token": token}),
                                     headers={"Authorization": "", "Cookie": f"{COOKIE}={sid}", **FORM})
    assert status == 303
    sid = re.match(rf"{COOKIE}=([^;]*)", headers["set-cookie"]).group(1)
    page = srv.request("GET", home, headers={"Authorization": "", "Cookie": f"{COOKIE}={sid}"})[2]
    token = re.search(rb'name="csrf_token" value="([^"]+)"', page).group(1).decode()
    return sid, token


def test_operator_page_rollback_offers_and_simulation_rows(world):
    srv, keys, _, _ = world
    admin = keys["admin"]
    assert put_policy(srv, admin, BASE_POLICY)[0] == 200           # version 1
    assert put_policy(srv, admin, POLICY_B)[0] == 200              # version 2
    status, body = put_policy(srv, admin, BASE_POLICY)             # version 3: version 1's content again
    assert status == 200 and body["applied"] and body["version"] == 3
    sid, token = _sign_in(srv, "/admin", admin)
    cookie = {"Authorization": "", "Cookie": f"{COOKIE}={sid}"}
    page = srv.request("GET", "/admin", headers=cookie)[2]
    assert b'id="rollback-2"' in page
    assert b'id="rollback-1"' not in page and b'id="rollback-3"' not in page      # same hash as in force
    # Simulate from the page: per-tenant rows as the CLI prints them.
    form = urlencode({"csrf_token": token, "document": POLICY_B, "action": "simulate", "since": "1d"})
    status, _, page = srv.request("POST", "/admin/policy-form", form, headers={**cookie, **FORM})
    assert status == 200 and b'id="simulation"' in page
    assert b'data-row="tenant[acme]"' in page and b'data-row="tenant[globex]"' in page


def test_comparison_rows_have_a_row_per_tenant():
    side = {"requests": 2, "served": 2, "denied": 0, "shed": 0, "downgraded": 0, "degraded": 0, "large_calls": 0,
            "large_share": 0.0, "spend_total": 30, "spend_by_engine": {"small": 30},
            "spend_by_tenant": {"acme": 10, "globex": 20}}
    prop = {**side, "spend_total": 25, "spend_by_tenant": {"acme": 5, "globex": 20}}
    rows = {r[0]: r[1:] for r in comparison_rows({"current": side, "proposed": prop})}
    assert rows["tenant[acme]"] == ("0.00001", "0.000005", "-0.000005")
    assert rows["tenant[globex]"] == ("0.00002", "0.00002", "+0")


def test_favicon_without_auth(world):
    srv = world[0]
    status, headers, body = srv.request("GET", "/favicon.ico", headers={"Authorization": ""})
    assert status == 200 and headers["content-type"] == "image/x-icon"
    reserved, kind, count = struct.unpack("<HHH", body[:6])
    assert (reserved, kind, count) == (0, 1, 1)
    size, offset = struct.unpack("<II", body[14:22])
    assert offset == 22 and len(body) == 22 + size and body[22:30] == b"\x89PNG\r\n\x1a\n"
