"""Names of the spend ledger's Redis keys (every one starts with the deployment's redis_prefix).

    {prefix}spend:{T}:seen:{request_id}   "1" with a TTL: the request id was recorded (idempotency)
    {prefix}spend:{T}:stream              stream of records, newest last; field "r" = the record's JSON
    {prefix}spend:{T}:h:{hour}            hash of one hour's rollup: "{engine}|{field}" -> integer
    {prefix}spend:{T}:hours               sorted set of the hours that have a rollup (score = member = hour)
    {prefix}spend:tenants                 set of tenants with any record

T is the tenant inside braces, a Redis Cluster hash tag: everything one record touches except the
tenants index lives in one slot. `hour` is unix seconds // 3600 of the request's arrival.
"""
from __future__ import annotations

ROLLUP_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_micros",
                 "baseline_cost_micros", "errors")


def _t(prefix: str, tenant: str) -> str:
    return f"{prefix}spend:{{{tenant}}}"


def seen_key(prefix: str, tenant: str, request_id: str) -> str:
    return f"{_t(prefix, tenant)}:seen:{request_id}"


def stream_key(prefix: str, tenant: str) -> str:
    return f"{_t(prefix, tenant)}:stream"


def rollup_key(prefix: str, tenant: str, hour: int) -> str:
    return f"{_t(prefix, tenant)}:h:{hour}"


def hours_key(prefix: str, tenant: str) -> str:
    return f"{_t(prefix, tenant)}:hours"


def tenants_key(prefix: str) -> str:
    return f"{prefix}spend:tenants"
