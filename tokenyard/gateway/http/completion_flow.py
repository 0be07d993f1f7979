"""The flow chat and text completions share: validate -> authenticate -> policy and route
(tokens, router, budget, overflow: tokenyard/gateway/http/route_plan.py) -> context checks -> reserve limits ->
admit -> engine. Each endpoint gives its parser and renders the reply; everything between (and so
every limit, route, admission and spend rule) is this one function.

    started = await start_generation(request, parse, prompt_param="messages")

The prompt is tokenised once, with the serving engine's tokenizer; that count is the one the
context check, the router, the rate limits and the usage record all use.
"""
from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope, Send

from tokenyard.engines.core.errors import EngineDeadError, RequestError
from tokenyard.engines.core.sampling_params import ParamError, SamplingParams
from tokenyard.engines.core.structured_output import GrammarError
from tokenyard.gateway.auth.api_keys import PRIORITIES, KeyRecord
from tokenyard.gateway.edge.chat_request import ChatRequest
from tokenyard.gateway.edge.completion_request import CompletionRequest
from tokenyard.gateway.edge.edge_params import json_int, parse_int, read_int
from tokenyard.gateway.edge.errors import APIError, BadRequest, ClientClosed, PayloadTooLarge, ServerError, Unavailable
from tokenyard.gateway.http.generation import EngineFailed, Generation, GenerationSetup, RequestRejected
from tokenyard.gateway.http.generation_group import GenerationGroup
from tokenyard.gateway.http.route_plan import observe_route, plan_route
from tokenyard.gateway.http.streaming import wait_disconnect
from tokenyard.gateway.http.upstream_call import UpstreamCall
from tokenyard.gateway.http.upstream_flow import start_upstream
from tokenyard.gateway.http.upstream_reply import UpstreamJSONResponse, UpstreamSSEResponse
from tokenyard.gateway.prompt.prompt_guard import UNROUTED, charge_refused, check_prompt_size, prompt_work
from tokenyard.gateway.prompt.rendering import RenderedPrompt, tokenize_prompt
from tokenyard.gateway.spend.usage import RecordContext

if TYPE_CHECKING:
    from tokenyard.gateway.state import Gateway

