"""The routing policy in force in one gateway, kept equal to Redis's current version.

Start-up (`start`): Redis's current version if there is one; else the deployment's `policy:` file
is imported as version 1 (author "import:<file name>"); else the built-in default, which is *no
policy*: routing, limits and prices stay exactly as the deployment says (today's behaviour,
version 0). Without Redis (tests that set no redis_url) the file is loaded locally.

Updates: every gateway subscribes to `{prefix}policy:events`; "version N" makes it read version
N and swap it in (one assignment: requests in flight keep the policy they started with). As a
safety net against a missed message (a dropped subscription), the current version number is
also read every POLL_S seconds and on every (re)subscribe.

A version that names engines this deployment lacks is refused at apply time; if one arrives
anyway (another deployment sharing the prefix), it is logged and the previous one stays.

Router artifacts named by the policy (`router.artifact`: the router in force, replacing the
deployment's; `router.shadow`: a candidate scored beside it) are read from Redis
(tokenyard/gateway/routing/artifact_store.py) and verified before the version is swapped in; a missing
or tampered one keeps the previous version in force (logged, `tokenyard_router_artifact_refusals_total`),
or fails the start. `router` is the two-engine router requests are scored with, `shadow` the candidate
(both None when absent); they change with the version, in the same assignment.
"""
from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from tokenyard.gateway.policy.store import PolicyStore, deployment_problems, events_channel
from tokenyard.gateway.policy.work import off_loop
from tokenyard.gateway.routing.artifact_store import ArtifactStore
from tokenyard.gateway.routing.learned_router import LearnedRouter
from tokenyard.policies import Policy, PolicyError, PolicyVersion, next_version
from tokenyard.policies.schema import Prices
from tokenyard.router_models.runtime.artifact import Artifact, ArtifactError
from tokenyard.router_models.runtime.calibration import threshold_from_quantiles
from tokenyard.router_models.runtime.scorer import Scorer

if TYPE_CHECKING:
    from tokenyard.gateway.config.deployment import Deployment
    from tokenyard.gateway.routing.engine_set_router import EngineSetRouter

log = logging.getLogger("tokenyard.policy")
POLL_S = 5.0
WINDOW_US_PER_MIN = 60_000_000


class PolicyStartError(RuntimeError):
    """The policy named by the deployment (or Redis's) cannot be used; the message says why."""


