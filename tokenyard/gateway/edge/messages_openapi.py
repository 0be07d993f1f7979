"""The Messages API's part of /openapi.json (tokenyard/gateway/server/openapi.py adds these paths)."""
from __future__ import annotations

from typing import Any

from tokenyard.gateway.edge.chat_request import MAX_STOP
from tokenyard.gateway.edge.messages_request import MAX_TOP_K, UNSUPPORTED
from tokenyard.gateway.edge.openapi_parts import json_body

ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"},
    "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"enum": ["invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                          "request_too_large", "rate_limit_error", "api_error", "overloaded_error"]},
        "message": {"type": "string"}}}}}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): json_body(ERROR, "Anthropic-shaped error (Retry-After kept on 429 and 503)") for c in codes}


def messages_paths() -> dict[str, Any]:
    cache = {"type": "object", "description": "accepted and ignored: the prefix cache needs no marker"}
    text = {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"const": "text"}, "text": {"type": "string"}, "cache_control": cache}}
    tool_use = {"type": "object", "required": ["type", "id", "name", "input"], "properties": {
        "type": {"const": "tool_use"}, "id": {"type": "string"}, "name": {"type": "string"},
        "input": {"type": "object"}, "cache_control": cache}}
    tool_result = {"type": "object", "required": ["type", "tool_use_id"], "properties": {
        "type": {"const": "tool_result"}, "tool_use_id": {"type": "string"},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": text}]},
        "is_error": {"type": "boolean"}, "cache_control": cache}}
    message = {"type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": {
        "role": {"enum": ["user", "assistant"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"oneOf": [text, tool_use, tool_result]}}],
                    "description": "user turns: text and tool_result blocks; assistant turns: text and tool_use. "
                                   "Image and document blocks are 400s; the last turn must be the user's"}}}
    tool = {"type": "object", "required": ["name", "input_schema"], "properties": {
        "type": {"const": "custom"}, "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        "description": {"type": "string"}, "input_schema": {"type": "object"}, "cache_control": cache}}
    conversation = {
        "model": {"type": "string", "description": "'auto' (the router decides) or an engine name"},
        "messages": {"type": "array", "minItems": 1, "items": message},
        "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": text}]},
        "tools": {"type": "array", "items": tool, "description": "custom tools only; server tools are 400s"},
        "tool_choice": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"},
            "disable_parallel_tool_use": {"type": "boolean"}}}}
    request = {"type": "object", "required": ["model", "messages", "max_tokens"], "additionalProperties": False,
               "description": ("Names Tokenyard does not implement are refused with 400 naming them (unless set "
                               "to a value that asks for nothing): " + ", ".join(sorted(UNSUPPORTED))),
               "properties": {
                   **conversation,
                   "max_tokens": {"type": "integer", "minimum": 1},
                   "stop_sequences": {"type": "array", "maxItems": MAX_STOP, "items": {"type": "string", "minLength": 1}},
                   "temperature": {"type": "number", "minimum": 0, "maximum": 1, "default": 1},
                   "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                   "top_k": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_K, "description": "0: off"},
                   "metadata": {"type": "object", "additionalProperties": False,
                                "properties": {"user_id": {"type": "string", "maxLength": 256}}},
                   "stream": {"type": "boolean"}, "cache_control": cache,
                   "service_tier": {"enum": ["auto", "standard_only"]}}}
    usage = {"type": "object", "properties": {
        "input_tokens": {"type": "integer", "description": "prompt tokens not read from the prefix cache"},
        "cache_read_input_tokens": {"type": "integer"}, "cache_creation_input_tokens": {"const": 0},
        "output_tokens": {"type": "integer"}}}
    reply = {"type": "object", "properties": {
        "id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
        "model": {"type": "string", "description": "the engine that served"},
        "content": {"type": "array", "items": {"oneOf": [text, tool_use]}},
        "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
        "stop_sequence": {"type": ["string", "null"]}, "usage": usage}}
    auth = [{"bearer": []}, {"x-api-key": []}]
    return {
        "/v1/messages": {"post": {
            "summary": ("Create a message (Anthropic's Messages API) through the same flow as chat completions; "
                        "streamed as Anthropic's events (message_start, content_block_start / delta / stop, "
                        "message_delta, message_stop) when stream is true. Key in x-api-key or Authorization"),
            "security": auth,
            "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
            "responses": {"200": {"description": "a message, or its event stream", "content": {
                "application/json": {"schema": reply}, "text/event-stream": {"schema": {"type": "string"}}}},
                **_errors(400, 401, 403, 404, 413, 422, 429, 500, 502, 503, 504)}}},
        "/v1/messages/count_tokens": {"post": {
            "summary": "Count a conversation's input tokens with the tokenizer of the engine the model names "
                       "(for auto: the engine routing counts with); starts and reserves nothing",
            "security": auth,
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["model", "messages"], "properties": conversation}}}},
            "responses": {"200": json_body({"type": "object", "properties": {"input_tokens": {"type": "integer"}}},
                                           "the count"), **_errors(400, 401, 404, 413, 422)}}},
    }
