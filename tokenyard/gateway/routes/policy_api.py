"""The admin API for routing policies (admin keys only; a tenant's key gets 403 admin_required).

    PUT  /admin/policy                      apply a document (YAML, or JSON): a new version
    GET  /admin/policy                      the current version (JSON; ?format=yaml or Accept: */yaml
                                            for the document as applied)
    GET  /admin/policy/history              every version, newest first, with its diff (?limit=N)
    POST /admin/policy/rollback/{version}   a new version carrying that version's exact document
    POST /admin/policy/validate             check a document (200 {valid, problems, hash, diff})
    POST /admin/policy/simulate             replay recorded traffic under a document vs the current
                                            policy (?start&end&limit&tenant)

An invalid document is 422 `invalid_policy` with every problem (line, column, key path, message,
allowed values) in `error.problems`; the running policy stays. PUT takes `?expected_version=N`
to refuse (409 `version_conflict`) when someone else applied in between. Applying a document
that means the current policy (same hash) stores nothing and answers `"applied": false`.
The version is installed on this gateway before the answer and announced to every other one.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokenyard.gateway.auth.api_keys import KeyRecord
from tokenyard.gateway.edge.edge_params import json_int, parse_int
from tokenyard.gateway.edge.errors import APIError, BadRequest, Forbidden, NotFound, PayloadTooLarge, Unavailable, json_error
from tokenyard.gateway.policy.store import NoSuchVersion, PolicyConflict
from tokenyard.gateway.policy.work import off_loop
from tokenyard.gateway.routes.policy_admin import DEFAULT_LIMIT, MAX_LIMIT, author_of, check_document, run_simulation
from tokenyard.gateway.routes.spend_queries import time_window
from tokenyard.policies import PolicyError, build_policy, diff, load_policy, policy_hash, policy_to_dict, policy_to_yaml

if TYPE_CHECKING:
    from tokenyard.gateway.state import Gateway

YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")


def routes() -> list[Route]:
    return [Route("/admin/policy", put_policy, methods=["PUT"]),
            Route("/admin/policy", get_policy, methods=["GET"]),
            Route("/admin/policy/history", history, methods=["GET"]),
            Route("/admin/policy/rollback/{version}", rollback, methods=["POST"]),
            Route("/admin/policy/validate", validate, methods=["POST"]),
            Route("/admin/policy/simulate", simulate_route, methods=["POST"])]


def _gw(request: Request) -> "Gateway":
    return request.app.state.gateway


async def admin_key(request: Request) -> KeyRecord:
    key = await _gw(request).keys.authenticate(request.headers.get("authorization"))
    if not key.is_admin:
        raise Forbidden("This endpoint needs an admin key", code="admin_required")
    return key


def problems_response(e: PolicyError, status: int = 422) -> Response:
    body = {"error": {"message": str(e), "type": "invalid_request_error", "param": None, "code": "invalid_policy",
                      "problems": [p.to_dict() for p in e.problems]}}
    return json_error(status, body)


async def read_document(request: Request) -> str:
    """The body as policy text. JSON is a subset of YAML, so it is validated as text too (line and
    column point into the JSON); the rare JSON that YAML reads differently is re-exported."""
    limit = _gw(request).deployment.limits.max_body_bytes
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"Policy document exceeds {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"Policy document is not valid UTF-8 (byte {e.start})", code="invalid_encoding") from e
    if not text.strip():
        raise BadRequest("Empty policy document", code="empty_policy")
    if request.headers.get("content-type", "").split(";")[0].strip() == "application/json":
        try:
            data = json.loads(text, parse_int=json_int)
        except json.JSONDecodeError as e:
            raise BadRequest(f"Body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                             code="invalid_json") from e
        except RecursionError as e:
            raise BadRequest("Body is not valid JSON: nested too deeply", code="invalid_json") from e
        except ValueError as e:     # an integer literal too long to be any policy value
            raise BadRequest(f"Body is not valid JSON: {e}", code="invalid_json") from e
        return await off_loop(_json_document, text, data)
    return text


def _json_document(text: str, data: Any) -> str:
    """JSON that YAML reads as the same policy stays as sent (lines and columns point into it);
    JSON that YAML reads differently (rare) is re-exported from the data. Unpaired surrogate
    escapes, aliases and the rest are refused by the validation that follows, with lines."""
    if "\\u" in text:
        # YAML reads each \\uXXXX escape on its own, so JSON's surrogate pairs (how json.dumps
        # writes an emoji) would become two lone surrogates: validate the decoded text instead.
        try:
            text = json.dumps(data, ensure_ascii=False, indent=2)
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest("Policy document contains an unpaired UTF-16 surrogate escape",
                             code="invalid_encoding") from None
        except (ValueError, RecursionError):
            raise BadRequest("Body is not valid JSON: nested too deeply", code="invalid_json") from None
    try:
        load_policy(text)
        return text
    except PolicyError:
        pass
    if not isinstance(data, dict):
        return text
    try:
        return policy_to_yaml(build_policy(data))
    except PolicyError:
        return text     # invalid either way: validated again as text, with lines and columns


def _store(gw: "Gateway") -> Any:
    if gw.policy.store is None:
        raise Unavailable("Policies are stored in Redis, which this gateway does not use", code="policy_unavailable",
                          headers={"retry-after": "60"})
    return gw.policy.store


def _conflict(message: str, param: str | None) -> Response:
    return json_error(409, {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                      "code": "version_conflict"}})


def _redis_down(e: Exception) -> APIError:
    return Unavailable(f"The policy store cannot be reached right now ({type(e).__name__}); retry shortly",
                       code="policy_unavailable", headers={"retry-after": "1"})


def version_body(gw: "Gateway", v: Any, with_document: bool = True) -> dict[str, Any]:
    d = v.to_dict()
    if not with_document:
        d.pop("document")
    return d


async def put_policy(request: Request) -> Response:
    key = await admin_key(request)
    gw = _gw(request)
    text = await read_document(request)
    store = _store(gw)
    expected = parse_int(request.query_params.get("expected_version"), "expected_version", minimum=0,
                         code="invalid_version")
    try:
        if expected is not None:
            current = await store.current_number()
            if current != expected:
                return _conflict(f"The current version is {current}, not {expected}", "expected_version")
        version, applied = await store.apply(text, author_of(key), list(gw.deployment.engines))
    except PolicyError as e:
        return problems_response(e)
    except PolicyConflict as e:
        return _conflict(str(e), None)
    except (RedisError, OSError) as e:
        raise _redis_down(e) from e
    await gw.policy.refresh()
    return JSONResponse({"applied": applied, **version_body(gw, version)}, status_code=200)


async def get_policy(request: Request) -> Response:
    await admin_key(request)
    gw = _gw(request)
    state = gw.policy
    fmt = request.query_params.get("format")
    if fmt not in (None, "json", "yaml"):
        raise BadRequest("format must be json or yaml", param="format", code="invalid_format")
    as_yaml = fmt == "yaml" or (fmt is None and any(t in request.headers.get("accept", "") for t in YAML_TYPES))
    v = state.version
    if as_yaml:
        if v is None:
            raise NotFound("No policy is in force (the built-in default: the deployment's routing)",
                           code="policy_not_found")
        return Response(v.document, media_type="application/yaml; charset=utf-8",
                        headers={"x-tokenyard-policy-version": str(v.version), "x-tokenyard-policy-hash": v.hash,
                                 "cache-control": "no-store"})
    if v is None:
        return JSONResponse({"version": 0, "source": state.source, "hash": None, "document": None, "policy": None})
    return JSONResponse({**version_body(gw, v), "source": state.source,
                         "policy": policy_to_dict(state.policy)}, headers={"cache-control": "no-store"})


async def history(request: Request) -> Response:
    await admin_key(request)
    gw = _gw(request)
    limit = parse_int(request.query_params.get("limit") or None, "limit", minimum=1, code="invalid_limit")
    try:
        versions = await _store(gw).history(limit)
    except (RedisError, OSError) as e:
        raise _redis_down(e) from e
    return JSONResponse({"object": "list", "current": gw.policy.number,
                         "data": [version_body(gw, v) for v in versions]}, headers={"cache-control": "no-store"})


async def rollback(request: Request) -> Response:
    key = await admin_key(request)
    gw = _gw(request)
    number = parse_int(request.path_params["version"], "version", minimum=1, code="invalid_version")
    try:
        version = await _store(gw).rollback(number, author_of(key), list(gw.deployment.engines))
    except NoSuchVersion as e:
        raise NotFound(str(e.problems[0]), param="version", code="version_not_found") from None
    except PolicyError as e:
        return problems_response(e)
    except PolicyConflict as e:
        return _conflict(str(e), None)
    except (RedisError, OSError) as e:
        raise _redis_down(e) from e
    await gw.policy.refresh()
    return JSONResponse({"applied": True, **version_body(gw, version)})


async def validate(request: Request) -> Response:
    await admin_key(request)
    gw = _gw(request)
    text = await read_document(request)
    return JSONResponse(await off_loop(_validation, text, list(gw.deployment.engines), gw.policy.policy,
                                       gw.policy.number))


def _validation(text: str, engines: list[str], current: Any, number: int) -> dict[str, Any]:
    try:
        policy = check_document(text, engines)
    except PolicyError as e:
        return {"valid": False, "problems": [p.to_dict() for p in e.problems]}
    return {"valid": True, "problems": [], "hash": policy_hash(policy),
            "unchanged": current is not None and policy_hash(current) == policy_hash(policy),
            "diff": diff(current, policy, f"version {number}", "proposed")}


async def simulate_route(request: Request) -> Response:
    await admin_key(request)
    gw = _gw(request)
    text = await read_document(request)
    q = request.query_params
    limit = parse_int(q.get("limit"), "limit", default=DEFAULT_LIMIT, minimum=1, maximum=MAX_LIMIT,
                      code="invalid_limit")
    start, end = time_window(q)
    try:
        proposed = await off_loop(check_document, text, list(gw.deployment.engines))
    except PolicyError as e:
        return problems_response(e)
    result = await run_simulation(gw, proposed, start, end, limit, q.get("tenant") or None)
    return JSONResponse(result, headers={"cache-control": "no-store"})
