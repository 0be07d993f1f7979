"""Reading the spend ledger back: hourly rollups for reports, per-request records for drill-down.

Both take the tenants to read explicitly; deciding which tenants a caller may see is the
endpoints' job (tokenyard/gateway/routes/spend_api.py, tokenyard/gateway/web/dashboard.py), so a reader here can never
widen a caller's view by itself. Works with a redis.asyncio client (the gateway and the CLI).
"""
from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

from tokenyard.gateway.edge.edge_params import parse_stream_id
from tokenyard.gateway.spend.redis_keys import ROLLUP_FIELDS, dims_key, hours_key, rollup_key, stream_key, tenants_key
from tokenyard.gateway.spend.usage import expand

SCAN_BATCH = 200


@dataclass(slots=True)
class RollupRow:
    tenant: str
    engine: str
    hour: int                     # unix seconds // 3600
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_micros: int = 0
    baseline_cost_micros: int = 0
    errors: int = 0
    dim: str | None = None        # a dimension rollup's row: "key", "user", "route" or "tag:NAME" ...
    value: str = ""               # ... and its value ("(other)": values past the per-hour bound)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


async def all_tenants(redis: Any, prefix: str) -> list[str]:
    return sorted(_s(t) for t in await redis.smembers(tenants_key(prefix)))


async def rollups(redis: Any, prefix: str, tenants: list[str], start_hour: int, end_hour: int) -> list[RollupRow]:
    """Rows of every (tenant, engine, hour) with start_hour <= hour < end_hour."""
    if not tenants or end_hour <= start_hour:
        return []
    pipe = redis.pipeline(transaction=False)
    for t in tenants:
        pipe.zrangebyscore(hours_key(prefix, t), start_hour, end_hour - 1)
    hours_by_tenant = await pipe.execute()
    wanted = [(t, int(_s(h))) for t, hours in zip(tenants, hours_by_tenant) for h in hours]
    if not wanted:
        return []
    pipe = redis.pipeline(transaction=False)
    for t, h in wanted:
        pipe.hgetall(rollup_key(prefix, t, h))
    return await asyncio.to_thread(_rows, wanted, await pipe.execute())


def _rows(wanted: list[tuple[str, int]], raws: list[dict[Any, Any]]) -> list[RollupRow]:
    out: list[RollupRow] = []
    for (t, h), raw in zip(wanted, raws):
        by_engine: dict[str, RollupRow] = {}
        for k, v in raw.items():
            engine, _, name = _s(k).rpartition("|")
            if name in ROLLUP_FIELDS:
                row = by_engine.setdefault(engine, RollupRow(t, engine, h))
                setattr(row, name, int(_s(v)))
        out.extend(by_engine[e] for e in sorted(by_engine))
    return out


async def dim_rollups(redis: Any, prefix: str, tenants: list[str], start_hour: int, end_hour: int,
                     dim: str) -> list[RollupRow]:
    """Rows of every (tenant, engine, hour, value of dim) with start_hour <= hour < end_hour. Records
    without a value for dim (and records older than these rollups) are not in them."""
    if not tenants or end_hour <= start_hour:
        return []
    pipe = redis.pipeline(transaction=False)
    for t in tenants:
        pipe.zrangebyscore(hours_key(prefix, t), start_hour, end_hour - 1)
    wanted = [(t, int(_s(h))) for t, hours in zip(tenants, await pipe.execute()) for h in hours]
    if not wanted:
        return []
    pipe = redis.pipeline(transaction=False)
    for t, h in wanted:
        pipe.hgetall(dims_key(prefix, t, h))
    # Parsed in a worker thread: a tenant-hour may hold many thousand fields (JSON heads to decode).
    return await asyncio.to_thread(_dim_rows, wanted, await pipe.execute(), dim)


def _dim_rows(wanted: list[tuple[str, int]], raws: list[dict[Any, Any]], dim: str) -> list[RollupRow]:
    out: list[RollupRow] = []
    for (t, h), raw in zip(wanted, raws):
        rows: dict[tuple[str, str], RollupRow] = {}
        for k, v in raw.items():
            head, _, name = _s(k).rpartition("|")
            if name not in ROLLUP_FIELDS:
                continue
            d, value, engine = json.loads(head)
            if d != dim:
                continue
            row = rows.setdefault((engine, value), RollupRow(t, engine, h, dim=dim, value=value))
            setattr(row, name, int(_s(v)))
        out.extend(rows[k] for k in sorted(rows))
    return out


