"""The dashboard pages: sign in with an API key, then spend, tokens, savings, latency, live engine stats.

    GET  /dashboard                 the dashboard (signed in), ?days=1|7|30|90&tenant= (admins)
    GET  /dashboard/login           the sign-in form
    POST /dashboard/login           api_key + csrf_token -> a session cookie, redirect to /dashboard
    POST /dashboard/logout          csrf_token -> session deleted, cookie cleared
    GET  /dashboard/spend.csv       the report as CSV (signed in), same parameters + group_by
    GET  /dashboard/live            live engine stats as JSON (signed in; dashboard.js polls it)
    GET  /dashboard/static/{name}   dashboard.css, dashboard.js

Rendered by Jinja2 templates (gateway/templates, autoescaped) on the server; the only script is a
static file from this origin. Every response here carries a Content-Security-Policy without
'unsafe-inline' (no inline script or style anywhere), X-Frame-Options DENY plus frame-ancestors
'none', nosniff, Referrer-Policy same-origin (not no-referrer: with it Chromium sends "Origin: null" on
our own form posts, which the CSRF origin check must refuse) and no-store. Sessions: gateway/sessions.py;
CSRF: gateway/csrf.py.
"""
from __future__ import annotations

import time

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from . import csrf, dashboard_view
from .api_keys import KeyRecord
from .edge_params import parse_int
from .errors import APIError, BadRequest, Unauthorized, Unavailable
from .sessions import COOKIE, Session
from .spend_reports import parse_group_by
from .spend_queries import build_report, csv_response, visible_tenants
from .spend_store import all_tenants
from .web_pages import gateway_of, read_form, render, secured, security_headers, static_file, with_cookie


STATIC = {"dashboard.css": "text/css; charset=utf-8", "dashboard.js": "text/javascript; charset=utf-8"}
DAYS = (1, 7, 30, 90)
MAX_FORM_BYTES = 8192
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
SECURITY_HEADERS = security_headers(CSP)


def routes() -> list[Route]:
    return [Route("/dashboard", page, methods=["GET"]),
            Route("/dashboard/login", login_page, methods=["GET"]),
            Route("/dashboard/login", login, methods=["POST"]),
            Route("/dashboard/logout", logout, methods=["POST"]),
            Route("/dashboard/spend.csv", spend_csv, methods=["GET"]),
            Route("/dashboard/live", live, methods=["GET"]),
            Route("/dashboard/static/{name}", static, methods=["GET"])]


_secured = secured(SECURITY_HEADERS)


async def _signed_in(request: Request) -> tuple[Session, KeyRecord] | None:
    """The session and its key's current record; None when not signed in or the key is gone/revoked."""
    gw = gateway_of(request)
    session = await gw.sessions.get(request.cookies.get(COOKIE))
    if session is None or not session.signed_in:
        return None
    rec = await gw.keys.lookup(session.key_id)
    if rec is None or rec.revoked is not None:
        await gw.sessions.delete(session.id)
        return None
    return session, rec


def _days(request: Request) -> int:
    days = parse_int(request.query_params.get("days"), "days", default=7, minimum=1, code="invalid_days")
    if days not in DAYS:
        raise BadRequest(f"days must be one of {', '.join(map(str, DAYS))}", param="days", code="invalid_days")
    return days


async def _form(request: Request) -> dict[str, str]:
    return await read_form(request, MAX_FORM_BYTES)


@_secured
async def page(request: Request) -> Response:
    auth = await _signed_in(request)
    if auth is None:
        return RedirectResponse("/dashboard/login", status_code=303)
    session, key = auth
    gw = gateway_of(request)
    tenant = request.query_params.get("tenant") or None
    tenants = await visible_tenants(gw, key, tenant)
    days = _days(request)
    try:
        view = await dashboard_view.build(gw, tenants, days)
        choices = await all_tenants(gw.ledger.redis, gw.deployment.redis_prefix) if key.is_admin else []
    except (RedisError, OSError) as e:
        raise Unavailable("The spend ledger cannot be read right now; retry shortly", code="spend_unavailable",
                          headers={"retry-after": "1"}) from e
    csv_query = f"days={days}&group_by=day,model" + (f"&tenant={tenant}" if tenant else "")
    return render("dashboard.html", key=key, session=session, csrf_field=csrf.FIELD, view=view, day_choices=DAYS,
                   tenant=tenant, tenant_choices=choices, csv_query=csv_query)


@_secured
async def login_page(request: Request) -> Response:
    gw = gateway_of(request)
    if await _signed_in(request) is not None:
        return RedirectResponse("/dashboard", status_code=303)
    session = await gw.sessions.get(request.cookies.get(COOKIE))
    if session is None:                  # keep an existing anonymous session (and its token) across reloads
        session = await gw.sessions.anonymous()
    return with_cookie(request, render("login.html", session=session, csrf_field=csrf.FIELD, error=None), session)


@_secured
async def login(request: Request) -> Response:
    gw = gateway_of(request)
    session = await gw.sessions.get(request.cookies.get(COOKIE))
    form = await _form(request)
    try:
        csrf.check(request, session, form.get(csrf.FIELD))
    except APIError:
        gw.metrics.dashboard_logins.labels("csrf_failed").inc()
        raise
    try:
        key = await gw.keys.authenticate("Bearer " + form.get("api_key", "").strip())
    except Unauthorized:
        gw.metrics.dashboard_logins.labels("bad_key").inc()
        return render("login.html", status=401, session=session, csrf_field=csrf.FIELD,
                       error="That key was not accepted.")
    await gw.sessions.delete(session.id)     # a new id on sign-in: no session fixation
    new = await gw.sessions.create(key_id=key.key_id, tenant=key.tenant, role=key.role)
    gw.metrics.dashboard_logins.labels("ok").inc()
    return with_cookie(request, RedirectResponse("/dashboard", status_code=303), new)


@_secured
async def logout(request: Request) -> Response:
    gw = gateway_of(request)
    session = await gw.sessions.get(request.cookies.get(COOKIE))
    form = await _form(request)
    csrf.check(request, session, form.get(csrf.FIELD))
    await gw.sessions.delete(session.id)
    return with_cookie(request, RedirectResponse("/dashboard/login", status_code=303), None)


@_secured
async def spend_csv(request: Request) -> Response:
    auth = await _signed_in(request)
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
    return csv_response(report, f"spend-{days}d.csv")


@_secured
async def live(request: Request) -> Response:
    if await _signed_in(request) is None:
        raise Unauthorized("Sign in at /dashboard/login first", code="not_signed_in")
    return JSONResponse({"engines": dashboard_view.live_stats(gateway_of(request))})


@_secured
async def static(request: Request) -> Response:
    return static_file(request.path_params["name"], STATIC)
