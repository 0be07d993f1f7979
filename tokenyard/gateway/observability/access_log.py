"""Request ids and the structured access log (one JSON object per request, no prompt text).

A client's x-request-id is kept when it is a sane token (1-128 of A-Z a-z 0-9 . _ : -),
otherwise one is made; it is echoed in the response's x-request-id and is the id of the usage
record and the chat completion. Endpoints add fields (engine, route reason, token counts) to
scope["tokenyard"]. The middleware also counts requests in progress, which drain waits on.
"""
from __future__ import annotations

import json
import logging
import re
import secrets
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("tokenyard.access")
_SANE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class AccessLog:
    def __init__(self, app: ASGIApp, gateway: Any) -> None:
        self.app = app
        self.gateway = gateway      # counts in_progress there; its deployment says if logging is on
        self.enabled = gateway.deployment.access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                candidate = value.decode("latin-1")
                rid = candidate if _SANE_ID.match(candidate) else None
                break
        rid = rid or secrets.token_hex(12)
        info: dict[str, Any] = {"request_id": rid}
        scope["tokenyard"] = info
        rid_header = (b"x-request-id", rid.encode())
        status = [0]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", []), rid_header]
            await send(message)

        t0 = time.perf_counter()
        self.gateway.in_progress += 1
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.gateway.in_progress -= 1
            if self.enabled and log.isEnabledFor(logging.INFO):
                # status 0: an unexpected error escaped to Starlette's 500 handler
                log.info(json.dumps(self._line(scope, info, status[0] or 500, time.perf_counter() - t0)))

    @staticmethod
    def _line(scope: Scope, info: dict[str, Any], status: int, seconds: float) -> dict[str, Any]:
        line: dict[str, Any] = {"ts": round(time.time(), 3), "request_id": info["request_id"],
                                "method": scope["method"], "path": scope["path"], "status": status,
                                "duration_ms": round(seconds * 1000, 2),
                                "client": (scope.get("client") or ("", 0))[0]}
        gen = info.get("generation")
        if gen is not None and gen.record is not None:
            r = gen.record
            line.update(engine=r.engine, model=r.requested_model, route_reason=r.route_reason,
                        stream=r.stream, outcome=r.status, finish_reason=r.finish_reason,
                        prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
                        completion_tokens=r.completion_tokens, ttft_ms=None if r.ttft_s is None else
                        round(r.ttft_s * 1000, 2))
            if r.upstream_attempts:
                line.update(deployment=r.upstream_deployment, usage_estimated=r.usage_estimated)
            if r.status in ("client_disconnected", "slow_client"):
                line["status"] = 499  # what the client saw was a cut connection, not the 200 it started with
        elif "error_code" in info:
            line["error_code"] = info["error_code"]
        if info.get("upstream_attempts"):     # every call to an upstream deployment, failed ones too
            line["attempts"] = info["upstream_attempts"]
        return line
