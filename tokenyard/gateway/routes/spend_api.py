"""GET /v1/spend/report and GET /v1/spend/requests: the spend ledger over HTTP.

Visibility (a tenant's key sees its own tenant, an admin key every tenant) is decided by
spend_queries.visible_tenants before the store is read.

    GET /v1/spend/report?start&end&group_by=model|tenant|day|hour|key|user|route|adapter|tag:NAME[,...]&tenant&format=json|csv
    GET /v1/spend/requests?start&end&tenant&limit&cursor
"""
from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokenyard.gateway.edge.edge_params import parse_int
from tokenyard.gateway.edge.errors import BadRequest, Unavailable
from tokenyard.gateway.routes.spend_queries import (
    build_report,
    csv_response,
    ledger_redis,
    time_window,
    visible_tenants,
    wants_csv,
)
from tokenyard.gateway.spend import reports as reports
from tokenyard.gateway.spend import store as store

if TYPE_CHECKING:
    from tokenyard.gateway.state import Gateway

MAX_PAGE = 1000


def routes() -> list[Route]:
    return [Route("/v1/spend/report", spend_report, methods=["GET"]),
            Route("/v1/spend/requests", spend_requests, methods=["GET"])]


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
        return await csv_response(report, f"spend-{'-'.join(group_by)}.csv")
    report["tenant"] = q.get("tenant") or (None if key.is_admin else key.tenant)
    body = await asyncio.to_thread(encode_report, report)
    return Response(body, media_type="application/json", headers={"cache-control": "no-store"})


def encode_report(report: dict) -> bytes:
    """The report as JSON, a row at a time: a report grouped by two dimensions may have 100,000 rows,
    and json.dumps holds the GIL for the whole of one call (~0.3 s for 40,000 rows), so even in a
    worker thread one call would stall the event loop; many small calls let it run between rows."""
    head = {k: v for k, v in report.items() if k != "data"}
    rows = [json.dumps(row, ensure_ascii=False, separators=(",", ":")) for row in report["data"]]
    text = json.dumps(head, ensure_ascii=False, separators=(",", ":"))
    return (text[:-1] + (',' if head else '') + '"data":[' + ",".join(rows) + "]}").encode()


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
        data, next_cursor = await store.records(ledger_redis(gw), gw.deployment.redis_prefix, tenants,
                                                limit=limit, cursor=cursor, start=start, end=end)
    except (RedisError, OSError) as e:
        raise Unavailable("The spend ledger cannot be read right now; retry shortly", code="spend_unavailable",
                          headers={"retry-after": "1"}) from e
    return JSONResponse({"object": "list", "data": data, "next_cursor": next_cursor,
                         "has_more": next_cursor is not None}, headers={"cache-control": "no-store"})
