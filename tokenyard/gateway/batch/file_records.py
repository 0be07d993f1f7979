"""Batch API file metadata in Redis, one tenant's files invisible to every other tenant.

Redis layout (every name starts with the deployment's `redis_prefix`):
    {prefix}file:{file_id}        hash: id, tenant, bytes, created_at, filename, purpose, lines, urls
    {prefix}files:{tenant}        sorted set: file ids by creation time (µs), for listing
    {prefix}file:{file_id}:users  set: ids of the open batches whose input it is (none: deletable)

A record is written only after its bytes are durable in the storage (file_storage.py), and
removed before they are deleted, so a record never names bytes that are gone. A lookup with the
wrong tenant answers like a missing file: 404, never "this is someone else's".

A file stays while any open batch reads it: each batch's id joins the file's users set in the same
transaction that creates the batch (and only if the file record still exists), and leaves it in
the same script that moves the batch to a final status; DELETE removes the record only when that
set is empty, in one script. So no order of creates, cancels and deletes leaves an open batch
without its input (issue 46.3: a single `used_by` id was overwritten by the next batch).
"""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenyard.gateway.batch.file_names import safe_filename
from tokenyard.gateway.edge.errors import NotFound

PURPOSES = ("batch", "batch_output")
_LUA = Path(__file__).resolve().parent / "lua"


@dataclass(slots=True)
class FileRecord:
    id: str
    tenant: str
    bytes: int
    created_at: int                 # unix seconds
    filename: str
    purpose: str                    # "batch" (uploaded input) or "batch_output" (a batch's output / error file)
    lines: int = 0                  # requests in an input file
    urls: dict[str, int] = field(default_factory=dict)   # input: url -> the first line using it
    created_us: int = 0             # creation time in µs: the listing order

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "status_details": None, "expires_at": None}

    def to_redis(self) -> dict[str, str]:
        return {"id": self.id, "tenant": self.tenant, "bytes": str(self.bytes), "created_at": str(self.created_at),
                "filename": self.filename, "purpose": self.purpose, "lines": str(self.lines),
                "urls": json.dumps(self.urls), "created_us": str(self.created_us)}

    @classmethod
    def from_redis(cls, raw: dict[bytes, bytes]) -> "FileRecord":
        d = {k.decode(): v.decode() for k, v in raw.items()}
        # safe_filename again: records stored before upload names were normalised (file_names.py).
        return cls(id=d["id"], tenant=d["tenant"], bytes=int(d["bytes"]), created_at=int(d["created_at"]),
                   filename=safe_filename(d["filename"]), purpose=d["purpose"], lines=int(d.get("lines") or 0),
                   urls=json.loads(d.get("urls") or "{}"), created_us=int(d.get("created_us") or 0))


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_record(file_id: str, tenant: str, size: int, filename: str, purpose: str, lines: int = 0,
               urls: dict[str, int] | None = None) -> FileRecord:
    now_us = time.time_ns() // 1000
    return FileRecord(file_id, tenant, size, now_us // 1_000_000, filename, purpose, lines, dict(urls or {}), now_us)


class FileRecords:
    def __init__(self, redis: Any, prefix: str) -> None:
        self.redis = redis
        self.prefix = prefix
        self._remove = redis.register_script((_LUA / "remove_unused_file.lua").read_text())

    def _key(self, file_id: str) -> str:
        return f"{self.prefix}file:{file_id}"

    def _index(self, tenant: str) -> str:
        return f"{self.prefix}files:{tenant}"

    async def put(self, rec: FileRecord) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self._key(rec.id), mapping=rec.to_redis())
        pipe.zadd(self._index(rec.tenant), {rec.id: rec.created_us})
        await pipe.execute()

    async def get(self, tenant: str, file_id: str) -> FileRecord:
        """The tenant's file, or 404 (also when it is another tenant's)."""
        raw = await self.redis.hgetall(self._key(file_id)) if _plausible(file_id) else {}
        if not raw:
            raise _missing(file_id)
        rec = FileRecord.from_redis(raw)
        if rec.tenant != tenant:
            raise _missing(file_id)
        return rec

    def key(self, file_id: str) -> str:
        return self._key(file_id)

    def users_key(self, file_id: str) -> str:
        return users_key(self.prefix, file_id)

    async def users_of(self, file_id: str) -> set[str]:
        """Ids of the batches that read this file: added atomically with each batch (BatchStore.create),
        removed as each reaches a final status (lua/transition.lua). `used_by` is the single id that
        records written before the set kept."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.smembers(self.users_key(file_id))
        pipe.hget(self._key(file_id), "used_by")
        members, legacy = await pipe.execute()
        users = {m.decode() for m in members}
        if legacy:
            users.add(legacy.decode())
        return users

    async def release(self, file_id: str, batch_id: str) -> None:
        """Forget a listed user found final or gone (a batch's final move releases it by itself; this
        clears what that could not: the `used_by` of older records, a batch record removed by hand)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.srem(self.users_key(file_id), batch_id)
        pipe.hget(self._key(file_id), "used_by")
        _, legacy = await pipe.execute()
        if legacy and legacy.decode() == batch_id:
            await self.redis.hdel(self._key(file_id), "used_by")

    async def remove_unused(self, rec: FileRecord) -> bool:
        """Remove the record unless a batch uses the file (one atomic step, so a batch created at the
        same moment either sees no file or keeps it); False when in use."""
        keys = [self._key(rec.id), self._index(rec.tenant), self.users_key(rec.id)]
        return bool(await self._remove(keys=keys, args=[rec.id]))

    async def list(self, tenant: str, purpose: str | None, limit: int, descending: bool,
                   after: str | None) -> tuple[list[FileRecord], bool]:
        """One page of the tenant's files (newest first when descending), after the file `after`;
        and whether more follow."""
        index = self._index(tenant)
        start = 0
        if after is not None:
            rank = await (self.redis.zrevrank(index, after) if descending else self.redis.zrank(index, after))
            if rank is None:
                raise NotFound(f"No such file: {after}", param="after", code="file_not_found")
            start = rank + 1
        out: list[FileRecord] = []
        page = max(limit * 2, 100)
        while len(out) <= limit:
            ids = await self.redis.zrange(index, start, start + page - 1, desc=descending)
            if not ids:
                break
            start += len(ids)
            pipe = self.redis.pipeline(transaction=False)
            for file_id in ids:
                pipe.hgetall(self._key(file_id.decode()))
            for raw in await pipe.execute():
                if raw:
                    rec = FileRecord.from_redis(raw)
                    if purpose is None or rec.purpose == purpose:
                        out.append(rec)
        return out[:limit], len(out) > limit


def users_key(prefix: str, file_id: str) -> str:
    """The set of open batches reading the file (batch_store.py adds and removes them)."""
    return f"{prefix}file:{file_id}:users"


def _plausible(file_id: str) -> bool:
    return isinstance(file_id, str) and 0 < len(file_id) <= 64 and file_id.isascii()


def _missing(file_id: str) -> NotFound:
    return NotFound(f"No such file: {file_id}", param="file_id", code="file_not_found")
