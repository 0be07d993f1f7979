"""Plumbing shared by the gateway's HTML pages (the spend dashboard and the operator page):
security headers on every response, the session cookie, and bounded form parsing.

Both pages use the same cookie session (tokenyard/gateway/auth/sessions.py) and CSRF tokens (tokenyard/gateway/auth/csrf.py);
only their content security policies and form sizes differ.
"""
from __future__ import annotations

from functools import wraps
from pathlib import Path
from typing import Any, Awaitable, Callable
from urllib.parse import parse_qs

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, Response

from tokenyard.gateway.auth.sessions import Session, cookie_header
from tokenyard.gateway.edge.errors import APIError, BadRequest, ClientClosed, NotFound, PayloadTooLarge
from tokenyard.gateway.state import gateway_of

Handler = Callable[[Request], Awaitable[Response]]

HERE = Path(__file__).resolve().parent
_templates = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]))


def render(name: str, status: int = 200, **ctx: Any) -> HTMLResponse:
    """A template from tokenyard/gateway/web/templates, autoescaped."""
    return HTMLResponse(_templates.get_template(name).render(**ctx), status_code=status)


def static_file(name: str, allowed: dict[str, str]) -> Response:
    """A file from tokenyard/gateway/web/static, only when `allowed` lists it (name -> media type)."""
    if name not in allowed:
        return NotFound("Not found", code="not_found").response()
    return Response((HERE / "static" / name).read_bytes(), media_type=allowed[name],
                    headers={"cache-control": "no-cache"})


def security_headers(csp: str) -> dict[str, str]:
    return {"content-security-policy": csp, "x-frame-options": "DENY", "x-content-type-options": "nosniff",
            "referrer-policy": "same-origin", "cache-control": "no-store"}


def secured(headers: dict[str, str]) -> Callable[[Handler], Handler]:
    """A decorator that puts `headers` on every response of a page handler, errors included."""
    def decorate(fn: Handler) -> Handler:
        @wraps(fn)
        async def wrapper(request: Request) -> Response:
            try:
                resp = await fn(request)
            except APIError as e:
                resp = e.response()
            for k, v in headers.items():
                resp.headers.setdefault(k, v)
            return resp
        return wrapper
    return decorate


def with_cookie(request: Request, resp: Response, session: Session | None) -> Response:
    """Set (or, with None, clear) the session cookie; Secure per `web.dashboard.cookie_secure`."""
    cfg = gateway_of(request).deployment.web.dashboard
    secure = cfg.cookie_secure == "always" or (cfg.cookie_secure == "auto" and request.url.scheme == "https")
    resp.headers.append("set-cookie", cookie_header(session, secure, cfg.session_ttl_s))
    return resp


async def read_form(request: Request, max_bytes: int, max_fields: int = 8) -> dict[str, str]:
    """An urlencoded form, at most `max_bytes`; the first value of each field."""
    if not request.headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
        raise BadRequest("Expected a form (application/x-www-form-urlencoded)", code="invalid_form")
    body = b""
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise PayloadTooLarge("Form too large", code="body_too_large")
    except ClientDisconnect:
        raise ClientClosed("The client closed the connection before sending the whole form",
                           code="client_disconnected") from None
    try:
        parsed = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=max_fields)
    except (UnicodeDecodeError, ValueError):
        raise BadRequest("Malformed form", code="invalid_form") from None
    return {k: v[0] for k, v in parsed.items()}
