"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the one request flow.

The body is translated into a chat request (tokenyard/gateway/edge/messages_request.py) and run by
the same `start_generation` as /v1/chat/completions: the key, limits, admission, routing (`auto`
included), the engine and the spend record (its `api` is "messages") are chat's. Only the reply is
rendered in Anthropic's shape: a `message` object, or its event stream

    event: message_start         {"type": "message_start", "message": {... "content": [], "usage": ...}}
    event: content_block_start   / content_block_delta (text_delta, input_json_delta) / content_block_stop
    event: message_delta         {"delta": {"stop_reason", "stop_sequence"}, "usage": {...}}
    event: message_stop

The key comes in `x-api-key` (what the anthropic SDK sends) or `Authorization: Bearer`. Errors on
these paths are Anthropic-shaped (tokenyard/gateway/edge/messages_errors.py); one after the stream
began is an `event: error` and the stream closes.

count_tokens tokenises the conversation (chat template and tools included) with the tokenizer of
the engine the model names, or for `auto` the engine routing counts with (the count that drives
routing and limits), and answers {"input_tokens": n}. It starts nothing and reserves nothing.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tokenyard.gateway.edge.errors import BadRequest, ServerError
from tokenyard.gateway.edge.messages_errors import error_body
from tokenyard.gateway.edge.messages_request import parse_messages_request
from tokenyard.gateway.http.completion_flow import CompletionResponse, read_json, start_generation
from tokenyard.gateway.http.generation import EngineFailed, RequestRejected
from tokenyard.gateway.http.generation_group import GenerationGroup
from tokenyard.gateway.http.messages_blocks import BlockStream, content_of, stop_reason, usage_of
from tokenyard.gateway.http.messages_upstream import upstream_message
from tokenyard.gateway.http.streaming import SSEResponse
from tokenyard.gateway.http.tool_calls import ToolCallStream
from tokenyard.gateway.prompt.prompt_guard import prompt_work
from tokenyard.gateway.prompt.rendering import RenderedPrompt

log = logging.getLogger(__name__)


