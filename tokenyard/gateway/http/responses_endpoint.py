"""POST /v1/responses (OpenAI's Responses API) through the one request flow, and its stored responses:
GET and DELETE /v1/responses/{id}.

    body -> parse_responses_request (tokenyard/gateway/edge/responses_request.py) -> authenticate
         -> the stored conversation of previous_response_id (this tenant's only) -> a ChatRequest
         -> completion_flow.generate (policy, route incl. auto, limits, admission, engine, spend)
         -> a Response object (tokenyard/gateway/http/responses_output.py), or its typed SSE events

The usage record says `api: "responses"`. With `store` (the default) the finished response, and the
conversation that led to it as chat messages, are kept (tokenyard/gateway/store/response_store.py)
before the client sees the reply, so a GET or a next turn right after it finds it. A stored
response failing to be written is logged and the reply still sent: the output is not thrown away.
Responses an upstream engine (type: openai) serves are translated from its chat reply the same way
(tokenyard/gateway/http/responses_upstream.py).
"""
from __future__ import annotations

import logging
import re
import time
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tokenyard.gateway.edge.chat_request import ChatRequest
from tokenyard.gateway.edge.errors import NotFound, ServerError
from tokenyard.gateway.edge.responses_request import parse_responses_request
from tokenyard.gateway.http.completion_flow import (
    CompletionResponse,
    Started,
    generate,
    new_entry,
    read_json,
    refuse_if_draining,
)
from tokenyard.gateway.http.generation import EngineFailed, RequestRejected
from tokenyard.gateway.http.generation_group import GenerationGroup
from tokenyard.gateway.http.responses_output import sse_event
from tokenyard.gateway.http.responses_turn import Turn, open_turn
from tokenyard.gateway.http.responses_upstream import upstream_response
from tokenyard.gateway.http.streaming import SSEResponse
from tokenyard.gateway.http.tool_calls import ToolCallStream
from tokenyard.gateway.store.response_store import ResponseStore

if TYPE_CHECKING:
    from tokenyard.gateway.state import Gateway

log = logging.getLogger(__name__)
_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def routes() -> list[Route]:
    return [Route("/v1/responses", create_response, methods=["POST"]),
            Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
            Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"])]


async def create_response(request: Request) -> Any:
    gw: Gateway = request.app.state.gateway
    arrival = time.perf_counter()
    info = request.scope.setdefault("tokenyard", {})
    refuse_if_draining(gw)
    body = await read_json(request, gw.deployment.limits.max_body_bytes, gw.deployment.limits.max_json_depth)
    draft = parse_responses_request(body)
    key = await gw.keys.authenticate(request.headers.get("authorization"))
    info["tenant"] = key.tenant
    req, turn = await open_turn(gw, draft, key.tenant)
    entry = new_entry(request, gw, arrival, info, api="responses")
    started = await generate(gw, req, key, "input", entry)
    return reply(request, started, turn)


def reply_tools(req: ChatRequest) -> Any:
    """The request's tools when the reply's text is parsed for calls, else None."""
    return req.tools if req.tools is not None and req.tools.parses_calls else None


def reply(request: Request, started: Started, turn: Turn) -> Any:
    if started.upstream is not None:
        return upstream_response(request, started, turn)
    gen = started.gen
    assert gen is not None
    tools = reply_tools(started.req)
    if turn.draft.stream:
        lim = request.app.state.gateway.deployment.limits
        return ResponsesSSE(gen, turn, started.headers, lim.stream_buffer_bytes, lim.stream_write_timeout_s,
                            (lambda: ToolCallStream(tools)) if tools is not None else None)
    return CompletionResponse(gen, started.headers, lambda gen: render_response(gen, tools, turn))


async def render_response(gen: GenerationGroup, tools: Any, turn: Turn) -> dict[str, Any]:
    """The Response object of a finished request (stored first when store is on)."""
    builder = turn.builder(gen.model_name)
    g = gen.first
    finish = g.finish_reason
    if tools is not None:
        parser = ToolCallStream(tools)
        deltas = parser.feed(g.text)
        more, finish = parser.close(finish)
        deltas += more
    else:
        deltas = [{"content": g.text}]
    for d in deltas:
        builder.feed(d)
    builder.close(finish, gen.usage())
    await turn.keep(builder)
    return builder.response()


class ResponsesSSE(SSEResponse):
    """The typed events of a streamed response, on the chat stream's machinery (its buffer, slow-reader
    and disconnect handling): only what is produced differs."""

    def __init__(self, gen: GenerationGroup, turn: Turn, headers: dict[str, str], buffer_bytes: int,
                 write_timeout_s: float, tool_stream: Any) -> None:
        super().__init__(gen, turn.response_id, int(time.time()), False, headers, buffer_bytes, write_timeout_s,
                         tool_stream)
        self.turn = turn
        self.builder = turn.builder(gen.model_name)

    def _emit(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            self._push(sse_event(event))

    async def _produce(self) -> None:
        gen, b = self.gen, self.builder
        st = self._choices[0]
        finish = None
        try:
            self._emit(b.start())
            async for _, delta in gen.deltas():
                if delta is None:
                    finish = st.gen.finish_reason
                    deltas: list[dict[str, Any]] = []
                    if st.tools is not None:
                        deltas, finish = st.tools.close(finish)
                else:
                    deltas = st.tools.feed(delta) if st.tools is not None else [{"content": delta}]
                for d in deltas:
                    self._emit(b.feed(d))
            if gen.aborted is None:
                closing = b.close(finish, gen.usage())
                await self.turn.keep(b)
                gen.finish(200)     # the usage record exists before the client can see response.completed
                self._emit(closing)
        except RequestRejected as e:    # a remote replica refused the input after the stream began
            gen.finish(400, "rejected")
            self._emit(b.fail(e.as_http().body()["error"]))
        except EngineFailed:
            gen.finish(500)
            self._emit(b.fail(ServerError("The engine failed while generating this response",
                                          code="engine_error").body()["error"]))
        except Exception:  # noqa: BLE001 - the stream is already open: report in-band, never a trace
            log.exception("responses stream %s failed", gen.request_id)
            gen.first.error = gen.first.error or "internal error"
            self._emit(b.fail(ServerError("Internal error while streaming").body()["error"]))
        finally:
            self._produced_all = True
            self._ready.set()


async def _stored(request: Request) -> tuple[ResponseStore, str, str]:
    gw: Gateway = request.app.state.gateway
    key = await gw.keys.authenticate(request.headers.get("authorization"))
    request.scope.setdefault("tokenyard", {})["tenant"] = key.tenant
    response_id = request.path_params["response_id"]
    if not _ID.match(response_id):
        raise NotFound(f"Response with id '{response_id[:64]}' not found.", param="response_id",
                       code="response_not_found")
    return ResponseStore.of(gw), key.tenant, response_id


async def get_response(request: Request) -> JSONResponse:
    store, tenant, response_id = await _stored(request)
    stored = await store.get(tenant, response_id)
    if stored is None:    # also another tenant's: its existence is not confirmed
        raise NotFound(f"Response with id '{response_id}' not found.", param="response_id",
                       code="response_not_found")
    return JSONResponse(stored["response"])


async def delete_response(request: Request) -> JSONResponse:
    store, tenant, response_id = await _stored(request)
    if not await store.delete(tenant, response_id):
        raise NotFound(f"Response with id '{response_id}' not found.", param="response_id",
                       code="response_not_found")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
