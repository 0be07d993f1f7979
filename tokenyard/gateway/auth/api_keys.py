"""API keys and the tenants they belong to: making keys, hashing them, their records in Redis.

A key is "ty-" + 43 url-safe characters from `secrets.token_urlsafe(32)`: 256 random bits.
Only SHA-256 of the key is ever stored. Why a plain hash and not bcrypt/argon2 or an HMAC
with a server-side pepper: slow hashes exist to protect guessable secrets (passwords); a
256-bit random key cannot be guessed, so a fast hash is as safe and keeps a cache miss to
microseconds. A pepper would add a second secret that every gateway and the CLI must share
and rotate, for no gain against an attacker who cannot invert SHA-256 anyway. (A development
key chosen by a person through TOKENYARD_DEV_KEY has no such entropy; it is for development.)

The key id is the first 16 hex digits of the hash: a public handle for `keys list` and
`keys revoke`, and the name of the record, so a lookup is one HGETALL and the full hash is
then compared in constant time (hmac.compare_digest).

Redis layout (every name starts with the deployment's `redis_prefix`):
    {prefix}key:{key_id}   hash: the KeyRecord fields (never the key)
    {prefix}keys           set of key ids (for listing)
    {prefix}keys:events    pub/sub channel: "revoke <key_id>" / "update <key_id>"
    {prefix}dev_key_id     the id of the development admin key made on the first start
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from dataclasses import dataclass, fields
from typing import Any

from tokenyard.policies.adapter_access import parse_patterns
from tokenyard.policies.schema import (
    PRIORITIES,  # admission classes, in order: interactive is always served first
)

ROLES = ("user", "admin")
KEY_PREFIX = "ty-"
DEV_TENANT = "dev"
_TENANT = re.compile(r"^[A-Za-z0-9._-]{1,64}$")  # no braces: the tenant is a Redis hash tag


class KeySpecError(ValueError):
    """A bad tenant, role, priority or limit given when making a key."""


@dataclass(slots=True)
class KeyRecord:
    key_id: str
    key_hash: str                       # hex SHA-256 of the key
    tenant: str
    name: str = ""
    role: str = "user"                  # "user" or "admin"
    priority: str = "interactive"       # admission class
    # The key's own requests per rate window, a bucket of its own (a policy rate class only tightens
    # it); None: the deployment's default applies instead, 0: no limit of its own.
    rpm: int | None = None
    tpm: int | None = None              # tokens per rate window; same
    max_concurrent: int | None = None   # queued + running per gateway; None: the deployment default, 0: no cap
    created: float = 0.0                # unix seconds
    revoked: float | None = None        # unix seconds, when revoked
    # The LoRA adapters the key may use (ENGINE:ADAPTER, ENGINE:*, *: tokenyard/policies/adapter_access.py);
    # None: every adapter (its tenant's list, if the policy gives one, still applies). Stored as JSON.
    adapters: tuple[str, ...] | None = None

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def priority_class(self) -> int:
        return PRIORITIES.index(self.priority)

    def matches(self, key_hash: str) -> bool:
        return hmac.compare_digest(self.key_hash.encode(), key_hash.encode())

    def to_redis(self) -> dict[str, str]:
        out = {f.name: "" if getattr(self, f.name) is None else str(getattr(self, f.name)) for f in fields(self)}
        out["adapters"] = "" if self.adapters is None else json.dumps(list(self.adapters))
        return out

    @classmethod
    def from_redis(cls, raw: dict[Any, Any]) -> "KeyRecord":
        d = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in raw.items()}

        def opt_int(name: str) -> int | None:
            return int(d[name]) if d.get(name) else None

        return cls(key_id=d["key_id"], key_hash=d["key_hash"], tenant=d["tenant"], name=d.get("name", ""),
                   role=d.get("role", "user"), priority=d.get("priority", "interactive"), rpm=opt_int("rpm"),
                   tpm=opt_int("tpm"), max_concurrent=opt_int("max_concurrent"),
                   created=float(d.get("created") or 0), revoked=float(d["revoked"]) if d.get("revoked") else None,
                   adapters=_adapters_from(d.get("adapters")))

    def public(self) -> dict[str, Any]:
        """What `keys list` shows: everything but the hash."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "key_hash"}


def _adapters_from(raw: str | None) -> tuple[str, ...] | None:
    """A stored allow list; one that does not read allows nothing (fail closed), never everything."""
    if not raw:
        return None
    try:
        items = json.loads(raw)
        return parse_patterns(items) if isinstance(items, list) else ()
    except ValueError:
        return ()


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_id_of(key_hash: str) -> str:
    return key_hash[:16]


