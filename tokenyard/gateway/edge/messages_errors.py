"""Errors on the Messages API routes (/v1/messages...) in Anthropic's shape:

    {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}

with the same HTTP status and headers (Retry-After, x-should-retry) the gateway's APIError carries;
the anthropic SDK reads both, as the openai SDK does. The app's error handlers
(tokenyard/gateway/server/app.py) answer through `error_response`, so every error on these paths,
Starlette's 404 / 405 and unexpected ones included, has this shape.
"""
from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

from tokenyard.gateway.edge.errors import APIError, should_retry

PREFIX = "/v1/messages"

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors).
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
          429: "rate_limit_error", 500: "api_error", 502: "api_error", 503: "overloaded_error",
          504: "api_error", 529: "overloaded_error"}


def is_messages_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


_MISSING_KEY = "You didn't provide an API key."


def error_body(err: APIError) -> dict[str, Any]:
    message = err.message
    if err.status == 401 and message.startswith(_MISSING_KEY):   # these routes take the key as x-api-key too
        message = _MISSING_KEY + " Send 'x-api-key: <key>' (or 'Authorization: Bearer <key>')."
    return {"type": "error", "error": {"type": error_type(err.status), "message": message}}


def error_response(err: APIError) -> Response:
    headers = dict(err.headers)
    if should_retry(err.status, err.code) is False and not any(k.lower() == "x-should-retry" for k in headers):
        headers["x-should-retry"] = "false"     # as on the other routes: sending it again cannot succeed
    return Response(json.dumps(error_body(err), ensure_ascii=False), status_code=err.status, headers=headers,
                    media_type="application/json")
