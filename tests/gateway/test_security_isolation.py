"""Tenant isolation and admin-only routes, enumerated from the app's own routes: every /v1/spend*,
/admin*, /dashboard* and /metrics route must have a check here (a new route fails this test until
one is added), and each refuses another tenant's data and non-admins where it should. Also the
session cookie's flags, CSRF on the dashboard's forms, and the body size and JSON depth limits."""
from __future__ import annotations

import json
import re
from urllib.parse import urlencode

import pytest
import redis
from gateway_helpers import KEY, SHARED_REDIS, delete_prefix, mock_deployment, running_gateway, unique_prefix, wait_ledger
from reliability_common import openai_error_shape
from starlette.routing import Route

from tokenyard.gateway.auth.api_keys import KeyStore
from tokenyard.gateway.auth.sessions import COOKIE

FORM = {"Content-Type": "application/x-www-form-urlencoded"}
GUARDED = ("/v1/spend", "/admin", "/dashboard", "/metrics")


def _form_session(srv) -> tuple[str, str]:
    status, headers, body = srv.request("GET", "/dashboard/login", headers={"Authorization": ""})
    sid = re.match(rf"{COOKIE}=([^;]*)", headers["set-cookie"]).group(1)
    return sid, re.search(rb'name="csrf_token" value="([^"]+)"', body).group(1).decode()


def _sign_in(srv, key: str) -> str:
    sid, token = _form_session(srv)
    status, headers, _ = srv.request("POST", "/dashboard/login", urlencode({"api_key": key, "csrf_token": token}),
                                     headers={"Authorization": "", "Cookie": f"{COOKIE}={sid}", **FORM})
    assert status == 303
    return re.match(rf"{COOKIE}=([^;]*)", headers["set-cookie"]).group(1)


@pytest.fixture(scope="module")
def world():
    prefix = unique_prefix("iso")
    client = redis.Redis.from_url(SHARED_REDIS)
    store = KeyStore(client, prefix)
    keys = {"acme": store.create("acme")[0], "globex": store.create("globex")[0]}
    doc = {**mock_deployment(output_len=4), "redis_url": SHARED_REDIS, "redis_prefix": prefix,
           "metrics": {"access": "admin"}, "limits": {"max_body_bytes": 4096}}
    try:
        with running_gateway(doc) as srv:
            for tenant, key in keys.items():
                for _ in range(2):
                    assert srv.chat({"model": "mock", "messages": [{"role": "user", "content": tenant}]},
                                    {"Authorization": f"Bearer {key}"})[0] == 200
            wait_ledger(srv)
            sessions = {t: _sign_in(srv, k) for t, k in keys.items()}
            sessions["admin"] = _sign_in(srv, KEY)
            yield srv, keys, sessions
    finally:
        client.close()
        delete_prefix(SHARED_REDIS, prefix)


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _cookie(sid: str) -> dict[str, str]:
    return {"Authorization": "", "Cookie": f"{COOKIE}={sid}"}


def _forbidden(status: int, body: bytes, code: str = "tenant_forbidden") -> bool:
    return status == 403 and json.loads(body)["error"]["code"] == code


def check_spend_report(srv, keys, sessions):
    acme = _bearer(keys["acme"])
    status, _, body = srv.request("GET", "/v1/spend/report?group_by=tenant", headers=acme)
    assert status == 200 and [r["tenant"] for r in json.loads(body)["data"]] == ["acme"]
    assert _forbidden(*srv.request("GET", "/v1/spend/report?tenant=globex", headers=acme)[::2])
    status, _, body = srv.request("GET", "/v1/spend/report?tenant=globex&format=csv", headers=acme)
    assert status == 403 and b"globex" not in body
    status, _, body = srv.request("GET", "/v1/spend/report?group_by=tenant")      # admin: everyone
    assert status == 200 and {r["tenant"] for r in json.loads(body)["data"]} >= {"acme", "globex"}
    assert srv.request("GET", "/v1/spend/report", headers={"Authorization": ""})[0] == 401


