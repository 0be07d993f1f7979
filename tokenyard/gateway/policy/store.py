"""The policy of record in Redis: versioned, with a current-version pointer, announced by pub/sub.

    store = PolicyStore(redis_asyncio_client, prefix)
    v = await store.apply(yaml_text, author="ops-admin", engines=["demo-small", "demo-large"])
    v = await store.rollback(3, author="ops-admin", engines=...)
    cur = await store.current()            # PolicyVersion or None (no policy applied yet)
    await store.history()                  # newest first

Redis layout (every name starts with the deployment's redis_prefix):
    {prefix}policy:versions   hash: version number -> PolicyVersion JSON (version, hash, author,
                              applied_at, document, diff, note); versions are never changed or removed
    {prefix}policy:current    the current version number
    {prefix}policy:events     pub/sub channel: "version N" when N becomes current

A version whose `router.artifact` / `router.shadow` names a router artifact that is not published
in this Redis, or fails its checksum (tokenyard/gateway/routing/artifact_store.py), is refused like
an invalid document (PolicyError), on apply and on rollback alike.

A version is made by tokenyard.policies.next_version / rollback_to (validation, canonical hash, diff) and
installed by one Lua script (tokenyard/gateway/policy/lua/policy_apply.lua) that checks the current version is
still the one the new version was made against: two admins applying at once cannot both win
with the same number or a diff against the wrong predecessor; the loser re-reads and retries.
Used by the gateway (admin API, start-up import) and by `tokenyard policy` (tokenyard/cli/policy.py).
"""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable

from tokenyard.gateway.routing.artifact_store import ArtifactStore
from tokenyard.policies import Policy, PolicyError, PolicyVersion, Problem, next_version, rollback_to
from tokenyard.router_models.runtime.artifact import ArtifactError

_LUA = Path(__file__).resolve().parent / "lua" / "policy_apply.lua"
RETRIES = 8


def versions_key(prefix: str) -> str:
    return f"{prefix}policy:versions"


def current_key(prefix: str) -> str:
    return f"{prefix}policy:current"


def events_channel(prefix: str) -> str:
    return f"{prefix}policy:events"


class PolicyConflict(Exception):
    """The current version kept moving while we tried to apply (RETRIES times)."""


class NoSuchVersion(PolicyError):
    pass


def deployment_problems(policy: Policy, engines: Iterable[str]) -> list[Problem]:
    """A policy valid on its own may still name engines this deployment does not have."""
    known = set(engines)
    problems: list[Problem] = []
    allowed = tuple(sorted(known))
    for role in ("small", "large"):
        name = getattr(policy.engines, role)
        if name not in known:
            problems.append(Problem(f"engines.{role}", f"engine {name!r} is not an engine of this deployment",
                                    allowed=allowed))
    for i, name in enumerate(policy.engines.tiers):
        if name not in known:
            problems.append(Problem(f"engines.tiers[{i}]", f"engine {name!r} is not an engine of this deployment",
                                    allowed=allowed))
    for i, rule in enumerate(policy.rules):
        # a pin to ENGINE:ADAPTER needs the engine; its adapters may load at run time
        if rule.action.pin is not None and rule.action.pin.partition(":")[0] not in known:
            problems.append(Problem(f"rules[{i}].action.pin",
                                    f"engine {rule.action.pin!r} is not an engine of this deployment",
                                    allowed=allowed))
    return problems


async def inline(fn: Callable[..., Any], *args: Any) -> Any:
    """Run CPU work right here (the CLI); the gateway passes policy_work.off_loop instead."""
    return fn(*args)


def _made(previous: PolicyVersion | None, document: str, author: str, note: str,
          engines: list[str] | None) -> tuple[PolicyVersion, list[Problem]]:
    """The next version and its deployment problems: all the CPU work of an apply, in one call."""
    version = next_version(previous, document, author, datetime.now(timezone.utc), note=note)
    return version, deployment_problems(version.policy(), engines) if engines is not None else []


