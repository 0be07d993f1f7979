"""/openapi.json's paths for learning from traffic: POST /v1/feedback (tokenyard/gateway/http/feedback_endpoint.py)
and the router admin API (tokenyard/gateway/routes/router_admin.py)."""
from __future__ import annotations

from typing import Any

from tokenyard.gateway.edge.openapi_parts import errors, json_body, query


def router_paths(auth: list[dict[str, Any]]) -> dict[str, Any]:
    feedback = {"type": "object", "required": ["response_id"], "additionalProperties": False, "properties": {
        "response_id": {"type": "string", "maxLength": 128,
                        "description": "a chat completion's, completion's or message's id, or a response's "
                                       "x-request-id header"},
        "score": {"type": "number", "minimum": 0, "maximum": 1, "description": "the answer's grade, 1 = good"},
        "preferred_engine": {"type": "string", "description": "the engine that should have answered (the "
                                                              "routed pair's small or large engine)"}}}
    stored = {"type": "object", "properties": {
        "object": {"const": "feedback"}, "response_id": {"type": "string"}, "engine": {"type": "string"},
        "label": {"enum": [0, 1, None], "description": "1: the small engine is enough; 0: the large one is "
                                                       "needed; null: no signal (a score on a large answer)"},
        "stored": {"enum": ["created", "replaced"]}}}
    counters = {"type": "object", "description": "counters (integers) and the rates and costs derived from them"}
    return {
        "/v1/feedback": {"post": {
            "summary": "Judge one response (score or preferred engine): a label the router learns from",
            "security": auth,
            "requestBody": {"required": True, "content": {"application/json": {"schema": feedback}}},
            "responses": {"200": json_body(stored, "the label stored"), **errors(400, 401, 404, 413, 503)}}},
        "/admin/router/artifacts": {
            "post": {"summary": "Publish a router artifact (the file's JSON) to Redis; the policy names it by its ref",
                     "security": auth,
                     "requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}},
                     "responses": {"200": json_body({"type": "object", "properties": {"ref": {"type": "string"}}},
                                                    "its ref, sha256:<hex>"), **errors(400, 401, 403, 413, 422, 503)}},
            "get": {"summary": "The published artifacts' refs", "security": auth,
                    "responses": {"200": json_body({"type": "object", "properties": {
                        "refs": {"type": "array", "items": {"type": "string"}}}}, "refs"), **errors(401, 403, 503)}}},
        "/admin/router/shadow": {"get": {
            "summary": "The shadow report: how the candidate would have routed the requests the router scored",
            "security": auth,
            "parameters": [query("candidate", "artifact ref (default: the policy's router.shadow)"),
                           query("tenant", "one tenant's requests only")],
            "responses": {"200": json_body({"type": "object", "properties": {
                "candidate": {"type": "string"}, "rows": {"type": "array", "items": counters}, "total": counters,
                "prices": {"type": "object"}}}, "the report"), **errors(400, 401, 403, 503)}}},
        "/admin/router/labels": {"get": {
            "summary": "Label counts per tenant (never the prompts)", "security": auth,
            "parameters": [query("tenant", "one tenant only")],
            "responses": {"200": json_body({"type": "object", "properties": {"tenants": {"type": "object"}}},
                                           "counts"), **errors(401, 403, 503)}}},
    }