AnyRequest = ChatRequest | CompletionRequest


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice 0 keeps the request's seed (n=1 replies are unchanged); the others get seeds of
    their own, reproducible from it, so n seeded choices differ from each other."""
    if seed is None or index == 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % (2**63)


@dataclass(slots=True)
class Started:
    gen: GenerationGroup | None     # started in the engine; the response must finish() it (None: upstream)
    req: AnyRequest
    request_id: str
    headers: dict[str, str]         # engine, route reason, policy version, rate limits
    upstream: UpstreamCall | None = None   # an upstream engine's call, opened (type: openai)


@dataclass(slots=True)
class Entry:
    """How one request entered the gateway: its timings and where its log fields go."""

    arrival: float                  # perf_counter seconds
    deadline: float                 # event-loop time by which it must start (admission)
    deadline_ms: int                # the same, as the budget in ms from arrival (the usage record)
    request_id: str
    info: dict[str, Any]            # the access log's fields (engine, route reason, the generation)
    api: str = "chat"               # the client API (the usage record's `api`)


@dataclass(slots=True)
class BatchLane:
    """A Batch API line's way through the flow (tokenyard/gateway/batch/line_runner.py); None for HTTP requests.
    The line runs at batch priority, on the bulk pool's engine when the routed engine has one, only
    once that engine has idle room, and is charged `price_percent` of the prices."""

    price_percent: int
    engine_for: Callable[[str], str]                 # routed engine -> the engine that runs the line
    wait_for_room: Callable[[str], Awaitable[None]]  # returns when the engine has idle room for one more


async def start_generation(request: Request, parse: Callable[[Any, "Gateway"], AnyRequest],
                           prompt_param: str, authorization: str | None = None) -> Started:
    """prompt_param: the parameter a too-long prompt is blamed on ("messages", "prompt").
    authorization: the credential as "Bearer <key>" when the route takes it from elsewhere (x-api-key)."""
    gw: Gateway = request.app.state.gateway
    arrival = time.perf_counter()
    info = request.scope.setdefault("tokenyard", {})
    refuse_if_draining(gw)
    body = await read_json(request, gw.deployment.limits.max_body_bytes, gw.deployment.limits.max_json_depth)
    req = parse(body, gw)
    key = await gw.keys.authenticate(authorization or request.headers.get("authorization"))
    info["tenant"] = key.tenant
    return await generate(gw, req, key, prompt_param, new_entry(request, gw, arrival, info))


def refuse_if_draining(gw: "Gateway") -> None:
    if gw.draining:
        raise Unavailable("The server is shutting down; retry on another instance", code="draining",
                          headers={"retry-after": "1"})


def new_entry(request: Request, gw: "Gateway", arrival: float, info: dict[str, Any], api: str = "chat") -> Entry:
    """The request's entry once it is authenticated: its start deadline (x-request-deadline-ms, from
    arrival) and its id; `api` the client API it came by (the usage record's)."""
    elapsed = time.perf_counter() - arrival
    deadline = gw.admission.deadline(_deadline_header(request), elapsed)
    deadline_ms = round((deadline - asyncio.get_running_loop().time() + elapsed) * 1000)
    return Entry(arrival, deadline, deadline_ms, info.get("request_id") or secrets.token_hex(12), info, api=api)


async def generate(gw: "Gateway", req: AnyRequest, key: KeyRecord, prompt_param: str, entry: Entry,
                   lane: BatchLane | None = None) -> Started:
    """Everything after authentication, for an HTTP request and a Batch API line alike: policy and
    route, context checks, limits, admission, and the start in the engine."""
    try:
        # Too long for any context it may be served with: refused before any template runs.
        check_prompt_size(gw, req, prompt_param)
        # The prompt, rendered and encoded (once per tokenizer), then policy and route: rules, the
        # learned router, budget, overflow; may refuse here.
        route = await plan_route(gw, req, key, entry.deadline, RenderedPrompt(req))
        started = await _generate(gw, req, key, prompt_param, entry, route, lane)
        observe_route(gw, entry.request_id, key, req, route)    # once started: a feedback sample, shadow counts
        return started
    except BadRequest as e:
        if e.code == "context_length_exceeded":   # still one request of the sender's limit
            # Under an engine's name only when it is one: the model is the client's string, and the
            # limiter's metrics label by engine (a random name per request would grow them without end).
            await charge_refused(gw, key, req.model if req.model in gw.handles else UNROUTED)
        raise


async def _generate(gw: "Gateway", req: AnyRequest, key: KeyRecord, prompt_param: str, entry: Entry,
                    route: Any, lane: BatchLane | None) -> Started:
    arrival, deadline, info = entry.arrival, entry.deadline, entry.info
    priority = key.priority_class if route.priority is None else route.priority
    engine = route.engine
    if lane is not None:
        priority = PRIORITIES.index("batch")
        engine = lane.engine_for(route.engine)
    elif engine in gw.deployment.batch.bulk_engines:
        raise BadRequest(f"Engine {engine} is reserved for Batch API work (pools.bulk); send this request to "
                         f"another model or through /v1/batches", param="model", code="model_reserved_for_batch")
    handle = gw.handles[engine]
    max_len = handle.engine.max_model_len
    all_ids = await prompt_work(req, _all_prompt_ids, req, route.prompt_ids, handle.tokenizer)
    prompt_ids = max(all_ids, key=len)
    if len(prompt_ids) >= max_len:
        raise BadRequest(f"This model's maximum context length is {max_len} tokens; the {prompt_param} have "
                         f"{len(prompt_ids)} tokens", param=prompt_param, code="context_length_exceeded")
    max_tokens = route.max_tokens          # the client's, capped by a policy rule
    if max_tokens is None:
        max_tokens = min(gw.deployment.limits.default_max_tokens, max_len - len(prompt_ids))
    elif len(prompt_ids) + max_tokens > max_len:
        raise BadRequest(f"This model's maximum context length is {max_len} tokens; you asked for "
                         f"{len(prompt_ids)} prompt + {max_tokens} completion tokens. Lower max_tokens.",
                         param="max_tokens", code="context_length_exceeded")
    if handle.type == "openai":
        return await _generate_upstream(gw, req, key, prompt_param, entry, route, lane, handle,
                                        [len(ids) for ids in all_ids], max_tokens, priority)
    grammar_param = "tools" if getattr(req, "tools", None) is not None and req.tools.forced else "response_format"
    try:
        params = [SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                 seed=choice_seed(req.seed, i), stop=req.stop, response_format=req.response_format,
                                 presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                 logit_bias=req.logit_bias, logprobs=req.logprobs, lora=route.adapter)
                  for i in range(req.n)]
    except ParamError as e:
        raise BadRequest(str(e), param=e.param, code=e.code) from e
    except GrammarError as e:   # the schema is over the size limit
        raise BadRequest(str(e), param=grammar_param, code=f"invalid_{grammar_param}") from e
    info.update(engine=handle.name, route_reason=route.reason)
    # The grammar, checked against its budget and compiled off the loop, before any limit is taken.
    await _prepare_grammar(handle.engine, params[0], grammar_param)
    if lane is not None:
        await lane.wait_for_room(handle.name)
    # n choices per prompt may each run to max_tokens; each prompt is computed (and charged) once.
    num_choices = len(all_ids) * req.n
    admitted = await gw.gatekeeper.enter(key, handle.name, sum(len(ids) for ids in all_ids), max_tokens * num_choices,
                                         deadline, priority, route.rate, route.budget)
    sink = admitted.billing(gw.usage_sink)   # the usage record settles the request's budget hold
    request_id = entry.request_id
    engine_rid = f"{request_id}-{secrets.token_hex(4)}"  # client ids may repeat; engine ids must not
    # The policy's prices (else the routed engine's: a bulk pool engine bills as the engine it stands in for).
    prices = route.prices or (gw.handles[route.engine].prices if lane is not None else None)
    context = _record_context(gw, req, key, entry, route, prices, lane)
    percent = 100 if lane is None else lane.price_percent
    # Choice k is prompt k // n, its choice k % n; the prompt's first choice prefills it for the rest.
    setup = GenerationSetup(handle, req.model, route.reason, req.stream, arrival, time.time(), gw.metrics, sink,
                            priority=priority, tenant=key.tenant, context=context, price_percent=percent,
                            grammar_param=grammar_param)
    choices = [Generation(setup, engine_rid if k == 0 else f"{engine_rid}.{k}", all_ids[k // req.n], params[k % req.n])
               for k in range(num_choices)]
    gen = GenerationGroup(choices, on_end=admitted.end, sink=sink,
                          leaders=[k - k % req.n for k in range(num_choices)])
    try:
        # Again, now: a cache hit unless the admission wait outlasted the grammar in the engine's
        # cache. No await from here to the engine: the grammar is still cached when it is added.
        await _prepare_grammar(handle.engine, params[0], grammar_param)
    except BaseException:
        for g in choices:
            g._end(None)     # never ran: the admission pass is given back
        raise
    try:
        gen.start()
    except EngineDeadError as e:
        raise Unavailable(f"Engine {handle.name} is unavailable", code="engine_unavailable") from e
    except ParamError as e:     # before RequestError, its base: e.g. a logit_bias id outside the vocabulary
        raise BadRequest(str(e), param=e.param, code=e.code) from e
    except GrammarError as e:   # before RequestError, its base: the schema is the problem
        raise BadRequest(str(e), param=grammar_param, code=f"invalid_{grammar_param}") from e
    except RequestError as e:
        raise BadRequest(str(e)) from e
    info["generation"] = gen
    headers = {"x-tokenyard-engine": handle.name, "x-tokenyard-route-reason": route.reason,
               "x-tokenyard-policy-version": str(route.policy_version), **admitted.headers}
    if route.score is not None:
        headers["x-tokenyard-router-score"] = f"{route.score:.6f}"
    if route.context_dropped_tokens:
        headers["x-tokenyard-context-dropped-tokens"] = str(route.context_dropped_tokens)
    return Started(gen, req, request_id, headers)


def upstream_reply(request: Request, started: Started, completion_id: str) -> Any:
    """The response for a request an upstream engine took: its JSON reply, or its stream relayed."""
    assert started.upstream is not None
    if started.req.stream:
        lim = request.app.state.gateway.deployment.limits
        return UpstreamSSEResponse(started.upstream, completion_id, started.req.include_usage, started.headers,
                                   lim.stream_write_timeout_s)
    return UpstreamJSONResponse(started.upstream, completion_id, started.headers)


async def _generate_upstream(gw: "Gateway", req: AnyRequest, key: KeyRecord, prompt_param: str, entry: Entry,
                             route: Any, lane: BatchLane | None, handle: Any, prompt_lengths: list[int],
                             max_tokens: int, priority: int) -> Started:
    """An upstream engine's call (tokenyard/gateway/http/upstream_flow.py); a fallback re-enters this flow."""
    prices = route.prices or (gw.handles[route.engine].prices if lane is not None else None)
    context = _record_context(gw, req, key, entry, route, prices, lane)

    async def fallback(moved: Any, reason: str) -> Started:
        ids = await prompt_work(req, moved.prompt.ids, gw.handles[moved.engine].tokenizer)
        return await _generate(gw, req, key, prompt_param, entry, replace(moved, prompt_ids=ids, reason=reason,
                                                                           prices=None), lane)
    return await start_upstream(gw, req, key, entry, route, lane, handle, prompt_lengths, max_tokens, priority,
                                context, fallback,
                                lambda call, headers: Started(None, req, entry.request_id, headers, upstream=call))


def _record_context(gw: "Gateway", req: AnyRequest, key: KeyRecord, entry: Entry, route: Any, prices: Any,
                    lane: BatchLane | None) -> RecordContext:
    """Everything the usage record needs besides the engine's counts (the policy replay reads it too)."""
    return RecordContext(tenant=key.tenant, key_id=key.key_id, client_request_id=entry.request_id, tags=req.metadata,
                         user=req.user, router_score=route.score, deadline_ms=entry.deadline_ms,
                         baseline_engine=gw.baseline_engine,
                         baseline_prices=route.baseline_prices or gw.baseline_prices, key_name=key.name,
                         requested_max_tokens=req.max_tokens, engine_state=route.engine_state,
                         prices=prices, policy_version=route.policy_version,
                         context_dropped_tokens=route.context_dropped_tokens,
                         routed_prompt_tokens=route.routed_prompt_tokens, batch=lane is not None,
                         api=req.api if req.api != "chat" else entry.api, lora=route.adapter or "")


async def _prepare_grammar(engine: Any, params: SamplingParams, grammar_param: str) -> None:
    """A constrained request's grammar made ready by its backend (tokenyard/engines/runtime/grammar_gate.py);
    backends without `prepare` (replica pools) check it where the engine runs."""
    prepare = getattr(engine, "prepare", None)
    if params.response_format is None or prepare is None:
        return
    try:
        await prepare(params)
    except GrammarError as e:
        raise BadRequest(str(e), param=grammar_param, code=f"invalid_{grammar_param}") from e


def _all_prompt_ids(req: AnyRequest, routed_ids: list[int], tok: Any) -> list[list[int]]:
    """Token ids of every prompt: the routed one as plan_route tokenised it, the others of a text
    completion batch with the same engine's tokenizer."""
    if not isinstance(req, CompletionRequest) or len(req.prompts) == 1:
        return [routed_ids]
    return [routed_ids if p is req.prompt else tokenize_prompt(tok, p) for p in req.prompts]


async def read_json(request: Request, max_bytes: int, max_depth: int) -> Any:
    declared = _declared_length(request.headers.get("content-length"))
    if declared is not None and declared > max_bytes:
        raise PayloadTooLarge(f"Request body is {declared} bytes; the limit is {max_bytes}", code="body_too_large")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise PayloadTooLarge(f"Request body exceeds {max_bytes} bytes", code="body_too_large")
            chunks.append(chunk)
    except ClientDisconnect:   # left mid-body: a 499 in the access log and metrics, not an unhandled error
        raise ClientClosed("The client closed the connection before sending the whole body",
                           code="client_disconnected") from None
    return decode_json(b"".join(chunks), max_depth)


def decode_json(raw: bytes, max_depth: int, what: str = "Request body") -> Any:
    """The JSON document in `raw` under the edge's rules (UTF-8, depth, no lone surrogates), or a 400
    that starts with `what` (a Batch API input line says which line)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"{what} is not valid UTF-8 (byte {e.start})", code="invalid_encoding") from e
    try:
        body = json.loads(text, parse_int=json_int)
    except json.JSONDecodeError as e:
        raise BadRequest(f"{what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                         code="invalid_json") from e
    except RecursionError as e:
        raise BadRequest(f"{what} nests deeper than {max_depth} levels", code="json_too_deep") from e
    except ValueError as e:     # an integer literal too long to be any parameter's value
        raise BadRequest(f"{what} is not valid JSON: {e}", code="invalid_json") from e
    if _depth(body, max_depth) > max_depth:
        raise BadRequest(f"{what} nests deeper than {max_depth} levels", code="json_too_deep")
    where = _unpaired_surrogate(body)
    if where is not None:
        # JSON's \ud800 escape decodes to a lone surrogate that no reply, log line or Redis write
        # can encode back as UTF-8; refused here so nothing downstream ever holds one.
        raise BadRequest(f"{what} contains an unpaired UTF-16 surrogate escape", param=where or None,
                         code="invalid_encoding")
    return body


_SURROGATE = re.compile("[\ud800-\udfff]")
_REPLY_JSON = json.JSONEncoder(ensure_ascii=False)   # json.dumps with options builds one per call


def _unpaired_surrogate(value: Any) -> str | None:
    """The path ("metadata.k", "messages[0].content"; "" for the top level) of the first string or
    key holding a lone surrogate, or None. A valid pair decodes to one code point, so any
    surrogate code point left in a str is unpaired."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            if not v.isascii() and _SURROGATE.search(v):
                return path
        elif isinstance(v, dict):
            for k, x in v.items():
                sub = f"{path}.{k}" if path else str(k)
                if not k.isascii() and _SURROGATE.search(k):
                    return path
                stack.append((x, sub))
        elif isinstance(v, list):
            stack.extend((x, f"{path}[{i}]") for i, x in enumerate(v))
    return None


def _deadline_header(request: Request) -> str | None:
    """x-request-deadline-ms as plain ASCII digits (admission reads it), or a 400 here: "²" passes
    str.isdigit() but not int()."""
    raw = request.headers.get("x-request-deadline-ms")
    if raw is None:
        return None
    return str(parse_int(raw, "x-request-deadline-ms", minimum=1, code="invalid_deadline"))


def _declared_length(raw: str | None) -> int | None:
    """Content-Length when it is a plain integer; otherwise None (the streamed count still applies)."""
    try:
        return read_int(raw, 0) if raw is not None else None
    except ValueError:
        return None


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of objects/arrays, stopping early once past limit."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


class CompletionResponse:
    """A non-streamed completion; a watcher aborts the engine request if the client leaves.
    render(gen) gives the reply's JSON object once every choice's text is complete."""

    def __init__(self, gen: GenerationGroup, headers: dict[str, str],
                 render: Callable[[GenerationGroup], dict | Awaitable[dict]],
                 error_body: Callable[[APIError], dict] = APIError.body) -> None:
        self.gen = gen
        self.headers = headers
        self.render = render
        self.error_body = error_body    # the API's error shape (the Messages API has its own)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gen = self.gen
        watcher = asyncio.get_running_loop().create_task(self._watch(receive))
        status, record_status = 200, None
        rejected: RequestRejected | None = None
        try:
            try:
                async for _ in gen.deltas():
                    pass
            except RequestRejected as e:
                status, record_status, rejected = 400, "rejected", e
            except EngineFailed:
                status = 500
            if gen.aborted == "client_disconnected":
                status, record_status = 499, "client_disconnected"
                return  # nobody to answer
            if rejected is not None:
                body = self.error_body(rejected.as_http())
            elif status == 500:
                body = self.error_body(ServerError("The engine failed while generating this response",
                                                   code="engine_error"))
            else:
                body = self.render(gen)
                if asyncio.iscoroutine(body):   # a render that writes too (a stored response)
                    body = await body
            data = _REPLY_JSON.encode(body).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
            headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
            gen.finish(status, record_status)  # the usage record exists before the client sees the reply
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": data})
        finally:
            watcher.cancel()
            gen.finish(status, record_status)

    async def _watch(self, receive: Receive) -> None:
        await wait_disconnect(receive)
        self.gen.abort("client_disconnected")
