"""GET /openapi.json: a hand-written OpenAPI 3.1 description of every endpoint.

Hand-written because the request body is validated by hand (chat_request.py) and this file is
the place a reader checks what is accepted; tests compare its paths with the app's routes.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from tokenyard.engines.core.structured_output import MAX_SCHEMA_CHARS
from tokenyard.gateway.batch.openapi_paths import batch_paths
from tokenyard.gateway.edge.chat_request import MAX_LOGIT_BIAS, MAX_N, MAX_STOP, MAX_TOP_LOGPROBS, ROLES, UNSUPPORTED
from tokenyard.gateway.edge.completion_request import MAX_CHOICES, MAX_LOGPROBS, MAX_PROMPTS
from tokenyard.gateway.edge.completion_request import UNSUPPORTED as TEXT_UNSUPPORTED
from tokenyard.gateway.edge.messages_openapi import messages_paths
from tokenyard.gateway.edge.openapi_parts import errors, json_body
from tokenyard.gateway.edge.tool_request import MAX_TOOLS
from tokenyard.gateway.server.openapi_admin import (
    adapter_paths,
    dashboard_paths,
    policy_paths,
    replica_paths,
    spend_paths,
)
from tokenyard.gateway.server.openapi_responses import responses_paths
from tokenyard.gateway.server.openapi_router import router_paths


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
                                              "created": {"type": "integer"}, "owned_by": {"type": "string"},
                                              "max_model_len": {"type": "integer", "description": (
                                                  "the engine's longest prompt + max_tokens (not on auto)")},
                                              "parent": {"type": "string", "description": (
                                                  "a LoRA adapter's engine (ids ENGINE:ADAPTER only)")}}}
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
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}},
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
                    **errors(400, 401, 403, 404, 413, 422, 429, 500, 502, 503, 504)}}},
            "/v1/embeddings": {"post": {
                "summary": "Create embeddings on an engine that serves them (embeddings: true; model names the "
                           "engine): a torch engine's mean-pooled, L2-normalised final hidden states, or an "
                           "upstream's reply; key, limits, admission and spend as chat",
                "security": auth,
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["model", "input"], "properties": {
                        "model": {"type": "string"},
                        "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}},
                                            {"type": "array", "items": {"type": "integer"}},
                                            {"type": "array", "items": {"type": "array",
                                                                        "items": {"type": "integer"}}}]},
                        "encoding_format": {"enum": ["float", "base64"]},
                        "dimensions": {"type": "integer", "minimum": 1},
                        "user": {"type": "string"}}}}}},
                "responses": {"200": json_body({"type": "object", "properties": {
                    "object": {"const": "list"}, "data": {"type": "array"}, "model": {"type": "string"},
                    "usage": {"type": "object"}}}, "the embeddings, model set to the engine"),
                    **errors(400, 401, 404, 413, 429, 502, 503, 504)}}},
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
                    **errors(400, 401, 403, 404, 413, 429, 500, 502, 503, 504)}}},
            "/v1/models": {"get": {"summary": "List models: auto, every engine, every ENGINE:ADAPTER", "security": auth,
                                   "responses": {"200": json_body({"type": "object", "properties": {
                                       "object": {"const": "list"},
                                       "data": {"type": "array", "items": {"$ref": "#/components/schemas/Model"}}}},
                                       "the models"), **errors(401)}}},
            "/v1/models/{model}": {"get": {"summary": "One model", "security": auth,
                                           "parameters": [{"name": "model", "in": "path", "required": True,
                                                           "schema": {"type": "string"}}],
                                           "responses": {"200": json_body({"$ref": "#/components/schemas/Model"}, "the model"),
                                                         **errors(401, 404)}}},
            "/health": {"get": {"summary": "Liveness: the event loop answers; engine and Redis state",
                                "responses": {"200": json_body({"type": "object"}, "alive")}}},
            "/ready": {"get": {"summary": "Readiness: engines loaded and not draining",
                               "responses": {"200": json_body({"type": "object"}, "ready"),
                                             "503": json_body({"type": "object"}, "starting, draining or an engine down")}}},
            "/metrics": {"get": {"summary": "Prometheus metrics (text exposition format); who may read it: "
                                            "metrics.access (default: loopback clients, else admin keys)",
                                 "responses": {"200": {"description": "metrics",
                                                       "content": {"text/plain": {"schema": {"type": "string"}}}},
                                               **errors(401, 403)}}},
            "/openapi.json": {"get": {"summary": "This document",
                                      "responses": {"200": json_body({"type": "object"}, "OpenAPI 3.1")}}},
            "/favicon.ico": {"get": {"summary": "The gateway's icon (no auth)", "responses": {"200": {
                "description": "a 16x16 icon", "content": {"image/x-icon": {"schema": {"type": "string",
                                                                                      "format": "binary"}}}}}}},
            **spend_paths(auth),
            **dashboard_paths(),
            **policy_paths(auth),
            **replica_paths(auth),
            **adapter_paths(auth),
            **batch_paths(auth),
            **messages_paths(),
            **responses_paths(auth, request),
            **router_paths(auth),
        },
    }
