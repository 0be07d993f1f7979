"""A Messages API request that routing sent to an upstream engine (type: openai): the upstream is sent
the translated chat body (tokenyard/gateway/http/upstream_body.py) and its chat completion, or its
chunks, are answered in Anthropic's shape through the same block events as the built-in engines'
replies (tokenyard/gateway/http/messages_blocks.py). Usage is the upstream's (or the gateway's
estimate), recorded by UpstreamCall as for chat.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from tokenyard.gateway.edge.errors import ServerError
from tokenyard.gateway.edge.messages_errors import error_body
from tokenyard.gateway.http.messages_blocks import BlockStream, content_of, stop_reason, usage_of
from tokenyard.gateway.http.upstream_call import UpstreamCall, UpstreamFailure
from tokenyard.gateway.http.upstream_reply import UpstreamSSEResponse, send_json, start_stream

log = logging.getLogger(__name__)


def upstream_message(request: Request, started: Any, message_id: str) -> Any:
    call = started.upstream
    req = started.req
    if req.stream:
        lim = request.app.state.gateway.deployment.limits
        return _Stream(call, message_id, req.stop, started.headers, lim.stream_write_timeout_s)
    return _Whole(call, message_id, req.stop, started.headers)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"event: " + obj["type"].encode() + b"\ndata: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _stop_string(choice: dict[str, Any], stops: list[str]) -> str | None:
    """The stop sequence that ended the reply, where the upstream says (vLLM's choices[].stop_reason)."""
    said = choice.get("stop_reason")
    return said if isinstance(said, str) and said in stops else None


def _deltas(part: Any) -> list[dict[str, Any]]:
    """A chat message or delta as the chat deltas BlockStream reads."""
    if not isinstance(part, dict):
        return []
    out: list[dict[str, Any]] = []
    if isinstance(part.get("content"), str):
        out.append({"content": part["content"]})
    calls = [c for c in part.get("tool_calls") or () if isinstance(c, dict)]
    if calls:
        out.append({"tool_calls": calls})
    return out


def _usage(call: UpstreamCall) -> dict[str, int]:
    p, cached, c, _ = call.counts()
    return usage_of(p, cached, c)


class _Whole:
    def __init__(self, call: UpstreamCall, message_id: str, stops: list[str], headers: dict[str, str]) -> None:
        self.call, self.message_id, self.stops, self.headers = call, message_id, stops, headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = self.call
        try:
            doc = call.document or {}
            choices = doc.get("choices") or [{}]
            choice = choices[0] if isinstance(choices[0], dict) else {}
            blocks = BlockStream()
            content = content_of(blocks.feed(_deltas(choice.get("message"))) + blocks.close())
            reason, sequence = stop_reason(choice.get("finish_reason"), _stop_string(choice, self.stops))
            if reason == "tool_use" and not any(b["type"] == "tool_use" for b in content):
                reason = "end_turn"
            body = {"id": self.message_id, "type": "message", "role": "assistant", "model": call.name,
                    "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(call)}
            await send_json(send, call, body, self.headers)
        finally:
            call.finish(200)


class _Stream(UpstreamSSEResponse):
    def __init__(self, call: UpstreamCall, message_id: str, stops: list[str], headers: dict[str, str],
                 write_timeout_s: float) -> None:
        super().__init__(call, message_id, False, headers, write_timeout_s)
        self.stops = stops

    async def _relay(self, send: Send) -> None:
        call = self.call
        await start_stream(send, self.headers)
        blocks = BlockStream()
        finish, stop_string = None, None
        try:
            await self._send(send, _sse({"type": "message_start", "message": {
                "id": self.completion_id, "type": "message", "role": "assistant", "model": call.name,
                "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage_of(0, 0, 0)}}))
            async for doc in call.events():
                if doc is None:
                    events = blocks.close()
                    reason, sequence = stop_reason(finish, stop_string)
                    if reason == "tool_use" and not blocks.tool_uses:
                        reason = "end_turn"
                    events.append({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": _usage(call)})
                    await self._send(send, b"".join(_sse(e) for e in events))
                    call.finish(200)     # the usage record exists before the client can see message_stop
                    await self._send(send, _sse({"type": "message_stop"}))
                    break
                events = []
                for ch in doc.get("choices") or ():
                    if isinstance(ch, dict):
                        events += blocks.feed(_deltas(ch.get("delta")))
                        finish = ch.get("finish_reason") or finish
                        stop_string = _stop_string(ch, self.stops) or stop_string
                if events:
                    await self._send(send, b"".join(_sse(e) for e in events))
        except UpstreamFailure as e:
            call.error = e.message
            await self._send(send, _sse(error_body(e.as_http())))
        except Exception:  # noqa: BLE001 - the stream is open: report in-band, never a trace
            log.exception("upstream message stream %s failed", call.request_id)
            call.error = "internal error"
            await self._send(send, _sse(error_body(ServerError("Internal error while streaming"))))
        await send({"type": "http.response.body", "body": b"", "more_body": False})
