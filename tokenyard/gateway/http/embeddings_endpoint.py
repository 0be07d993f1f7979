"""POST /v1/embeddings: the client names the engine as `model`. A built-in torch engine marked
`embeddings: true` computes them itself (builtin_embeddings.py); an upstream engine that serves them
(`type: openai` with `embeddings: true`) gets the request passed through, as below.

The request runs the same gates as a completion: its key, the token rate limit (the input counted
before the call with the engine's tokenizer, or estimated), the engine's admission queue and
deadline; then one call with the upstream's retries and cooldowns (upstream_call.py), and a usage
record priced at the engine's input price from the prompt tokens the upstream reports. The reply is
the upstream's, with the engine's name as `model`.
"""
from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tokenyard.gateway.auth.api_keys import PRIORITIES
from tokenyard.gateway.edge.errors import BadRequest, NotFound
from tokenyard.gateway.http import builtin_embeddings
from tokenyard.gateway.http.completion_flow import read_json
from tokenyard.gateway.http.upstream_call import UpstreamCall, UpstreamFailure
from tokenyard.gateway.spend.usage import RecordContext

MAX_INPUTS = 2048


def routes() -> list[Route]:
    return [Route("/v1/embeddings", embeddings, methods=["POST"])]


def _inputs(value: Any) -> list[str] | list[list[int]]:
    """OpenAI's `input`: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and len(value) <= MAX_INPUTS:
        if all(isinstance(v, str) for v in value):
            return value
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [value]
        if all(isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
               for v in value):
            return value
    raise BadRequest(f"'input' must be a string, a non-empty list of at most {MAX_INPUTS} strings, or token ids",
                     param="input")


async def embeddings(request: Request) -> Any:
    gw = request.app.state.gateway
    arrival = time.perf_counter()
    info = request.scope.setdefault("tokenyard", {})
    body = await read_json(request, gw.deployment.limits.max_body_bytes, gw.deployment.limits.max_json_depth)
    check_body(body)
    key = await gw.keys.authenticate(request.headers.get("authorization"))
    info["tenant"] = key.tenant
    deadline = gw.admission.deadline(request.headers.get("x-request-deadline-ms"), time.perf_counter() - arrival)
    reply, headers = await run_embeddings(gw, key, body, info.get("request_id") or secrets.token_hex(12), info,
                                          arrival, deadline)
    return JSONResponse(reply, headers=headers)


def check_body(body: Any) -> list[str] | list[list[int]]:
    """The request's own checks, before its key is read: an object with a model and an input."""
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must name an engine that serves embeddings", param="model")
    return _inputs(body.get("input"))


async def run_embeddings(gw: Any, key: Any, body: Any, request_id: str, info: dict[str, Any], arrival: float,
                         deadline: float, lane: Any = None) -> tuple[dict[str, Any], dict[str, str]]:
    """One embeddings request after its key: (the reply object, its headers). `lane`: a Batch API line's
    (completion_flow.BatchLane: batch priority, idle room, its price percent); None for HTTP."""
    inputs = check_body(body)
    model = body["model"]
    handle = gw.handles.get(model)
    spec = getattr(handle.engine, "spec", None) if handle is not None else None
    context = _context(key, request_id, body, handle, lane) if handle is not None else None
    if handle is not None and handle.type != "openai" and _builtin(gw, model):
        return await builtin_embeddings.serve(gw, key, handle, body, inputs, arrival, info, context, deadline, lane)
    if handle is None or handle.type != "openai" or not getattr(spec, "embeddings", False):
        served = sorted(n for n, h in gw.handles.items()
                        if getattr(getattr(h.engine, "spec", None), "embeddings", 0) or _builtin(gw, n))
        raise NotFound(f"The model {model!r} does not serve embeddings" +
                       (f"; engines that do: {', '.join(served)}" if served else "; no engine here does"),
                       param="model", code="model_not_found")
    # A long list is counted on a worker thread (the tokenizer holds the loop otherwise).
    tokens = _count(handle.tokenizer, inputs) if len(inputs) < 64 else \
        await asyncio.to_thread(_count, handle.tokenizer, inputs)
    if lane is not None:
        await lane.wait_for_room(handle.name)
    admitted = await gw.gatekeeper.enter(key, handle.name, tokens, 0, deadline,
                                         None if lane is None else PRIORITIES.index("batch"))
    upstream = {k: v for k, v in body.items() if k not in ("metadata",)}
    upstream["model"] = spec.upstream_model
    call = UpstreamCall(handle.engine, "/embeddings", upstream, request_id=f"{request_id}-{secrets.token_hex(4)}",
                        requested_model=model, route_reason="embeddings", arrival=arrival, arrival_wall=time.time(),
                        metrics=gw.metrics, sink=admitted.billing(gw.usage_sink), prices=handle.prices,
                        context=context, prompt_tokens=tokens, max_tokens=0, on_end=admitted.end,
                        price_percent=100 if lane is None else lane.price_percent, expect="data")
    info.update(engine=handle.name, route_reason="embeddings")
    try:
        await call.open()
    except UpstreamFailure as e:
        call.give_back()
        info["upstream_attempts"] = call.attempts
        raise e.as_http() from None
    except BaseException:
        call.give_back()
        raise
    info["upstream_attempts"] = call.attempts
    info["generation"] = call
    assert call.document is not None
    reply = {**call.document, "model": handle.name}
    call.finish(200)
    return reply, {"x-tokenyard-engine": handle.name, **admitted.headers}


def _count(tok: Any, inputs: list[str] | list[list[int]]) -> int:
    """Input tokens before the call: token-id inputs as given, strings with the engine's tokenizer."""
    return sum(len(x) if isinstance(x, list) else len(tok.encode(x, add_special_tokens=False)) for x in inputs)


def _builtin(gw: Any, name: str) -> bool:
    """A built-in engine the deployment marks `embeddings: true` (builtin_embeddings.py serves it)."""
    spec = gw.deployment.engines.get(name)
    return spec is not None and spec.embeddings


def _context(key: Any, request_id: str, body: dict[str, Any], handle: Any, lane: Any = None) -> RecordContext:
    return RecordContext(tenant=key.tenant, key_id=key.key_id, client_request_id=request_id,
                         tags=_tags(body.get("metadata")), user=body.get("user") if isinstance(body.get("user"), str)
                         else None, baseline_engine=handle.name, key_name=key.name, prices=handle.prices,
                         api="embeddings", batch=lane is not None)


def _tags(meta: Any) -> dict[str, str]:
    if not isinstance(meta, dict):
        return {}
    return {str(k)[:64]: str(v)[:512] for k, v in list(meta.items())[:16] if isinstance(v, str)}
