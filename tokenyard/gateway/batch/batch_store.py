"""Batches in Redis: their records, status changes, per-line answers and which gateway runs them.

Redis layout (every name starts with the deployment's `redis_prefix`):
    {prefix}batch:{id}            hash: the batch (status, timestamps, files, counts, tenant, key id)
    {prefix}batches:{tenant}      sorted set: batch ids by creation time (µs), for listing
    {prefix}batches:open          set: ids of batches not yet final (a gateway resumes these)
    {prefix}batch:{id}:answers    hash: line index -> "o"/"e" + the output/error file line (while it runs)
    {prefix}batch:{id}:lease      string: the id of the gateway running it, expiring after batch.lease_s

Exactly once: a line's answer and its count go in together by one script (lua/record_line.lua)
that refuses a line already answered, so a restart, a second gateway or a retry can never answer
a line twice; a line not in the answers hash was never answered and is run (again). Status moves
are compare-and-set (lua/transition.lua), so a cancel and a finish racing each other leave one
consistent outcome; reaching a final status drops the answers hash (they are in the files by then)
and, in the same script, takes the batch out of its input file's users set (file_records.py), so
the file can be deleted exactly when no open batch reads it.
"""
from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

from redis.exceptions import WatchError

from tokenyard.gateway.batch.file_records import users_key
from tokenyard.gateway.edge.errors import NotFound

_LUA = Path(__file__).resolve().parent / "lua"
FINAL = ("completed", "failed", "expired", "cancelled")
OPEN = ("validating", "in_progress", "finalizing", "cancelling")
_WATCH_TRIES = 5    # a file record changes only by its own DELETE: a second round always settles it
_TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
          "expired_at", "cancelling_at", "cancelled_at")


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


