"""Pieces every part of /openapi.json uses: the error reference, JSON bodies, error responses and
query and path parameters (tokenyard/gateway/server/openapi.py assembles the document)."""
from __future__ import annotations

from typing import Any

ERROR = {"$ref": "#/components/schemas/Error"}


def json_body(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def errors(*codes: int) -> dict[str, Any]:
    """OpenAI-shaped error responses for these status codes."""
    return {str(c): json_body(ERROR, "OpenAI-shaped error") for c in codes}


def query(name: str, description: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "description": description,
            "schema": schema or {"type": "string"}}


def path_param(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string", "maxLength": 64}}
