"""POST /v1/chat/completions: the shared flow (gateway/http/completion_flow.py) with the chat
parser (gateway/http/chat_request.py), rendered as chat.completion objects (or their chunks).
"""
from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.routing import Route

from gateway.http.chat_request import parse_chat_request
from gateway.http.completion_flow import CompletionResponse, start_generation
from gateway.http.generation import Generation
from gateway.http.streaming import SSEResponse


def routes() -> list[Route]:
    return [Route("/v1/chat/completions", chat_completions, methods=["POST"])]


async def chat_completions(request: Request) -> Any:
    started = await start_generation(
        request, lambda body, gw: parse_chat_request(body, gw.deployment.limits.max_messages), "messages")
    gen, req = started.gen, started.req
    completion_id = "chatcmpl-" + started.request_id
    if req.stream:
        lim = request.app.state.gateway.deployment.limits
        return SSEResponse(gen, completion_id, int(time.time()), req.include_usage, started.headers,
                           lim.stream_buffer_bytes, lim.stream_write_timeout_s)

    def render(gen: Generation) -> dict:
        return {"id": completion_id, "object": "chat.completion", "created": int(time.time()),
                "model": gen.handle.name, "system_fingerprint": None,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": gen.text, "refusal": None},
                             "logprobs": gen.logprobs_field(), "finish_reason": gen.finish_reason}],
                "usage": gen.usage()}

    return CompletionResponse(gen, started.headers, render)