def check_spend_requests(srv, keys, sessions):
    acme = _bearer(keys["acme"])
    status, _, body = srv.request("GET", "/v1/spend/requests?limit=1000", headers=acme)
    data = json.loads(body)["data"]
    assert status == 200 and data and {r["tenant"] for r in data} == {"acme"}
    assert _forbidden(*srv.request("GET", "/v1/spend/requests?tenant=globex", headers=acme)[::2])
    status, _, body = srv.request("GET", "/v1/spend/requests?tenant=globex")
    assert status == 200 and {r["tenant"] for r in json.loads(body)["data"]} == {"globex"}
    assert srv.request("GET", "/v1/spend/requests", headers={"Authorization": ""})[0] == 401


def check_dashboard(srv, keys, sessions):
    status, _, body = srv.request("GET", "/dashboard", headers=_cookie(sessions["acme"]))
    assert status == 200 and b"globex" not in body
    assert _forbidden(*srv.request("GET", "/dashboard?tenant=globex", headers=_cookie(sessions["acme"]))[::2])
    assert srv.request("GET", "/dashboard?tenant=globex", headers=_cookie(sessions["admin"]))[0] == 200
    assert srv.request("GET", "/dashboard", headers={"Authorization": ""})[0] == 303     # not signed in
    assert srv.request("GET", "/dashboard", headers=_bearer(keys["acme"]))[0] == 303    # a key is not a session


def check_spend_csv(srv, keys, sessions):
    status, _, body = srv.request("GET", "/dashboard/spend.csv?group_by=tenant", headers=_cookie(sessions["acme"]))
    assert status == 200 and b"acme" in body and b"globex" not in body
    assert _forbidden(*srv.request("GET", "/dashboard/spend.csv?tenant=globex",
                                   headers=_cookie(sessions["acme"]))[::2])
    status, _, body = srv.request("GET", "/dashboard/spend.csv?group_by=tenant", headers=_cookie(sessions["admin"]))
    assert status == 200 and b"globex" in body
    assert srv.request("GET", "/dashboard/spend.csv", headers={"Authorization": ""})[0] == 401


def check_live(srv, keys, sessions):
    status, _, body = srv.request("GET", "/dashboard/live", headers=_cookie(sessions["acme"]))
    assert status == 200 and b"globex" not in body and b"acme" not in body      # engine stats only
    assert srv.request("GET", "/dashboard/live", headers={"Authorization": ""})[0] == 401


def check_login(srv, keys, sessions):
    status, _, body = srv.request("GET", "/dashboard/login", headers={"Authorization": ""})
    assert status == 200 and b"globex" not in body and b"acme" not in body


def check_logout(srv, keys, sessions):
    status, _, body = srv.request("POST", "/dashboard/logout", urlencode({"csrf_token": "x"}),
                                  headers={**_cookie(sessions["globex"]), **FORM})
    assert _forbidden(status, body, "csrf_failed")


def check_static(srv, keys, sessions):
    assert srv.request("GET", "/dashboard/static/dashboard.js", headers={"Authorization": ""})[0] == 200
    status, _, body = srv.request("GET", "/dashboard/static/..%2f..%2fapi_keys.py", headers={"Authorization": ""})
    assert status == 404 and b"hash" not in body


def check_metrics(srv, keys, sessions):
    assert _forbidden(*srv.request("GET", "/metrics", headers=_bearer(keys["acme"]))[::2], "admin_required")
    assert srv.request("GET", "/metrics", headers={"Authorization": ""})[0] == 401
    status, _, body = srv.request("GET", "/metrics")                                 # the admin key
    assert status == 200 and b"acme" not in body and b"globex" not in body


# The operator page's public parts: its sign-in form and static assets (no data in either).
PUBLIC_ADMIN_PAGES = {("GET", "/admin/login"), ("GET", "/admin/static/x"), ("HEAD", "/admin/login"),
                      ("HEAD", "/admin/static/x")}


def check_admin_route(srv, keys, sessions, route: Route):
    for method in sorted(route.methods or {"GET"}):
        path = re.sub(r"{[^}]+}", "x", route.path)
        status, headers, body = srv.request(method, path, headers=_bearer(keys["acme"]))
        if (method, path) in PUBLIC_ADMIN_PAGES:
            assert status in (200, 404) and b"rules" not in body, f"{method} {path}: {status}"
        elif method == "POST" and path in ("/admin/login", "/admin/logout", "/admin/policy-form", "/admin/rollback"):
            # The page's forms, posted with a key but no form or CSRF token: refused (as bad input
            # or forbidden), and above all no session issued.
            assert status in (400, 401, 403) and "set-cookie" not in headers, f"{method} {path}: {status}"
        elif path == "/admin" and method in ("GET", "HEAD"):
            # The page takes an admin *session*, never a bearer key: anyone else goes to sign-in.
            assert status == 303 and headers["location"].endswith("/admin/login"), f"{method} {path}: {status}"
        else:
            assert status in (401, 403), f"{method} {path} answers a tenant key with {status}"


