"""Learning from the operator's traffic, at serving time: keep a sample of routed prompts for
feedback, and score each request with the policy's shadow candidate.

    learning = TrafficLearning(deployment.router_learning, redis, prefix, metrics)
    learning.observe(Observation(...))     # once per request the two-engine router scored (no I/O)
    await learning.flush()                 # what is queued, to Redis now (endpoints, tests, shutdown)

`observe` runs on the request path and never waits: a kept prompt is queued (bounded by
`router_learning.queue_max`; past it, dropped and counted) and the shadow candidate's decision is
added to in-memory counters (tokenyard/gateway/routing/shadow_tally.py). A background task writes both
to Redis every FLUSH_S seconds. Nothing here changes a request's route: the candidate is only counted.

Which prompts are kept (docs/router.md, "Learning from traffic"): only with `router_learning.enabled`,
only for enrolled tenants, not when the request's metadata says `tokenyard_learning: "off"`, not
prompts longer than `max_prompt_chars`, and then a `sample_rate` share chosen at random.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from tokenyard.gateway.routing.feedback_store import FeedbackStore
from tokenyard.gateway.routing.learned_router import LearnedRouter
from tokenyard.gateway.routing.shadow_tally import FLUSH_S, ShadowTally
from tokenyard.policies.evaluate import small_is_enough

log = logging.getLogger("tokenyard.router.learning")
OPT_OUT_TAG = "tokenyard_learning"      # request metadata: "off" keeps this request's prompt out


@dataclass(slots=True)
class Observation:
    """One request the two-engine router scored, as the route plan saw it."""

    request_id: str
    tenant: str
    metadata: dict[str, str] | None
    text: str                       # what the router scored (the messages' contents)
    prompt_tokens: int              # the count it scored with
    engine: str                     # the engine the plan chose (what feedback on the answer is about)
    score: float                    # the router in force's P(small is enough)
    current_large: bool             # the router in force's own decision (score below its threshold)
    router: LearnedRouter           # the router in force
    current_ref: str                # its policy ref, or "deployment"
    shadow: LearnedRouter | None = None
    shadow_ref: str | None = None
    shadow_threshold: float | None = None   # the threshold the candidate would decide with


class TrafficLearning:
    def __init__(self, settings: Any, redis: Any, prefix: str, metrics: Any, rng: random.Random | None = None) -> None:
        self.settings = settings            # config.learning_settings.LearningSettings
        self.redis = redis
        self.prefix = prefix
        self.metrics = metrics
        self.store = (FeedbackStore(redis, prefix, settings.retention_s, settings.max_labels_per_tenant)
                      if redis is not None else None)
        self.tally = ShadowTally()
        self._queue: list[tuple[str, str, dict[str, Any]]] = []
        self._rng = rng or random.Random()
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    # -- the request path ---------------------------------------------------------------------
    def observe(self, o: Observation) -> None:
        if o.shadow is not None and o.shadow_ref is not None:
            p = o.shadow.scorer.score(o.text, o.prompt_tokens)
            threshold = o.shadow.threshold if o.shadow_threshold is None else o.shadow_threshold
            candidate_large = not small_is_enough(p, threshold)
            self.tally.add(o.shadow_ref, o.current_ref, o.tenant, o.prompt_tokens, o.current_large,
                           candidate_large, p)
            outcome = ("agree" if candidate_large == o.current_large else "to_large" if candidate_large
                       else "to_small")
            self.metrics.router_shadow.labels(outcome).inc()
        self._sample(o)

    def _sample(self, o: Observation) -> None:
        s = self.settings
        if not s.enabled or self.store is None:
            return
        if (not s.enrolled(o.tenant) or (o.metadata or {}).get(OPT_OUT_TAG) == "off"
                or len(o.text) > s.max_prompt_chars or (s.sample_rate < 1.0 and self._rng.random() >= s.sample_rate)):
            self.metrics.router_samples.labels("skipped").inc()
            return
        if len(self._queue) >= s.queue_max:
            self.metrics.router_samples.labels("dropped").inc()
            return
        self._queue.append((o.tenant, o.request_id, {
            "prompt": o.text, "prompt_tokens": o.prompt_tokens, "engine": o.engine, "small": o.router.small,
            "large": o.router.large, "score": o.score, "router": o.current_ref, "time": time.time()}))

    # -- the writer ---------------------------------------------------------------------------
    async def flush(self) -> None:
        """Queued samples and shadow counts to Redis (a failed sample write is counted and dropped;
        failed counts are kept for the next flush)."""
        if self.redis is None:
            return
        async with self._lock:
            queued, self._queue = self._queue, []
            if queued and self.store is not None:
                try:
                    await self.store.put_samples(queued)
                    self.metrics.router_samples.labels("stored").inc(len(queued))
                except Exception as e:  # noqa: BLE001 - Redis away: these samples are lost, counted
                    self.metrics.router_samples.labels("failed").inc(len(queued))
                    log.warning("could not store %d routing samples: %s", len(queued), e)
            await self.tally.flush(self.redis, self.prefix)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - counts stay in memory until Redis answers
                log.debug("shadow counts not flushed: %s", e)

    def start(self) -> None:
        if self.redis is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            await self.flush()
        except Exception as e:  # noqa: BLE001 - shutting down with Redis away: the counts are lost
            log.warning("shadow counts lost at shutdown: %s", e)
