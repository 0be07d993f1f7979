"""Values at the HTTP edge that used to end in a 500 (or a wrong status), on a gateway with Redis:
Unicode digits in integer parameters, nan/huge/negative report times, forged cursors, lone
surrogates in chat metadata, a huge integer in a chat body, sign-in pages that made a session
per GET, and /metrics from loopback under a foreign Host header (DNS rebinding)."""
from __future__ import annotations

import json
import re
from urllib.parse import quote, urlencode

import pytest
import redis
from gateway_helpers import SHARED_REDIS, delete_prefix, running_gateway, unique_prefix, wait_ledger
from policy_gateway_helpers import BASE_POLICY, bearer, make_keys, put_policy, two_engine_deployment

from tokenyard.gateway.auth.sessions import COOKIE

FORM = {"Content-Type": "application/x-www-form-urlencoded"}
SUPERSCRIPT_TWO = "\u00b2"        # "²".isdigit() is True, int("²") raises
BENGALI_THREE = "\u09e9"          # a decimal digit int() reads: still not an ASCII integer


@pytest.fixture(scope="module")
def world():
    prefix = unique_prefix("edge")
    keys = make_keys(prefix, "acme")
    try:
        with running_gateway(two_engine_deployment(prefix)) as srv:
            assert put_policy(srv, keys["admin"], BASE_POLICY)[0] == 200
            status, _, _ = srv.chat({"model": "small", "messages": [{"role": "user", "content": "hi"}]},
                                    bearer(keys["acme"]))
            assert status == 200
            wait_ledger(srv)
            yield srv, keys, prefix
    finally:
        delete_prefix(SHARED_REDIS, prefix)


def _err(status_body: tuple[int, dict, bytes]) -> tuple[int, dict]:
    status, _, body = status_body
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError):
        raise AssertionError(f"{status}: not an OpenAI error: {body[:300]!r}") from None
    assert set(err) == {"message", "type", "param", "code"}, err
    return status, err


def _sign_in(srv, page: str, key: str) -> tuple[str, str]:
    """(session cookie, CSRF token) of a session signed in at /dashboard/login or /admin/login."""
    status, headers, body = srv.request("GET", f"/{page}/login", headers={"Authorization": ""})
    assert status == 200
    sid = re.match(rf"{COOKIE}=([^;]*)", headers["set-cookie"]).group(1)
    token = re.search(rb'name="csrf_token" value="([^"]+)"', body).group(1).decode()
    status, headers, _ = srv.request("POST", f"/{page}/login", urlencode({"api_key": key, "csrf_token": token}),
                                     headers={"Authorization": "", "Cookie": f"{COOKIE}={sid}", **FORM})
    assert status == 303, status
    sid = re.match(rf"{COOKIE}=([^;]*)", headers["set-cookie"]).group(1)
    status, _, body = srv.request("GET", f"/{page}", headers={"Authorization": "", "Cookie": f"{COOKIE}={sid}"})
    assert status == 200, status
    token = re.search(rb'name="csrf_token" value="([^"]+)"', body).group(1).decode()
    return sid, token


BAD_INTEGERS = [SUPERSCRIPT_TWO, BENGALI_THREE, "9" * 5000, "-1", "1e3", " ", "0x10"]


@pytest.mark.parametrize("raw", BAD_INTEGERS, ids=["superscript", "bengali", "5000-digits", "negative", "exp",
                                                   "blank", "hex"])
@pytest.mark.parametrize("method, path", [
    ("GET", "/admin/policy/history?limit={}"),
    ("PUT", "/admin/policy?expected_version={}"),
    ("POST", "/admin/policy/rollback/{}"),
    ("POST", "/admin/policy/simulate?limit={}"),
    ("GET", "/v1/spend/requests?limit={}"),
])
def test_integer_parameters_are_400(world, method, path, raw):
    srv, keys, _ = world
    body = BASE_POLICY if method in ("PUT", "POST") else None
    status, err = _err(srv.request(method, path.format(quote(raw, safe="")), body,
                                   {**bearer(keys["admin"]), "Content-Type": "application/yaml"}))
    assert status == 400, (status, err)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("query", ["start=nan", "end=nan", "start=inf", "start=1e300", "end=-5", "start=-1e9",
                                   "start=1" + "0" * 400, "end=" + quote(BENGALI_THREE), "start=99999999999d",
                                   "start=0001-01-01T00:00:00%2B14:00"])
@pytest.mark.parametrize("path", ["/v1/spend/report", "/v1/spend/requests"])
def test_report_times_are_400(world, path, query):
    srv, keys, _ = world
    status, err = _err(srv.request("GET", f"{path}?{query}", headers=bearer(keys["admin"])))
    assert status == 400 and err["code"] == "invalid_time", (status, err)


@pytest.mark.parametrize("cursor", ["99999999999999999999999-0.acme", "18446744073709551616-0.acme",
                                    f"1{SUPERSCRIPT_TWO}-0.acme", "1-1"])
def test_forged_cursor_is_400_not_503(world, cursor):
    srv, keys, _ = world
    status, err = _err(srv.request("GET", f"/v1/spend/requests?cursor={quote(cursor)}",
                                   headers=bearer(keys["admin"])))
    assert status == 400 and err["code"] == "invalid_cursor", (status, err)


