"""The operator endpoints' part of /openapi.json: spend API, dashboard and sign-in pages, policy
admin API and page (tokenyard/gateway/server/openapi.py assembles the document)."""
from __future__ import annotations

from typing import Any

from tokenyard.gateway.edge.openapi_parts import errors, json_body, path_param, query


def spend_paths(auth: list[dict[str, Any]]) -> dict[str, Any]:
    """The spend ledger (money in integer micro-units)."""
    window = [query("start", "unix seconds, ISO 8601, or a span before now (7d, 12h); default: end - 7 days"),
              query("end", "unix seconds or ISO 8601; default: now"),
              query("tenant", "admin keys: one tenant; a tenant key may only name its own")]
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
            "parameters": [*window, query("group_by", ("model, tenant, day, hour, key, user, route, adapter or tag:NAME, or "
                                                       "several "
                                                       "comma-separated; one of key/user/route/tag from the rollups "
                                                       "(its \"\" group: records without a value), two or more from "
                                                       "the request stream")),
                           query("format", "json (default) or csv", {"enum": ["json", "csv"]})],
            "responses": {"200": {"description": "the report", "content": {
                "application/json": {"schema": report}, "text/csv": {"schema": {"type": "string"}}}},
                **errors(400, 401, 403, 503)}}},
        "/v1/spend/requests": {"get": {
            "summary": "Usage records, newest first, paged by cursor (no prompt text)", "security": auth,
            "parameters": [*window, query("limit", "1..1000 (default 100)", {"type": "integer", "minimum": 1,
                                                                          "maximum": 1000}),
                           query("cursor", "next_cursor of the previous page")],
            "responses": {"200": json_body(page, "a page of records"), **errors(400, 401, 403, 503)}}},
    }


def dashboard_paths() -> dict[str, Any]:
    """The dashboard pages (session cookie, CSRF token on every form)."""
    html = {"description": "an HTML page", "content": {"text/html": {"schema": {"type": "string"}}}}
    redirect = {"description": "redirect (sign-in page, or the dashboard)"}
    form = {"required": True, "content": {"application/x-www-form-urlencoded": {"schema": {
        "type": "object", "required": ["csrf_token"],
        "properties": {"csrf_token": {"type": "string"}, "api_key": {"type": "string"}}}}}}
    days = query("days", "1, 7, 30 or 90 (default 7)", {"enum": ["1", "7", "30", "90"]})
    return {
        "/dashboard": {"get": {"summary": "The spend dashboard (signed in)", "parameters": [
            days, query("tenant", "admins: one tenant")], "responses": {"200": html, "303": redirect,
                                                                     **errors(400, 403, 503)}}},
        "/dashboard/login": {
            "get": {"summary": "Sign-in form", "responses": {"200": html, "303": redirect}},
            "post": {"summary": "Sign in with an API key: sets the session cookie", "requestBody": form,
                     "responses": {"303": redirect, "401": html, **errors(400, 403, 413)}}},
        "/dashboard/logout": {"post": {"summary": "Sign out", "requestBody": form,
                                       "responses": {"303": redirect, **errors(400, 403, 413)}}},
        "/dashboard/spend.csv": {"get": {"summary": "The report as CSV (signed in)", "parameters": [
            days, query("tenant", "admins: one tenant"), query("group_by", "default day,model")], "responses": {
            "200": {"description": "CSV", "content": {"text/csv": {"schema": {"type": "string"}}}},
            **errors(400, 401, 403, 503)}}},
        "/dashboard/live": {"get": {"summary": "Live engine stats (signed in)", "responses": {
            "200": json_body({"type": "object"}, "engines"), **errors(401)}}},
        "/dashboard/static/{name}": {"get": {"summary": "dashboard.css or dashboard.js", "parameters": [
            {"name": "name", "in": "path", "required": True, "schema": {"enum": ["dashboard.css", "dashboard.js"]}}],
            "responses": {"200": {"description": "the file"}, **errors(404)}}},
    }


