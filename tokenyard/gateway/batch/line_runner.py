"""One Batch API line through the same flow as an HTTP request (tokenyard/gateway/http/completion_flow.py):
the endpoint's parser, policy and route, context checks, the tenant's rate limits, admission and
the engine, at batch priority, in idle capacity or on the bulk pool, charged at the batch price.

    response = await run_line(gw, key, url, body, request_id, lane, on_start)
    # {"status_code": 200, "request_id": ..., "body": {...chat.completion...}}, or None when cut short

What the line's own input causes (a 400 for a bad body, 403 policy_denied, 404 for an unknown
model, 429 insufficient_quota or request_too_large, a 500 from the engine) is its answer, and it
goes to the error file. What only says "not now" (429 rate or concurrency limit, 503 shed, engine
or Redis unavailable) raises `RetryLater`: the line waits and runs again, it never fails for that.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Callable

from tokenyard.gateway.auth.api_keys import KeyRecord
from tokenyard.gateway.edge.chat_request import parse_chat_request
from tokenyard.gateway.edge.completion_request import parse_completion_request
from tokenyard.gateway.edge.errors import APIError, BadRequest, ServerError
from tokenyard.gateway.edge.responses_request import parse_responses_request
from tokenyard.gateway.http.chat_endpoint import render_chat
from tokenyard.gateway.http.completion_flow import BatchLane, Entry, generate
from tokenyard.gateway.http.completions_endpoint import render_text
from tokenyard.gateway.http.embeddings_endpoint import run_embeddings
from tokenyard.gateway.http.generation import EngineFailed, RequestRejected
from tokenyard.gateway.http.generation_group import GenerationGroup
from tokenyard.gateway.http.responses_endpoint import render_response, reply_tools
from tokenyard.gateway.http.responses_turn import open_turn
from tokenyard.gateway.http.responses_upstream import document_response
from tokenyard.gateway.http.upstream_body import as_ours

if TYPE_CHECKING:
    from tokenyard.gateway.state import Gateway

# Refusals that depend only on load or on the moment; the line is run again later.
_RETRY_CODES = {"rate_limit_exceeded", "concurrency_limit_exceeded", "queue_full", "engine_overloaded",
                "deadline_exceeded", "gateway_busy", "engine_unavailable", "rate_limiter_unavailable",
                "auth_unavailable", "draining"}
MAX_RETRY_S = 5.0


class RetryLater(Exception):
    def __init__(self, after_s: float, reason: str) -> None:
        super().__init__(reason)
        self.after_s = after_s


async def run_line(gw: "Gateway", key: KeyRecord, url: str, body: dict[str, Any], request_id: str,
                   lane: BatchLane, on_start: Callable[[GenerationGroup], None]) -> dict[str, Any] | None:
    """The line's response (status_code, request_id, body), or None when it was aborted (cancel).
    on_start(gen) gets the running request, so a cancel can abort it."""
    if url == "/v1/embeddings":
        return await _embeddings_line(gw, key, body, request_id, lane)
    try:
        turn = None
        if url == "/v1/chat/completions":
            req: Any = parse_chat_request(body, gw.deployment.limits.max_messages)
            prompt_param, prefix = "messages", "chatcmpl-"
        elif url == "/v1/responses":
            req, turn = await open_turn(gw, parse_responses_request(body), key.tenant)
            prompt_param, prefix = "input", "resp-"
        else:
            req = parse_completion_request(body)
            prompt_param, prefix = "prompt", "cmpl-"
        if req.stream:
            raise BadRequest("stream is not supported in a batch: each line's response is written whole",
                             param="stream", code="unsupported_parameter")
        loop = asyncio.get_running_loop()
        max_ms = gw.deployment.admission.max_deadline_ms
        entry = Entry(time.perf_counter(), loop.time() + max_ms / 1000, max_ms, request_id, {},
                      api="chat" if turn is None else "responses")
        started = await generate(gw, req, key, prompt_param, entry, lane)
    except APIError as e:
        if e.code in _RETRY_CODES or (e.status == 503 and e.code is None):
            raise RetryLater(_retry_after(e), e.code or "unavailable") from e
        return _response(e.status, request_id, e.body())
    if started.upstream is not None:    # an upstream engine (type: openai) answered the line whole
        call = started.upstream
        try:
            assert call.document is not None
            doc = as_ours(call.document, prefix + request_id, call.name) if turn is None else \
                await document_response(call, turn)
            call.finish(200)
            return _response(200, request_id, doc)
        finally:
            call.finish(200)
    gen = started.gen
    assert gen is not None
    on_start(gen)
    status, record_status = 200, None
    try:
        try:
            async for _ in gen.deltas():
                pass
        except RequestRejected as e:
            status, record_status = 400, "rejected"
            return _response(400, request_id, e.as_http().body())
        except EngineFailed:
            status = 500
            return _response(500, request_id, ServerError("The engine failed while generating this response",
                                                          code="engine_error").body())
        if gen.aborted is not None:
            status, record_status = 499, gen.aborted
            return None
        if turn is not None:
            reply = await render_response(gen, reply_tools(req), turn)
        elif url == "/v1/chat/completions":
            reply = render_chat(gen, req, prefix + request_id)
        else:
            reply = render_text(gen, prefix + request_id)
        return _response(200, request_id, reply)
    except asyncio.CancelledError:      # the gateway stops: the line runs again after the restart
        status, record_status = 499, "unfinished"
        raise
    finally:
        gen.finish(status, record_status)


async def _embeddings_line(gw: "Gateway", key: KeyRecord, body: dict[str, Any], request_id: str,
                           lane: BatchLane) -> dict[str, Any]:
    """An embeddings line: the endpoint's own work at batch priority and the batch's price (one call,
    nothing to abort half-way)."""
    max_ms = gw.deployment.admission.max_deadline_ms
    try:
        reply, _ = await run_embeddings(gw, key, body, request_id, {}, time.perf_counter(),
                                        asyncio.get_running_loop().time() + max_ms / 1000, lane)
    except APIError as e:
        if e.code in _RETRY_CODES or (e.status == 503 and e.code is None):
            raise RetryLater(_retry_after(e), e.code or "unavailable") from e
        return _response(e.status, request_id, e.body())
    return _response(200, request_id, reply)


def _response(status: int, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"status_code": status, "request_id": request_id, "body": body}


def _retry_after(e: APIError) -> float:
    raw = e.headers.get("retry-after-ms")
    try:
        seconds = int(raw) / 1000 if raw else float(e.headers.get("retry-after", "1"))
    except ValueError:
        seconds = 1.0
    return min(max(seconds, 0.05), MAX_RETRY_S)
