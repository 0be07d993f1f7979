"""CSRF protection for the dashboard's forms: a synchronizer token tied to the session.

Every session (an anonymous one too, for the sign-in form) has a random token stored server-side
with it (tokenyard/gateway/auth/sessions.py). Every POST form carries it in a hidden `csrf_token` field and the
handler compares it with the session's in constant time; a POST without a session, without the
field, or with another value is refused (403 `csrf_failed`). As a second, independent check, a
POST whose Origin (or, without Origin, Referer) names another origin is refused too.

GET requests change nothing (the period filter and the CSV download are GETs), so they need no
token; SameSite=Strict already keeps the session cookie off cross-site requests.
"""
from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from starlette.requests import Request

from tokenyard.gateway.auth.sessions import Session
from tokenyard.gateway.edge.errors import Forbidden

FIELD = "csrf_token"


def check(request: Request, session: Session | None, submitted: str | None) -> None:
    if not same_origin(request):
        raise Forbidden("Cross-origin form posts are refused", code="csrf_failed")
    if session is None or not submitted or not hmac.compare_digest(session.csrf.encode(), submitted.encode()):
        raise Forbidden("Missing or wrong CSRF token; reload the page and try again", param=FIELD,
                        code="csrf_failed")


def same_origin(request: Request) -> bool:
    """True when Origin/Referer is absent (non-browser clients) or names this server's origin."""
    origin = request.headers.get("origin")
    if origin is not None:
        if origin == "null":
            return False      # sandboxed frames and cross-origin redirects: not a page of ours
        source = origin
    else:
        source = request.headers.get("referer")
        if not source:
            return True
    parts = urlsplit(source)
    return parts.netloc == request.headers.get("host", "") and parts.scheme in ("http", "https")