def record_name(prefix: str, key_id: str) -> str:
    return f"{prefix}key:{key_id}"


def events_channel(prefix: str) -> str:
    return f"{prefix}keys:events"


def check_tenant(tenant: str) -> str:
    if not isinstance(tenant, str) or not _TENANT.match(tenant):
        raise KeySpecError(f"tenant must be 1-64 of A-Z a-z 0-9 . _ -, got {tenant!r}")
    return tenant


def new_record(key: str, tenant: str, name: str = "", role: str = "user", priority: str = "interactive",
               rpm: int | None = None, tpm: int | None = None, max_concurrent: int | None = None,
               adapters: list[str] | tuple[str, ...] | None = None) -> KeyRecord:
    check_tenant(tenant)
    if role not in ROLES:
        raise KeySpecError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if priority not in PRIORITIES:
        raise KeySpecError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
    for label, value in (("rpm", rpm), ("tpm", tpm), ("max_concurrent", max_concurrent)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise KeySpecError(f"{label} must be an integer >= 0 (0: unlimited), got {value!r}")
    if adapters is not None:
        try:
            adapters = parse_patterns(adapters)
        except ValueError as e:
            raise KeySpecError(f"adapters: {e}") from None
    h = hash_key(key)
    return KeyRecord(key_id=key_id_of(h), key_hash=h, tenant=tenant, name=name[:128], role=role, priority=priority,
                     rpm=rpm, tpm=tpm, max_concurrent=max_concurrent, created=time.time(), adapters=adapters)


class KeyStore:
    """Key records in Redis through a synchronous client (the CLI and server start-up)."""

    def __init__(self, redis: Any, prefix: str = "tokenyard:") -> None:
        self.redis = redis
        self.prefix = prefix

    def put(self, rec: KeyRecord, event: str = "update") -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(record_name(self.prefix, rec.key_id))
        pipe.hset(record_name(self.prefix, rec.key_id), mapping=rec.to_redis())
        pipe.sadd(f"{self.prefix}keys", rec.key_id)
        pipe.publish(events_channel(self.prefix), f"{event} {rec.key_id}")
        pipe.execute()

    def create(self, tenant: str, **kw: Any) -> tuple[str, KeyRecord]:
        """A new key and its record (stored). The key itself is returned once and never kept."""
        key = generate_key()
        rec = new_record(key, tenant, **kw)
        self.put(rec)
        return key, rec

    def get(self, key_id: str) -> KeyRecord | None:
        raw = self.redis.hgetall(record_name(self.prefix, key_id))
        return KeyRecord.from_redis(raw) if raw else None

    def list(self, tenant: str | None = None) -> list[KeyRecord]:
        ids = sorted(i.decode() if isinstance(i, bytes) else i for i in self.redis.smembers(f"{self.prefix}keys"))
        out = [r for r in (self.get(i) for i in ids) if r is not None]
        return sorted((r for r in out if tenant is None or r.tenant == tenant), key=lambda r: (r.tenant, r.created))

    def revoke(self, key_id: str) -> KeyRecord | None:
        rec = self.get(key_id)
        if rec is None:
            return None
        if rec.revoked is None:
            rec.revoked = time.time()
            self.put(rec, event="revoke")
        return rec

    def ensure_dev_key(self, dev_key: str | None) -> tuple[str | None, KeyRecord | None]:
        """The development admin key. With dev_key set (TOKENYARD_DEV_KEY / auth.dev_key): make sure
        its record exists (a revoked one stays revoked). Without: make a random one on the first
        start only; returns (key, record) when the key is new and must be shown, else (None, record)."""
        if dev_key:
            rec = self.get(key_id_of(hash_key(dev_key)))
            if rec is None or not rec.matches(hash_key(dev_key)):
                rec = new_record(dev_key, DEV_TENANT, name="dev", role="admin")
                self.put(rec)
            return dev_key, rec
        key = generate_key()
        rec = new_record(key, DEV_TENANT, name="dev", role="admin")
        if self.redis.set(f"{self.prefix}dev_key_id", rec.key_id, nx=True):
            self.put(rec)
            return key, rec
        existing = self.redis.get(f"{self.prefix}dev_key_id")
        return None, self.get(existing.decode() if isinstance(existing, bytes) else existing)
