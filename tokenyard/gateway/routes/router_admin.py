"""The admin API for learning from traffic (admin keys only; a tenant's key gets 403 admin_required).

    POST /admin/router/artifacts        publish a router artifact (the file's JSON as the body): {"ref"}
    GET  /admin/router/artifacts        the published refs
    GET  /admin/router/shadow           the shadow report (?candidate=REF, default the policy's
                                        router.shadow; ?tenant=T): agreement, large shares, predicted
                                        prompt cost and shortfall, per router in force and tenant
    GET  /admin/router/labels           label counts per tenant (?tenant=T): never the prompts

A published artifact is named in a policy (`router.artifact` to promote it, `router.shadow` to
shadow it) and applied with PUT /admin/policy: promotion is a policy version like any other, so it
is audited and rolled back with the policy (docs/router.md). A body that is not a valid, intact
artifact is 422 `invalid_router_artifact`.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tokenyard.gateway.edge.errors import BadRequest, PayloadTooLarge, Unavailable, Unprocessable
from tokenyard.gateway.routes.policy_api import admin_key
from tokenyard.gateway.routing.artifact_store import ArtifactStore
from tokenyard.gateway.routing.shadow_tally import read_report, with_costs
from tokenyard.router_models.runtime.artifact import ArtifactError

if TYPE_CHECKING:
    from tokenyard.gateway.state import Gateway

MAX_ARTIFACT_BYTES = 16 * 1024 * 1024


def routes() -> list[Route]:
    return [Route("/admin/router/artifacts", publish, methods=["POST"]),
            Route("/admin/router/artifacts", list_artifacts, methods=["GET"]),
            Route("/admin/router/shadow", shadow_report, methods=["GET"]),
            Route("/admin/router/labels", label_counts, methods=["GET"])]


def _gw(request: Request) -> "Gateway":
    return request.app.state.gateway


def _redis(gw: "Gateway") -> Any:
    if gw.redis is None:
        raise Unavailable("Router artifacts, shadow counts and labels live in Redis, which this gateway does not use",
                          code="store_unavailable")
    return gw.redis


async def publish(request: Request) -> JSONResponse:
    gw = _gw(request)
    await admin_key(request)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_ARTIFACT_BYTES:
            raise PayloadTooLarge(f"Router artifact exceeds {MAX_ARTIFACT_BYTES} bytes", code="body_too_large")
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"Router artifact is not valid UTF-8 (byte {e.start})", code="invalid_encoding") from e
    try:
        ref = await ArtifactStore(_redis(gw), gw.deployment.redis_prefix).publish(text)
    except ArtifactError as e:
        raise Unprocessable(str(e), code="invalid_router_artifact") from e
    return JSONResponse({"ref": ref})


async def list_artifacts(request: Request) -> JSONResponse:
    gw = _gw(request)
    await admin_key(request)
    return JSONResponse({"refs": await ArtifactStore(_redis(gw), gw.deployment.redis_prefix).refs()})


def input_prices(gw: "Gateway") -> tuple[str, str, int, int] | None:
    """(small, large, their input prices per 1M tokens in micro-units) of the router in force."""
    router = gw.policy.router
    small, large = getattr(router, "small", None), getattr(router, "large", None)
    if small is None or large is None:
        return None

    def price(engine: str) -> int:
        p = gw.policy.prices.get(engine)
        if p is not None:
            return p.input
        spec = gw.deployment.engines.get(engine)
        return spec.prices.input if spec is not None else 0
    return small, large, price(small), price(large)


async def shadow_report(request: Request) -> JSONResponse:
    gw = _gw(request)
    await admin_key(request)
    redis = _redis(gw)
    policy = gw.policy.policy
    candidate = request.query_params.get("candidate") or (policy.router.shadow if policy is not None else None)
    if not candidate:
        raise BadRequest("No shadow candidate: the policy in force sets no router.shadow; name one with ?candidate=REF",
                         param="candidate", code="no_shadow_candidate")
    await gw.learning.flush()           # this gateway's counts up to now
    report = await read_report(redis, gw.deployment.redis_prefix, candidate, request.query_params.get("tenant"))
    prices = input_prices(gw)
    if prices is not None:
        small, large, p_small, p_large = prices
        report["prices"] = {"small": small, "large": large, "small_input_micros": p_small,
                            "large_input_micros": p_large}
        for row in [*report["rows"], report["total"]]:
            with_costs(row, p_small, p_large)
    return JSONResponse(report)


async def label_counts(request: Request) -> JSONResponse:
    gw = _gw(request)
    await admin_key(request)
    store = gw.learning.store
    if store is None:
        _redis(gw)
    assert store is not None
    wanted = request.query_params.get("tenant")
    tenants = [wanted] if wanted else await store.tenants()
    out = {}
    for tenant in tenants:
        counts = Counter(str(v.get("label")) for v in (await store.labels(tenant)).values())
        out[tenant] = {"labels": sum(counts.values()), "small_enough": counts.get("1", 0),
                       "large_needed": counts.get("0", 0), "no_signal": counts.get("None", 0)}
    return JSONResponse({"tenants": out})
