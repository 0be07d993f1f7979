"""The dashboard pages: sign in with an API key, then spend, tokens, savings, latency, live engine stats.

    GET  /dashboard                 the dashboard (signed in), ?days=1|7|30|90&tenant= (admins)
    GET  /dashboard/login           the sign-in form
    POST /dashboard/login           api_key + csrf_token -> a session cookie, redirect to /dashboard
    POST /dashboard/logout          csrf_token -> session deleted, cookie cleared
    GET  /dashboard/spend.csv       the report as CSV (signed in), same parameters + group_by
    GET  /dashboard/live            live engine stats as JSON (signed in; dashboard.js polls it)
    GET  /dashboard/static/{name}   dashboard.css, dashboard.js

Rendered by Jinja2 templates (tokenyard/gateway/web/templates, autoescaped) on the server; the only script is a
static file from this origin. Every response here carries a Content-Security-Policy without
'unsafe-inline' (no inline script or style anywhere), X-Frame-Options DENY plus frame-ancestors
'none', nosniff, Referrer-Policy same-origin (not no-referrer: with it Chromium sends "Origin: null" on
our own form posts, which the CSRF origin check must refuse) and no-store. Sessions: tokenyard/gateway/auth/sessions.py;
CSRF: tokenyard/gateway/auth/csrf.py.
"""
from __future__ import annotations

import time

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from tokenyard.gateway.auth import csrf
from tokenyard.gateway.edge.edge_params import parse_int
from tokenyard.gateway.edge.errors import BadRequest, Unauthorized, Unavailable
from tokenyard.gateway.routes.spend_queries import build_report, csv_response, visible_tenants
from tokenyard.gateway.spend.reports import is_dimension, parse_group_by
from tokenyard.gateway.spend.store import all_tenants
from tokenyard.gateway.state import gateway_of
from tokenyard.gateway.web import dashboard_view
from tokenyard.gateway.web.pages import read_form, render, secured, security_headers, static_file
from tokenyard.gateway.web.sign_in import SignIn

STATIC = {"dashboard.css": "text/css; charset=utf-8", "dashboard.js": "text/javascript; charset=utf-8"}
DAYS = (1, 7, 30, 90)
MAX_FORM_BYTES = 8192
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
SECURITY_HEADERS = security_headers(CSP)


def routes() -> list[Route]:
    return [Route("/dashboard", page, methods=["GET"]), *SIGN_IN.routes(),
            Route("/dashboard/spend.csv", spend_csv, methods=["GET"]),
            Route("/dashboard/live", live, methods=["GET"]),
            Route("/dashboard/static/{name}", static, methods=["GET"])]


_secured = secured(SECURITY_HEADERS)
SIGN_IN = SignIn(home="/dashboard", template="login.html", secured=_secured,
                 metric=lambda request: gateway_of(request).metrics.dashboard_logins)


def _days(request: Request) -> int:
    days = parse_int(request.query_params.get("days"), "days", default=7, minimum=1, code="invalid_days")
    if days not in DAYS:
        raise BadRequest(f"days must be one of {', '.join(map(str, DAYS))}", param="days", code="invalid_days")
    return days


def _breakdown_by(request: Request) -> str:
    """The spend breakdown's dimension: by=key|user|route, or by=tag with tag=NAME."""
    by = request.query_params.get("by") or "key"
    if by == "tag":
        name = (request.query_params.get("tag") or "").strip()
        by = f"tag:{name}"
    if by not in ("key", "user", "route") and not is_dimension(by):
        raise BadRequest("by must be key, user, route, or tag with a tag name of 1-64 characters", param="by",
                         code="invalid_breakdown")
    return by


async def _form(request: Request) -> dict[str, str]:
    return await read_form(request, MAX_FORM_BYTES)


@_secured
async def page(request: Request) -> Response:
    auth = await SIGN_IN.current(request)
    if auth is None:
        return RedirectResponse("/dashboard/login", status_code=303)
    session, key = auth
    gw = gateway_of(request)
    tenant = request.query_params.get("tenant") or None
    tenants = await visible_tenants(gw, key, tenant)
    days = _days(request)
    by = _breakdown_by(request)
    try:
        view = await dashboard_view.build(gw, tenants, days, by)
        choices = await all_tenants(gw.ledger.redis, gw.deployment.redis_prefix) if key.is_admin else []
    except (RedisError, OSError) as e:
        raise Unavailable("The spend ledger cannot be read right now; retry shortly", code="spend_unavailable",
                          headers={"retry-after": "1"}) from e
    csv_query = f"days={days}&group_by=day,model" + (f"&tenant={tenant}" if tenant else "")
    return render("dashboard.html", key=key, session=session, csrf_field=csrf.FIELD, view=view, day_choices=DAYS,
                   tenant=tenant, tenant_choices=choices, csv_query=csv_query)


@_secured
async def spend_csv(request: Request) -> Response:
    auth = await SIGN_IN.current(request)
    if auth is None:
        raise Unauthorized("Sign in at /dashboard/login first", code="not_signed_in")
    gw = gateway_of(request)
    try:
        group_by = parse_group_by(request.query_params.get("group_by") or "day,model")
    except ValueError as e:
        raise BadRequest(str(e), param="group_by", code="invalid_group_by") from None
    days = _days(request)
    tenants = await visible_tenants(gw, auth[1], request.query_params.get("tenant") or None)
    end = time.time()
    report = await build_report(gw, tenants, end - days * 86400, end, group_by)
    return await csv_response(report, f"spend-{days}d.csv")


@_secured
async def live(request: Request) -> Response:
    if await SIGN_IN.current(request) is None:
        raise Unauthorized("Sign in at /dashboard/login first", code="not_signed_in")
    return JSONResponse({"engines": dashboard_view.live_stats(gateway_of(request))})


@_secured
async def static(request: Request) -> Response:
    return static_file(request.path_params["name"], STATIC)
