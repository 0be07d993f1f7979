"""The one sign-in flow of the HTML pages: an API key typed into a form becomes a cookie session.

    SIGN_IN = SignIn(home="/dashboard", template="login.html", metric=...)   # per page
    auth = await SIGN_IN.current(request)      # (session, key record) or None

Rules, the same for every page:
- GET  {home}/login shows the form; an anonymous session carries the CSRF token (kept across reloads).
- POST {home}/login checks the CSRF token, then the key; a key that is not accepted is a 401 page,
  a tenant key where `admin_only` is a 403 page. On success the anonymous session is deleted and a
  new one created (a new id on sign-in: no session fixation), then a redirect to {home}.
- POST {home}/logout checks the CSRF token and deletes the session.
- A session whose key was revoked or deleted since sign-in (or lost its admin role where
  `admin_only`) is deleted on its next use, so revocation signs the browser out too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from tokenyard.gateway.auth import csrf
from tokenyard.gateway.auth.api_keys import KeyRecord
from tokenyard.gateway.auth.sessions import COOKIE, Session
from tokenyard.gateway.edge.errors import APIError, Unauthorized
from tokenyard.gateway.state import gateway_of
from tokenyard.gateway.web.pages import read_form, render, with_cookie

MAX_FORM_BYTES = 8192


@dataclass(frozen=True, slots=True)
class SignIn:
    home: str                       # the page's path; the flow lives under {home}/login and {home}/logout
    template: str                   # the sign-in form's template
    secured: Callable[[Any], Any]   # the page's security-header decorator (its own CSP)
    admin_only: bool = False
    metric: Callable[[Request], Any] | None = None   # request -> labelled counter of outcomes, if counted

    def routes(self) -> list[Route]:
        return [Route(f"{self.home}/login", self.secured(self.login_page), methods=["GET"]),
                Route(f"{self.home}/login", self.secured(self.login), methods=["POST"]),
                Route(f"{self.home}/logout", self.secured(self.logout), methods=["POST"])]

    async def current(self, request: Request) -> tuple[Session, KeyRecord] | None:
        """The session and its key's current record; None when not signed in or no longer allowed."""
        gw = gateway_of(request)
        session = await gw.sessions.get(request.cookies.get(COOKIE))
        if session is None or not session.signed_in:
            return None
        rec = await gw.keys.lookup(session.key_id)
        if rec is None or rec.revoked is not None or (self.admin_only and not rec.is_admin):
            await gw.sessions.delete(session.id)
            return None
        return session, rec

    def _count(self, request: Request, outcome: str) -> None:
        if self.metric is not None:
            self.metric(request).labels(outcome).inc()

    def _form_page(self, session: Session | None, status: int = 200, error: str | None = None) -> Response:
        return render(self.template, status, session=session, csrf_field=csrf.FIELD, error=error)

    async def login_page(self, request: Request) -> Response:
        if await self.current(request) is not None:
            return RedirectResponse(self.home, status_code=303)
        gw = gateway_of(request)
        session = await gw.sessions.get(request.cookies.get(COOKIE))
        if session is None:                  # keep an existing anonymous session (and its token) across reloads
            session = await gw.sessions.anonymous()
        return with_cookie(request, self._form_page(session), session)

    async def login(self, request: Request) -> Response:
        gw = gateway_of(request)
        session = await gw.sessions.get(request.cookies.get(COOKIE))
        form = await read_form(request, MAX_FORM_BYTES)
        try:
            csrf.check(request, session, form.get(csrf.FIELD))
        except APIError:
            self._count(request, "csrf_failed")
            raise
        try:
            key = await gw.keys.authenticate("Bearer " + form.get("api_key", "").strip())
        except Unauthorized:
            self._count(request, "bad_key")
            return self._form_page(session, 401, "That key was not accepted.")
        if self.admin_only and not key.is_admin:
            self._count(request, "not_admin")
            return self._form_page(session, 403, "That is a tenant key; this page needs an admin key.")
        await gw.sessions.delete(session.id)
        new = await gw.sessions.create(key_id=key.key_id, tenant=key.tenant, role=key.role)
        self._count(request, "ok")
        return with_cookie(request, RedirectResponse(self.home, status_code=303), new)

    async def logout(self, request: Request) -> Response:
        gw = gateway_of(request)
        session = await gw.sessions.get(request.cookies.get(COOKIE))
        form = await read_form(request, MAX_FORM_BYTES)
        csrf.check(request, session, form.get(csrf.FIELD))
        await gw.sessions.delete(session.id)
        return with_cookie(request, RedirectResponse(f"{self.home}/login", status_code=303), None)
