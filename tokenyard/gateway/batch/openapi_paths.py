"""The Batch API's part of /openapi.json (tokenyard/gateway/server/openapi.py adds these paths)."""
from __future__ import annotations

from typing import Any

from tokenyard.gateway.edge.openapi_parts import errors, json_body, path_param, query

_ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"]


def batch_paths(auth: list[dict[str, Any]]) -> dict[str, Any]:
    file_obj = {"type": "object", "properties": {
        "id": {"type": "string"}, "object": {"const": "file"}, "bytes": {"type": "integer"},
        "created_at": {"type": "integer"}, "filename": {"type": "string"},
        "purpose": {"enum": ["batch", "batch_output"]}, "status": {"const": "processed"}}}
    batch_obj = {"type": "object", "properties": {
        "id": {"type": "string"}, "object": {"const": "batch"}, "endpoint": {"enum": _ENDPOINTS},
        "input_file_id": {"type": "string"}, "completion_window": {"const": "24h"},
        "status": {"enum": ["validating", "in_progress", "finalizing", "completed", "failed", "expired",
                            "cancelling", "cancelled"]},
        "output_file_id": {"type": ["string", "null"]}, "error_file_id": {"type": ["string", "null"]},
        "request_counts": {"type": "object", "properties": {k: {"type": "integer"}
                                                             for k in ("total", "completed", "failed")}},
        "metadata": {"type": ["object", "null"]}}}

    def listing(item: dict[str, Any]) -> dict[str, Any]:
        return {"type": "object", "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": item},
                                                 "has_more": {"type": "boolean"}}}

    upload = {"type": "object", "required": ["file", "purpose"], "properties": {
        "file": {"type": "string", "format": "binary",
                 "description": "JSONL: one {custom_id, method: POST, url, body} per line (batch.max_lines, "
                                "batch.max_file_bytes); the first bad line is a 400 naming it"},
        "purpose": {"const": "batch"}}}
    create = {"type": "object", "required": ["input_file_id", "endpoint", "completion_window"],
              "additionalProperties": False, "properties": {
                  "input_file_id": {"type": "string"}, "endpoint": {"enum": _ENDPOINTS},
                  "completion_window": {"const": "24h"},
                  "metadata": {"type": ["object", "null"], "maxProperties": 16,
                               "additionalProperties": {"type": "string", "maxLength": 512}}}}
    return {
        "/v1/files": {
            "post": {"summary": "Upload a Batch API input file (multipart: file, purpose=batch)", "security": auth,
                     "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": upload}}},
                     "responses": {"200": json_body(file_obj, "the stored file"), **errors(400, 401, 413, 503)}},
            "get": {"summary": "The caller's files", "security": auth,
                    "parameters": [query("purpose", "only files of this purpose", {"type": "string"}),
                                   query("limit", "at most this many (1..10000)", {"type": "integer"}),
                                   query("order", "by creation time", {"enum": ["asc", "desc"]}),
                                   query("after", "a file id: the page after it", {"type": "string"})],
                    "responses": {"200": json_body(listing(file_obj), "a page of files"), **errors(400, 401, 404, 503)}}},
        "/v1/files/{file_id}": {
            "get": {"summary": "One of the caller's files", "security": auth, "parameters": [path_param("file_id")],
                    "responses": {"200": json_body(file_obj, "the file"), **errors(401, 404, 503)}},
            "delete": {"summary": "Delete one of the caller's files (not the input of an open batch)",
                       "security": auth, "parameters": [path_param("file_id")],
                       "responses": {"200": json_body({"type": "object"}, "deleted"), **errors(401, 404, 409, 503)}}},
        "/v1/files/{file_id}/content": {
            "get": {"summary": "The file's bytes (JSONL)", "security": auth, "parameters": [path_param("file_id")],
                    "responses": {"200": {"description": "the bytes", "content": {"application/octet-stream": {
                        "schema": {"type": "string", "format": "binary"}}}}, **errors(401, 404, 503)}}},
        "/v1/batches": {
            "post": {"summary": "Create a batch from an uploaded input file", "security": auth,
                     "requestBody": {"required": True, "content": {"application/json": {"schema": create}}},
                     "responses": {"200": json_body(batch_obj, "the batch (status validating)"),
                                   **errors(400, 401, 404, 413, 503)}},
            "get": {"summary": "The caller's batches, newest first", "security": auth,
                    "parameters": [query("limit", "at most this many (1..100)", {"type": "integer"}),
                                   query("after", "a batch id: the page after it", {"type": "string"})],
                    "responses": {"200": json_body(listing(batch_obj), "a page of batches"),
                                  **errors(400, 401, 404, 503)}}},
        "/v1/batches/{batch_id}": {
            "get": {"summary": "One of the caller's batches", "security": auth, "parameters": [path_param("batch_id")],
                    "responses": {"200": json_body(batch_obj, "the batch"), **errors(401, 404, 503)}}},
        "/v1/batches/{batch_id}/cancel": {
            "post": {"summary": "Cancel a batch: lines in flight are aborted, the rest answered batch_cancelled",
                     "security": auth, "parameters": [path_param("batch_id")],
                     "responses": {"200": json_body(batch_obj, "the batch (cancelling or cancelled)"),
                                   **errors(401, 404, 409, 503)}}},
    }
