"""/v1/responses for a request an upstream engine (type: openai) took: the upstream is sent the chat
body (what every upstream speaks) and its chat reply, whole or streamed, is turned into the Response
object or its typed events by the same ResponseBuilder as the built-in engines' replies.

The relay's rules are upstream_reply.py's (retries end once the stream began, a client that leaves
aborts the upstream request, a slow reader is cut); only what is written differs.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from tokenyard.gateway.edge.errors import ServerError
from tokenyard.gateway.http.completion_flow import Started
from tokenyard.gateway.http.responses_output import sse_event
from tokenyard.gateway.http.upstream_call import UpstreamCall, UpstreamFailure
from tokenyard.gateway.http.upstream_reply import UpstreamSSEResponse, send_json, start_stream

if TYPE_CHECKING:
    from tokenyard.gateway.http.responses_turn import Turn

log = logging.getLogger(__name__)


def upstream_response(request: Request, started: Started, turn: "Turn") -> Any:
    call = started.upstream
    assert call is not None
    if turn.draft.stream:
        lim = request.app.state.gateway.deployment.limits
        return ResponsesUpstreamSSE(call, turn, started.headers, lim.stream_write_timeout_s)
    return ResponsesUpstreamJSON(call, turn, started.headers)


def _usage(call: UpstreamCall) -> dict[str, Any]:
    p, cached, c, _ = call.counts()
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def document_response(call: UpstreamCall, turn: "Turn") -> dict[str, Any]:
    """The Response object of an upstream's whole chat reply (stored when store is on)."""
    doc = call.document or {}
    choice = (doc.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    b = turn.builder(call.name)
    b.feed({"content": message.get("content") or ""})
    for i, c in enumerate(message.get("tool_calls") or ()):
        b.feed({"tool_calls": [{**c, "index": i}]})
    b.close(choice.get("finish_reason"), _usage(call))
    await turn.keep(b)
    return b.response()


class ResponsesUpstreamJSON:
    def __init__(self, call: UpstreamCall, turn: "Turn", headers: dict[str, str]) -> None:
        self.call = call
        self.turn = turn
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = self.call
        try:
            await send_json(send, call, await document_response(call, self.turn), self.headers)
        finally:
            call.finish(200)


class ResponsesUpstreamSSE(UpstreamSSEResponse):
    def __init__(self, call: UpstreamCall, turn: "Turn", headers: dict[str, str], write_timeout_s: float) -> None:
        super().__init__(call, turn.response_id, True, headers, write_timeout_s)
        self.turn = turn
        self.builder = turn.builder(call.name)

    async def _events(self, send: Send, events: list[dict[str, Any]]) -> None:
        if events:
            await self._send(send, b"".join(sse_event(e) for e in events))

    async def _relay(self, send: Send) -> None:
        call, b = self.call, self.builder
        await start_stream(send, self.headers)
        finish = None
        try:
            await self._events(send, b.start())
            async for doc in call.events():
                if doc is None:
                    closing = b.close(finish, _usage(call))
                    await self.turn.keep(b)
                    call.finish(200)     # the usage record exists before the client can see the end
                    await self._events(send, closing)
                    break
                for choice in doc.get("choices") or ():
                    finish = choice.get("finish_reason") or finish
                    await self._events(send, b.feed(choice.get("delta") or {}))
        except UpstreamFailure as e:
            call.error = e.message
            await self._events(send, b.fail(e.as_http().body()["error"]))
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the stream is open: report in-band, never a trace
            log.exception("upstream responses stream %s failed", call.request_id)
            call.error = "internal error"
            await self._events(send, b.fail(ServerError("Internal error while streaming").body()["error"]))
        await send({"type": "http.response.body", "body": b"", "more_body": False})