def _rolled_back(history: list[PolicyVersion], version: int, author: str,
                 engines: list[str] | None) -> tuple[PolicyVersion, list[Problem]]:
    new = rollback_to(history, version, author, datetime.now(timezone.utc))
    return new, deployment_problems(new.policy(), engines) if engines is not None else []


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class PolicyStore:
    def __init__(self, redis: Any, prefix: str,
                 run: Callable[..., Awaitable[Any]] = inline) -> None:
        self.redis = redis                 # redis.asyncio client
        self.prefix = prefix
        self.run = run                     # how validation, hashing and diffs run (off the loop in the gateway)
        self._script = redis.register_script(_LUA.read_text())

    async def current_number(self) -> int:
        raw = await self.redis.get(current_key(self.prefix))
        return int(_s(raw)) if raw else 0

    async def get(self, version: int) -> PolicyVersion | None:
        raw = await self.redis.hget(versions_key(self.prefix), str(version))
        return PolicyVersion.from_dict(json.loads(raw)) if raw else None

    async def current(self) -> PolicyVersion | None:
        n = await self.current_number()
        return await self.get(n) if n else None

    async def history(self, limit: int | None = None) -> list[PolicyVersion]:
        """Every version, newest first (limit: the newest `limit`)."""
        raw = await self.redis.hgetall(versions_key(self.prefix))
        out = sorted((PolicyVersion.from_dict(json.loads(v)) for v in raw.values()), key=lambda v: -v.version)
        return out[:limit] if limit is not None else out

    async def apply(self, document: str, author: str, engines: Iterable[str] | None = None,
                    note: str = "", allow_unchanged: bool = False) -> tuple[PolicyVersion, bool]:
        """Validate and make `document` the current version. Returns (version, applied); applied is
        False when the document means exactly the current policy (same hash; nothing stored)
        unless allow_unchanged. Raises PolicyError (invalid, or engines unknown to the deployment)."""
        engines = list(engines) if engines is not None else None
        for _ in range(RETRIES):
            previous = await self.current()
            version, problems = await self.run(_made, previous, document, author, note, engines)
            problems += await self.artifact_problems(version.policy())
            if problems:
                raise PolicyError(problems)
            if previous is not None and previous.hash == version.hash and not allow_unchanged:
                return previous, False
            if await self._install(previous, version):
                return version, True
        raise PolicyConflict("the current policy version kept changing; try again")

    async def rollback(self, version: int, author: str, engines: Iterable[str] | None = None) -> PolicyVersion:
        """A new version carrying `version`'s exact document (NoSuchVersion when there is none)."""
        engines = list(engines) if engines is not None else None
        for _ in range(RETRIES):
            history = await self.history()
            if not any(v.version == version for v in history):
                raise NoSuchVersion([Problem("version", f"no policy version {version}",
                                             allowed=tuple(str(v.version) for v in reversed(history)))])
            new, problems = await self.run(_rolled_back, history, version, author, engines)
            problems += await self.artifact_problems(new.policy())
            if problems:
                raise PolicyError(problems)
            previous = history[0]
            if await self._install(previous, new):
                return new
        raise PolicyConflict("the current policy version kept changing; try again")

    async def artifact_problems(self, policy: Policy) -> list[Problem]:
        """The router artifacts the policy names, each published here and intact (a Problem each if not)."""
        out: list[Problem] = []
        store = ArtifactStore(self.redis, self.prefix)
        for key in ("artifact", "shadow"):
            ref = getattr(policy.router, key)
            if ref is None:
                continue
            try:
                await store.load(ref)
            except ArtifactError as e:
                out.append(Problem(f"router.{key}", str(e)))
        return out

    async def _install(self, previous: PolicyVersion | None, new: PolicyVersion) -> bool:
        expected = str(previous.version) if previous is not None else "0"
        ok, _ = await self._script(keys=[current_key(self.prefix), versions_key(self.prefix)],
                                   args=[expected, str(new.version), json.dumps(new.to_dict()),
                                         events_channel(self.prefix)])
        return int(ok) == 1
