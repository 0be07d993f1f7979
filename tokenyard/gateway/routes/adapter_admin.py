"""The admin API for an engine's LoRA adapters: list, load and unload them while it serves (admin keys only).

    GET    /admin/engines/{engine}/adapters           {"engine", "adapters": [{"name", "model", "source"}],
                                                      "lora_roots", "replicas": [{"replica", "adapters",
                                                      "resident"}], "audit": [latest changes, newest first]}
    POST   /admin/engines/{engine}/adapters           {"name": "sql", "path": "/srv/adapters/sql"} -> 200 what
                                                      was loaded ("model": "ENGINE:NAME", rank, modules, seconds)
    DELETE /admin/engines/{engine}/adapters/{name}    -> 200 {"engine", "name", "unloaded": true}

Where adapters may come from: the engine's `lora_roots` in the deployment (folders; a relative path is taken
inside the first). A path outside every root (after `..` and symlinks are resolved), or an engine without
`lora_roots`, is a 400 `path_not_allowed`: the admin key picks adapters, the operator picks the folders.
A loaded adapter is a model at once (`ENGINE:NAME`, in /v1/models); on a replica pool it is loaded on every
replica or on none. Unloading an adapter that requests are still running with is refused with 409
`adapter_conflict` (nothing changes; they finish, and the unload can be sent again): requests are never cut.
A run-time load or unload outlives its engine core's restart (the gateway replays it on the fresh core,
tokenyard/engines/serving/adapter_replay.py) but not the gateway's; lora_modules keeps an adapter for good.

Errors (OpenAI-shaped): 404 `engine_not_found`, `adapter_not_found`; 400 `invalid_adapter` (the engine's
check: a rank, shape or base mismatch names the tensor), `invalid_adapter_name`, `path_not_allowed`,
`adapters_not_supported` (an engine started without lora_modules, or an upstream), `invalid_json`;
409 `adapter_conflict` (the name is taken, or requests use it); 503 `replica_down` / `engine_unavailable`.

Audit: every load and unload, refused or done, is a line on the `tokenyard.audit` logger and, with Redis,
an entry of the list `{prefix}audit:adapters` (the latest AUDIT_KEEP; GET shows this engine's).
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokenyard.engines.lora.adapter_errors import NAME
from tokenyard.gateway.auth.api_keys import KeyRecord
from tokenyard.gateway.backends.adapter_control import AdapterControlError, load_adapter, unload_adapter
from tokenyard.gateway.backends.replica_sleep import replicas_of
from tokenyard.gateway.edge.errors import APIError, BadRequest, NotFound
from tokenyard.gateway.routes.policy_api import admin_key

if TYPE_CHECKING:
    from tokenyard.gateway.state import Gateway

audit_log = logging.getLogger("tokenyard.audit")
MAX_BODY_BYTES = 8192
AUDIT_KEEP = 1000        # entries kept in Redis
AUDIT_SHOWN = 50         # shown by GET (this engine's, among the latest AUDIT_KEEP)


def routes() -> list[Route]:
    base = "/admin/engines/{engine}/adapters"
    return [Route(base, list_adapters, methods=["GET"]), Route(base, load, methods=["POST"]),
            Route(base + "/{name}", unload, methods=["DELETE"])]


def audit_key(prefix: str) -> str:
    return f"{prefix}audit:adapters"


def _engine(request: Request) -> tuple["Gateway", str, Any]:
    gw: "Gateway" = request.app.state.gateway
    name = request.path_params["engine"]
    handle = gw.handles.get(name)
    if handle is None:
        raise NotFound(f"No engine named {name!r} (known: {', '.join(sorted(gw.handles))})", param="engine",
                       code="engine_not_found")
    return gw, name, handle


def allowed_path(roots: tuple[Path, ...], raw: str) -> Path:
    """The adapter folder, resolved, if it lies inside one of the roots; BadRequest otherwise."""
    if not roots:
        raise BadRequest("This engine has no lora_roots in the deployment: adapters cannot be loaded at run time",
                         param="path", code="path_not_allowed")
    p = Path(raw).expanduser()
    resolved = (p if p.is_absolute() else roots[0] / p).resolve()
    if not any(resolved.is_relative_to(root) for root in roots):
        raise BadRequest(f"The path {raw!r} is outside this engine's lora_roots ({', '.join(map(str, roots))})",
                         param="path", code="path_not_allowed")
    return resolved


async def list_adapters(request: Request) -> Response:
    await admin_key(request)
    gw, name, handle = _engine(request)
    configured = set((gw.deployment.engines[name].options.get("lora_modules") or {}) if name in gw.deployment.engines
                     else ())
    adapters = [{"name": a, "model": f"{name}:{a}", "source": "deployment" if a in configured else "runtime"}
                for a in gw.router.adapters_of(name)]
    replicas = []
    for r in replicas_of(handle.engine):
        st = r.engine.stats()
        replicas.append({"replica": r.label, "adapters": list(st.lora_names), "resident": list(st.lora_resident)})
    spec = gw.deployment.engines.get(name)
    return JSONResponse({"engine": name, "adapters": adapters,
                         "lora_roots": [str(p) for p in (spec.lora_roots if spec is not None else ())],
                         "replicas": replicas, "audit": await _audit_entries(gw, name)})


async def load(request: Request) -> Response:
    key = await admin_key(request)
    gw, engine, handle = _engine(request)
    body = await _body(request)
    adapter, raw_path = body.get("name"), body.get("path")
    if not isinstance(adapter, str) or not NAME.match(adapter):
        raise BadRequest(f"name must be 1-64 of A-Z a-z 0-9 . _ - (starting with a letter or digit), got {adapter!r}",
                         param="name", code="invalid_adapter_name")
    if not isinstance(raw_path, str) or not raw_path:
        raise BadRequest("path must be the adapter's folder (adapter_config.json + adapter_model.safetensors)",
                         param="path", code="path_not_allowed")
    spec = gw.deployment.engines.get(engine)
    try:
        path = allowed_path(spec.lora_roots if spec is not None else (), raw_path)
    except APIError as e:
        await _audit(gw, key, "load", engine, adapter, raw_path, f"refused: {e.code}")
        raise
    try:
        info = await load_adapter(handle.engine, adapter, str(path))
    except AdapterControlError as e:
        await _audit(gw, key, "load", engine, adapter, str(path), f"refused: {e.code}: {e.message}")
        raise _api_error(e) from None
    gw.router.add_adapter(engine, adapter)
    await _audit(gw, key, "load", engine, adapter, str(path), "done")
    return JSONResponse({"engine": engine, "model": f"{engine}:{adapter}", **info})


async def unload(request: Request) -> Response:
    key = await admin_key(request)
    gw, engine, handle = _engine(request)
    adapter = request.path_params["name"]
    if adapter not in gw.router.adapters_of(engine):
        raise NotFound(f"Engine {engine} has no LoRA adapter {adapter!r} (it serves: "
                       f"{', '.join(gw.router.adapters_of(engine)) or 'none'})", param="name",
                       code="adapter_not_found")
    try:
        await unload_adapter(handle.engine, adapter)
    except AdapterControlError as e:
        await _audit(gw, key, "unload", engine, adapter, None, f"refused: {e.code}: {e.message}")
        if e.status != 404:
            raise _api_error(e) from None
    gw.router.remove_adapter(engine, adapter)
    await _audit(gw, key, "unload", engine, adapter, None, "done")
    return JSONResponse({"engine": engine, "name": adapter, "unloaded": True})


async def _audit(gw: "Gateway", key: KeyRecord, action: str, engine: str, adapter: str, path: str | None,
                 outcome: str) -> None:
    entry = {"at": round(time.time(), 3), "actor": key.name or key.key_id, "key_id": key.key_id, "action": action,
             "engine": engine, "adapter": adapter, "path": path, "outcome": outcome}
    audit_log.info("adapter %s", json.dumps(entry, sort_keys=True))
    if gw.redis is None:
        return
    try:
        name = audit_key(gw.deployment.redis_prefix)
        pipe = gw.redis.pipeline(transaction=False)
        pipe.lpush(name, json.dumps(entry))
        pipe.ltrim(name, 0, AUDIT_KEEP - 1)
        await pipe.execute()
    except Exception as e:  # noqa: BLE001 - the change is made; the log line above is its record
        audit_log.warning("adapter audit entry not stored in Redis: %s", e)


async def _audit_entries(gw: "Gateway", engine: str) -> list[dict[str, Any]]:
    if gw.redis is None:
        return []
    try:
        raw = await gw.redis.lrange(audit_key(gw.deployment.redis_prefix), 0, AUDIT_KEEP - 1)
    except Exception:  # noqa: BLE001 - the list is informative
        return []
    out = []
    for item in raw:
        try:
            entry = json.loads(item)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("engine") == engine:
            out.append(entry)
            if len(out) >= AUDIT_SHOWN:
                break
    return out


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise BadRequest(f"Body exceeds {MAX_BODY_BYTES} bytes", code="invalid_json")
    try:
        body = json.loads(raw or b"{}")
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"Body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest('Body must be a JSON object such as {"name": "sql", "path": "/srv/adapters/sql"}',
                         code="invalid_json")
    return body


def _api_error(e: AdapterControlError) -> APIError:
    err = APIError(e.message, param=e.param, code=e.code)
    err.status = e.status
    err.type = {400: "invalid_request_error", 404: "invalid_request_error",
                409: "invalid_request_error"}.get(e.status, "service_unavailable")
    return err
