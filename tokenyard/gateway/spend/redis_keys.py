"""Names of the spend ledger's Redis keys (every one starts with the deployment's redis_prefix).

    {prefix}spend:{T}:seen:{request_id}   "1" with a TTL: the request id was recorded (idempotency)
    {prefix}spend:{T}:stream              stream of records, newest last; field "r" = the record's JSON
    {prefix}spend:{T}:h:{hour}            hash of one hour's rollup: "{engine}|{field}" -> integer
    {prefix}spend:{T}:hours               sorted set of the hours that have a rollup (score = member = hour)
    {prefix}spend:{T}:hd:{hour}           hash of one hour's rollup by one more dimension (key, user, route,
                                          adapter, tag:NAME): '["{dim}", "{value}", "{engine}"]|{field}' -> integer
    {prefix}spend:{T}:hv:{hour}:{dim}     set of the values of dim seen that hour (bounded: past
                                          spend.max_values_per_dimension, new values count as "(other)")
    {prefix}spend:{T}:tn:{hour}           set of the tag dimensions (tag:NAME) kept that hour (bounded: past
                                          spend.max_tag_names, a record's other tags count once, together,
                                          under tag:(other) = "(other)")
    {prefix}spend:tenants                 set of tenants with any record

T is the tenant inside braces, a Redis Cluster hash tag: everything one record touches except the
tenants index lives in one slot. `hour` is unix seconds // 3600 of the request's arrival.
"""
from __future__ import annotations

import functools
import json
from typing import Any

OTHER = "(other)"     # the value a dimension's rollup counts new values under once it holds max_values_per_dimension
FOLDED_TAGS = "tag:" + OTHER   # the dimension a record's tags past spend.max_tag_names are counted under, once
ROLLUP_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_micros",
                 "baseline_cost_micros", "errors")


def _t(prefix: str, tenant: str) -> str:
    return f"{prefix}spend:{{{tenant}}}"


def seen_key(prefix: str, tenant: str, request_id: str) -> str:
    return f"{_t(prefix, tenant)}:seen:{request_id}"


def stream_key(prefix: str, tenant: str) -> str:
    return f"{_t(prefix, tenant)}:stream"


def stream_seq_key(prefix: str) -> str:
    """One counter for every tenant's stream: the sequence part of each entry's id (spend_record.lua), so
    ids order the entries of all tenants as they were recorded."""
    return f"{prefix}spend:stream_seq"


def rollup_key(prefix: str, tenant: str, hour: int) -> str:
    return f"{_t(prefix, tenant)}:h:{hour}"


def dims_key(prefix: str, tenant: str, hour: int) -> str:
    return f"{_t(prefix, tenant)}:hd:{hour}"


def dim_values_key(prefix: str, tenant: str, hour: int, dim: str) -> str:
    return f"{_t(prefix, tenant)}:hv:{hour}:{dim}"


def tag_names_key(prefix: str, tenant: str, hour: int) -> str:
    return f"{_t(prefix, tenant)}:tn:{hour}"


def hours_key(prefix: str, tenant: str) -> str:
    return f"{_t(prefix, tenant)}:hours"


def tenants_key(prefix: str) -> str:
    return f"{prefix}spend:tenants"


def record_dimensions(rec: dict[str, Any]) -> list[tuple[str, str]]:
    """The (dimension, value) pairs a record is rolled up by besides tenant, engine and hour: its
    key id, user, route reason, LoRA adapter and each metadata tag (tag:NAME). Empty values are left out: a
    report's "" group is the rest of the total (which also covers records older than these rollups)."""
    dims = [("key", rec.get("key_id") or ""), ("user", rec.get("user") or ""),
            ("route", rec.get("route_reason") or ""), ("adapter", rec.get("lora") or "")]
    dims += [(f"tag:{k}", str(v)) for k, v in sorted((rec.get("tags") or {}).items())]
    return [(d, v) for d, v in dims if v]


# One encoder for every field prefix: json.dumps with options builds a new one per call.
_FIELD_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


@functools.lru_cache(maxsize=4096)
def dim_field_prefix(dim: str, value: str, engine: str) -> str:
    """A dimension rollup's field prefix: JSON, so any value (a user id, a tag with '|' in it) parses back.
    Cached: every record asks for the same few keys, routes and engines again (4,096 kept, the rest
    computed as before)."""
    return _FIELD_JSON.encode([dim, value, engine]) + "|"
