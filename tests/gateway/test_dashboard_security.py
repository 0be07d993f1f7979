"""Dashboard sessions, cookie flags, CSRF, security headers and /metrics access, over plain HTTP
(no browser; the page itself is exercised in test_dashboard_page.py)."""
from __future__ import annotations

import json
import re
from urllib.parse import urlencode

import pytest
import redis
from gateway_helpers import KEY, SHARED_REDIS, add_key, delete_prefix, mock_deployment, running_gateway, unique_prefix

from tokenyard.gateway.auth.api_keys import KeyStore
from tokenyard.gateway.auth.sessions import COOKIE
from tokenyard.gateway.server.metrics_access import _is_loopback

FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def _cookie(headers: dict[str, str]) -> tuple[str, str]:
    raw = headers["set-cookie"]
    value = re.match(rf"{COOKIE}=([^;]*)", raw).group(1)
    return value, raw


def _login_form(srv) -> tuple[str, str]:
    """GET the sign-in page: (session cookie value, CSRF token from the form)."""
    status, headers, body = srv.request("GET", "/dashboard/login", headers={"Authorization": ""})
    assert status == 200
    sid, _ = _cookie(headers)
    token = re.search(rb'name="csrf_token" value="([^"]+)"', body).group(1).decode()
    return sid, token


def _post(srv, path: str, sid: str | None, fields: dict[str, str], **headers: str):
    cookie = {"Cookie": f"{COOKIE}={sid}"} if sid else {}
    return srv.request("POST", path, urlencode(fields), headers={"Authorization": "", **FORM, **cookie, **headers})


@pytest.fixture(scope="module")
def srv():
    with running_gateway(mock_deployment()) as s:   # no Redis: sessions in memory
        yield s


