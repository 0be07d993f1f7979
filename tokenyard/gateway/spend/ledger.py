"""The spend ledger: every usage record into Redis exactly once, with its hourly rollup.

    ledger = SpendLedger(redis_url, prefix, cfg, metrics)
    await ledger.start()          # also replays whatever a previous run left in the spool
    ledger(record)                # the usage sink: never blocks, never raises
    await ledger.stop()           # writes what is queued (to Redis, else to the spool)

One Lua script (tokenyard/gateway/spend/lua/spend_record.lua) per record does, atomically: the idempotency check
on the request id (SET NX with a TTL), the stream entry (XADD MAXLEN ~ with an id whose sequence is shared by
every tenant's stream, so entries are ordered as recorded across tenants; XTRIM MINID ~), and the
rollup counters of (tenant, engine, hour) and of each dimension (key, user, route, adapter, each tag: values
and tag names bounded per tenant-hour, the rest under "(other)"). So a rollup can never disagree with the records, and
replaying a record twice changes nothing.

Records are written off the request path by one writer task, in batches (a pipeline of EVALSHA
calls: one round trip; the script is loaded again only when the server answers NOSCRIPT); woken by a
record, the writer waits LINGER_S (10 ms) for more before it writes a batch that is not full. If Redis
fails, the batch goes to the local spool (tokenyard/gateway/spend/spool.py) and so does everything
after it, until the replay task has pushed the spool back into Redis; a record is thus always in
exactly one of: the queue, Redis, the spool.

Money: each record's cost is computed once, when the request ends, in integer micro-units
(tokenyard.policies.schema.Prices.cost: the exact total over a million rounded half up, once); rollups are sums
of those integers (HINCRBY, 64-bit), so any report equals the sum of its records to the micro-unit.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from redis.exceptions import NoScriptError, RedisError

from tokenyard.gateway.config.spend_settings import SpendConfig
from tokenyard.gateway.spend.redis_keys import (
    FOLDED_TAGS,
    OTHER,
    dim_field_prefix,
    dim_values_key,
    dims_key,
    hours_key,
    record_dimensions,
    rollup_key,
    seen_key,
    stream_key,
    stream_seq_key,
    tag_names_key,
    tenants_key,
)
from tokenyard.gateway.spend.spool import SpendSpool
from tokenyard.gateway.spend.usage import UsageRecord, compact

log = logging.getLogger("tokenyard.spend")
_LUA = Path(__file__).resolve().parent / "lua" / "spend_record.lua"
BATCH = 128
# How long the writer waits, once woken, before it takes a batch not yet full: a record reaches
# Redis at most this much (plus its round trip) later than it would without the wait. The policy's
# budget check reads rollups cached 2 s anyway, and budget holds are settled apart from the ledger.
LINGER_S = 0.01
_RECORD_JSON = json.JSONEncoder(separators=(",", ":"))   # json.dumps with options builds one per call
_ERRORS = (RedisError, OSError, TimeoutError, asyncio.TimeoutError)


class SpendLedger:
    def __init__(self, redis_url: str, prefix: str, cfg: SpendConfig, metrics: Any,
                 timeout_s: float = 2.0) -> None:
        import redis.asyncio as aioredis
        self.prefix = prefix
        self.cfg = cfg
        self.metrics = metrics
        # Its own client: ledger writes are off the request path and may take longer than the
        # request path's redis_timeout_ms (a batch is up to BATCH scripts in one round trip).
        self.redis = aioredis.Redis.from_url(redis_url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        self._script = self.redis.register_script(_LUA.read_text())
        self.spool = SpendSpool(cfg.spool_dir, redis_url, prefix, fsync=cfg.spool_fsync == "always")
        self._queue: list[UsageRecord] = []
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._spool_lock = asyncio.Lock()
        self.in_flight = 0            # records taken from the queue, not yet in Redis or the spool
        self.redis_down = False       # while True, records go straight to the spool
        self.stored = 0               # records this process put into Redis (first time), for tests/metrics

    # -- the sink -----------------------------------------------------------------------------
    def __call__(self, record: UsageRecord) -> None:
        self._queue.append(record)
        if self._wake is not None:
            self._wake.set()

    @property
    def pending(self) -> int:
        """Records not yet durable anywhere (queued or being written)."""
        return len(self._queue) + self.in_flight

    # -- life cycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self._wake = asyncio.Event()
        if self._queue:
            self._wake.set()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._writer()), loop.create_task(self._replayer())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        while self._queue:                       # what ended during shutdown
            await self._write(self._take())
        await self.redis.aclose()

    # -- writing ------------------------------------------------------------------------------
    def _take(self) -> list[UsageRecord]:
        batch, self._queue = self._queue[:BATCH], self._queue[BATCH:]
        self.in_flight += len(batch)
        return batch

    async def _writer(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            if len(self._queue) < BATCH:
                # The records of the next few ms share this batch's round trip: at a steady trickle
                # (one client) a round trip per record was a large share of the gateway's CPU per request
                # (bench/RESULTS.md, "Gateway CPU per one-token request, cut").
                await asyncio.sleep(LINGER_S)
            while self._queue:
                await self._write(self._take())

    async def _write(self, batch: list[UsageRecord]) -> None:
        try:
            if not self.redis_down:
                try:
                    await self._store([r.to_dict() for r in batch], "stored")
                    return
                except _ERRORS as e:
                    self._went_down(e)
            await self._to_spool([r.to_dict() for r in batch])
        finally:
            self.in_flight -= len(batch)

    async def _store(self, records: list[dict[str, Any]], outcome: str) -> None:
        """Run the script for each record in one pipeline (raises on any Redis failure).

        The pipeline sends EVALSHA alone: redis-py's script pipelines ask SCRIPT EXISTS first, a
        second round trip on every batch. A server that lacks the script (restarted, SCRIPT FLUSH)
        answers NOSCRIPT for each of them; those records, and only those, run again once it is
        loaded (a record that did run is never sent twice by this, and would be a no-op if it were)."""
        calls = [self._script_args(rec) for rec in records]
        results = await self._run(calls)
        missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if missing:
            await self.redis.script_load(self._script.script)
            again = await self._run([calls[i] for i in missing])
            for i, r in zip(missing, again):
                results[i] = r
        for r in results:
            if isinstance(r, BaseException):
                raise r
        fresh = sum(1 for r in results if int(r) == 1)
        self.stored += fresh
        self.metrics.spend_records.labels(outcome).inc(fresh)
        if len(records) - fresh:
            self.metrics.spend_records.labels("duplicate").inc(len(records) - fresh)

    async def _run(self, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """One round trip: EVALSHA per (keys, args); errors come back in the list, not raised."""
        pipe = self.redis.pipeline(transaction=False)
        sha = self._script.sha
        for keys, args in calls:
            pipe.evalsha(sha, len(keys), *keys, *args)
        return await pipe.execute(raise_on_error=False)

    def _script_args(self, rec: dict[str, Any]) -> tuple[list[str], list[Any]]:
        cfg, p, tenant = self.cfg, self.prefix, rec.get("tenant") or "-"
        hour = int(rec["time"]) // 3600
        now_ms = int(time.time() * 1000)
        retention_s = cfg.stream_retention_days * 86400
        keys = [seen_key(p, tenant, rec["request_id"]), stream_key(p, tenant), rollup_key(p, tenant, hour),
                hours_key(p, tenant), tenants_key(p)]
        # The stream entry's tags are written by the script (only the names the rollups keep), and
        # fields at their default are left out (store.stream_record restores both).
        untagged = compact({k: v for k, v in rec.items() if k != "tags"})
        args = [_RECORD_JSON.encode(untagged), rec["engine"], hour, tenant,
                int(rec["prompt_tokens"]), int(rec["cached_tokens"]), int(rec["completion_tokens"]),
                int(rec["cost_micros"]), int(rec.get("baseline_cost_micros", 0)),
                0 if rec["status"] == "ok" else 1,
                cfg.rollup_retention_days * 86400, retention_s, cfg.stream_max_len,
                max(0, now_ms - retention_s * 1000), int(now_ms // 1000 - cfg.rollup_retention_days * 86400) // 3600]
        dims = record_dimensions(rec)
        keys += [dims_key(p, tenant, hour), tag_names_key(p, tenant, hour)]
        keys += [dim_values_key(p, tenant, hour, d) for d, _ in dims]
        keys.append(stream_seq_key(p))
        args += [len(dims), cfg.max_values_per_dimension, cfg.max_tag_names, FOLDED_TAGS,
                 dim_field_prefix(FOLDED_TAGS, OTHER, rec["engine"])]
        for d, v in dims:
            args += [v, dim_field_prefix(d, v, rec["engine"]), dim_field_prefix(d, OTHER, rec["engine"]),
                     d if d.startswith("tag:") else ""]
        return keys, args

    async def _to_spool(self, records: list[dict[str, Any]]) -> None:
        async with self._spool_lock:
            try:
                await asyncio.to_thread(self.spool.append, records)
            except OSError as e:   # nowhere left to put them: say so loudly, keep serving
                log.error("spend spool %s unwritable (%s): %d usage record(s) lost", self.spool.dir, e, len(records))
                self.metrics.spend_records.labels("lost").inc(len(records))
                return
        self.metrics.spend_records.labels("spooled").inc(len(records))

    def _went_down(self, e: BaseException) -> None:
        if not self.redis_down:
            log.warning("spend ledger: redis unreachable (%s: %s); spooling usage records to %s",
                        type(e).__name__, e, self.spool.dir)
        self.redis_down = True
        self.metrics.spend_write_errors.inc()

    # -- replay -------------------------------------------------------------------------------
    async def _replayer(self) -> None:
        while True:
            try:
                if self.redis_down or self.spool.pending():
                    await self.replay()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep the loop alive whatever happens; retry later
                log.exception("spend spool replay failed")
            await asyncio.sleep(self.cfg.replay_interval_s)

    async def replay(self) -> int:
        """Push every spooled record into Redis (idempotent). Returns records sent; on a Redis
        failure stops, leaves the files for next time and keeps spooling."""
        sent = 0
        with self.spool.lock() as held:
            if not held:
                return 0   # another process is replaying this spool
            async with self._spool_lock:
                files = await asyncio.to_thread(self.spool.claim)
            for path in files:
                records = await asyncio.to_thread(lambda: list(self.spool.read(path)))
                try:
                    for i in range(0, len(records), BATCH):
                        await self._store(records[i:i + BATCH], "replayed")
                        sent += len(records[i:i + BATCH])
                except _ERRORS as e:
                    self._went_down(e)
                    return sent
                await asyncio.to_thread(self.spool.done, path)
        if self.redis_down:
            log.info("spend ledger: redis reachable again; spool replayed (%d record(s))", sent)
        self.redis_down = False
        return sent
