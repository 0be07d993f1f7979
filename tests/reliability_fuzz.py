"""The fuzzing scenario: schemathesis cases from the live /openapi.json against a mock gateway."""
from __future__ import annotations

import secrets
import time

from gateway_helpers import KEY, SHARED_REDIS, delete_prefix, mock_deployment, running_gateway
from reliability_common import ErrorLogs, Report, anthropic_error_shape, check_idle, openai_error_shape


# --- fuzzing ----------------------------------------------------------------------------------------
def _signed_in_cookie(srv) -> str:
    """A dashboard session signed in with the admin key (so signed-in pages are fuzzed too)."""
    import re
    from urllib.parse import urlencode

    from tokenyard.gateway.auth.sessions import COOKIE
    status, headers, body = srv.request("GET", "/dashboard/login", headers={"Authorization": ""})
    sid = re.match(rf"{COOKIE}=([^;]*)", headers["set-cookie"]).group(1)
    token = re.search(rb'name="csrf_token" value="([^"]+)"', body).group(1).decode()
    status, headers, _ = srv.request("POST", "/dashboard/login", urlencode({"api_key": KEY, "csrf_token": token}),
                                     headers={"Authorization": "", "Cookie": f"{COOKIE}={sid}",
                                              "Content-Type": "application/x-www-form-urlencoded"})
    assert status == 303, status
    return re.match(rf"{COOKIE}=([^;]*)", headers["set-cookie"]).group(1)


def run_fuzz(examples_per_mode: int, seed: int = 0) -> Report:
    """schemathesis cases from the live /openapi.json: every operation, positive and negative
    generation, chat requests also with a real model name, dashboard pages also signed in."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    from tokenyard.gateway.auth.sessions import COOKIE
    report = Report("fuzz /openapi.json")
    prefix = f"tytest:rel:fuzz:{secrets.token_hex(4)}:"
    doc = {**mock_deployment(output_len=6, max_sleep_ms=2), "redis_url": SHARED_REDIS, "redis_prefix": prefix,
           "rate_limits": {"requests": 10_000_000, "tokens": 1_000_000_000},
           "admission": {"max_concurrent_per_tenant": 0}}
    cases = 0
    by_status: dict[int, int] = {}
    failures: list[str] = []
    t0 = time.perf_counter()
    try:
        with running_gateway(doc) as srv, ErrorLogs() as errors:
            spec = requests.get(srv.base_url + "/openapi.json", timeout=10).json()
            schema = schemathesis.openapi.from_dict(spec)
            session = requests.Session()
            signed_in = {COOKIE: _signed_in_cookie(srv)}
            operations = [r.ok() for r in schema.get_all_operations()]
            report.figures["operations"] = len(operations)

            def check(case, resp) -> None:
                nonlocal cases
                cases += 1
                by_status[resp.status_code] = by_status.get(resp.status_code, 0) + 1
                where = f"{case.method} {case.path} -> {resp.status_code}"
                deadline = (case.headers or {}).get("x-request-deadline-ms")
                if resp.status_code == 503 and deadline is not None:
                    # The case asked for a deadline (down to 1 ms) and missed it: the documented shed.
                    body = resp.json()
                    hdrs = {k.lower() for k in resp.headers}
                    if not (openai_error_shape(body) and body["error"]["code"] in ("deadline_exceeded",
                                                                                  "engine_overloaded")
                            and "retry-after" in hdrs):
                        failures.append(f"{where}: {resp.text[:200]}")
                elif resp.status_code >= 500:
                    failures.append(f"{where}: {resp.text[:200]} (body {str(case.body)[:200]})")
                elif resp.status_code >= 400:
                    ctype = {k.lower(): v for k, v in resp.headers.items()}.get("content-type", "")
                    ctype = ctype[0] if isinstance(ctype, list) else ctype
                    if case.path == "/dashboard/login" and resp.status_code == 401 and ctype.startswith("text/html"):
                        return   # documented: a refused sign-in shows the form again
                    try:
                        body = resp.json()
                    except ValueError:
                        body = None
                    if case.path.startswith("/v1/messages"):    # the Messages API answers in Anthropic's shape
                        if not ctype.startswith("application/json") or not anthropic_error_shape(body):
                            failures.append(f"{where}: not Anthropic-shaped ({ctype}): {resp.text[:200]}")
                    elif not ctype.startswith("application/json") or not openai_error_shape(body):
                        failures.append(f"{where}: not OpenAI-shaped ({ctype}): {resp.text[:200]}")

            for op in operations:
                variants: list[tuple[str, dict]] = [("", {})]
                if op.path.startswith("/dashboard") and op.path not in ("/dashboard/login", "/dashboard/logout"):
                    variants.append(("signed-in", signed_in))
                for label, cookies in variants:
                    for mode in GenerationMode:
                        strategy = op.as_strategy(generation_mode=mode)
                        if op.path in ("/v1/chat/completions", "/v1/messages") and mode.is_positive:
                            def real_model(pair):   # half the cases name the real engine: reach the engine
                                case, use = pair
                                if use and isinstance(case.body, dict):
                                    case.body["model"] = "mock"
                                return case
                            strategy = st.tuples(strategy, st.booleans()).map(real_model)

                        @hseed(seed)
                        @settings(max_examples=examples_per_mode, deadline=None, database=None,
                                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
                        @given(case=strategy)
                        def run(case):
                            resp = case.call(base_url=srv.base_url, session=session,
                                             headers={"Authorization": f"Bearer {KEY}"}, cookies=cookies, timeout=30)
                            check(case, resp)

                        try:
                            run()
                        except Unsatisfiable:
                            pass    # an operation without parameters has no invalid (negative) cases
            report.figures["error_logs"] = len(errors.records)
            report.check(not errors.records, f"errors logged while fuzzing: {sorted(set(errors.records))[:3]}")
            check_idle(srv, report, "mock")
    finally:
        delete_prefix(SHARED_REDIS, prefix)
    report.figures.update(cases=cases, seconds=round(time.perf_counter() - t0, 1),
                          statuses=dict(sorted(by_status.items())), failures=len(failures))
    report.check(not failures, f"{len(failures)} bad responses, e.g. {failures[:5]}")
    return report