_SURROGATE = re.compile("[\ud800-\udfff]")


def readable(value: Any) -> Any:
    """A stored record with every unpaired surrogate (kept by json.dumps as a \\ud800 escape, so
    it round-trips through Redis but can never be encoded as UTF-8 in a reply) replaced by U+FFFD:
    one such record, written before the edge refused them, must not break every page it is on."""
    if isinstance(value, str):
        return value if value.isascii() else _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {readable(k): readable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [readable(v) for v in value]
    return value


def _field(fields: dict[Any, Any], name: str) -> Any:
    return fields[name.encode()] if name.encode() in fields else fields.get(name)


def stream_record(fields: dict[Any, Any]) -> dict[str, Any]:
    """One request-stream entry as its usage record. The ledger's script stores the record without
    its tags ('r'), the tags whose name the rollups keep ('t') and how many were folded into
    "(other)" ('x', absent when none), and leaves out the fields at their default (usage.compact).
    Entries written before that kept every field and tag inside 'r'."""
    rec: dict[str, Any] = expand(json.loads(_field(fields, "r")))
    kept = _field(fields, "t")
    tags = json.loads(kept) if kept is not None else {}
    rec["tags"] = {**(rec.get("tags") or {}), **(tags if isinstance(tags, dict) else {})}
    folded = _field(fields, "x")
    if folded is not None:
        rec["tags_folded"] = int(folded)
    return rec


def _sid(raw: Any) -> tuple[int, int]:
    ms, _, seq = _s(raw).partition("-")
    return int(ms), int(seq or 0)


def encode_cursor(sid: tuple[int, int], tenant: str) -> str:
    return f"{sid[0]}-{sid[1]}.{tenant}"


def decode_cursor(cursor: str) -> tuple[tuple[int, int], str]:
    """ValueError on anything malformed."""
    sid, sep, tenant = cursor.partition(".")
    if not sep:
        raise ValueError("bad cursor")
    return parse_stream_id(sid), tenant


async def records(redis: Any, prefix: str, tenants: list[str], *, limit: int, cursor: str | None = None,
                  start: float | None = None, end: float | None = None,
                  max_scan: int = 20_000) -> tuple[list[dict[str, Any]], str | None]:
    """Newest first, across the tenants' streams merged by stream id (ties: tenant name).

    Returns (records, next_cursor); next_cursor is None when nothing older is left. At most
    max_scan entries are examined per call (a narrow time filter on a long stream returns fewer
    than `limit` records and a cursor to continue from), so one call's work stays bounded."""
    pos = decode_cursor(cursor) if cursor else None
    out: list[dict[str, Any]] = []
    scanned = 0
    while True:
        fetched: dict[str, list[tuple[tuple[int, int], dict[str, Any]]]] = {}
        pipe = redis.pipeline(transaction=False)
        for t in tenants:
            if pos is None:
                hi = "+"
            else:
                sid = f"{pos[0][0]}-{pos[0][1]}"
                hi = sid if t > pos[1] else "(" + sid
            pipe.xrevrange(stream_key(prefix, t), max=hi, min="-", count=SCAN_BATCH)
        for t, entries in zip(tenants, await pipe.execute()):
            fetched[t] = [(_sid(i), fields) for i, fields in entries]
        merged = sorted(((sid, t, f) for t, items in fetched.items() for sid, f in items),
                        key=lambda x: (-x[0][0], -x[0][1], x[1]))
        if not merged:
            return out, None
        # Entries past the last one fetched from a full batch may be missing: walk only up to it.
        horizons = [(-items[-1][0][0], -items[-1][0][1], t) for t, items in fetched.items()
                    if len(items) == SCAN_BATCH]
        horizon = min(horizons) if horizons else None
        for sid, t, fields in merged:
            if horizon is not None and (-sid[0], -sid[1], t) > horizon:
                break
            pos = (sid, t)
            scanned += 1
            rec = readable(stream_record(fields))
            if (start is None or rec["time"] >= start) and (end is None or rec["time"] < end):
                out.append(rec)
                if len(out) >= limit:
                    return out, encode_cursor(*pos)
            if scanned >= max_scan:
                return out, encode_cursor(*pos)
        if horizon is None:
            return out, None
        # A pipeline whose reply is already buffered returns without yielding: without this, a
        # 10,000-record page (0.4 s of parsing) would run on the loop in one piece.
        await asyncio.sleep(0)
