"""POST /v1/chat/completions: the shared flow (tokenyard/gateway/http/completion_flow.py) with the chat
parser (tokenyard/gateway/edge/chat_request.py), rendered as chat.completion objects (or their chunks):
one choice per `n`, each message's text parsed into content and tool_calls when the request has tools.
"""
from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.routing import Route

from tokenyard.gateway.edge.chat_request import parse_chat_request
from tokenyard.gateway.http.completion_flow import CompletionResponse, start_generation, upstream_reply
from tokenyard.gateway.http.generation import Generation
from tokenyard.gateway.http.generation_group import GenerationGroup
from tokenyard.gateway.http.streaming import SSEResponse
from tokenyard.gateway.http.tool_calls import ToolCallStream, assemble


def routes() -> list[Route]:
    return [Route("/v1/chat/completions", chat_completions, methods=["POST"])]


async def chat_completions(request: Request) -> Any:
    started = await start_generation(
        request, lambda body, gw: parse_chat_request(body, gw.deployment.limits.max_messages), "messages")
    gen, req = started.gen, started.req
    completion_id = "chatcmpl-" + started.request_id
    if started.upstream is not None:
        return upstream_reply(request, started, completion_id)
    if req.stream:
        tools = req.tools if req.tools is not None and req.tools.parses_calls else None
        lim = request.app.state.gateway.deployment.limits
        return SSEResponse(gen, completion_id, int(time.time()), req.include_usage, started.headers,
                           lim.stream_buffer_bytes, lim.stream_write_timeout_s,
                           lambda: ToolCallStream(tools) if tools is not None else None)
    return CompletionResponse(gen, started.headers, lambda gen: render_chat(gen, req, completion_id))


def render_chat(gen: GenerationGroup, req: Any, completion_id: str) -> dict:
    """The chat.completion object of a finished request (also a Batch API line's response body)."""
    tools = req.tools if req.tools is not None and req.tools.parses_calls else None

    def choice(index: int, g: Generation) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": g.text, "refusal": None}
        finish = g.finish_reason
        if tools is not None:
            parser = ToolCallStream(tools)
            deltas = parser.feed(g.text)
            more, finish = parser.close(finish)
            message["content"], calls = assemble(deltas + more)
            if calls:
                message["tool_calls"] = calls
        return {"index": index, "message": message, "logprobs": g.logprobs_field(), "finish_reason": finish}

    return {"id": completion_id, "object": "chat.completion", "created": int(time.time()),
            "model": gen.model_name, "system_fingerprint": None,
            "choices": [choice(i, g) for i, g in enumerate(gen.choices)], "usage": gen.usage()}
