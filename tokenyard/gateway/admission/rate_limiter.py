"""Request and token limits in Redis: one Lua script, one round trip, the server's clock
(reservations made while one is on its way share the next round trip: tokenyard/gateway/store/script_batch.py).

    res = await limiter.reserve(key_record, tokens=prompt + max_tokens, engine="demo-small")
    ...                                          # the request runs
    limiter.refund(res, tokens=res.tokens - used)   # give back what it did not use

The limits are GCRA buckets (tokenyard/gateway/admission/lua/reserve.lua) with a burst of one window's worth.
A request is charged in every bucket that applies to it, atomically (all allow, or none is charged):
  the tenant's      `{prefix}rl:{tenant}:req|tok`, shared by all its keys: the policy's rate class
                    for the tenant, else the deployment's `rate_limits.requests`/`tokens` per
                    `window_s` for keys without limits of their own;
  the key's own     `{prefix}rl:{tenant}:key:{key_id}:req|tok`, when the key was made with
                    `--rpm`/`--tpm` (per `rate_limits.window_s`; 0: the key sets none).
So a key's explicit limit is never loosened by a policy: the stricter of the two governs, and a
rate class can only tighten it. The braces make the tenant a hash tag, so all of one tenant's
buckets land in one Redis Cluster slot and one script can touch them all.

Answers carry the x-ratelimit-* headers OpenAI sends, of the bucket that binds (the fewest units
remaining; on a tie the smaller limit); a refusal is a 429 with `retry-after` (whole seconds) and
`retry-after-ms`, which the OpenAI SDKs honour. A request bigger than a whole token bucket can
never fit: 429 `request_too_large` without a retry hint.

Redis unreachable: `on_redis_error: open` admits the request unlimited, `closed` refuses it
with 503; either way it is logged and counted (tokenyard_rate_limit_redis_fallbacks_total).
The gateway merely busy (every Redis place taken, see redis_guard.py) is not Redis unreachable:
the request is shed with 503 gateway_busy and Retry-After, and the limits never open for it.
"""
from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenyard.gateway.auth.api_keys import KeyRecord
from tokenyard.gateway.config.deployment import RateLimits
from tokenyard.gateway.edge.errors import RateLimited, Unavailable, retry_headers
from tokenyard.gateway.store.redis_guard import RedisBusy, RedisGuard, RedisUnavailable
from tokenyard.gateway.store.script_batch import ScriptBatch

log = logging.getLogger("tokenyard.ratelimit")
_LUA = Path(__file__).resolve().parent / "lua"


def format_reset(us: int) -> str:
    """A duration the way OpenAI writes x-ratelimit-reset-*: "20ms", "1.5s", "6m0s"."""
    if us < 1_000_000:
        return f"{max(0, math.ceil(us / 1000))}ms"
    s = us / 1_000_000
    if s < 60:
        return f"{s:.3f}".rstrip("0").rstrip(".") + "s"
    m, rest = divmod(int(math.ceil(s)), 60)
    return f"{m}m{rest}s"


@dataclass(slots=True, frozen=True)
class Bucket:
    """One GCRA bucket a request is charged in."""

    key: str              # the Redis key
    kind: str             # "requests" or "tokens"
    limit: int            # units per window (> 0)
    window_us: int
    owner: str            # who it limits, for messages: "tenant acme", "key 3f2a... of tenant acme"


@dataclass(slots=True)
class Reservation:
    """What one request holds against its limits (enforced False: nothing to refund)."""

    tenant: str
    tokens: int
    enforced: bool
    buckets: tuple[Bucket, ...] = ()
    headers: dict[str, str] = field(default_factory=dict)
    now_us: int = 0               # Redis server time of the reservation (0: not checked)

    def limit(self, kind: str) -> int:
        """The binding limit of that kind (the one the headers show), 0 when none applies."""
        return int(self.headers.get(f"x-ratelimit-limit-{kind}", 0))