def test_pages_carry_security_headers(srv):
    for path in ("/dashboard/login", "/dashboard", "/dashboard/static/dashboard.js"):
        status, headers, _ = srv.request("GET", path, headers={"Authorization": ""})
        assert status in (200, 303), path
        csp = headers["content-security-policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
        assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"
    status, headers, _ = srv.request("GET", "/dashboard", headers={"Authorization": ""})
    assert status == 303 and headers["location"] == "/dashboard/login"


def test_session_cookie_flags_and_csrf(srv):
    sid, token = _login_form(srv)
    _, raw = _cookie(srv.request("GET", "/dashboard/login", headers={"Authorization": ""})[1])
    flags = [p.strip().lower() for p in raw.split(";")]
    assert "httponly" in flags and "samesite=strict" in flags and "path=/" in flags
    assert "secure" not in flags                      # plain http, cookie_secure: auto
    # No token, a wrong token, a token of another session, a cross-origin post: all refused.
    other_sid, other_token = _login_form(srv)
    for fields, s, extra in (({"api_key": KEY}, sid, {}),
                             ({"api_key": KEY, "csrf_token": "wrong"}, sid, {}),
                             ({"api_key": KEY, "csrf_token": other_token}, sid, {}),
                             ({"api_key": KEY, "csrf_token": token}, None, {}),
                             ({"api_key": KEY, "csrf_token": token}, sid, {"Origin": "http://evil.example"})):
        status, headers, body = _post(srv, "/dashboard/login", s, fields, **extra)
        assert status == 403 and json.loads(body)["error"]["code"] == "csrf_failed"
        assert headers["x-frame-options"] == "DENY"
    # A bad key is refused with the form again; the right token and key sign in with a NEW session id.
    status, _, body = _post(srv, "/dashboard/login", sid, {"api_key": "ty-wrong", "csrf_token": token})
    assert status == 401 and b"not accepted" in body
    status, headers, _ = _post(srv, "/dashboard/login", sid, {"api_key": KEY, "csrf_token": token},
                               Origin=f"http://127.0.0.1:{srv.port}")
    assert status == 303 and headers["location"] == "/dashboard"
    new_sid, raw = _cookie(headers)
    assert new_sid and new_sid != sid and "HttpOnly" in raw and "SameSite=Strict" in raw
    # The new session reaches the signed-in endpoints; the old (anonymous) id does not.
    status, _, body = srv.request("GET", "/dashboard/live", headers={"Authorization": "",
                                                                      "Cookie": f"{COOKIE}={new_sid}"})
    assert status == 200 and [e["engine"] for e in json.loads(body)["engines"]] == ["mock"]
    status, _, _ = srv.request("GET", "/dashboard/live", headers={"Authorization": "", "Cookie": f"{COOKIE}={sid}"})
    assert status == 401
    # Logout needs the signed-in session's token too.
    status, _, _ = srv.request("GET", "/dashboard/login", headers={"Authorization": "",
                                                                    "Cookie": f"{COOKIE}={new_sid}"})
    assert status == 303                                # already signed in
    status, _, body = _post(srv, "/dashboard/logout", new_sid, {"csrf_token": token})
    assert status == 403
    session = srv.gateway.sessions._memory
    csrf_now = next(s.csrf for s in session.values() if s.id == new_sid)
    status, headers, _ = _post(srv, "/dashboard/logout", new_sid, {"csrf_token": csrf_now})
    assert status == 303 and "Max-Age=0" in headers["set-cookie"]
    status, _, _ = srv.request("GET", "/dashboard/live", headers={"Authorization": "",
                                                                   "Cookie": f"{COOKIE}={new_sid}"})
    assert status == 401


def test_secure_cookie_when_configured_and_revoked_key_ends_session():
    prefix = unique_prefix("dash")
    client = redis.Redis.from_url(SHARED_REDIS)
    key, rec = KeyStore(client, prefix).create("acme")
    doc = {**mock_deployment(), "redis_url": SHARED_REDIS, "redis_prefix": prefix,
           "dashboard": {"cookie_secure": "always"}}
    try:
        with running_gateway(doc) as s:
            sid, token = _login_form(s)
            assert "; Secure" in s.request("GET", "/dashboard/login", headers={"Authorization": ""})[1]["set-cookie"]
            status, headers, _ = _post(s, "/dashboard/login", sid, {"api_key": key, "csrf_token": token})
            assert status == 303
            new_sid, _ = _cookie(headers)
            # Stored in Redis under the hash of the id, never the id itself or the key.
            names = [k.decode() for k in client.scan_iter(match=prefix + "session:*")]
            assert names and all(new_sid not in n for n in names)
            assert all(key.encode() not in b"".join(client.hvals(n)) for n in names)
            cookie = {"Authorization": "", "Cookie": f"{COOKIE}={new_sid}"}
            assert s.request("GET", "/dashboard", headers=cookie)[0] == 200
            KeyStore(client, prefix).revoke(rec.key_id)
            for _ in range(100):
                if s.request("GET", "/dashboard", headers=cookie)[0] == 303:
                    break
            else:
                raise AssertionError("a revoked key's session still works")
    finally:
        client.close()
        delete_prefix(SHARED_REDIS, prefix)


def test_metrics_access_modes():
    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and not _is_loopback("10.0.0.1")
    assert not _is_loopback(None) and not _is_loopback("unix")
    with running_gateway({**mock_deployment(), "metrics": {"access": "admin"}}) as s:
        user = add_key(s, "acme")
        assert s.request("GET", "/metrics", headers={"Authorization": ""})[0] == 401
        status, _, body = s.request("GET", "/metrics", headers={"Authorization": f"Bearer {user}"})
        assert status == 403 and json.loads(body)["error"]["code"] == "admin_required"
        assert s.request("GET", "/metrics")[0] == 200          # the dev key is an admin key
    with running_gateway(mock_deployment()) as s:               # default: loopback may read without a key
        assert s.request("GET", "/metrics", headers={"Authorization": ""})[0] == 200