CHECKS = {"/v1/spend/report": check_spend_report, "/v1/spend/requests": check_spend_requests,
          "/dashboard": check_dashboard, "/dashboard/spend.csv": check_spend_csv, "/dashboard/live": check_live,
          "/dashboard/login": check_login, "/dashboard/logout": check_logout,
          "/dashboard/static/{name}": check_static, "/metrics": check_metrics}


def test_every_report_dashboard_admin_and_metrics_route_is_isolated(world):
    srv, keys, sessions = world
    guarded = sorted({r.path for r in srv.app.routes if isinstance(r, Route) and r.path.startswith(GUARDED)})
    assert "/v1/spend/report" in guarded and "/dashboard" in guarded
    unchecked = [p for p in guarded if p not in CHECKS and not p.startswith("/admin")]
    assert not unchecked, f"routes without an isolation check: {unchecked}"
    for route in srv.app.routes:
        if isinstance(route, Route) and route.path.startswith("/admin"):
            check_admin_route(srv, keys, sessions, route)
    for path in guarded:
        if path in CHECKS:
            CHECKS[path](srv, keys, sessions)


def test_session_cookie_flags_and_csrf(world):
    srv, keys, _ = world
    sid, token = _form_session(srv)
    raw = srv.request("GET", "/dashboard/login", headers={"Authorization": ""})[1]["set-cookie"]
    flags = {p.strip().split("=")[0].lower() for p in raw.split(";")}
    assert {"httponly", "samesite", "path", "max-age"} <= flags and "samesite=strict" in raw.lower()
    for fields, cookie, extra in (({"api_key": KEY}, sid, {}), ({"api_key": KEY, "csrf_token": "x"}, sid, {}),
                                  ({"api_key": KEY, "csrf_token": token}, None, {}),
                                  ({"api_key": KEY, "csrf_token": token}, sid, {"Origin": "https://evil.example"}),
                                  ({"api_key": KEY, "csrf_token": token}, sid, {"Origin": "null"})):
        headers = {"Authorization": "", **FORM, **extra, **({"Cookie": f"{COOKIE}={cookie}"} if cookie else {})}
        status, resp_headers, body = srv.request("POST", "/dashboard/login", urlencode(fields), headers=headers)
        assert _forbidden(status, body, "csrf_failed") and resp_headers["x-frame-options"] == "DENY"
    new = _sign_in(srv, keys["acme"])
    assert new != sid


def test_body_size_and_json_depth_limits(world):
    srv, _, _ = world

    def err(status_body) -> dict:
        status, _, body = status_body
        parsed = json.loads(body)
        assert openai_error_shape(parsed), parsed
        return {"status": status, "code": parsed["error"]["code"]}

    big = json.dumps({"model": "mock", "messages": [{"role": "user", "content": "x" * 5000}]})
    assert err(srv.request("POST", "/v1/chat/completions", big)) == {"status": 413, "code": "body_too_large"}
    # No content-length (chunked): cut while reading.
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.request("POST", "/v1/chat/completions", body=iter([big[:3000].encode(), big[3000:].encode()]),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
                 encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "body_too_large"
    conn.close()

    def nested(depth: int) -> dict:
        value: object = "x"
        for _ in range(depth - 2):
            value = [value]
        return {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "metadata": {"k": value}}

    assert err(srv.request("POST", "/v1/chat/completions", nested(33))) == {"status": 400, "code": "json_too_deep"}
    assert err(srv.request("POST", "/v1/chat/completions", nested(32)))["code"] != "json_too_deep"
    deep = "[" * 2000 + "]" * 2000                  # deeper than the parser's recursion: still a clean 400
    assert err(srv.request("POST", "/v1/chat/completions", deep))["status"] == 400
    form = urlencode({"api_key": "x" * 9000, "csrf_token": "y"})
    status, _, body = srv.request("POST", "/dashboard/login", form, headers={"Authorization": "", **FORM})
    assert status == 413 and json.loads(body)["error"]["code"] == "body_too_large"
