"""Router artifacts published to the deployment's Redis, named by their checksum, so that a policy
can name the router in force (`router.artifact`) or a shadow candidate (`router.shadow`) and every
gateway sharing the Redis loads the same bytes.

    store = ArtifactStore(redis_asyncio_client, prefix)
    ref = await store.publish(text)        # "sha256:<hex>": the artifact's own checksum; checked first
    art = await store.load(ref)            # the verified Artifact; ArtifactError when absent or tampered
    await store.refs()                     # every published ref

Redis layout: `{prefix}router:artifacts`, a hash ref -> the artifact file's JSON text. Published
artifacts are never changed or removed by the gateway (a policy version may name any of them, so a
rollback to it must still find its router).

Two checks guard what routes traffic: the artifact's `checksum` (sha256 of its canonical content,
tokenyard/router_models/runtime/artifact.py) must match its content, and it must equal the ref the
policy names. An artifact edited in Redis after it was published fails one or the other, and is
refused with an ArtifactError naming the ref: at `policy apply` time (the version is not stored) and
when a gateway installs a version (the previous version stays in force; tokenyard/gateway/policy/state.py).
Only two-engine artifacts (format version 1) are accepted: the N-engine router has no policy path yet.
"""
from __future__ import annotations

import json
from typing import Any

from tokenyard.router_models.runtime.artifact import Artifact, ArtifactError, from_json


def artifacts_key(prefix: str) -> str:
    return f"{prefix}router:artifacts"


def parse_artifact(text: str, ref: str | None = None) -> Artifact:
    """The verified artifact in `text`; with `ref`, its checksum must be that ref."""
    where = f"router artifact {ref}" if ref else "router artifact"
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as e:       # not JSON, nested too deep, an absurd number
        raise ArtifactError(f"{where}: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from e
    try:
        art = from_json(body)
    except ArtifactError as e:
        raise ArtifactError(f"{where}: {e}") from e
    except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as e:    # a body of the wrong shape
        raise ArtifactError(f"{where}: malformed ({type(e).__name__})") from e
    if ref is not None and body.get("checksum") != ref:
        raise ArtifactError(f"{where}: the stored artifact's checksum is {body.get('checksum')!r}, not the "
                            "checksum the policy names: it was replaced after it was published; publish it again")
    return art


class ArtifactStore:
    def __init__(self, redis: Any, prefix: str) -> None:
        self.redis = redis          # redis.asyncio client
        self.prefix = prefix

    async def publish(self, text: str) -> str:
        """Verify and store an artifact file's text; returns its ref (publishing twice is harmless)."""
        parse_artifact(text)
        ref = str(json.loads(text)["checksum"])     # verified equal to the content's hash
        await self.redis.hset(artifacts_key(self.prefix), ref, text)
        return ref

    async def text(self, ref: str) -> str | None:
        raw = await self.redis.hget(artifacts_key(self.prefix), ref)
        return raw.decode("utf-8") if isinstance(raw, bytes) else raw

    async def load(self, ref: str) -> Artifact:
        text = await self.text(ref)
        if text is None:
            raise ArtifactError(f"router artifact {ref} is not published in this deployment's Redis "
                                "(tokenyard router publish FILE)")
        return parse_artifact(text, ref)

    async def refs(self) -> list[str]:
        raw = await self.redis.hkeys(artifacts_key(self.prefix))
        return sorted(r.decode() if isinstance(r, bytes) else r for r in raw)