def routes() -> list[Route]:
    return [Route("/v1/messages", create_message, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]


def authorization(request: Request) -> str | None:
    """x-api-key as the flow's "Bearer <key>"; None: the Authorization header, as on every route."""
    key = request.headers.get("x-api-key")
    return f"Bearer {key.strip()}" if key and key.strip() else None


def _parse(body: Any, gw: Any) -> Any:
    return parse_messages_request(body, gw.deployment.limits.max_messages)


async def create_message(request: Request) -> Any:
    started = await start_generation(request, _parse, "messages", authorization(request))
    message_id = "msg_" + started.request_id
    if started.upstream is not None:
        return upstream_message(request, started, message_id)
    gen, req = started.gen, started.req
    assert gen is not None
    if req.stream:
        lim = request.app.state.gateway.deployment.limits
        return MessagesSSEResponse(gen, message_id, req, started.headers, lim.stream_buffer_bytes,
                                   lim.stream_write_timeout_s)
    return CompletionResponse(gen, started.headers, lambda gen: render_message(gen, req, message_id),
                              error_body=error_body)


def _tools(req: Any) -> Any:
    return req.tools if req.tools is not None and req.tools.parses_calls else None


def render_message(gen: GenerationGroup, req: Any, message_id: str) -> dict[str, Any]:
    """The Messages API's `message` object of a finished request."""
    g = gen.first
    blocks = BlockStream()
    tools = _tools(req)
    finish = g.finish_reason
    if tools is not None:
        parser = ToolCallStream(tools)
        deltas = parser.feed(g.text)
        more, finish = parser.close(finish)
        events = blocks.feed(deltas + more)
    else:
        events = blocks.feed([{"content": g.text}])
    content = content_of(events + blocks.close())
    reason, sequence = stop_reason(finish, g.stop_string)
    if reason == "tool_use" and not any(b["type"] == "tool_use" for b in content):
        reason = "end_turn"     # the only call was malformed and is given back as text
    return {"id": message_id, "type": "message", "role": "assistant", "model": gen.model_name,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage_of(g.num_prompt_tokens, g.num_cached_tokens, g.num_completion_tokens)}


def event(obj: dict[str, Any]) -> bytes:
    """One server-sent event: its name (the object's type) and its data."""
    return b"event: " + obj["type"].encode() + b"\ndata: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class MessagesSSEResponse(SSEResponse):
    """A streamed message: the chat stream's buffering, slow-reader and disconnect handling
    (tokenyard/gateway/http/streaming.py), with Anthropic's events for its chunks."""

    def __init__(self, gen: GenerationGroup, message_id: str, req: Any, headers: dict[str, str],
                 buffer_bytes: int, write_timeout_s: float) -> None:
        tools = _tools(req)
        super().__init__(gen, message_id, 0, False, headers, buffer_bytes, write_timeout_s,
                         (lambda: ToolCallStream(tools)) if tools is not None else None)
        self.message_id = message_id

    def _start(self) -> dict[str, Any]:
        g = self.gen.first
        return {"type": "message_start", "message": {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.gen.model_name,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": usage_of(g.num_prompt_tokens, g.num_cached_tokens, 0)}}

    async def _produce(self) -> None:
        gen, st = self.gen, self._choices[0]
        blocks = BlockStream()
        finish = None
        try:
            self._push(event(self._start()))
            self._push(event({"type": "ping"}))
            async for _, delta in gen.deltas():
                if delta is None:
                    finish = st.gen.finish_reason
                    deltas: list[dict[str, Any]] = []
                    if st.tools is not None:
                        deltas, finish = st.tools.close(finish)
                    events = blocks.feed(deltas) + blocks.close()
                else:
                    events = blocks.feed(st.tools.feed(delta) if st.tools is not None else [{"content": delta}])
                for e in events:
                    self._push(event(e))
            if gen.aborted is None:
                g = gen.first
                reason, sequence = stop_reason(finish, g.stop_string)
                if reason == "tool_use" and not blocks.tool_uses:
                    reason = "end_turn"
                self._push(event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                  "usage": usage_of(g.num_prompt_tokens, g.num_cached_tokens,
                                                    g.num_completion_tokens)}))
                gen.finish(200)   # the usage record exists before the client can see message_stop
                self._push(event({"type": "message_stop"}))
        except RequestRejected as e:    # a remote replica refused the input after the stream began
            gen.finish(400, "rejected")
            self._push(event(error_body(e.as_http())))
        except EngineFailed:
            gen.finish(500)
            self._push(event(error_body(ServerError("The engine failed while generating this response"))))
        except Exception:  # noqa: BLE001 - the stream is already open: report in-band, never a trace
            log.exception("message stream %s failed", gen.request_id)
            gen.first.error = gen.first.error or "internal error"
            self._push(event(error_body(ServerError("Internal error while streaming"))))
        finally:
            self._produced_all = True
            self._ready.set()


async def count_tokens(request: Request) -> JSONResponse:
    gw = request.app.state.gateway
    body = await read_json(request, gw.deployment.limits.max_body_bytes, gw.deployment.limits.max_json_depth)
    if isinstance(body, dict) and "max_tokens" not in body:
        body = {**body, "max_tokens": 1}     # count_tokens takes no max_tokens; the translation wants one
    elif isinstance(body, dict):
        raise BadRequest("max_tokens: Extra inputs are not permitted", param="max_tokens")
    req = _parse(body, gw)
    await gw.keys.authenticate(authorization(request) or request.headers.get("authorization"))
    if req.stream:
        raise BadRequest("stream: Extra inputs are not permitted", param="stream")
    pinned = gw.router.pinned(req.model)       # NotFound for an unknown model, as create does
    engine = pinned.engine if pinned is not None else gw.router.counting_engine
    ids = await prompt_work(req, RenderedPrompt(req).ids, gw.handles[engine].tokenizer)
    return JSONResponse({"input_tokens": len(ids)})
