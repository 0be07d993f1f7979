"""Dashboard sessions: a random id in a cookie, the session itself on the server.

Storage: Redis when the gateway has one (`{prefix}session:{sha256(id)}`, a hash with a TTL), so
every gateway behind a load balancer knows the session and it expires on its own; in memory
otherwise (tests and deployments without Redis; capped, expired entries dropped first). Only a
hash of the id is used as the key, so reading Redis (a dump, `MONITOR`) yields no usable cookie.

A session holds the signed-in key's id, tenant and role, never the API key itself; each request
re-checks the key record (tokenyard/gateway/auth/key_cache.py), so revoking the key ends its sessions at once.
An anonymous session (key_id None) exists only to carry the sign-in form's CSRF token; signing in
replaces it with a new session id (no session fixation). It is never stored: its id carries its
expiry ("a.<unix expiry>.<random>") and its token is an HMAC of the id under a secret shared by
the gateways (`{prefix}sessions:anon_secret` in Redis, made once), so anyone may load the sign-in
page as often as they like without making the server keep anything.

The cookie: HttpOnly (no script can read it), SameSite=Strict (never sent on a request another
site starts, including top-level navigations: the dashboard is a tool one opens directly, so
arriving from a link elsewhere shows the sign-in page rather than risk a cross-site request),
Path=/, Max-Age = the session's lifetime, Secure over https (`dashboard.cookie_secure`).
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

from redis.exceptions import RedisError

from tokenyard.gateway.edge.errors import Unavailable

T = TypeVar("T")

COOKIE = "ty_session"
ANON_TTL_S = 600
MEMORY_CAP = 10_000
ANON = "a."                           # stored session ids (token_urlsafe) never contain "."


@dataclass(slots=True)
class Session:
    id: str
    csrf: str                         # the synchronizer token every form of this session must send back
    expires: float                    # unix seconds
    key_id: str | None = None         # None: not signed in yet
    tenant: str | None = None
    role: str | None = None

    @property
    def signed_in(self) -> bool:
        return self.key_id is not None


def _redis_errors_are_503(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Sessions in an unreachable Redis: the dashboard answers 503 (retry), never a 500."""
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return await fn(*args, **kwargs)
        except (RedisError, OSError) as e:
            raise Unavailable("Dashboard sessions are unavailable right now; retry shortly",
                              code="sessions_unavailable", headers={"retry-after": "1"}) from e
    return wrapper


def _h(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


class SessionStore:
    def __init__(self, redis: Any, prefix: str, ttl_s: int) -> None:
        self.redis = redis            # redis.asyncio client, or None: in memory
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._memory: OrderedDict[str, Session] = OrderedDict()
        self._anon_secret: bytes | None = None

    def _name(self, session_id: str) -> str:
        return f"{self.prefix}session:{_h(session_id)}"

    @_redis_errors_are_503
    async def create(self, key_id: str | None = None, tenant: str | None = None, role: str | None = None) -> Session:
        ttl = self.ttl_s if key_id else ANON_TTL_S
        s = Session(id=secrets.token_urlsafe(32), csrf=secrets.token_urlsafe(32), expires=time.time() + ttl,
                    key_id=key_id, tenant=tenant, role=role)
        if self.redis is None:
            self._remember(s)
            return s
        fields = {"csrf": s.csrf, "expires": str(s.expires), "key_id": key_id or "", "tenant": tenant or "",
                  "role": role or ""}
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self._name(s.id), mapping=fields)
        pipe.expire(self._name(s.id), ttl)
        await pipe.execute()
        return s

    @_redis_errors_are_503
    async def anonymous(self) -> Session:
        """A fresh sign-in-form session: nothing is stored (see the module's docstring)."""
        expires = int(time.time()) + ANON_TTL_S
        session_id = f"{ANON}{expires}.{secrets.token_urlsafe(24)}"
        return Session(id=session_id, csrf=await self._anon_token(session_id), expires=float(expires))

    async def _anon_token(self, session_id: str) -> str:
        if self._anon_secret is None:
            if self.redis is None:
                self._anon_secret = secrets.token_bytes(32)
            else:
                name = f"{self.prefix}sessions:anon_secret"
                await self.redis.set(name, secrets.token_hex(32), nx=True)
                raw = await self.redis.get(name)
                self._anon_secret = raw if isinstance(raw, bytes) else str(raw).encode()
        return hmac.new(self._anon_secret, session_id.encode(), hashlib.sha256).hexdigest()

    async def _get_anonymous(self, session_id: str, now: float) -> Session | None:
        expiry, dot, _ = session_id[len(ANON):].partition(".")
        if not dot or not expiry.isascii() or not expiry.isdigit() or len(expiry) > 12 or int(expiry) <= now:
            return None
        return Session(id=session_id, csrf=await self._anon_token(session_id), expires=float(expiry))

    @_redis_errors_are_503
    async def get(self, session_id: str | None) -> Session | None:
        if not session_id or len(session_id) > 128:
            return None
        now = time.time()
        if session_id.startswith(ANON):
            return await self._get_anonymous(session_id, now)
        if self.redis is None:
            s = self._memory.get(_h(session_id))
            if s is None or s.expires <= now:
                self._memory.pop(_h(session_id), None)
                return None
            return s
        raw = await self.redis.hgetall(self._name(session_id))
        if not raw:
            return None
        d = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in raw.items()}
        s = Session(id=session_id, csrf=d.get("csrf", ""), expires=float(d.get("expires") or 0),
                    key_id=d.get("key_id") or None, tenant=d.get("tenant") or None, role=d.get("role") or None)
        return s if s.expires > now and s.csrf else None

    @_redis_errors_are_503
    async def delete(self, session_id: str) -> None:
        if session_id.startswith(ANON):
            return          # never stored
        if self.redis is None:
            self._memory.pop(_h(session_id), None)
        else:
            await self.redis.delete(self._name(session_id))

    def _remember(self, s: Session) -> None:
        now = time.time()
        if len(self._memory) >= MEMORY_CAP:
            for h in [h for h, v in self._memory.items() if v.expires <= now]:
                del self._memory[h]
            while len(self._memory) >= MEMORY_CAP:
                self._memory.popitem(last=False)       # oldest first
        self._memory[_h(s.id)] = s


def cookie_header(session: Session | None, secure: bool, ttl_s: int) -> str:
    """The Set-Cookie value; None clears the cookie."""
    value, max_age = (session.id, max(1, int(session.expires - time.time()))) if session else ("", 0)
    parts = [f"{COOKIE}={value}", "Path=/", f"Max-Age={max_age}", "HttpOnly", "SameSite=Strict"]
    if secure:
        parts.append("Secure")
    return "; ".join(parts)