def policy_paths(auth: list[dict[str, Any]]) -> dict[str, Any]:
    """The routing-policy admin API (admin keys only) and the operator page."""
    doc = {"required": True, "content": {
        "application/yaml": {"schema": {"type": "string", "description": "a policy document (tokenyard/policies/README.md)"}},
        "application/json": {"schema": {"type": "object", "description": "the same document as JSON"}}}}
    version = {"type": "object", "properties": {
        "version": {"type": "integer"}, "hash": {"type": "string"}, "author": {"type": "string"},
        "applied_at": {"type": "string"}, "document": {"type": "string"}, "diff": {"type": "string"},
        "note": {"type": "string"}, "applied": {"type": "boolean"}}}
    problems = json_body({"type": "object", "properties": {"error": {"type": "object", "properties": {
        "code": {"const": "invalid_policy"}, "problems": {"type": "array", "items": {"type": "object", "properties": {
            "line": {"type": ["integer", "null"]}, "column": {"type": ["integer", "null"]}, "path": {"type": "string"},
            "message": {"type": "string"}, "allowed": {"type": "array", "items": {"type": "string"}}}}}}}}},
        "invalid policy: every problem with line, column, key path and allowed values")
    window = [query("start", "unix seconds, ISO 8601, or a span before now (7d, 12h); default: end - 7 days"),
              query("end", "unix seconds or ISO 8601; default: now"),
              query("limit", "most recorded requests replayed (newest first), 1..100000, default 10000",
                 {"type": "integer", "minimum": 1, "maximum": 100000}),
              query("tenant", "replay one tenant's traffic only")]
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
                    "security": auth, "parameters": [query("format", "json or yaml", {"enum": ["json", "yaml"]})],
                    "responses": {"200": {"description": "the current version", "content": {
                        "application/json": {"schema": version}, "application/yaml": {"schema": {"type": "string"}}}},
                        **errors(401, 403, 404)}},
            "put": {"summary": "Apply a policy document: validated, stored as a new version in Redis, announced to "
                               "every gateway", "security": auth, "requestBody": doc,
                    "parameters": [query("expected_version", "refuse with 409 unless this is the current version",
                                      {"type": "integer"})],
                    "responses": {"200": json_body(version, "the new (or, unchanged, the current) version"),
                                  "422": problems, **errors(400, 401, 403, 409, 413, 503)}}},
        "/admin/policy/history": {"get": {
            "summary": "Every version, newest first, with author, time, hash and diff", "security": auth,
            "parameters": [query("limit", "newest N versions", {"type": "integer", "minimum": 1})],
            "responses": {"200": json_body({"type": "object", "properties": {
                "current": {"type": "integer"}, "data": {"type": "array", "items": version}}}, "the history"),
                **errors(400, 401, 403, 503)}}},
        "/admin/policy/rollback/{version}": {"post": {
            "summary": "Restore a version's exact document as a new version", "security": auth,
            "parameters": [{"name": "version", "in": "path", "required": True, "schema": {"type": "integer"}}],
            "responses": {"200": json_body(version, "the new version"), "422": problems,
                          **errors(400, 401, 403, 404, 409, 503)}}},
        "/admin/policy/validate": {"post": {
            "summary": "Check a document without applying it", "security": auth, "requestBody": doc,
            "responses": {"200": json_body({"type": "object", "properties": {
                "valid": {"type": "boolean"}, "problems": {"type": "array"}, "hash": {"type": "string"},
                "diff": {"type": "string"}}}, "valid or not, with every problem"), **errors(400, 401, 403, 413)}}},
        "/admin/policy/simulate": {"post": {
            "summary": "Replay recorded traffic (spend records: features and token counts, no text) under the "
                       "document and under the policy in force", "security": auth, "requestBody": doc,
            "parameters": window,
            "responses": {"200": json_body({"type": "object", "properties": {
                "records": {"type": "integer"}, "current": {"type": ["object", "null"]},
                "proposed": {"type": "object"}, "delta": {"type": ["object", "null"]},
                "text": {"type": ["string", "null"]}}}, "the comparison (money in micro-units)"),
                "422": problems, **errors(400, 401, 403, 413, 503)}}},
        "/admin": {"get": {"summary": "The operator page (signed in with an admin key)",
                           "responses": {"200": html, "303": redirect}}},
        "/admin/login": {
            "get": {"summary": "Operator sign-in form", "responses": {"200": html, "303": redirect}},
            "post": {"summary": "Sign in with an admin key", "requestBody": form,
                     "responses": {"303": redirect, "401": html, **errors(400, 403, 413)}}},
        "/admin/logout": {"post": {"summary": "Sign out", "requestBody": form,
                                   "responses": {"303": redirect, **errors(400, 403)}}},
        "/admin/policy-form": {"post": {"summary": "The page's editor: validate, simulate or apply", "requestBody": form,
                                        "responses": {"200": html, "303": redirect, "422": html,
                                                      **errors(400, 401, 403, 413)}}},
        "/admin/rollback": {"post": {"summary": "The page's rollback button", "requestBody": form,
                                     "responses": {"303": redirect, "422": html, **errors(400, 401, 403)}}},
        "/admin/static/{name}": {"get": {"summary": "dashboard.css or admin.css", "parameters": [
            {"name": "name", "in": "path", "required": True, "schema": {"enum": ["dashboard.css", "admin.css"]}}],
            "responses": {"200": {"description": "the file"}, "404": {"description": "not found"}}}},
    }


