"""Per-tenant request and token limits in Redis: one Lua script, one round trip, the server's clock.

    res = await limiter.reserve(key_record, tokens=prompt + max_tokens, engine="demo-small")
    ...                                          # the request runs
    limiter.refund(res, tokens=res.tokens - used)   # give back what it did not use

The limits are GCRA buckets (gateway/admission/lua/reserve.lua): `requests` and `tokens` per `window_s`
(a minute by default), with a burst of one window's worth. A tenant's buckets are
`{prefix}rl:{tenant}:req` and `...:tok`; the braces make the tenant a hash tag, so all of one
tenant's keys land in one Redis Cluster slot and one script can touch both. Keys of a tenant
share its buckets; the limits applied are those of the key presenting the request (a key's own
`rpm`/`tpm`, else the deployment's `rate_limits.requests`/`tokens`).

Answers carry the x-ratelimit-* headers OpenAI sends; a refusal is a 429 with `retry-after`
(whole seconds) and `retry-after-ms`, which the OpenAI SDKs honour. A request bigger than the
whole token bucket can never fit: 429 `request_too_large` without a retry hint.

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

from gateway.auth.api_keys import KeyRecord
from gateway.config.deployment import RateLimits
from gateway.http.errors import RateLimited, Unavailable, retry_headers
from gateway.store.redis_guard import RedisBusy, RedisGuard, RedisUnavailable

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


@dataclass(slots=True)
class Reservation:
    """What one request holds against its tenant's limits (enforced False: nothing to refund)."""

    tenant: str
    request_limit: int
    token_limit: int
    tokens: int
    enforced: bool
    headers: dict[str, str] = field(default_factory=dict)
    now_us: int = 0               # Redis server time of the reservation (0: not checked)
    window_us: int = 0            # the window it was reserved under (0: rate_limits.window_s)


class RateLimiter:
    def __init__(self, redis: Any, prefix: str, cfg: RateLimits, guard: RedisGuard | None, metrics: Any) -> None:
        self.redis = redis                # redis.asyncio client; None: limits off (no Redis configured)
        self.prefix = prefix
        self.cfg = cfg
        self.guard = guard
        self.metrics = metrics
        self.window_us = int(cfg.window_s * 1_000_000)
        if redis is not None:
            self._reserve = redis.register_script((_LUA / "reserve.lua").read_text())
            self._refund = redis.register_script((_LUA / "refund.lua").read_text())
        self._pending: set[asyncio.Task] = set()

    @property
    def active(self) -> bool:
        return self.redis is not None and self.cfg.enabled

    def limits_for(self, rec: KeyRecord) -> tuple[int, int]:
        return (self.cfg.requests if rec.rpm is None else rec.rpm, self.cfg.tokens if rec.tpm is None else rec.tpm)

    def _keys(self, tenant: str) -> list[str]:
        return [f"{self.prefix}rl:{{{tenant}}}:req", f"{self.prefix}rl:{{{tenant}}}:tok"]

    async def reserve(self, rec: KeyRecord, tokens: int, engine: str,
                      rate: tuple[int, int, int] | None = None) -> Reservation:
        """rate: (request_limit, token_limit, window_us) from the policy's rate class for the tenant;
        None: the key's own limits, else the deployment's."""
        req_limit, tok_limit = self.limits_for(rec) if rate is None else rate[:2]
        window_us = self.window_us if rate is None else rate[2]
        if not self.active or (req_limit == 0 and tok_limit == 0):
            return Reservation(rec.tenant, req_limit, tok_limit, tokens, enforced=False)
        args = [req_limit, tok_limit, window_us, 1, tokens]
        try:
            r = await self.guard.call("rate_limit", lambda: self._reserve(keys=self._keys(rec.tenant), args=args))
        except RedisUnavailable as e:
            return self._redis_down(rec, tokens, engine, e)
        allowed, now_us, too_large, rretry, tretry, rrem, trem, rreset, treset = (int(x) for x in r)
        headers = {}
        if req_limit:
            headers.update({"x-ratelimit-limit-requests": str(req_limit),
                            "x-ratelimit-remaining-requests": str(max(0, rrem)),
                            "x-ratelimit-reset-requests": format_reset(rreset)})
        if tok_limit:
            headers.update({"x-ratelimit-limit-tokens": str(tok_limit),
                            "x-ratelimit-remaining-tokens": str(max(0, trem)),
                            "x-ratelimit-reset-tokens": format_reset(treset)})
        if allowed:
            return Reservation(rec.tenant, req_limit, tok_limit, tokens, enforced=True, headers=headers, now_us=now_us,
                               window_us=window_us)
        if too_large:
            self.metrics.rate_limited.labels(engine, "request_too_large").inc()
            raise RateLimited(f"Request too large: {tokens} tokens (prompt + max_tokens) is more than the limit of "
                              f"{tok_limit} tokens per {window_us / 1e6:g} s for tenant {rec.tenant}. Lower "
                              f"max_tokens or shorten the prompt.", code="request_too_large", headers=headers)
        which = "requests" if rretry >= tretry else "tokens"
        wait_s = max(rretry, tretry) / 1_000_000
        self.metrics.rate_limited.labels(engine, which).inc()
        limit = req_limit if which == "requests" else tok_limit
        raise RateLimited(f"Rate limit reached for tenant {rec.tenant} on {which} per {window_us / 1e6:g} s: "
                          f"limit {limit}. Retry in {wait_s * 1000:.0f} ms.", code="rate_limit_exceeded",
                          headers={**headers, **retry_headers(wait_s)})

    def _redis_down(self, rec: KeyRecord, tokens: int, engine: str, e: Exception) -> Reservation:
        mode = self.cfg.on_redis_error
        self.metrics.rate_limit_fallbacks.labels(engine, mode).inc()
        log.debug("rate limit for %s not checked (%s); failing %s", rec.tenant, e, mode)
        if mode == "closed":
            raise Unavailable("Rate limits cannot be checked right now; retry shortly", code="rate_limiter_unavailable",
                              headers=retry_headers(self.cfg.redis_retry_s))
        req_limit, tok_limit = self.limits_for(rec)
        return Reservation(rec.tenant, req_limit, tok_limit, tokens, enforced=False)

    def refund(self, res: Reservation, requests: int = 0, tokens: int = 0) -> None:
        """Give back units in the background (the reply need not wait for it). Best effort: a refund
        lost to a Redis error only makes the tenant's limit stricter for a moment."""
        if not res.enforced or (requests <= 0 and tokens <= 0):
            return
        args = [res.request_limit, res.token_limit, res.window_us or self.window_us, max(0, requests), max(0, tokens)]
        task = asyncio.get_running_loop().create_task(self._do_refund(res.tenant, args))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _do_refund(self, tenant: str, args: list[int]) -> None:
        try:
            await self.guard.call("rate_limit_refund", lambda: self._refund(keys=self._keys(tenant), args=args))
        except (RedisUnavailable, RedisBusy):
            pass   # counted by the guard; a lost refund only makes the limit stricter for a moment

    async def drain(self) -> None:
        """Wait for refunds in flight (tests and shutdown)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)
