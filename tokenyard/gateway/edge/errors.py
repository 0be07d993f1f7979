"""Typed API errors and the one place they become OpenAI-shaped JSON.

Inside the gateway, code raises an `APIError` subclass; the edge turns it into
    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
with its HTTP status. Nothing else ever reaches a client: unexpected exceptions become a 500
with a generic message (the details go to the log, never a stack trace to the client).

x-should-retry: the OpenAI SDKs retry 408, 409, 429 and 5xx answers on their own (twice by
default) unless the answer says `x-should-retry: false`. Every error that the same request sent
again cannot fix says so: 4xx answers other than 408 and 409, and of the 429s the budget refusal
(insufficient_quota) and the request bigger than the whole token bucket (request_too_large).
A 429 rate_limit_exceeded (retry-after says when) and 5xx answers leave the SDK to decide.
"""
from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # imported where a response is built: a replica's parent reads its deployment (which
    # names these errors) before it starts its engine core, and starlette is 40 ms of that on a 2-core VM
    from starlette.responses import Response


class APIError(Exception):
    status = 500
    type = "server_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return json_error(self.status, self.body(), self.headers)


class BadRequest(APIError):
    status, type = 400, "invalid_request_error"


class Unauthorized(APIError):
    status, type = 401, "invalid_request_error"   # OpenAI's type for a bad key; code says which


class Forbidden(APIError):
    status, type = 403, "permission_error"


class NotFound(APIError):
    status, type = 404, "invalid_request_error"


class PayloadTooLarge(APIError):
    status, type = 413, "invalid_request_error"


class Unprocessable(APIError):
    status, type = 422, "invalid_request_error"


class RateLimited(APIError):
    status, type = 429, "rate_limit_error"


class ClientClosed(APIError):
    """The client went away while its request body was still being read (nginx's 499): nobody sees
    this answer; the status is for the access log and the metrics, not an error to log."""
    status, type = 499, "invalid_request_error"


class ServerError(APIError):
    status, type = 500, "server_error"


class Unavailable(APIError):
    status, type = 503, "service_unavailable"


class BadGateway(APIError):
    """An upstream engine (type: openai) failed or answered something unusable."""
    status, type = 502, "upstream_error"


class GatewayTimeout(APIError):
    status, type = 504, "upstream_timeout"


_BY_STATUS: dict[int, type[APIError]] = {c.status: c for c in (
    BadRequest, Unauthorized, Forbidden, NotFound, PayloadTooLarge, Unprocessable, RateLimited, ServerError,
    Unavailable, BadGateway, GatewayTimeout)}


def error_for_status(status: int, message: str, code: str | None = None) -> APIError:
    """An APIError for a status Starlette raised itself (404 route, 405 method, ...)."""
    cls = _BY_STATUS.get(status)
    if cls is None:
        err = APIError(message, code=code)
        err.status = status
        err.type = "invalid_request_error" if 400 <= status < 500 else "server_error"
        return err
    return cls(message, code=code)


def retry_headers(seconds: float) -> dict[str, str]:
    """Retry-After in whole seconds (what HTTP allows) and retry-after-ms (what the OpenAI SDKs read
    first, so a client can come back after 200 ms rather than a rounded-up second)."""
    seconds = min(max(seconds, 0.001), 3600.0) if seconds == seconds else 1.0   # finite, NaN-safe
    return {"retry-after": str(max(1, math.ceil(seconds))), "retry-after-ms": str(math.ceil(seconds * 1000))}


NOT_RETRYABLE_429 = frozenset({"insufficient_quota", "request_too_large"})


def should_retry(status: int, code: str | None) -> bool | None:
    """False where sending the same request again cannot succeed; None: the client decides."""
    if status == 429:
        return False if code in NOT_RETRYABLE_429 else None
    if 400 <= status < 500 and status not in (408, 409):
        return False
    return None


def json_error(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    err = body.get("error") if isinstance(body, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    if should_retry(status, code) is False and not any(k.lower() == "x-should-retry" for k in headers or {}):
        headers = {**(headers or {}), "x-should-retry": "false"}
    from starlette.responses import Response
    return Response(json.dumps(body), status_code=status, headers=headers, media_type="application/json")
