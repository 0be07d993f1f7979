"""Every parameter of every route in /openapi.json (query, path, header, form field), admin routes
included, with an admin key and signed-in sessions, driven with the values that used to reach a
500: Unicode digits, 5,000-digit numbers, nan/inf, negatives, lone-surrogate escapes, control
characters. No answer may be a 5xx, and every 4xx outside the HTML sign-in forms is OpenAI-shaped.
(schemathesis in test_fuzz_openapi.py generates from the schema; this drives the hostile values
it rarely reaches.)"""
from __future__ import annotations

import json
import re
from urllib.parse import quote, urlencode

from gateway_helpers import SHARED_REDIS, delete_prefix, running_gateway, unique_prefix
from policy_gateway_helpers import BASE_POLICY, bearer, make_keys, put_policy, two_engine_deployment
from reliability_common import ErrorLogs

from tokenyard.gateway.auth.sessions import COOKIE

NASTY = ["\u00b2", "\u09e9", "9" * 5000, "-1", "0", "nan", "inf", "-inf", "1e308", "1" + "0" * 400,
         "18446744073709551616-0.acme", "\ud800", "%", "\x00", " ", "", "7d" * 300, "0001-01-01T00:00:00+14:00"]


def _sign_in(srv, page: str, key: str) -> tuple[str, str]:
    status, headers, body = srv.request("GET", f"/{page}/login", headers={"Authorization": ""})
    sid = re.match(rf"{COOKIE}=([^;]*)", headers["set-cookie"]).group(1)
    token = re.search(rb'name="csrf_token" value="([^"]+)"', body).group(1).decode()
    status, headers, _ = srv.request("POST", f"/{page}/login", urlencode({"api_key": key, "csrf_token": token}),
                                     headers={"Authorization": "", "Cookie": f"{COOKIE}={sid}",
                                              "Content-Type": "application/x-www-form-urlencoded"})
    sid = re.match(rf"{COOKIE}=([^;]*)", headers["set-cookie"]).group(1)
    _, _, body = srv.request("GET", f"/{page}", headers={"Authorization": "", "Cookie": f"{COOKIE}={sid}"})
    return sid, re.search(rb'name="csrf_token" value="([^"]+)"', body).group(1).decode()


def _form_fields(op: dict) -> list[str]:
    schema = (op.get("requestBody") or {}).get("content", {}).get("application/x-www-form-urlencoded", {})
    props = (schema.get("schema") or {}).get("properties") or {}
    return [name for name in props if name != "csrf_token"]


def test_every_parameter_with_hostile_values():
    prefix = unique_prefix("edgefuzz")
    keys = make_keys(prefix, "acme")
    failures: list[str] = []
    cases = 0
    try:
        with running_gateway(two_engine_deployment(prefix)) as srv, ErrorLogs() as errors:
            assert put_policy(srv, keys["admin"], BASE_POLICY)[0] == 200
            spec = json.loads(srv.request("GET", "/openapi.json")[2])
            sessions = {p: _sign_in(srv, p, keys["admin"]) for p in ("dashboard", "admin")}
            for path, methods in spec["paths"].items():
                for method, op in methods.items():
                    page = "admin" if path.startswith("/admin") and not path.startswith("/admin/policy") \
                        else "dashboard" if path.startswith("/dashboard") else None
                    sid, token = sessions[page] if page else (None, None)
                    params = [(p["in"], p["name"]) for p in op.get("parameters", [])]
                    params += [("form", name) for name in _form_fields(op)]
                    for where, name in params:
                        for value in NASTY:
                            url = re.sub(r"\{[^}]+\}", "1", path)
                            headers = {**bearer(keys["admin"])}
                            body = BASE_POLICY if "/admin/policy" in path and method in ("put", "post") else None
                            if page:
                                headers = {"Authorization": "", "Cookie": f"{COOKIE}={sid}"}
                            if where == "query":
                                url += "?" + urlencode({name: value}, encoding="utf-8", errors="surrogatepass")
                            elif where == "path":
                                url = path.replace("{%s}" % name, quote(value.encode("utf-8", "surrogatepass"),
                                                                        safe=""))
                                url = re.sub(r"\{[^}]+\}", "1", url)
                            elif where == "header":
                                if not value.isascii() and not all(ord(c) < 256 for c in value):
                                    continue        # not sendable as an HTTP header
                                if any(c in value for c in "\x00\r\n"):
                                    continue
                                headers[name] = value
                            else:
                                body = urlencode({"csrf_token": token or "", name: value}, encoding="utf-8",
                                                 errors="surrogatepass")
                                headers["Content-Type"] = "application/x-www-form-urlencoded"
                            if body is not None and where != "form":
                                headers.setdefault("Content-Type", "application/yaml")
                            if path == "/v1/chat/completions":
                                body = json.dumps({"model": "small", "messages": [{"role": "user", "content": "x"}]})
                                headers["Content-Type"] = "application/json"
                            status, hdrs, data = srv.request(method.upper(), url, body, headers)
                            cases += 1
                            where_ = f"{method.upper()} {url[:80]} [{where} {name}={value[:20]!r}] -> {status}"
                            if status >= 500 and not (status == 503 and name == "x-request-deadline-ms"):
                                failures.append(f"{where_}: {data[:200]!r}")
                            elif status >= 400 and not hdrs.get("content-type", "").startswith("text/html"):
                                try:
                                    err = json.loads(data)["error"]
                                    assert set(err) == {"message", "type", "param", "code"}
                                except (ValueError, KeyError, AssertionError):
                                    failures.append(f"{where_}: not OpenAI-shaped: {data[:200]!r}")
            assert not errors.records, errors.records[:5]
    finally:
        delete_prefix(SHARED_REDIS, prefix)
    assert cases > 300
    assert not failures, f"{len(failures)} bad answers, e.g. {failures[:8]}"
