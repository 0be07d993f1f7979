"""The operator page for routing policies: view, edit, validate, simulate, apply, history, roll back.

    GET  /admin                 the page (signed in with an admin key); ?since=1d|7d|30d
    GET  /admin/login           sign-in form          POST /admin/login   api_key + csrf_token
    POST /admin/logout          csrf_token
    POST /admin/policy-form     csrf_token, document, since, action = validate | simulate | apply
    POST /admin/rollback        csrf_token, version
    GET  /admin/static/{name}   dashboard.css, admin.css

The same session scheme as the dashboard (tokenyard/gateway/auth/sessions.py: a random id in the HttpOnly,
SameSite=Strict `ty_session` cookie, the session in Redis; tokenyard/gateway/auth/csrf.py: a synchronizer token
on every form plus the Origin/Referer check), but only admin keys may sign in here, and every
request re-checks that the session's key is still an admin key that is not revoked. Server-
rendered Jinja2 (autoescaped); no script at all, so the CSP allows none; the dashboard's security
headers on every response. Validate and simulate re-render the page with the edited text kept;
apply and rollback redirect back (303) to the page showing the new version.
"""
from __future__ import annotations

import time
from typing import Any

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from tokenyard.gateway.auth import csrf
from tokenyard.gateway.auth.api_keys import KeyRecord
from tokenyard.gateway.auth.sessions import Session
from tokenyard.gateway.edge.edge_params import parse_int
from tokenyard.gateway.edge.errors import Unauthorized
from tokenyard.gateway.policy.store import NoSuchVersion, PolicyConflict
from tokenyard.gateway.policy.work import off_loop
from tokenyard.gateway.routes.policy_admin import DEFAULT_LIMIT, author_of, check_document, comparison_rows, run_simulation
from tokenyard.gateway.state import gateway_of
from tokenyard.gateway.web.pages import read_form, render, secured, security_headers, static_file
from tokenyard.gateway.web.sign_in import SignIn
from tokenyard.policies import PolicyError, diff

STATIC = {"dashboard.css": "text/css; charset=utf-8", "admin.css": "text/css; charset=utf-8"}
SECURITY_HEADERS = security_headers("default-src 'self'; script-src 'none'; style-src 'self'; img-src 'self'; "
                                    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
SINCE = {"1d": 86400, "7d": 7 * 86400, "30d": 30 * 86400}
MAX_FORM_BYTES = 512 * 1024


def routes() -> list[Route]:
    return [Route("/admin", page, methods=["GET"]), *SIGN_IN.routes(),
            Route("/admin/policy-form", policy_form, methods=["POST"]),
            Route("/admin/rollback", rollback_form, methods=["POST"]),
            Route("/admin/static/{name}", static, methods=["GET"])]


_secured = secured(SECURITY_HEADERS)
SIGN_IN = SignIn(home="/admin", template="admin_login.html", secured=_secured, admin_only=True)


def _render(name: str, status: int = 200, **ctx: Any) -> HTMLResponse:
    return render(name, status, csrf_field=csrf.FIELD, **ctx)


async def _form(request: Request) -> dict[str, str]:
    return await read_form(request, MAX_FORM_BYTES)


async def _page(request: Request, session: Session, key: KeyRecord, *, document: str | None = None,
                problems: list | None = None, simulation: dict | None = None, validation_diff: str | None = None,
                message: str | None = None, since: str = "7d", status: int = 200) -> Response:
    gw = gateway_of(request)
    state = gw.policy
    history = []
    if state.store is not None:
        try:
            history = await state.store.history(50)
        except (RedisError, OSError):
            message = (message + " · " if message else "") + "history unavailable: Redis cannot be reached"
    if document is None:
        document = state.version.document if state.version is not None else ""
    return _render("admin.html", status=status, session=session, key=key, state=state, store=state.store is not None,
                   history=history, document=document, problems=problems, simulation=simulation,
                   simulation_rows=comparison_rows(simulation) if simulation else [],
                   validation_diff=validation_diff, message=message, since=since, since_choices=list(SINCE))


@_secured
async def page(request: Request) -> Response:
    auth = await SIGN_IN.current(request)
    if auth is None:
        return RedirectResponse("/admin/login", status_code=303)
    message = None
    if request.query_params.get("applied"):
        message = f"Version {request.query_params['applied']} applied and announced to every gateway."
    elif request.query_params.get("unchanged"):
        message = "That document means the policy in force; nothing was stored."
    return await _page(request, *auth, message=message)


async def _signed_form(request: Request) -> tuple[Session, KeyRecord, dict[str, str]]:
    auth = await SIGN_IN.current(request)
    form = await _form(request)
    if auth is None:
        raise Unauthorized("Sign in at /admin/login first", code="not_signed_in")
    csrf.check(request, auth[0], form.get(csrf.FIELD))
    return auth[0], auth[1], form


@_secured
async def policy_form(request: Request) -> Response:
    session, key, form = await _signed_form(request)
    gw = gateway_of(request)
    text = form.get("document", "").replace("\r\n", "\n")
    action = form.get("action", "validate")
    since = form.get("since", "7d") if form.get("since") in SINCE else "7d"
    engines = list(gw.deployment.engines)
    try:
        policy = await off_loop(check_document, text, engines)
    except PolicyError as e:
        return await _page(request, session, key, document=text, problems=e.problems, since=since, status=422)
    if action == "simulate":
        end = time.time()
        result = await run_simulation(gw, policy, end - SINCE[since], end, DEFAULT_LIMIT, None)
        return await _page(request, session, key, document=text, simulation=result, since=since)
    if action == "apply":
        store = gw.policy.store
        if store is None:
            return await _page(request, session, key, document=text, message="No policy store (Redis) here.",
                               status=503)
        try:
            version, applied = await store.apply(text, author_of(key), engines)
        except PolicyError as e:
            return await _page(request, session, key, document=text, problems=e.problems, status=422)
        except (PolicyConflict, RedisError, OSError) as e:
            return await _page(request, session, key, document=text, message=f"Not applied: {e}", status=503)
        await gw.policy.refresh()
        where = f"/admin?applied={version.version}" if applied else "/admin?unchanged=1"
        return RedirectResponse(where, status_code=303)
    changes = await off_loop(diff, gw.policy.policy, policy, f"version {gw.policy.number}", "edited")
    return await _page(request, session, key, document=text, since=since, validation_diff=changes)


@_secured
async def rollback_form(request: Request) -> Response:
    session, key, form = await _signed_form(request)
    gw = gateway_of(request)
    number = parse_int(form.get("version", ""), "version", minimum=1, code="invalid_version")
    store = gw.policy.store
    if store is None:
        return await _page(request, session, key, message="No policy store (Redis) here.", status=503)
    try:
        version = await store.rollback(number, author_of(key), list(gw.deployment.engines))
    except (NoSuchVersion, PolicyError) as e:
        return await _page(request, session, key, problems=e.problems, status=422)
    except (PolicyConflict, RedisError, OSError) as e:
        return await _page(request, session, key, message=f"Not rolled back: {e}", status=503)
    await gw.policy.refresh()
    return RedirectResponse(f"/admin?applied={version.version}", status_code=303)


@_secured
async def static(request: Request) -> Response:
    return static_file(request.path_params["name"], STATIC)