class BatchStore:
    def __init__(self, redis: Any, prefix: str) -> None:
        self.redis = redis
        self.prefix = prefix
        self._record = redis.register_script((_LUA / "record_line.lua").read_text())
        self._transition = redis.register_script((_LUA / "transition.lua").read_text())
        self._lease = redis.register_script((_LUA / "lease.lua").read_text())

    def key(self, batch_id: str) -> str:
        return f"{self.prefix}batch:{batch_id}"

    def _answers(self, batch_id: str) -> str:
        return f"{self.prefix}batch:{batch_id}:answers"

    def _index(self, tenant: str) -> str:
        return f"{self.prefix}batches:{tenant}"

    @property
    def _open(self) -> str:
        return f"{self.prefix}batches:open"

    # -- records -------------------------------------------------------------------------------
    async def create(self, fields: dict[str, Any], input_key: str | None = None) -> bool:
        """fields: id, tenant, key_id, endpoint, input_file_id, completion_window, total, metadata.
        input_key: the input file's record; the batch is created (and joins the file's users set) only
        while it exists, in one transaction: False when the file was deleted meanwhile."""
        now_us = time.time_ns() // 1000
        rec = {**{k: "" for k in _TIMES}, "status": "validating", "completed": 0, "failed": 0,
               "output_file_id": "", "error_file_id": "", "errors": "", "created_us": now_us,
               "created_at": now_us // 1_000_000, "expires_at": now_us // 1_000_000 + 24 * 3600}
        rec.update(fields)
        rec["metadata"] = json.dumps(fields.get("metadata"))
        for _ in range(_WATCH_TRIES):
            async with self.redis.pipeline(transaction=True) as pipe:
                if input_key is not None:
                    # WATCH: a DELETE of the file (lua/remove_unused_file.lua) between this check and
                    # EXEC aborts the transaction, and the next round sees the file gone.
                    await pipe.watch(input_key)
                    if not await pipe.exists(input_key):
                        return False
                    pipe.multi()
                    pipe.sadd(users_key(self.prefix, rec["input_file_id"]), rec["id"])
                pipe.hset(self.key(rec["id"]), mapping={k: str(v) for k, v in rec.items()})
                pipe.zadd(self._index(rec["tenant"]), {rec["id"]: now_us})
                pipe.sadd(self._open, rec["id"])
                try:
                    await pipe.execute()
                    return True
                except WatchError:
                    continue
        raise WatchError(f"batch {rec['id']}: its input file kept changing")

    async def get(self, batch_id: str, tenant: str | None = None) -> dict[str, str]:
        """The batch's fields; 404 when absent or (tenant given) another tenant's."""
        raw = await self.redis.hgetall(self.key(batch_id)) if _plausible(batch_id) else {}
        rec = {k.decode(): v.decode() for k, v in raw.items()}
        if not rec or (tenant is not None and rec.get("tenant") != tenant):
            raise NotFound(f"No such batch: {batch_id}", param="batch_id", code="batch_not_found")
        return rec

    async def set_fields(self, batch_id: str, **values: Any) -> None:
        await self.redis.hset(self.key(batch_id), mapping={k: str(v) for k, v in values.items()})

    async def set_if_empty(self, batch_id: str, field: str, value: str) -> str:
        """The field's value, set to `value` first if it was empty (an output file id chosen once)."""
        key = self.key(batch_id)
        current = await self.redis.hget(key, field)
        if current:
            return current.decode()
        # Two finalizers at once (after a lease expired mid-finalize) must agree on one id.
        pipe = self.redis.pipeline(transaction=True)
        await pipe.watch(key)
        current = await pipe.hget(key, field)
        if current:
            await pipe.reset()
            return current.decode()
        pipe.multi()
        pipe.hset(key, field, value)
        try:
            await pipe.execute()
        except Exception:  # noqa: BLE001 - WatchError: someone else set it; read theirs
            return (await self.redis.hget(key, field) or b"").decode()
        return value

    async def list(self, tenant: str, limit: int, after: str | None) -> tuple[list[dict[str, str]], bool]:
        """One page of the tenant's batches, newest first, after the batch `after`; and whether more follow."""
        index = self._index(tenant)
        start = 0
        if after is not None:
            rank = await self.redis.zrevrank(index, after)
            if rank is None:
                raise NotFound(f"No such batch: {after}", param="after", code="batch_not_found")
            start = rank + 1
        ids = await self.redis.zrange(index, start, start + limit, desc=True)
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in ids[:limit]:
            pipe.hgetall(self.key(batch_id.decode()))
        recs = [{k.decode(): v.decode() for k, v in raw.items()} for raw in await pipe.execute() if raw]
        return recs, len(ids) > limit

    async def open_ids(self) -> list[str]:
        return sorted(m.decode() for m in await self.redis.smembers(self._open))

    # -- status --------------------------------------------------------------------------------
    async def move(self, batch_id: str, to: str, allowed: tuple[str, ...], time_field: str = "") -> bool:
        """Compare and set: to `to` if the status is one of `allowed` (stamping `time_field`)."""
        args = [batch_id, to, time_field, int(time.time()), "1" if to in FINAL else "0", *allowed]
        keys = [self.key(batch_id), self._open, self._answers(batch_id)]
        if to in FINAL:     # the input file is free once no open batch reads it (file_records.py)
            file_id = await self.redis.hget(self.key(batch_id), "input_file_id")
            if file_id:
                keys.append(users_key(self.prefix, file_id.decode()))
        return bool(await self._transition(keys=keys, args=args))

    # -- answers -------------------------------------------------------------------------------
    async def answer(self, batch_id: str, index: int, ok: bool, line: str) -> bool:
        """Record line `index`'s answer unless it has one; True when recorded now."""
        keys = [self._answers(batch_id), self.key(batch_id)]
        return bool(await self._record(keys=keys, args=[index, "o" if ok else "e", line]))

    async def answered(self, batch_id: str) -> set[int]:
        return {int(f) for f in await self.redis.hkeys(self._answers(batch_id))}

    async def answers(self, batch_id: str, start: int, stop: int) -> list[bytes | None]:
        """Answers of lines [start, stop), each b"o..." / b"e..." or None when unanswered."""
        if stop <= start:
            return []
        return await self.redis.hmget(self._answers(batch_id), [str(i) for i in range(start, stop)])

    # -- who runs it ---------------------------------------------------------------------------
    async def hold(self, batch_id: str, owner: str, lease_s: float) -> bool:
        """Claim or renew this gateway's lease on running the batch; False when another holds it."""
        return bool(await self._lease(keys=[self.key(batch_id) + ":lease"], args=[owner, int(lease_s * 1000), "1"]))

    async def release(self, batch_id: str, owner: str) -> None:
        await self._lease(keys=[self.key(batch_id) + ":lease"], args=[owner, 0, "0"])


def to_openai(rec: dict[str, str]) -> dict[str, Any]:
    """OpenAI's Batch object from the stored fields."""
    def ts(name: str) -> int | None:
        return int(rec[name]) if rec.get(name) else None

    completed, failed = int(rec.get("completed") or 0), int(rec.get("failed") or 0)
    return {"id": rec["id"], "object": "batch", "endpoint": rec["endpoint"],
            "errors": json.loads(rec["errors"]) if rec.get("errors") else None,
            "input_file_id": rec["input_file_id"], "completion_window": rec["completion_window"],
            "status": rec["status"], "output_file_id": rec.get("output_file_id") or None,
            "error_file_id": rec.get("error_file_id") or None,
            **{name: ts(name) for name in _TIMES},
            "request_counts": {"total": int(rec.get("total") or 0), "completed": completed, "failed": failed},
            "metadata": json.loads(rec["metadata"]) if rec.get("metadata") else None}


def _plausible(batch_id: str) -> bool:
    return isinstance(batch_id, str) and 0 < len(batch_id) <= 64 and batch_id.isascii()
