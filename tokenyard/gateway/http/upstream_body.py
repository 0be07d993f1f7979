"""What an upstream engine (type: openai) is sent for a client's request, and how its answer is
shown to the client.

The client's body is passed through (tools, tool_choice, response_format, logprobs, n, penalties,
seed, stop, and anything else the edge accepted), with four changes:
- `model` becomes the upstream's name for it (`upstream_model`);
- the messages are the ones routing kept (a policy's context limit may have dropped old turns);
- the completion budget is the one the gateway reserved against the limits (the client's
  max_tokens, capped by a policy rule, or the deployment's default), so the upstream can never bill
  more than was held; it goes under the name the client used (max_tokens or max_completion_tokens);
- the gateway's own fields (metadata tags, the priority / service tier it queued the request by)
  stay here; a stream asks for usage (stream_options.include_usage), the source of spend.
The reply keeps everything the upstream said except `id` and `model`, which become the gateway's
(the id the access log and usage record carry; the engine name the client routes by).
"""
from __future__ import annotations

from typing import Any

from tokenyard.gateway.edge.chat_request import ChatRequest
from tokenyard.gateway.edge.completion_request import CompletionRequest

GATEWAY_ONLY = ("metadata", "priority", "service_tier")


def upstream_body(req: ChatRequest | CompletionRequest, upstream_model: str, max_tokens: int) -> dict[str, Any]:
    body = {k: v for k, v in (req.body or {}).items() if k not in GATEWAY_ONLY}
    body["model"] = upstream_model
    if isinstance(req, ChatRequest):
        body["messages"] = req.messages
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = max_tokens
        body.pop("max_tokens", None)
    else:
        body["max_tokens"] = max_tokens
    if req.stream:
        options = body.get("stream_options")
        body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    else:
        body.pop("stream_options", None)
    return body


def as_ours(doc: dict[str, Any], completion_id: str, engine: str) -> dict[str, Any]:
    """An upstream reply object (or stream chunk) with the gateway's id and engine name."""
    out = dict(doc)
    out["id"] = completion_id
    out["model"] = engine
    return out