class PolicyState:
    def __init__(self, deployment: "Deployment", metrics: Any,
                 learned: "LearnedRouter | EngineSetRouter | None") -> None:
        self.deployment = deployment
        self.metrics = metrics
        self.learned = learned          # the deployment's router (router.artifact in the YAML)
        self.router: "LearnedRouter | EngineSetRouter | None" = learned   # the router in force
        self.shadow: LearnedRouter | None = None                          # the policy's candidate
        self.version: PolicyVersion | None = None
        self.policy: Policy | None = None
        self.prices: dict[str, Prices] = {}
        self.router_threshold: float | None = learned.threshold if learned is not None else None
        self.source = "builtin"
        self.store: PolicyStore | None = None
        self._tasks: list[asyncio.Task] = []

    @property
    def number(self) -> int:
        return self.version.version if self.version is not None else 0

    @property
    def engines(self) -> list[str]:
        return list(self.deployment.engines)

    def install(self, v: PolicyVersion, source: str, artifacts: dict[str, Artifact] | None = None) -> None:
        """Swap in version v (raises PolicyError when it does not fit this deployment); artifacts:
        the router artifacts it names, by ref, already read and verified (`fetch_artifacts`)."""
        self._swap(v, *self._prepare(v, artifacts or {}), source)

    async def fetch_artifacts(self, v: PolicyVersion) -> dict[str, Artifact]:
        """The router artifacts version v names, verified (ArtifactError when one is missing or tampered)."""
        policy = v.policy()
        refs = [r for r in (policy.router.artifact, policy.router.shadow) if r is not None]
        if not refs:
            return {}
        if self.store is None:
            raise ArtifactError(f"policy version {v.version} names router artifact {refs[0]}, which only a "
                                "gateway with Redis can read")
        store = ArtifactStore(self.store.redis, self.deployment.redis_prefix)
        return {ref: await store.load(ref) for ref in refs}

    def _two_engine(self, policy: Policy, art: Artifact) -> LearnedRouter:
        """A published artifact as a router between the policy's small and large engines, with the
        threshold the policy gives it (its own calibrated one, a target share resolved on its own
        quantiles, or the policy's raw threshold, which decide() applies)."""
        share = policy.router.target_large_share
        return LearnedRouter(Scorer(art, target_large_share=share), policy.engines.small, policy.engines.large)

    def _prepare(self, v: PolicyVersion, artifacts: dict[str, Artifact]) -> tuple[Any, ...]:
        """The CPU part of installing (parse, check, threshold, routers): runs off the loop on refresh."""
        policy = v.policy()
        problems = deployment_problems(policy, self.engines)
        if problems:
            raise PolicyError(problems)
        for ref in (policy.router.artifact, policy.router.shadow):
            if ref is not None and ref not in artifacts:
                raise ArtifactError(f"policy version {v.version} names router artifact {ref}, which only a "
                                    "gateway with Redis can read")
        router: Any = self.learned
        if policy.router.artifact is not None:
            router = self._two_engine(policy, artifacts[policy.router.artifact])
        shadow = self._two_engine(policy, artifacts[policy.router.shadow]) if policy.router.shadow else None
        threshold = router.threshold if isinstance(router, LearnedRouter) else None
        if policy.router.target_large_share is not None and isinstance(router, LearnedRouter):
            threshold = threshold_from_quantiles(router.scorer.artifact.quantiles,
                                                 policy.router.target_large_share)
        prices = dict(policy.prices)
        return policy, prices, threshold, router, shadow

    def _swap(self, v: PolicyVersion, policy: Policy, prices: dict[str, Prices], threshold: float | None,
              router: Any, shadow: LearnedRouter | None, source: str) -> None:
        # One tuple of assignments between awaits: a request never sees half of a version.
        self.version, self.policy, self.prices, self.router_threshold, self.router, self.shadow, self.source = \
            v, policy, prices, threshold, router, shadow, source
        self.metrics.policy_version.set(v.version)
        self.metrics.policy_updates.labels(source).inc()
        log.info("policy version %d in force (%s, hash %s, by %s)", v.version, source, v.hash[:12], v.author)

    def weight_of(self, tenant: str) -> int:
        """The tenant's fair-share weight in the admission queues (1 without a policy)."""
        policy = self.policy
        return policy.weight_of(tenant) if policy is not None else 1

    def rate_for(self, tenant: str) -> tuple[int, int, int] | None:
        """(request_limit, token_limit, window_us) of the tenant's rate class, or None (no class).

        A class of R requests/min with a burst of B requests is a GCRA bucket of B requests over a
        window of B/R minutes (so R per minute, B at once); the token bucket uses the same window:
        tokens_per_min x B/R tokens."""
        if self.policy is None:
            return None
        rc = self.policy.rate_class_for(tenant)
        if rc is None:
            return None
        window_us = max(1, round(rc.burst * WINDOW_US_PER_MIN / rc.requests_per_min))
        tokens = max(1, round(rc.tokens_per_min * rc.burst / rc.requests_per_min))
        return rc.burst, tokens, window_us

    # -- start-up and updates -----------------------------------------------------------------
    def _file_text(self) -> str | None:
        path = self.deployment.policy_file
        if path is None:
            return None
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise PolicyStartError(f"policy: cannot read {path}: {e}") from e

    def start_local(self) -> None:
        """No Redis: the deployment's policy file (if any) is version 1 of this gateway alone."""
        text = self._file_text()
        if text is None:
            return
        try:
            v = next_version(None, text, f"import:{self.deployment.policy_file.name}", datetime.now(timezone.utc),
                             note=f"imported from {self.deployment.policy_file}")
            self.install(v, "file")
        except (PolicyError, ArtifactError) as e:
            raise PolicyStartError(f"policy: {self.deployment.policy_file}: {e}") from e

    async def start_redis(self, redis: Any, pubsub_client: Any) -> None:
        self.store = PolicyStore(redis, self.deployment.redis_prefix, run=off_loop)
        try:
            current = await self.store.current()
            if current is None and self.deployment.policy_file is not None:
                text = self._file_text()
                try:
                    current, _ = await self.store.apply(
                        text, f"import:{self.deployment.policy_file.name}", self.engines,
                        note=f"imported from {self.deployment.policy_file}", allow_unchanged=True)
                except PolicyError as e:
                    raise PolicyStartError(f"policy: {self.deployment.policy_file}: {e}") from e
                current = await self.store.current()   # another gateway may have imported first
            if current is not None:
                try:
                    self.install(current, "redis", await self.fetch_artifacts(current))
                except ArtifactError as e:
                    raise PolicyStartError(f"the current policy in Redis (version {current.version}): {e}") from e
                except PolicyError as e:
                    raise PolicyStartError(f"the current policy in Redis (version {current.version}) does not "
                                           f"fit this deployment: {e}") from e
        except PolicyStartError:
            raise
        except Exception as e:  # noqa: BLE001 - Redis down at start: the file, locally, until it answers
            log.warning("could not read the policy from redis (%s: %s); using the deployment's file until it "
                        "answers", type(e).__name__, e)
            self.start_local()
        loop = asyncio.get_running_loop()
        self._tasks += [loop.create_task(self._listen(pubsub_client)), loop.create_task(self._poll())]

    async def refresh(self) -> bool:
        """Install Redis's current version if it differs from ours; True when it changed."""
        if self.store is None:
            return False
        n = await self.store.current_number()
        if n == 0 or n == self.number:
            return False
        v = await self.store.get(n)
        if v is None:
            return False
        before = self.number
        try:
            artifacts = await self.fetch_artifacts(v)
        except ArtifactError as e:
            self.metrics.router_artifact_refusals.inc()
            log.error("policy version %d names a router artifact that cannot be used; keeping version %d: %s",
                      n, self.number, e)
            return False
        try:
            prepared = await off_loop(self._prepare, v, artifacts)
        except PolicyError as e:
            log.error("policy version %d does not fit this deployment; keeping version %d: %s", n, self.number, e)
            return False
        if self.number != before:
            return False        # another refresh installed a version while this one was being prepared
        self._swap(v, *prepared, "redis")
        return True

    async def _listen(self, pubsub_client: Any, reconnect_s: float = 1.0) -> None:
        channel = events_channel(self.deployment.redis_prefix)
        while True:
            pubsub = pubsub_client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                await self.refresh()            # whatever happened while we were not subscribed
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - resubscribe later; the poll covers the gap
                log.warning("policy events subscription lost (%s: %s); resubscribing", type(e).__name__, e)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:  # noqa: BLE001
                    pass
            await asyncio.sleep(reconnect_s)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - Redis away: keep the version we have
                log.debug("policy version check failed: %s", e)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
