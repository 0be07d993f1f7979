"""GET /openapi.json: a hand-written OpenAPI 3.1 description of every endpoint.

Hand-written because the request body is validated by hand (chat_request.py) and this file is
the place a reader checks what is accepted; tests compare its paths with the app's routes.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from engines.core.structured_output import MAX_SCHEMA_CHARS
from gateway.batch.openapi_paths import batch_paths
from gateway.http.chat_request import MAX_LOGIT_BIAS, MAX_N, MAX_STOP, MAX_TOP_LOGPROBS, ROLES, UNSUPPORTED
from gateway.http.completion_request import MAX_CHOICES, MAX_LOGPROBS, MAX_PROMPTS
from gateway.http.completion_request import UNSUPPORTED as TEXT_UNSUPPORTED
from gateway.http.tool_request import MAX_TOOLS

_ERROR = {"$ref": "#/components/schemas/Error"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): _json(_ERROR, "OpenAI-shaped error") for c in codes}


@lru_cache(maxsize=1)
def openapi_schema() -> dict[str, Any]:
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    call = {"type": "object", "required": ["id", "type", "function"], "properties": {
        "id": {"type": "string"}, "type": {"const": "function"},
        "function": {"type": "object", "required": ["name", "arguments"], "properties": {
            "name": {"type": "string"}, "arguments": {"type": "string", "description": "a JSON object, as text"}}}}}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": list(ROLES)},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": text_part},
                              {"type": "null"}],
                    "description": "required, except on an assistant message that carries tool_calls"},
        "name": {"type": "string"},
        "tool_calls": {"type": "array", "items": call, "description": "assistant messages: the calls it made"},
        "tool_call_id": {"type": "string", "description": "tool messages (required): the call this answers"}}}
    tool = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
            "parameters": {"type": "object", "description": "a JSON Schema of type object for the arguments"},
            "strict": {"type": ["boolean", "null"]}}}}}
    request = {
        "type": "object", "required": ["model", "messages"], "additionalProperties": False,
        "description": ("Parameters of OpenAI's API that Tokenyard does not implement are refused with 400 "
                        "naming them (unless set to their neutral value): " + ", ".join(sorted(UNSUPPORTED))),
        "properties": {
            "model": {"type": "string", "description": "'auto' (the router decides) or an engine name"},
            "messages": {"type": "array", "minItems": 1, "items": message},
            "max_tokens": {"type": ["integer", "null"], "minimum": 1},
            "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
            "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2, "default": 1},
            "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1, "default": 1},
            "n": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_N, "default": 1,
                  "description": ("choices to generate; the prompt is prefilled once (the other choices start "
                                  "from its prefix-cache blocks) and counted once in usage; each choice has its "
                                  "own seed (derived from `seed` when given)")},
            "tools": {"type": ["array", "null"], "maxItems": MAX_TOOLS, "items": tool,
                      "description": ("functions the model may call: passed to a chat template that renders "
                                      "tools, else described in a system preamble")},
            "tool_choice": {"description": ("'auto' (default with tools): a call the model writes is parsed "
                                            "into tool_calls; 'none': plain text; 'required' or a named function: "
                                            "constrained decoding holds the reply to exactly one call whose "
                                            "arguments follow the function's parameters (cannot be combined with "
                                            "response_format); a schema the grammar cannot compile is a 400 with "
                                            "param 'tools'"),
                            "oneOf": [{"enum": ["none", "auto", "required"]}, {"type": "null"},
                                      {"type": "object", "required": ["type", "function"], "properties": {
                                          "type": {"const": "function"}, "function": {
                                              "type": "object", "required": ["name"],
                                              "properties": {"name": {"type": "string"}}}}}]},
            "parallel_tool_calls": {"type": ["boolean", "null"], "default": True,
                                    "description": "false: at most one call per reply"},
            "stop": {"oneOf": [{"type": "string", "minLength": 1},
                               {"type": "array", "maxItems": MAX_STOP, "items": {"type": "string", "minLength": 1}},
                               {"type": "null"}]},
            "seed": {"type": ["integer", "null"]},
            "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2, "default": 0,
                                 "description": "subtracted from the logit of every token already in the output"},
            "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2, "default": 0,
                                  "description": "subtracted once per occurrence of a token in the output"},
            "logit_bias": {"type": ["object", "null"], "maxProperties": MAX_LOGIT_BIAS,
                           "propertyNames": {"pattern": "^[0-9]{1,10}$"},
                           "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                           "description": ("token id -> bias added to its logit before temperature (-100 in "
                                           "effect forbids the token, +100 forces it); an id outside the "
                                           "engine's vocabulary is a 400 with param 'logit_bias'")},
            "logprobs": {"type": ["boolean", "null"], "default": False,
                         "description": ("return each completion token's log probability: the model's "
                                         "distribution (log_softmax of the raw logits, before penalties, "
                                         "logit_bias, temperature and top_p); not speculated")},
            "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_TOP_LOGPROBS,
                             "description": "alternatives per token; needs logprobs true"},
            "stream": {"type": ["boolean", "null"], "default": False},
            "stream_options": {"type": ["object", "null"],
                               "properties": {"include_usage": {"type": "boolean"}}},
            "user": {"type": ["string", "null"]},
            "service_tier": {"enum": ["auto", "default", "flex", "priority", None],
                             "description": ("the admission class: flex runs as batch (behind interactive work); "
                                             "priority asks for interactive but never rises above the key's class "
                                             "or a policy rule's; auto and default keep it")},
            "priority": {"enum": ["interactive", "batch", None],
                         "description": ("the admission class by name; a request may lower its class, never raise "
                                         "it; must agree with service_tier when both are sent")},
            "metadata": {"type": ["object", "null"], "maxProperties": 16,
                         "additionalProperties": {"type": "string", "maxLength": 512}},
            "response_format": {
                "description": ("Structured output by constrained decoding: every token is sampled from those the "
                                "grammar allows, so a reply with finish_reason 'stop' parses (json_object) or "
                                "validates against the schema (json_schema; always enforced, strict or not). "
                                "finish_reason 'length' means the JSON was cut short. A schema the grammar "
                                f"library cannot compile, or over {MAX_SCHEMA_CHARS} characters, is a 400 with "
                                "param 'response_format'. Not speculated."),
                "oneOf": [
                    {"type": "null"},
                    {"type": "object", "required": ["type"], "additionalProperties": False,
                     "properties": {"type": {"enum": ["text", "json_object"]}}},
                    {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False,
                     "properties": {"type": {"const": "json_schema"}, "json_schema": {
                         "type": "object", "required": ["name"], "additionalProperties": False, "properties": {
                             "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                             "description": {"type": "string"},
                             "schema": {"type": "object", "description": "a JSON Schema"},
                             "strict": {"type": ["boolean", "null"]}}}}}]},
        }}
    usage = {"type": "object", "properties": {
        "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}}}}
    token_lp = {"type": "object", "properties": {
        "token": {"type": "string"}, "logprob": {"type": "number"},
        "bytes": {"type": ["array", "null"], "items": {"type": "integer"}}}}
    logprobs = {"oneOf": [{"type": "null"}, {"type": "object", "properties": {"content": {"type": "array", "items": {
        "type": "object", "properties": {**token_lp["properties"],
                                         "top_logprobs": {"type": "array", "items": token_lp}}}}}}]}
    completion = {"type": "object", "properties": {
        "id": {"type": "string"}, "object": {"const": "chat.completion"}, "created": {"type": "integer"},
        "model": {"type": "string", "description": "the engine that served"},
        "choices": {"type": "array", "items": {"type": "object", "properties": {
            "index": {"type": "integer"}, "finish_reason": {"enum": ["stop", "length", "tool_calls"]},
            "logprobs": logprobs,
            "message": {"type": "object", "properties": {"role": {"const": "assistant"},
                                                          "content": {"type": ["string", "null"]},
                                                          "tool_calls": {"type": "array", "items": call}}}}}},
        "usage": usage}}
    chunk = {"type": "object", "description": "one `data:` event; the stream ends with `data: [DONE]`", "properties": {
        "id": {"type": "string"}, "object": {"const": "chat.completion.chunk"}, "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object", "properties": {
            "index": {"type": "integer"}, "finish_reason": {"enum": ["stop", "length", "tool_calls", None]},
            "logprobs": logprobs,
            "delta": {"type": "object", "properties": {
                "role": {"const": "assistant"}, "content": {"type": "string"},
                "tool_calls": {"type": "array", "description": (
                    "a call's first delta has index, id, type and function.name (arguments ''); later deltas "
                    "carry pieces of function.arguments for that index"), "items": {"type": "object", "properties": {
                        "index": {"type": "integer"}, "id": {"type": "string"}, "type": {"const": "function"},
                        "function": {"type": "object", "properties": {"name": {"type": "string"},
                                                                      "arguments": {"type": "string"}}}}}}}}}}},
        "usage": {"oneOf": [usage, {"type": "null"}]}}}
    shared = {k: request["properties"][k] for k in (
        "model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
        "logit_bias", "stream", "stream_options", "user", "metadata", "service_tier", "priority")}
    text_request = {
        "type": "object", "required": ["model", "prompt"], "additionalProperties": False,
        "description": ("OpenAI's legacy text completion: the prompt is encoded as is (no chat template). Refused "
                        "with 400 naming them unless neutral: " + ", ".join(sorted(TEXT_UNSUPPORTED))
                        + " (echo false, suffix empty, best_of 1 are accepted)"),
        "properties": {
            **shared,
            "prompt": {"description": ("a string, an array of token ids of the serving engine's vocabulary, or a "
                                       f"batch of up to {MAX_PROMPTS} of those (prompts x n at most {MAX_CHOICES}); "
                                       "a batch goes to one engine, routed by its longest prompt, and its choices "
                                       "are indexed prompt * n + choice"),
                       "oneOf": [{"type": "string", "minLength": 1},
                                 {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                                 {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
                                  "items": {"oneOf": [{"type": "string", "minLength": 1},
                                                      {"type": "array", "minItems": 1,
                                                       "items": {"type": "integer", "minimum": 0}}]}}]},
            "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS,
                         "description": ("return each completion token's log probability and this many most "
                                         "likely alternatives (the model's distribution, as on chat)")},
            "echo": {"enum": [False, None], "description": "not supported: false only"},
            "suffix": {"enum": ["", None], "description": "not supported: empty only"},
            "best_of": {"enum": [1, None], "description": "not supported: 1 only"},
        }}
    legacy_lp = {"oneOf": [{"type": "null"}, {"type": "object", "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": {"type": "array", "items": {"type": "number"}},
        "top_logprobs": {"type": "array", "items": {"type": "object", "additionalProperties": {"type": "number"}}},
        "text_offset": {"type": "array", "items": {"type": "integer"}}}}]}
    text_choice = {"type": "object", "properties": {
        "text": {"type": "string"}, "index": {"type": "integer"}, "logprobs": legacy_lp,
        "finish_reason": {"enum": ["stop", "length", None]}}}
    text_completion = {"type": "object", "description": ("the reply; streamed, each `data:` event is one of these "
                                                         "(usage on the last with include_usage), then "
                                                         "`data: [DONE]`"), "properties": {
        "id": {"type": "string"}, "object": {"const": "text_completion"}, "created": {"type": "integer"},
        "model": {"type": "string", "description": "the engine that served"},
        "choices": {"type": "array", "items": text_choice}, "usage": {"oneOf": [usage, {"type": "null"}]}}}
    error = {"type": "object", "required": ["error"], "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
    model = {"type": "object", "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                                              "created": {"type": "integer"}, "owned_by": {"type": "string"}}}
    auth = [{"bearer": []}]
    headers = {"x-request-id": {"schema": {"type": "string"}, "description": "echoed or generated"},
               "x-tokenyard-engine": {"schema": {"type": "string"}},
               "x-tokenyard-route-reason": {"schema": {"type": "string"}},
               **{f"x-ratelimit-{k}": {"schema": {"type": "string"}} for k in (
                   "limit-requests", "limit-tokens", "remaining-requests", "remaining-tokens", "reset-requests",
                   "reset-tokens")}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "Tokenyard gateway", "version": "0.1.0",
                 "description": "OpenAI-compatible chat and text completions over Tokenyard's engines"},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"ChatCompletionRequest": request, "ChatCompletion": completion,
                        "ChatCompletionChunk": chunk, "CompletionRequest": text_request,
                        "TextCompletion": text_completion, "Error": error, "Model": model}},
        "paths": {
            "/v1/chat/completions": {"post": {
                "summary": "Create a chat completion (streamed as server-sent events when stream is true)",
                "security": auth,
                "parameters": [{"name": "x-request-id", "in": "header", "required": False,
                                "schema": {"type": "string", "maxLength": 128}},
                               {"name": "x-request-deadline-ms", "in": "header", "required": False,
                                "description": "ms from arrival by which the request must start; else shed "
                                               "(503 + Retry-After) or expired in the queue",
                                "schema": {"type": "integer", "minimum": 1}}],
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}}},
                "responses": {
                    "200": {"description": "a completion, or an event stream of chunks", "headers": headers,
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ChatCompletion"}},
                                        "text/event-stream": {"schema": {
                                            "$ref": "#/components/schemas/ChatCompletionChunk"}}}},
                    **_errors(400, 401, 403, 404, 413, 422, 429, 500, 503)}}},
            "/v1/completions": {"post": {
                "summary": "Create a text completion from a prompt (streamed as server-sent events when stream is "
                           "true); same admission, limits, routing and spend as chat",
                "security": auth,
                "parameters": [{"name": "x-request-id", "in": "header", "required": False,
                                "schema": {"type": "string", "maxLength": 128}},
                               {"name": "x-request-deadline-ms", "in": "header", "required": False,
                                "description": "as for chat completions", "schema": {"type": "integer", "minimum": 1}}],
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/CompletionRequest"}}}},
                "responses": {
                    "200": {"description": "a text completion, or an event stream of them", "headers": headers,
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/TextCompletion"}},
                                        "text/event-stream": {"schema": {
                                            "$ref": "#/components/schemas/TextCompletion"}}}},
                    **_errors(400, 401, 403, 404, 413, 429, 500, 503)}}},
            "/v1/models": {"get": {"summary": "List models: 'auto' and every engine", "security": auth,
                                   "responses": {"200": _json({"type": "object", "properties": {
                                       "object": {"const": "list"},
                                       "data": {"type": "array", "items": {"$ref": "#/components/schemas/Model"}}}},
                                       "the models"), **_errors(401)}}},
            "/v1/models/{model}": {"get": {"summary": "One model", "security": auth,
                                           "parameters": [{"name": "model", "in": "path", "required": True,
                                                           "schema": {"type": "string"}}],
                                           "responses": {"200": _json({"$ref": "#/components/schemas/Model"}, "the model"),
                                                         **_errors(401, 404)}}},
            "/health": {"get": {"summary": "Liveness: the event loop answers; engine and Redis state",
                                "responses": {"200": _json({"type": "object"}, "alive")}}},
            "/ready": {"get": {"summary": "Readiness: engines loaded and not draining",
                               "responses": {"200": _json({"type": "object"}, "ready"),
                                             "503": _json({"type": "object"}, "starting, draining or an engine down")}}},
            "/metrics": {"get": {"summary": "Prometheus metrics (text exposition format); who may read it: "
                                            "metrics.access (default: loopback clients, else admin keys)",
                                 "responses": {"200": {"description": "metrics",
                                                       "content": {"text/plain": {"schema": {"type": "string"}}}},
                                               **_errors(401, 403)}}},
            "/openapi.json": {"get": {"summary": "This document",
                                      "responses": {"200": _json({"type": "object"}, "OpenAPI 3.1")}}},
            **_spend_paths(auth),
            **_dashboard_paths(),
            **_policy_paths(auth),
            **batch_paths(auth),
        },
    }


def _q(name: str, description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "description": description,
            "schema": schema or {"type": "string"}}


def _spend_paths(auth: list[dict[str, Any]]) -> dict[str, Any]:
    """The spend ledger (money in integer micro-units)."""
    window = [_q("start", "unix seconds, ISO 8601, or a span before now (7d, 12h); default: end - 7 days"),
              _q("end", "unix seconds or ISO 8601; default: now"),
              _q("tenant", "admin keys: one tenant; a tenant key may only name its own")]
    row = {"type": "object", "properties": {k: {"type": ["integer", "null"]} for k in (
        "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens", "cost_micros",
        "baseline_cost_micros", "savings_micros", "cost_per_million_tokens_micros", "errors")}}
    report = {"type": "object", "properties": {
        "object": {"const": "spend.report"}, "start": {"type": "string"}, "end": {"type": "string"},
        "group_by": {"type": "array", "items": {"oneOf": [
            {"enum": ["model", "tenant", "day", "hour", "key", "user", "route"]},
            {"type": "string", "pattern": "^tag:.{1,64}$"}]}},
        "source": {"enum": ["rollups", "stream"]},
        "baseline_engine": {"type": "string"}, "tenant": {"type": ["string", "null"]},
        "data": {"type": "array", "items": row}, "total": row}}
    page = {"type": "object", "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": {"type": "object"}},
        "next_cursor": {"type": ["string", "null"]}, "has_more": {"type": "boolean"}}}
    return {
        "/v1/spend/report": {"get": {
            "summary": ("Spend and tokens from the hourly rollups, grouped; JSON or CSV (format=csv or "
                        "Accept: text/csv)"),
            "security": auth,
            "parameters": [*window, _q("group_by", ("model, tenant, day, hour, key, user, route or tag:NAME, or several "
                                                       "comma-separated; one of key/user/route/tag from the rollups "
                                                       "(its \"\" group: records without a value), two or more from "
                                                       "the request stream")),
                           _q("format", "json (default) or csv", {"enum": ["json", "csv"]})],
            "responses": {"200": {"description": "the report", "content": {
                "application/json": {"schema": report}, "text/csv": {"schema": {"type": "string"}}}},
                **_errors(400, 401, 403, 503)}}},
        "/v1/spend/requests": {"get": {
            "summary": "Usage records, newest first, paged by cursor (no prompt text)", "security": auth,
            "parameters": [*window, _q("limit", "1..1000 (default 100)", {"type": "integer", "minimum": 1,
                                                                          "maximum": 1000}),
                           _q("cursor", "next_cursor of the previous page")],
            "responses": {"200": _json(page, "a page of records"), **_errors(400, 401, 403, 503)}}},
    }


def _dashboard_paths() -> dict[str, Any]:
    """The dashboard pages (session cookie, CSRF token on every form)."""
    html = {"description": "an HTML page", "content": {"text/html": {"schema": {"type": "string"}}}}
    redirect = {"description": "redirect (sign-in page, or the dashboard)"}
    form = {"required": True, "content": {"application/x-www-form-urlencoded": {"schema": {
        "type": "object", "required": ["csrf_token"],
        "properties": {"csrf_token": {"type": "string"}, "api_key": {"type": "string"}}}}}}
    days = _q("days", "1, 7, 30 or 90 (default 7)", {"enum": ["1", "7", "30", "90"]})
    return {
        "/dashboard": {"get": {"summary": "The spend dashboard (signed in)", "parameters": [
            days, _q("tenant", "admins: one tenant")], "responses": {"200": html, "303": redirect,
                                                                     **_errors(400, 403, 503)}}},
        "/dashboard/login": {
            "get": {"summary": "Sign-in form", "responses": {"200": html, "303": redirect}},
            "post": {"summary": "Sign in with an API key: sets the session cookie", "requestBody": form,
                     "responses": {"303": redirect, "401": html, **_errors(400, 403, 413)}}},
        "/dashboard/logout": {"post": {"summary": "Sign out", "requestBody": form,
                                       "responses": {"303": redirect, **_errors(400, 403, 413)}}},
        "/dashboard/spend.csv": {"get": {"summary": "The report as CSV (signed in)", "parameters": [
            days, _q("tenant", "admins: one tenant"), _q("group_by", "default day,model")], "responses": {
            "200": {"description": "CSV", "content": {"text/csv": {"schema": {"type": "string"}}}},
            **_errors(400, 401, 403, 503)}}},
        "/dashboard/live": {"get": {"summary": "Live engine stats (signed in)", "responses": {
            "200": _json({"type": "object"}, "engines"), **_errors(401)}}},
        "/dashboard/static/{name}": {"get": {"summary": "dashboard.css or dashboard.js", "parameters": [
            {"name": "name", "in": "path", "required": True, "schema": {"enum": ["dashboard.css", "dashboard.js"]}}],
            "responses": {"200": {"description": "the file"}, **_errors(404)}}},
    }


def _policy_paths(auth: list[dict[str, Any]]) -> dict[str, Any]:
    """The routing-policy admin API (admin keys only) and the operator page."""
    doc = {"required": True, "content": {
        "application/yaml": {"schema": {"type": "string", "description": "a policy document (policies/README.md)"}},
        "application/json": {"schema": {"type": "object", "description": "the same document as JSON"}}}}
    version = {"type": "object", "properties": {
        "version": {"type": "integer"}, "hash": {"type": "string"}, "author": {"type": "string"},
        "applied_at": {"type": "string"}, "document": {"type": "string"}, "diff": {"type": "string"},
        "note": {"type": "string"}, "applied": {"type": "boolean"}}}
    problems = _json({"type": "object", "properties": {"error": {"type": "object", "properties": {
        "code": {"const": "invalid_policy"}, "problems": {"type": "array", "items": {"type": "object", "properties": {
            "line": {"type": ["integer", "null"]}, "column": {"type": ["integer", "null"]}, "path": {"type": "string"},
            "message": {"type": "string"}, "allowed": {"type": "array", "items": {"type": "string"}}}}}}}}},
        "invalid policy: every problem with line, column, key path and allowed values")
    window = [_q("start", "unix seconds, ISO 8601, or a span before now (7d, 12h); default: end - 7 days"),
              _q("end", "unix seconds or ISO 8601; default: now"),
              _q("limit", "most recorded requests replayed (newest first), 1..100000, default 10000",
                 {"type": "integer", "minimum": 1, "maximum": 100000}),
              _q("tenant", "replay one tenant's traffic only")]
    html = {"description": "an HTML page", "content": {"text/html": {"schema": {"type": "string"}}}}
    redirect = {"description": "redirect"}
    form = {"required": True, "content": {"application/x-www-form-urlencoded": {"schema": {
        "type": "object", "required": ["csrf_token"], "properties": {
            "csrf_token": {"type": "string"}, "api_key": {"type": "string"}, "document": {"type": "string"},
            "action": {"enum": ["validate", "simulate", "apply"]}, "since": {"enum": ["1d", "7d", "30d"]},
            "version": {"type": "string"}}}}}}
    return {
        "/admin/policy": {
            "get": {"summary": "The policy in force (JSON; ?format=yaml or Accept: application/yaml: the document)",
                    "security": auth, "parameters": [_q("format", "json or yaml", {"enum": ["json", "yaml"]})],
                    "responses": {"200": {"description": "the current version", "content": {
                        "application/json": {"schema": version}, "application/yaml": {"schema": {"type": "string"}}}},
                        **_errors(401, 403, 404)}},
            "put": {"summary": "Apply a policy document: validated, stored as a new version in Redis, announced to "
                               "every gateway", "security": auth, "requestBody": doc,
                    "parameters": [_q("expected_version", "refuse with 409 unless this is the current version",
                                      {"type": "integer"})],
                    "responses": {"200": _json(version, "the new (or, unchanged, the current) version"),
                                  "422": problems, **_errors(400, 401, 403, 409, 413, 503)}}},
        "/admin/policy/history": {"get": {
            "summary": "Every version, newest first, with author, time, hash and diff", "security": auth,
            "parameters": [_q("limit", "newest N versions", {"type": "integer", "minimum": 1})],
            "responses": {"200": _json({"type": "object", "properties": {
                "current": {"type": "integer"}, "data": {"type": "array", "items": version}}}, "the history"),
                **_errors(400, 401, 403, 503)}}},
        "/admin/policy/rollback/{version}": {"post": {
            "summary": "Restore a version's exact document as a new version", "security": auth,
            "parameters": [{"name": "version", "in": "path", "required": True, "schema": {"type": "integer"}}],
            "responses": {"200": _json(version, "the new version"), "422": problems,
                          **_errors(400, 401, 403, 404, 409, 503)}}},
        "/admin/policy/validate": {"post": {
            "summary": "Check a document without applying it", "security": auth, "requestBody": doc,
            "responses": {"200": _json({"type": "object", "properties": {
                "valid": {"type": "boolean"}, "problems": {"type": "array"}, "hash": {"type": "string"},
                "diff": {"type": "string"}}}, "valid or not, with every problem"), **_errors(400, 401, 403, 413)}}},
        "/admin/policy/simulate": {"post": {
            "summary": "Replay recorded traffic (spend records: features and token counts, no text) under the "
                       "document and under the policy in force", "security": auth, "requestBody": doc,
            "parameters": window,
            "responses": {"200": _json({"type": "object", "properties": {
                "records": {"type": "integer"}, "current": {"type": ["object", "null"]},
                "proposed": {"type": "object"}, "delta": {"type": ["object", "null"]},
                "text": {"type": ["string", "null"]}}}, "the comparison (money in micro-units)"),
                "422": problems, **_errors(400, 401, 403, 413, 503)}}},
        "/admin": {"get": {"summary": "The operator page (signed in with an admin key)",
                           "responses": {"200": html, "303": redirect}}},
        "/admin/login": {
            "get": {"summary": "Operator sign-in form", "responses": {"200": html, "303": redirect}},
            "post": {"summary": "Sign in with an admin key", "requestBody": form,
                     "responses": {"303": redirect, "401": html, **_errors(400, 403, 413)}}},
        "/admin/logout": {"post": {"summary": "Sign out", "requestBody": form,
                                   "responses": {"303": redirect, **_errors(400, 403)}}},
        "/admin/policy-form": {"post": {"summary": "The page's editor: validate, simulate or apply", "requestBody": form,
                                        "responses": {"200": html, "303": redirect, "422": html,
                                                      **_errors(400, 401, 403, 413)}}},
        "/admin/rollback": {"post": {"summary": "The page's rollback button", "requestBody": form,
                                     "responses": {"303": redirect, "422": html, **_errors(400, 401, 403)}}},
        "/admin/static/{name}": {"get": {"summary": "dashboard.css or admin.css", "parameters": [
            {"name": "name", "in": "path", "required": True, "schema": {"enum": ["dashboard.css", "admin.css"]}}],
            "responses": {"200": {"description": "the file"}, "404": {"description": "not found"}}}},
    }
