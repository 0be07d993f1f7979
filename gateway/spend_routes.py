"""GET /v1/spend/report and GET /v1/spend/requests: the spend ledger over HTTP.

Who sees what: a tenant's key sees its own tenant only (asking for another with `tenant=` is a
403, never an empty answer that would confirm or deny the tenant exists); an admin key sees every
tenant, or one with `tenant=`. The tenant list is decided here, before the store is read.

    GET /v1/spend/report?start&end&group_by=model|tenant|day|hour[,...]&tenant&format=json|csv
    GET /v1/spend/requests?start&end&tenant&limit&cursor
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import spend_reports as reports
from . import spend_store as store
from .api_keys import KeyRecord, check_tenant
from .edge_params import parse_int, parse_time
from .errors import BadRequest, Forbidden, Unavailable

if TYPE_CHECKING:
    from .app import Gateway

DEFAULT_DAYS = 7
MAX_PAGE = 1000


async def visible_tenants(gw: "Gateway", key: KeyRecord, requested: str | None) -> list[str]:
    if requested:
        try:
            check_tenant(requested)
        except ValueError as e:
            raise BadRequest(str(e), param="tenant", code="invalid_tenant") from None
    if not key.is_admin:
        if requested and requested != key.tenant:
            raise Forbidden("This key may only read its own tenant's spend", param="tenant",
                            code="tenant_forbidden")
        return [key.tenant]
    if requested:
        return [requested]
    try:
        return await store.all_tenants(_redis(gw), gw.deployment.redis_prefix)
    except (RedisError, OSError) as e:
        raise Unavailable("The spend ledger cannot be read right now; retry shortly", code="spend_unavailable",
                          headers={"retry-after": "1"}) from e


def time_window(params: Any) -> tuple[float, float]:
    """start/end query parameters (unix seconds, ISO 8601, or for start a span like 7d); default:
    the last 7 days up to now."""
    now = time.time()
    end = parse_time(params["end"], "end") if params.get("end") else now
    start = parse_time(params["start"], "start", now=now, relative=True) if params.get("start") \
        else max(0.0, end - DEFAULT_DAYS * 86400)
    if start >= end:
        raise BadRequest("start must be before end", param="start", code="invalid_time")
    return start, end


def _redis(gw: "Gateway") -> Any:
    if gw.ledger is None:
        raise Unavailable("The spend ledger is not configured on this gateway (no Redis)", code="spend_unavailable",
                          headers={"retry-after": "60"})
    return gw.ledger.redis


async def build_report(gw: "Gateway", tenants: list[str], start: float, end: float,
                       group_by: list[str]) -> dict[str, Any]:
    start_hour, end_hour = reports.hour_range(start, end)
    try:
        rows = await store.rollups(_redis(gw), gw.deployment.redis_prefix, tenants, start_hour, end_hour)
    except (RedisError, OSError) as e:
        raise Unavailable("The spend ledger cannot be read right now; retry shortly", code="spend_unavailable",
                          headers={"retry-after": "1"}) from e
    return {"object": "spend.report", "start": reports.iso(start_hour * 3600), "end": reports.iso(end_hour * 3600),
            "group_by": group_by, "currency": "micro-units", "baseline_engine": gw.baseline_engine,
            "data": reports.aggregate(rows, group_by), "total": reports.totals(rows), "rows": rows}


def wants_csv(request: Request) -> bool:
    fmt = request.query_params.get("format")
    if fmt is not None:
        if fmt not in ("json", "csv"):
            raise BadRequest("format must be json or csv", param="format", code="invalid_format")
        return fmt == "csv"
    return "text/csv" in request.headers.get("accept", "")


def csv_response(report: dict[str, Any], filename: str) -> Response:
    return Response(reports.to_csv(report["data"], report["group_by"]), media_type="text/csv; charset=utf-8",
                    headers={"content-disposition": f'attachment; filename="{filename}"',
                             "cache-control": "no-store"})


async def spend_report(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    key = await gw.keys.authenticate(request.headers.get("authorization"))
    q = request.query_params
    try:
        group_by = reports.parse_group_by(q.get("group_by"))
    except ValueError as e:
        raise BadRequest(str(e), param="group_by", code="invalid_group_by") from None
    start, end = time_window(q)
    as_csv = wants_csv(request)
    tenants = await visible_tenants(gw, key, q.get("tenant"))
    report = await build_report(gw, tenants, start, end, group_by)
    del report["rows"]
    if as_csv:
        return csv_response(report, f"spend-{'-'.join(group_by)}.csv")
    report["tenant"] = q.get("tenant") or (None if key.is_admin else key.tenant)
    return JSONResponse(report, headers={"cache-control": "no-store"})


async def spend_requests(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    key = await gw.keys.authenticate(request.headers.get("authorization"))
    q = request.query_params
    limit = parse_int(q.get("limit"), "limit", default=100, minimum=1, maximum=MAX_PAGE, code="invalid_limit")
    cursor = q.get("cursor") or None
    if cursor is not None:
        try:
            store.decode_cursor(cursor)
        except ValueError:
            raise BadRequest("cursor is not one this endpoint returned", param="cursor",
                             code="invalid_cursor") from None
    start = end = None
    if q.get("start") or q.get("end"):
        start, end = time_window(q)
    tenants = await visible_tenants(gw, key, q.get("tenant"))
    try:
        data, next_cursor = await store.records(_redis(gw), gw.deployment.redis_prefix, tenants,
                                                limit=limit, cursor=cursor, start=start, end=end)
    except (RedisError, OSError) as e:
        raise Unavailable("The spend ledger cannot be read right now; retry shortly", code="spend_unavailable",
                          headers={"retry-after": "1"}) from e
    return JSONResponse({"object": "list", "data": data, "next_cursor": next_cursor,
                         "has_more": next_cursor is not None}, headers={"cache-control": "no-store"})
