"""/openapi.json's Responses API paths: POST /v1/responses, GET and DELETE /v1/responses/{response_id}
(tokenyard/gateway/http/responses_endpoint.py; the body's translation: tokenyard/gateway/edge/responses_request.py)."""
from __future__ import annotations

from typing import Any

from tokenyard.gateway.edge.openapi_parts import errors, json_body, path_param
from tokenyard.gateway.edge.responses_request import INPUT_ROLES, UNSUPPORTED
from tokenyard.gateway.edge.tool_request import MAX_TOOLS


def responses_paths(auth: list[dict[str, Any]], chat_request: dict[str, Any]) -> dict[str, Any]:
    """chat_request: the ChatCompletionRequest schema, whose shared parameters are reused."""
    shared = chat_request["properties"]
    text_parts = {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}}}}
    item = {"oneOf": [
        {"type": "object", "required": ["role", "content"], "description": "a message (type 'message' or absent)",
         "properties": {"type": {"const": "message"}, "role": {"enum": list(INPUT_ROLES)},
                        "content": {"oneOf": [{"type": "string"}, text_parts]}}},
        {"type": "object", "required": ["type", "call_id", "name", "arguments"],
         "description": "a call the model made, sent back: an assistant message's tool call",
         "properties": {"type": {"const": "function_call"}, "call_id": {"type": "string"},
                        "name": {"type": "string"}, "arguments": {"type": "string"}}},
        {"type": "object", "required": ["type", "call_id", "output"], "description": "the call's result",
         "properties": {"type": {"const": "function_call_output"}, "call_id": {"type": "string"},
                        "output": {"oneOf": [{"type": "string"}, text_parts]}}}]}
    tool = {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"const": "function", "description": "function tools only; built-in tools are a 400"},
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
        "parameters": {"type": ["object", "null"]}, "strict": {"type": ["boolean", "null"]}}}
    request = {
        "type": "object", "required": ["model", "input"], "additionalProperties": False,
        "description": ("OpenAI's Responses API, translated into a chat request and served by the same flow. "
                        "Refused with 400 naming them unless neutral: " + ", ".join(sorted(UNSUPPORTED))),
        "properties": {
            "model": shared["model"],
            "input": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": item}]},
            "instructions": {"type": ["string", "null"], "description": "a leading system message; not carried "
                                                                         "over by previous_response_id"},
            "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
            "temperature": shared["temperature"], "top_p": shared["top_p"], "metadata": shared["metadata"],
            "user": shared["user"], "service_tier": shared["service_tier"], "priority": shared["priority"],
            "stream": {"type": ["boolean", "null"], "default": False},
            "stream_options": {"type": ["object", "null"],
                               "properties": {"include_obfuscation": {"type": "boolean"}}},
            "store": {"type": ["boolean", "null"], "default": True,
                      "description": "keep the response for GET and previous_response_id (responses.retention_days)"},
            "previous_response_id": {"type": ["string", "null"],
                                     "description": "continue a stored response of the same tenant"},
            "tools": {"type": ["array", "null"], "maxItems": MAX_TOOLS, "items": tool},
            "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {"type": "null"},
                                      {"type": "object", "required": ["type", "name"], "properties": {
                                          "type": {"const": "function"}, "name": {"type": "string"}}}]},
            "parallel_tool_calls": shared["parallel_tool_calls"],
            "text": {"type": ["object", "null"], "properties": {"format": {
                "description": "text, json_object, or json_schema {name, schema, strict}: constrained decoding "
                               "as chat's response_format", "type": "object"}}},
        }}
    response = {"type": "object", "properties": {
        "id": {"type": "string"}, "object": {"const": "response"}, "created_at": {"type": "integer"},
        "status": {"enum": ["completed", "incomplete", "failed"]}, "model": {"type": "string"},
        "incomplete_details": {"type": ["object", "null"]},
        "output": {"type": "array", "description": "a message item (output_text content) and/or function_call "
                                                   "items", "items": {"type": "object"}},
        "usage": {"type": "object", "properties": {
            "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"},
            "total_tokens": {"type": "integer"},
            "input_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}}}}}}
    one = {"parameters": [path_param("response_id")], "security": auth}
    return {
        "/v1/responses": {"post": {
            "summary": "Create a model response (OpenAI's Responses API; streamed as typed server-sent events "
                       "when stream is true); same admission, limits, routing and spend as chat",
            "security": auth,
            "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
            "responses": {"200": {"description": "the Response, or its event stream (response.created ... "
                                                 "response.completed)",
                                  "content": {"application/json": {"schema": response},
                                              "text/event-stream": {"schema": {"type": "object"}}}},
                          **errors(400, 401, 403, 404, 413, 429, 500, 502, 503, 504)}}},
        "/v1/responses/{response_id}": {
            "get": {"summary": "A stored response of the caller's tenant", **one,
                    "responses": {"200": json_body(response, "the response"), **errors(401, 404, 503)}},
            "delete": {"summary": "Delete a stored response", **one,
                       "responses": {"200": json_body({"type": "object", "properties": {
                           "id": {"type": "string"}, "object": {"const": "response.deleted"},
                           "deleted": {"const": True}}}, "deleted"), **errors(401, 404, 503)}}},
    }