def replica_paths(auth: list[dict[str, Any]]) -> dict[str, Any]:
    """An engine's replicas: state, sleep and wake (tokenyard/gateway/routes/replica_api.py)."""
    params = [path_param("engine"), path_param("replica")]
    state = {"type": "object", "properties": {
        "engine": {"type": "string"}, "index": {"type": "integer"}, "replica": {"type": "string"},
        "sleep_level": {"enum": [0, 1, 2]}, "sleep_state": {"enum": ["awake", "asleep", "waking"]},
        "seconds": {"type": ["number", "null"]}, "phases": {"type": "object"}}}
    listing = {"type": "object", "properties": {"engine": {"type": "string"}, "replicas": {
        "type": "array", "items": {"type": "object", "properties": {
            "index": {"type": "integer"}, "replica": {"type": "string"},
            "state": {"enum": ["up", "asleep", "waking", "down"]}, "sleep_level": {"enum": [0, 1, 2]},
            "sleep_state": {"type": "string"}, "routable": {"type": "boolean"}, "can_sleep": {"type": "boolean"}}}}}}
    body = {"required": False, "content": {"application/json": {"schema": {"type": "object", "properties": {
        "level": {"enum": [1, 2], "default": 1,
                  "description": "1: free the KV cache, keep the weights; 2: drop the weights too"},
        "drain_timeout_s": {"type": "number", "minimum": 0, "maximum": 3600, "default": 30}}}}}}
    return {
        "/admin/engines/{engine}/replicas": {"get": {
            "summary": "An engine's replicas with their state (up, asleep, waking, down) and sleep level",
            "security": auth, "parameters": [path_param("engine")],
            "responses": {"200": json_body(listing, "the replicas"), **errors(401, 403, 404)}}},
        "/admin/engines/{engine}/replicas/{replica}/sleep": {"post": {
            "summary": "Drain a replica and put it to sleep (level 1: KV cache freed; 2: weights dropped too)",
            "security": auth, "parameters": params, "requestBody": body,
            "responses": {"200": json_body(state, "asleep"), **errors(400, 401, 403, 404, 409, 503)}}},
        "/admin/engines/{engine}/replicas/{replica}/wake": {"post": {
            "summary": "Wake a sleeping replica; answers when it serves again", "security": auth,
            "parameters": params,
            "responses": {"200": json_body(state, "awake"), **errors(401, 403, 404, 409, 503)}}},
    }


def adapter_paths(auth: list[dict[str, Any]]) -> dict[str, Any]:
    """An engine's LoRA adapters at run time (tokenyard/gateway/routes/adapter_admin.py)."""
    names = {"type": "array", "items": {"type": "string"}}
    listing = {"type": "object", "properties": {
        "engine": {"type": "string"},
        "adapters": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "model": {"type": "string", "description": "ENGINE:NAME"},
            "source": {"enum": ["deployment", "runtime"]}}}},
        "lora_roots": names,
        "replicas": {"type": "array", "items": {"type": "object", "properties": {
            "replica": {"type": "string"}, "adapters": names,
            "resident": {**names, "description": "the adapters in a pool slot now"}}}},
        "audit": {"type": "array", "items": {"type": "object", "properties": {
            "at": {"type": "number"}, "actor": {"type": "string"}, "key_id": {"type": "string"},
            "action": {"enum": ["load", "unload"]}, "engine": {"type": "string"}, "adapter": {"type": "string"},
            "path": {"type": ["string", "null"]}, "outcome": {"type": "string"}}}}}}
    loaded = {"type": "object", "properties": {
        "engine": {"type": "string"}, "model": {"type": "string", "description": "ENGINE:NAME, usable at once"},
        "name": {"type": "string"}, "path": {"type": "string"}, "rank": {"type": "integer"},
        "alpha": {"type": "number"}, "modules": names, "bytes": {"type": "integer"},
        "seconds": {"type": "number"}, "replicas": {**names, "description": "a replica pool: every replica"}}}
    body = {"required": True, "content": {"application/json": {"schema": {
        "type": "object", "required": ["name", "path"], "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"},
            "path": {"type": "string", "description": "the adapter's folder (adapter_config.json + "
                                                      "adapter_model.safetensors), inside the engine's lora_roots "
                                                      "(a relative path: inside the first)"}}}}}}
    return {
        "/admin/engines/{engine}/adapters": {
            "get": {"summary": "An engine's LoRA adapters, where they come from, each replica's, and the audit trail",
                    "security": auth, "parameters": [path_param("engine")],
                    "responses": {"200": json_body(listing, "the adapters"), **errors(401, 403, 404)}},
            "post": {"summary": "Load a LoRA adapter while the engine serves (every replica or none); 400 names "
                                "the tensor of a rank, shape or base mismatch, or a path outside lora_roots",
                     "security": auth, "parameters": [path_param("engine")], "requestBody": body,
                     "responses": {"200": json_body(loaded, "loaded"), **errors(400, 401, 403, 404, 409, 503)}}},
        "/admin/engines/{engine}/adapters/{name}": {"delete": {
            "summary": "Unload a LoRA adapter; 409 adapter_conflict while requests still run with it (they finish)",
            "security": auth, "parameters": [path_param("engine"), path_param("name")],
            "responses": {"200": json_body({"type": "object", "properties": {
                "engine": {"type": "string"}, "name": {"type": "string"}, "unloaded": {"type": "boolean"}}},
                "unloaded"), **errors(401, 403, 404, 409, 503)}}},
    }
