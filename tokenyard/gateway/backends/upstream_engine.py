"""An engine that is another OpenAI-compatible server: its deployments, their health, and the choice
of one for each attempt.

    engine = UpstreamEngine("big", spec, metrics)      # spec: config.upstream_config.UpstreamSpec
    await engine.start()                               # one aiohttp session; first health check
    dep = engine.pick(exclude=set(), affinity=hashes)  # a Deployment, or None when all rest
    dep.begin(); ...; engine.succeeded(dep, seconds) / engine.failed(dep, outcome, retry_after)

To the gateway's admission, policy and pages it is an EngineBackend like the built-in ones (stats,
dead, max_model_len): admission hands it at most `max_concurrency` requests per deployment that
takes requests, and queues the rest with their deadlines. Requests never go through `add_request`
(the request flow calls the upstream itself: tokenyard/gateway/http/upstream_call.py).

Health: each deployment is "up", "cooling" (after a failure: connection refused, 5xx, timeout, a
broken stream, or a 429, for its Retry-After) or "trial" (the pause is over: one request, or the
health check, may test it). A failed trial doubles the pause up to `max_cooldown_s`; a success
makes it "up" again. Every `health_interval_s`, GET <base_url>/models checks the deployments
that are not up (and, less often, those that are), so a deployment that was down at start-up
joins as soon as it answers; the gateway itself starts whatever the upstreams do.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tokenyard.engines.core.errors import EngineDeadError
from tokenyard.engines.core.outputs import EngineStats
from tokenyard.gateway.backends.prefix_affinity import AffinityIndex
from tokenyard.gateway.backends.remote_engine import empty_stats
from tokenyard.gateway.config.upstream_config import UpstreamSpec

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 1 << 20       # when the deployment names none: the upstream checks its own context
EWMA_ALPHA = 0.2
AFFINITY_LRU = 16384


@dataclass(slots=True)
class Deployment:
    """One base URL of an upstream engine."""

    url: str
    label: str                          # host:port: what metrics, logs and usage records show
    cap: int                            # requests in flight at most
    state: str = "up"                   # up | cooling | trial
    until: float = 0.0                  # monotonic time the cooling ends
    pause_s: float = 0.0                # the current cooling length (doubles on a failed trial)
    in_flight: int = 0
    ewma_s: float | None = None         # time to the response head, smoothed
    affinity: AffinityIndex = field(default_factory=lambda: AffinityIndex(AFFINITY_LRU))
    trial_taken: bool = False           # a trial request is out

    def usable(self, now: float) -> bool:
        if self.state == "cooling" and now >= self.until:
            self.state, self.trial_taken = "trial", False
        if self.state == "up":
            return self.in_flight < self.cap
        return self.state == "trial" and not self.trial_taken


class UpstreamEngine:
    """EngineBackend facade plus the deployment choice for one `type: openai` engine."""

    def __init__(self, name: str, spec: UpstreamSpec, metrics: Any = None) -> None:
        self.name = name
        self.spec = spec
        self.metrics = metrics
        self.deployments = [Deployment(url, label, spec.max_concurrency)
                            for url, label in zip(spec.base_urls, spec.labels)]
        self.session: aiohttp.ClientSession | None = None
        self._health: asyncio.Task | None = None
        self._rr = 0

    # -- EngineBackend ----------------------------------------------------------------------
    @property
    def dead(self) -> str | None:
        """Down while every deployment cools down (a trial is still possible after the pause)."""
        now = time.monotonic()
        if any(d.state != "cooling" or now >= d.until for d in self.deployments):
            return None
        return f"every deployment of upstream engine {self.name} is failing"

    @property
    def max_model_len(self) -> int:
        return self.spec.max_model_len or DEFAULT_CONTEXT

    @property
    def num_in_flight(self) -> int:
        return sum(d.in_flight for d in self.deployments)

    @property
    def num_failed_steps(self) -> int:
        """No engine steps here (/metrics reads it of every engine): failed calls are counted per
        deployment in tokenyard_upstream_attempts."""
        return 0

    def stats(self) -> EngineStats:
        # Admission's room: `max_concurrency` per deployment that takes requests (at least one, so a
        # request can still reach a deployment whose pause has ended); no KV blocks to count.
        now = time.monotonic()
        up = sum(1 for d in self.deployments if d.state != "cooling" or now >= d.until)
        s = empty_stats(max_num_seqs=self.spec.max_concurrency * max(1, up), block_size=1)
        s.num_running = self.num_in_flight
        s.num_free_blocks = s.num_total_blocks = 1 << 30
        return s

    def add_request(self, *args: Any, **kwargs: Any) -> Any:
        raise EngineDeadError(f"engine {self.name} is an upstream: requests go through the upstream call")

    def abort(self, request_id: str) -> None:
        """Nothing to do here: an upstream call is cancelled by closing its HTTP response."""

    async def start(self) -> None:
        if self.session is None:
            t = self.spec.timeouts
            # limit=0: the concurrency cap is admission's; keep-alive connections are reused.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=True)
            self.session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s),
                auto_decompress=True, raise_for_status=False)
            await self.check_all(every=True)
            self._health = asyncio.get_running_loop().create_task(self._health_loop(), name=f"upstream-{self.name}")

    async def stop(self) -> None:
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
            self._health = None
        if self.session is not None:
            await self.session.close()
            self.session = None

    # -- choice ---------------------------------------------------------------------------------
    def pick(self, exclude: set[str], affinity: list[bytes] | None = None) -> Deployment | None:
        """A deployment for the next attempt (not in `exclude`, by url), or None when none can take it now."""
        now = time.monotonic()
        ready = [d for d in self.deployments if d.url not in exclude and d.usable(now)]
        if not ready:
            return None
        trial = next((d for d in ready if d.state == "trial"), None)
        if trial is not None:
            return trial           # a rested deployment is tried as soon as it may be
        balance = self.spec.balance
        if balance == "prefix_affinity" and affinity:
            best = max(ready, key=lambda d: (d.affinity.match(affinity), -d.in_flight))
            if best.affinity.match(affinity):
                return best
        if balance == "latency_ewma":
            # Unmeasured deployments first (they get a measurement), then by the expected wait.
            return min(ready, key=lambda d: (d.ewma_s is not None, (d.ewma_s or 0.0) * (1 + d.in_flight)))
        least = min(d.in_flight for d in ready)
        tied = [d for d in ready if d.in_flight == least]
        self._rr += 1
        return tied[self._rr % len(tied)]

    def begin(self, dep: Deployment, affinity: list[bytes] | None = None) -> None:
        dep.in_flight += 1
        if dep.state == "trial":
            dep.trial_taken = True
        if affinity:
            dep.affinity.record(affinity)

    def end(self, dep: Deployment) -> None:
        dep.in_flight = max(0, dep.in_flight - 1)

    def succeeded(self, dep: Deployment, head_s: float | None = None) -> None:
        if head_s is not None:
            dep.ewma_s = head_s if dep.ewma_s is None else (1 - EWMA_ALPHA) * dep.ewma_s + EWMA_ALPHA * head_s
            if self.metrics is not None:
                self.metrics.upstream_latency.labels(self.name, dep.label).observe(head_s)
        if dep.state != "up":
            log.info("upstream engine %s: deployment %s is back", self.name, dep.label)
        dep.state, dep.pause_s, dep.trial_taken = "up", 0.0, False
        self._gauge(dep)

    def failed(self, dep: Deployment, retry_after_s: float | None = None) -> None:
        """Cool the deployment down: Retry-After's pause for a 429, else the cooldown (doubled after a
        failed trial, up to max_cooldown_s), with jitter so gateways do not return all at once."""
        spec = self.spec
        if retry_after_s is not None:
            pause = min(max(retry_after_s, 0.0), spec.max_cooldown_s)
        elif dep.state == "trial":
            pause = min(max(dep.pause_s, spec.cooldown_s) * 2, spec.max_cooldown_s)
        else:
            pause = spec.cooldown_s
        dep.pause_s = pause
        dep.until = time.monotonic() + pause * random.uniform(1.0, 1.1)
        if dep.state != "cooling":
            log.warning("upstream engine %s: deployment %s cooled down for %.1f s", self.name, dep.label, pause)
            if self.metrics is not None:
                self.metrics.upstream_cooldowns.labels(self.name, dep.label).inc()
        dep.state, dep.trial_taken = "cooling", False
        self._gauge(dep)

    def _gauge(self, dep: Deployment) -> None:
        if self.metrics is not None:
            self.metrics.upstream_up.labels(self.name, dep.label).set(1 if dep.state == "up" else 0)

    # -- health -----------------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        rounds = 0
        while True:
            await asyncio.sleep(min(self.spec.health_interval_s, max(0.05, self.spec.cooldown_s / 2)))
            rounds += 1
            # Resting deployments are checked often (a trial as soon as the pause ends); healthy ones
            # every health_interval_s (a request failing on them cools them down sooner anyway).
            every = rounds * min(self.spec.health_interval_s, max(0.05, self.spec.cooldown_s / 2)) \
                >= self.spec.health_interval_s
            if every:
                rounds = 0
            try:
                await self.check_all(every=every)
            except asyncio.CancelledError:
                raise
            except Exception:      # noqa: BLE001 - a health check must never end the loop
                log.exception("upstream engine %s: health check failed", self.name)

    async def check_all(self, every: bool) -> None:
        now = time.monotonic()
        todo = [d for d in self.deployments if every or (d.state != "up" and now >= d.until)]
        await asyncio.gather(*(self.check(d) for d in todo))

    async def check(self, dep: Deployment) -> bool:
        """GET <base_url>/models: a 2xx within the connect + first-token timeouts means it serves."""
        if self.session is None:
            return False
        t = self.spec.timeouts
        try:
            async with self.session.get(dep.url + "/models", headers=self.headers(),
                                        timeout=aiohttp.ClientTimeout(total=t.connect_s + t.first_token_s,
                                                                      sock_connect=t.connect_s)) as resp:
                await resp.read()
                ok = 200 <= resp.status < 300
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            ok = False
        if ok:
            if dep.state != "up":
                self.succeeded(dep)
            else:
                self._gauge(dep)
        elif dep.state == "up" or time.monotonic() >= dep.until:
            self.failed(dep)
        return ok

    def headers(self) -> dict[str, str]:
        """The deployment's extra headers and the key (read here, at the moment it is sent)."""
        out = dict(self.spec.headers)
        if self.spec.api_key is not None:
            out["Authorization"] = "Bearer " + self.spec.api_key.value
        return out