def test_dashboard_days_and_rollback_form_with_unicode_digits(world):
    srv, keys, _ = world
    sid, _ = _sign_in(srv, "dashboard", keys["admin"])
    status, err = _err(srv.request("GET", f"/dashboard?days={quote(SUPERSCRIPT_TWO)}",
                                   headers={"Authorization": "", "Cookie": f"{COOKIE}={sid}"}))
    assert status == 400 and err["param"] == "days"
    sid, token = _sign_in(srv, "admin", keys["admin"])
    for raw in (SUPERSCRIPT_TWO, "9" * 5000):
        status, err = _err(srv.request("POST", "/admin/rollback", urlencode({"csrf_token": token, "version": raw}),
                                       headers={"Authorization": "", "Cookie": f"{COOKIE}={sid}", **FORM}))
        assert status == 400 and err["param"] == "version"


def test_huge_integer_in_chat_body_is_400_before_auth(world):
    srv, _, _ = world
    body = '{"model": "small", "max_tokens": ' + "9" * 5000 + ', "messages": [{"role": "user", "content": "x"}]}'
    status, err = _err(srv.request("POST", "/v1/chat/completions", body,
                                   {"Authorization": "", "Content-Type": "application/json"}))
    assert status == 400 and err["code"] == "invalid_json", (status, err)


@pytest.mark.parametrize("field", ["metadata", "user", "metadata-key"])
def test_lone_surrogate_in_chat_is_refused_and_spend_stays_readable(world, field):
    srv, keys, prefix = world
    extra = {"metadata": '"metadata": {"k": "\\ud800"}', "user": '"user": "a\\udfffb"',
             "metadata-key": '"metadata": {"\\udbff": "v"}'}[field]
    body = '{"model": "small", "messages": [{"role": "user", "content": "x"}], ' + extra + "}"
    status, err = _err(srv.request("POST", "/v1/chat/completions", body,
                                   {**bearer(keys["acme"]), "Content-Type": "application/json"}))
    assert status == 400 and err["code"] == "invalid_encoding", (status, err)
    for key in (keys["acme"], keys["admin"]):
        assert srv.request("GET", "/v1/spend/requests", headers=bearer(key))[0] == 200


def test_spend_readers_survive_a_stored_surrogate(world):
    """A record written before the edge refused surrogates (or by another writer) must not make
    the drill-down answer 500 for the 30 days it is kept."""
    srv, keys, prefix = world
    from tokenyard.gateway.spend.redis_keys import stream_key
    client = redis.Redis.from_url(SHARED_REDIS)
    try:
        rec = json.loads(client.xrevrange(stream_key(prefix, "acme"), count=1)[0][1][b"r"])
        rec.update(user="bad\ud800user", metadata={"k\udfff": "v\ud800"})
        client.xadd(stream_key(prefix, "acme"), {"r": json.dumps(rec)})   # ensure_ascii: \ud800 escapes
    finally:
        client.close()
    for key in (keys["acme"], keys["admin"]):
        status, _, body = srv.request("GET", "/v1/spend/requests?limit=5", headers=bearer(key))
        assert status == 200, body[:300]
        newest = json.loads(body)["data"][0]
        assert newest["user"] == "bad\ufffduser" and newest["metadata"] == {"k\ufffd": "v\ufffd"}


def test_sign_in_pages_create_no_session_per_get(world):
    srv, keys, prefix = world
    client = redis.Redis.from_url(SHARED_REDIS)
    try:
        def sessions() -> int:
            return sum(1 for _ in client.scan_iter(match=f"{prefix}session:*", count=1000))
        before = sessions()
        for page in ("dashboard", "admin"):
            for _ in range(40):
                assert srv.request("GET", f"/{page}/login", headers={"Authorization": ""})[0] == 200
        assert sessions() == before       # nothing stored per visit
        # ... and signing in still works (the form's CSRF token is checked), and makes one session.
        _sign_in(srv, "dashboard", keys["admin"])
        status, headers, body = srv.request("GET", "/dashboard/login", headers={"Authorization": ""})
        sid = re.match(rf"{COOKIE}=([^;]*)", headers["set-cookie"]).group(1)
        status, _, _ = srv.request("POST", "/dashboard/login", urlencode({"api_key": keys["admin"],
                                                                          "csrf_token": "forged"}),
                                   headers={"Authorization": "", "Cookie": f"{COOKIE}={sid}", **FORM})
        assert status == 403
    finally:
        client.close()


@pytest.mark.parametrize("host, allowed", [("127.0.0.1:8000", True), ("localhost", True), ("[::1]:80", True),
                                           ("LOCALHOST:1", True), ("evil.example:8000", False),
                                           ("127.0.0.1.evil.example", False), ("", False)])
def test_metrics_loopback_rule_checks_host(world, host, allowed):
    srv, _, _ = world
    status, _, _ = srv.request("GET", "/metrics", headers={"Authorization": "", "Host": host})
    assert (status == 200) == allowed, (host, status)


@pytest.mark.parametrize("raw", [SUPERSCRIPT_TWO, "9" * 5000, "0", "-5", "1.5"])
def test_deadline_header_is_400(world, raw):
    srv, keys, _ = world
    status, err = _err(srv.request("POST", "/v1/chat/completions",
                                   {"model": "small", "messages": [{"role": "user", "content": "x"}]},
                                   {**bearer(keys["acme"]), "x-request-deadline-ms": raw}))
    assert status == 400 and err["code"] == "invalid_deadline", (status, err)
