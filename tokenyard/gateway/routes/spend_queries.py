"""Reading the spend ledger for a caller: which tenants a key may see, the time window asked for, and
the report built from the hourly rollups. Shared by the spend API (spend_api.py) and the pages
(web/dashboard.py, policy_api.py), so the visibility rule lives in one place.

Who sees what: a tenant's key sees its own tenant only (asking for another with `tenant=` is a
403, never an empty answer that would confirm or deny the tenant exists); an admin key sees every
tenant, or one with `tenant=`. The tenant list is decided here, before the store is read.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response

from tokenyard.gateway.auth.api_keys import KeyRecord, check_tenant, record_name
from tokenyard.gateway.edge.edge_params import parse_time
from tokenyard.gateway.edge.errors import BadRequest, Forbidden, Unavailable
from tokenyard.gateway.spend import reports as reports
from tokenyard.gateway.spend import store as store
from tokenyard.gateway.spend.redis_keys import OTHER

if TYPE_CHECKING:
    from tokenyard.gateway.state import Gateway

DEFAULT_DAYS = 7


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
        return await store.all_tenants(ledger_redis(gw), gw.deployment.redis_prefix)
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


def ledger_redis(gw: "Gateway") -> Any:
    if gw.ledger is None:
        raise Unavailable("The spend ledger is not configured on this gateway (no Redis)", code="spend_unavailable",
                          headers={"retry-after": "60"})
    return gw.ledger.redis


MAX_STREAM_REPORT = 200_000    # records one stream-sourced report may read


async def build_report(gw: "Gateway", tenants: list[str], start: float, end: float,
                       group_by: list[str]) -> dict[str, Any]:
    start_hour, end_hour = reports.hour_range(start, end)
    try:
        data, total, source, rows = await read_report(ledger_redis(gw), gw.deployment.redis_prefix, tenants,
                                                      start_hour, end_hour, group_by)
    except (RedisError, OSError) as e:
        raise Unavailable("The spend ledger cannot be read right now; retry shortly", code="spend_unavailable",
                          headers={"retry-after": "1"}) from e
    return {"object": "spend.report", "start": reports.iso(start_hour * 3600), "end": reports.iso(end_hour * 3600),
            "group_by": group_by, "currency": "micro-units", "baseline_engine": gw.baseline_engine,
            "source": source, "data": data, "total": total, "rows": rows}


async def read_report(redis: Any, prefix: str, tenants: list[str], start_hour: int, end_hour: int,
                      group_by: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any], str, list[store.RollupRow]]:
    """(groups, total, source, base rollup rows): from the hourly rollups, with at most one dimension
    among key, user, route, adapter, tag:NAME; else from the request stream (exact within its retention; at
    most MAX_STREAM_REPORT records, BadRequest past that). Grouped by key, rows name their key.

    The grouping runs in a worker thread (asyncio.to_thread), as does the parsing of the rollups
    (store.py): 200,000 stream records are seconds of Python, which on the event loop would stall
    /health, streams and every other request for as long."""
    dims = reports.dimensions(group_by)
    rows = await store.rollups(redis, prefix, tenants, start_hour, end_hour)
    if not dims:
        data, total = await asyncio.to_thread(lambda: (reports.aggregate(rows, group_by), reports.totals(rows)))
        return data, total, "rollups", rows
    if len(dims) == 1:
        dim_rows = await store.dim_rollups(redis, prefix, tenants, start_hour, end_hour, dims[0])
        data, total = await asyncio.to_thread(
            lambda: (reports.aggregate_with_dimension(rows, dim_rows, group_by), reports.totals(rows)))
        return await _named(redis, prefix, data, group_by), total, "rollups", rows
    data, total = await stream_report(redis, prefix, tenants, start_hour * 3600, end_hour * 3600, group_by)
    return await _named(redis, prefix, data, group_by), total, "stream", rows


async def _named(redis: Any, prefix: str, data: list[dict[str, Any]], group_by: list[str]) -> list[dict[str, Any]]:
    """Rows grouped by key get the key's name (one pipelined read of the key records). The ids come
    from the tenants' own rollups, so a name shown is always one of the caller's visible tenants' keys."""
    if "key" not in group_by:
        return data
    ids = sorted({row["key"] for row in data} - {reports.NONE, OTHER})
    names: dict[str, str] = {}
    if ids:
        pipe = redis.pipeline(transaction=False)
        for key_id in ids:
            pipe.hget(record_name(prefix, key_id), "name")
        for key_id, name in zip(ids, await pipe.execute()):
            if name:
                names[key_id] = name.decode() if isinstance(name, bytes) else str(name)
    return reports.with_key_names(data, names)


async def stream_report(redis: Any, prefix: str, tenants: list[str], start: float, end: float,
                        group_by: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(groups, total) of every record in [start, end) from the tenants' streams, grouped a page at a
    time in a worker thread; a 400 past MAX_STREAM_REPORT records."""
    acc = reports.RecordGroups(group_by)
    cursor = None
    while True:
        page, cursor = await store.records(redis, prefix, tenants, limit=10_000, cursor=cursor, start=start, end=end)
        await asyncio.to_thread(acc.add, page)
        if acc.count > MAX_STREAM_REPORT:
            raise BadRequest(f"this grouping reads the request stream, and the window holds more than "
                             f"{MAX_STREAM_REPORT} records; narrow start/end or group by at most one of key, user, "
                             "route, tag:NAME (those come from the rollups)", param="group_by", code="report_too_large")
        if cursor is None:
            return await asyncio.to_thread(acc.rows), reports.derive(acc.total)


def wants_csv(request: Request) -> bool:
    fmt = request.query_params.get("format")
    if fmt is not None:
        if fmt not in ("json", "csv"):
            raise BadRequest("format must be json or csv", param="format", code="invalid_format")
        return fmt == "csv"
    return "text/csv" in request.headers.get("accept", "")


async def csv_response(report: dict[str, Any], filename: str) -> Response:
    """The report as CSV, written in a worker thread (as large as the report)."""
    text = await asyncio.to_thread(reports.to_csv, report["data"], report["group_by"])
    return Response(text, media_type="text/csv; charset=utf-8",
                    headers={"content-disposition": f'attachment; filename="{filename}"',
                             "cache-control": "no-store"})