class RateLimiter:
    def __init__(self, redis: Any, prefix: str, cfg: RateLimits, guard: RedisGuard | None, metrics: Any) -> None:
        self.redis = redis                # redis.asyncio client; None: limits off (no Redis configured)
        self.prefix = prefix
        self.cfg = cfg
        self.guard = guard
        self.metrics = metrics
        self.window_us = int(cfg.window_s * 1_000_000)
        if redis is not None:
            # Reservations that arrive while one is on its way share the next round trip.
            self._reserve = ScriptBatch(redis, redis.register_script((_LUA / "reserve.lua").read_text()))
            self._refund = redis.register_script((_LUA / "refund.lua").read_text())
        self._pending: set[asyncio.Task] = set()

    @property
    def active(self) -> bool:
        return self.redis is not None and self.cfg.enabled

    def buckets(self, rec: KeyRecord, rate: tuple[int, int, int] | None = None) -> tuple[Bucket, ...]:
        """The buckets a request of this key is charged in. rate: (request_limit, token_limit,
        window_us) of the policy's rate class for the tenant, or None."""
        tenant = f"{self.prefix}rl:{{{rec.tenant}}}"
        if rate is not None:
            shared = (rate[0], rate[1], rate[2])
        else:     # the deployment's limits, for the dimensions the key sets none of its own
            shared = (self.cfg.requests if rec.rpm is None else 0, self.cfg.tokens if rec.tpm is None else 0,
                      self.window_us)
        out = [Bucket(f"{tenant}:req", "requests", shared[0], shared[2], f"tenant {rec.tenant}"),
               Bucket(f"{tenant}:tok", "tokens", shared[1], shared[2], f"tenant {rec.tenant}")]
        own = f"key {rec.key_id} of tenant {rec.tenant}"
        out += [Bucket(f"{tenant}:key:{rec.key_id}:req", "requests", rec.rpm or 0, self.window_us, own),
                Bucket(f"{tenant}:key:{rec.key_id}:tok", "tokens", rec.tpm or 0, self.window_us, own)]
        return tuple(b for b in out if b.limit > 0)

    async def reserve(self, rec: KeyRecord, tokens: int, engine: str,
                      rate: tuple[int, int, int] | None = None) -> Reservation:
        """rate: (request_limit, token_limit, window_us) from the policy's rate class for the tenant;
        None: the deployment's. A key's own --rpm/--tpm applies on top of either."""
        buckets = self.buckets(rec, rate)
        if not self.active or not buckets:
            return Reservation(rec.tenant, tokens, enforced=False)
        args = [x for b in buckets for x in (b.limit, b.window_us, 1 if b.kind == "requests" else tokens)]
        keys = [b.key for b in buckets]
        try:
            r = await self.guard.call("rate_limit", lambda: self._reserve(keys=keys, args=args))
        except RedisUnavailable as e:
            return self._redis_down(rec, tokens, engine, e)
        allowed, now_us, too_large = (int(x) for x in r[:3])
        state = [(b, int(r[3 + 3 * i]), int(r[4 + 3 * i]), int(r[5 + 3 * i])) for i, b in enumerate(buckets)]
        headers = {}
        for kind in ("requests", "tokens"):
            mine = [s for s in state if s[0].kind == kind]
            if mine:
                b, _, rem, reset = min(mine, key=lambda s: (s[2], s[0].limit))
                headers.update({f"x-ratelimit-limit-{kind}": str(b.limit),
                                f"x-ratelimit-remaining-{kind}": str(max(0, rem)),
                                f"x-ratelimit-reset-{kind}": format_reset(reset)})
        if allowed:
            return Reservation(rec.tenant, tokens, enforced=True, buckets=buckets, headers=headers, now_us=now_us)
        if too_large:
            b = min((s[0] for s in state if s[0].kind == "tokens" and tokens > s[0].limit), key=lambda b: b.limit)
            self.metrics.rate_limited.labels(engine, "request_too_large").inc()
            raise RateLimited(f"Request too large: {tokens} tokens (prompt + max_tokens) is more than the limit of "
                              f"{b.limit} tokens per {b.window_us / 1e6:g} s for {b.owner}. Lower "
                              f"max_tokens or shorten the prompt.", code="request_too_large", headers=headers)
        b, retry_us = max(((s[0], s[1]) for s in state), key=lambda x: x[1])
        wait_s = retry_us / 1_000_000
        self.metrics.rate_limited.labels(engine, b.kind).inc()
        raise RateLimited(f"Rate limit reached for {b.owner} on {b.kind} per {b.window_us / 1e6:g} s: "
                          f"limit {b.limit}. Retry in {wait_s * 1000:.0f} ms.", code="rate_limit_exceeded",
                          headers={**headers, **retry_headers(wait_s)})

    def _redis_down(self, rec: KeyRecord, tokens: int, engine: str, e: Exception) -> Reservation:
        mode = self.cfg.on_redis_error
        self.metrics.rate_limit_fallbacks.labels(engine, mode).inc()
        log.debug("rate limit for %s not checked (%s); failing %s", rec.tenant, e, mode)
        if mode == "closed":
            raise Unavailable("Rate limits cannot be checked right now; retry shortly", code="rate_limiter_unavailable",
                              headers=retry_headers(self.cfg.redis_retry_s))
        return Reservation(rec.tenant, tokens, enforced=False)

    def refund(self, res: Reservation, requests: int = 0, tokens: int = 0) -> None:
        """Give back units in the background (the reply need not wait for it). Best effort: a refund
        lost to a Redis error only makes the tenant's limit stricter for a moment."""
        if not res.enforced or (requests <= 0 and tokens <= 0):
            return
        keys = [b.key for b in res.buckets]
        args = [x for b in res.buckets
                for x in (b.limit, b.window_us, max(0, requests if b.kind == "requests" else tokens))]
        task = asyncio.get_running_loop().create_task(self._do_refund(keys, args))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _do_refund(self, keys: list[str], args: list[int]) -> None:
        try:
            await self.guard.call("rate_limit_refund", lambda: self._refund(keys=keys, args=args))
        except (RedisUnavailable, RedisBusy):
            pass   # counted by the guard; a lost refund only makes the limit stricter for a moment

    async def drain(self) -> None:
        """Wait for refunds in flight (tests and shutdown)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)
