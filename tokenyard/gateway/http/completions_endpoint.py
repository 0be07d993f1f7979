"""POST /v1/completions (OpenAI's legacy text completion): the shared flow
(tokenyard/gateway/http/completion_flow.py) with a prompt that is encoded as is or given as token ids (no
chat template), rendered as text_completion objects, streamed or not. Admission, limits,
routing and spend are the chat endpoint's, unchanged.
"""
from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.routing import Route

from tokenyard.gateway.edge.completion_request import parse_completion_request
from tokenyard.gateway.http.completion_flow import CompletionResponse, start_generation, upstream_reply
from tokenyard.gateway.http.generation_group import GenerationGroup
from tokenyard.gateway.http.streaming import TextSSEResponse


def routes() -> list[Route]:
    return [Route("/v1/completions", completions, methods=["POST"])]


async def completions(request: Request) -> Any:
    started = await start_generation(request, lambda body, gw: parse_completion_request(body), "prompt")
    gen, req = started.gen, started.req
    completion_id = "cmpl-" + started.request_id
    if started.upstream is not None:
        return upstream_reply(request, started, completion_id)
    if req.stream:
        lim = request.app.state.gateway.deployment.limits
        return TextSSEResponse(gen, completion_id, int(time.time()), req.include_usage, started.headers,
                               lim.stream_buffer_bytes, lim.stream_write_timeout_s)

    return CompletionResponse(gen, started.headers, lambda gen: render_text(gen, completion_id))


def render_text(gen: GenerationGroup, completion_id: str) -> dict:
    """The text_completion object of a finished request (also a Batch API line's response body)."""
    return {"id": completion_id, "object": "text_completion", "created": int(time.time()),
            "model": gen.model_name, "system_fingerprint": None,
            "choices": [{"text": g.text, "index": i, "logprobs": g.legacy_logprobs_field(),
                         "finish_reason": g.finish_reason} for i, g in enumerate(gen.choices)],
            "usage": gen.usage()}
