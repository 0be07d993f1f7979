"""The tail of the shared request flow for an upstream engine (type: openai): everything before it
(authentication, policy and route, the prompt count, the context check) is the built-in engines'
path in completion_flow.py; here the limits are reserved, the request is admitted into the
engine's queue, and the upstream is called until it answers.

When the call fails before anything reached the client (every attempt failed, or the upstream
refused the prompt as too long for its context), the policy's fallback chain for the request
(a rule's `fallback`, else its tenant's) may move it: the next engine on the chain that is alive
takes it through the same flow (a built-in engine or another upstream), with its reservation made
anew for that engine; otherwise the client gets the failure as an OpenAI-shaped error naming the
engine.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from tokenyard.gateway.backends.prefix_affinity import prefix_hashes
from tokenyard.gateway.backends.upstream_engine import UpstreamEngine
from tokenyard.gateway.edge.chat_request import ChatRequest
from tokenyard.gateway.edge.errors import BadRequest
from tokenyard.gateway.http.upstream_body import upstream_body
from tokenyard.gateway.http.upstream_call import UpstreamCall, UpstreamFailure
from tokenyard.gateway.spend.usage import RecordContext

if TYPE_CHECKING:
    from tokenyard.gateway.state import Gateway

AFFINITY_BLOCK = 16
AFFINITY_BLOCKS = 32


async def start_upstream(gw: "Gateway", req: Any, key: Any, entry: Any, route: Any, lane: Any, handle: Any,
                         prompt_lengths: list[int], max_tokens: int, priority: int,
                         context: RecordContext, fallback: Callable[[Any, str], Awaitable[Any]],
                         started: Callable[[UpstreamCall, dict[str, str]], Any]) -> Any:
    """What `started(call, headers)` makes of the opened call (completion_flow.Started), or what the
    fallback engine's flow returns."""
    engine: UpstreamEngine = handle.engine
    # A batch of text prompts goes as one call: the upstream answers every choice of every prompt.
    num_choices = len(prompt_lengths) * req.n
    admitted = await gw.gatekeeper.enter(key, handle.name, sum(prompt_lengths), max_tokens * num_choices,
                                         entry.deadline, priority, route.rate, route.budget)
    sink = admitted.billing(gw.usage_sink)
    body = upstream_body(req, engine.spec.upstream_model, max_tokens)
    affinity = None
    if engine.spec.balance == "prefix_affinity" and not getattr(handle.tokenizer, "estimate", False):
        affinity = prefix_hashes(route.prompt_ids, AFFINITY_BLOCK, AFFINITY_BLOCKS, key.tenant)
    call = UpstreamCall(engine, "/chat/completions" if isinstance(req, ChatRequest) else "/completions", body,
                        request_id=f"{entry.request_id}-{secrets.token_hex(4)}", requested_model=req.model,
                        route_reason=route.reason, arrival=entry.arrival, arrival_wall=time.time(),
                        metrics=gw.metrics, sink=sink, prices=context.prices or handle.prices, context=context,
                        prompt_tokens=sum(prompt_lengths), max_tokens=max_tokens, on_end=admitted.end,
                        affinity=affinity, price_percent=100 if lane is None else lane.price_percent)
    entry.info.update(engine=handle.name, route_reason=route.reason)
    attempts = entry.info.setdefault("upstream_attempts", [])
    try:
        await call.open()
    except UpstreamFailure as e:
        call.give_back()
        attempts.extend(call.attempts)
        nxt = _next_engine(gw, route, handle.name, e)
        if nxt is not None:
            gw.metrics.upstream_fallbacks.labels(handle.name, e.fallback_reason).inc()
            return await fallback(nxt, f"fallback_{e.fallback_reason}")
        err = e.as_http()
        if isinstance(err, BadRequest) and err.code == "context_length_exceeded":
            err.param = "messages" if isinstance(req, ChatRequest) else "prompt"
        raise err from None
    except BaseException:
        call.give_back()
        raise
    attempts.extend(call.attempts)
    entry.info["generation"] = call
    headers = {"x-tokenyard-engine": handle.name, "x-tokenyard-route-reason": route.reason,
               "x-tokenyard-policy-version": str(route.policy_version), **admitted.headers}
    if route.score is not None:
        headers["x-tokenyard-router-score"] = f"{route.score:.6f}"
    return started(call, headers)


def _next_engine(gw: "Gateway", route: Any, failed: str, e: UpstreamFailure) -> Any:
    """The route moved to the next live engine of its fallback chain, or None."""
    chain = route.fallback
    if chain is None:
        return None
    tried = set(route.tried) | {failed}
    name = chain.next_engine(e.fallback_reason, lambda n: n in gw.handles and not gw.handles[n].engine.dead, tried)
    return None if name is None else replace(route, engine=name, tried=tuple(sorted(tried)))
