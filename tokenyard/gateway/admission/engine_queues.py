"""Admission: the gateway holds the queue, the engine is fed as it has room.

    slot = await admission.admit(key_record, engine="demo-small", prompt_tokens=n, deadline=t)
    ...                                   # hand the request to the engine, run it
    slot.release()                        # when it ends, however it ends

Each engine has a bounded `FairQueue` (interactive before batch, weighted fair share of tokens
between tenants: the policy's tenant `weight`).
A request goes straight to the engine when nothing is queued and the engine has room; else it
is shed at once if the queue is full or its predicted wait exceeds its deadline (shedding.py),
or queued. The engine "has room" while fewer than `admission.max_running` requests (default:
the engine's max_num_seqs) are handed to it and its free KV blocks, from its latest stats less
what was handed to it since, cover the prompt; so the engine's own waiting set stays short and
the order of service is decided here, where tenants and deadlines are known.

A queued request that reaches its deadline is removed and answered 503 deadline_exceeded by a
timer at that moment: it never reaches the engine. The queue is pumped when a request ends,
when one arrives, and every `tick_ms` while it is not empty (KV room changes with each step).
The per-tenant cap counts a tenant's requests queued or running in this gateway.

Several gateway workers in front of one engine core (server.workers, tokenyard/gateway/server/supervisor.py
says why this design): each worker has its queue, and counts the requests the other workers hold in the
core (EngineProcess.others_in_flight, sent by the core after every step) as taking the engine's slots;
the free KV blocks come from the core's stats, which are the whole engine's.
"""
from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING, Any, Callable

from tokenyard.gateway.admission.desired_replicas import DesiredReplicas, DesiredReplicasConfig, ScalingSignals
from tokenyard.gateway.admission.fair_queue import FairQueue, Waiter
from tokenyard.gateway.admission.shedding import ArrivalRate, ServiceRate, WindowedRate, predicted_wait, shed
from tokenyard.gateway.auth.api_keys import PRIORITIES, KeyRecord
from tokenyard.gateway.config.autoscaling_config import MAX_RATE_WINDOW_S
from tokenyard.gateway.config.deployment import AdmissionConfig
from tokenyard.gateway.edge.edge_params import parse_int

if TYPE_CHECKING:
    from tokenyard.engines.core.backend import EngineBackend


class EngineQueue:
    def __init__(self, name: str, engine: EngineBackend, cfg: AdmissionConfig, metrics: Any) -> None:
        self.name = name
        self.engine = engine
        self.cfg = cfg
        self.metrics = metrics
        self.queue = FairQueue()
        self.running = 0                    # handed to the engine and not yet ended
        self.rate = ServiceRate()
        self.arrivals = [ArrivalRate() for _ in PRIORITIES]   # admitted per class, for overtaking
        self.admitted = WindowedRate(MAX_RATE_WINDOW_S)      # all classes, for the autoscaling signal
        self._pending_blocks = 0            # KV blocks handed out since the engine's last stats
        self._stats_step = -1
        self._wake: asyncio.Event | None = None
        self._ticker: asyncio.Task | None = None

    @property
    def slots(self) -> int:
        return self.cfg.max_running or self.engine.stats().max_num_seqs

    def predicted_wait(self, tenant: str = "", priority: int = len(PRIORITIES) - 1) -> float:
        if not self.queue and self.running < self.slots:
            return 0.0
        overtaking = sum(a.per_second() for a in self.arrivals[:priority])
        return predicted_wait(self.queue.ahead(tenant, priority), self.rate.per_second(self.running), overtaking)

    def replicas_up(self) -> int:
        """Replicas taking requests: a pool's routable awake ones (a sleeping replica is no capacity
        until it wakes), else 1 unless the engine is dead."""
        replicas = getattr(self.engine, "replicas", None)
        if replicas is None:
            return 0 if self.engine.dead else 1
        return sum(1 for r in replicas if r.awake)

    def scaling_signals(self, rate_window_s: float = 30.0) -> ScalingSignals:
        # Running: the engine's own count (all gateways' requests, for shared replicas) if larger than ours.
        s = self.engine.stats()
        return ScalingSignals(
            replicas=self.replicas_up(), slots=self.slots, running=max(self.running, s.num_running + s.num_waiting),
            queue_depth=len(self.queue), kv_usage=s.kv_usage, predicted_wait_s=self.predicted_wait(),
            arrival_rate=self.admitted.per_second(rate_window_s), service_rate=self.rate.per_second(self.running))

    def _room_for(self, blocks: int) -> bool:
        # Requests other gateway workers hold in the same engine core (server.workers; 0 otherwise), as the
        # core reported after its latest step: the slots are the engine's, not this worker's.
        running = self.running + getattr(self.engine, "others_in_flight", 0)
        if running >= self.slots:
            return False
        if running == 0:
            return True          # an idle engine takes anything: never deadlock on a big prompt
        s = self.engine.stats()
        if s.num_steps != self._stats_step:
            self._stats_step, self._pending_blocks = s.num_steps, 0
        return s.num_free_blocks - self._pending_blocks >= blocks

    def _grant(self, blocks: int) -> None:
        self.running += 1
        self._pending_blocks += blocks

    async def acquire(self, tenant: str, priority: int, deadline: float, blocks: int, cost: int = 1,
                      weight: int = 1) -> None:
        """Return when the engine has room for this request; raise the shed error otherwise.
        cost: the tokens it reserves (its share of the fair queue); weight: its tenant's."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if not self.queue and self._room_for(blocks):
            self._grant(blocks)
            self.arrivals[priority].add()
            self.admitted.add()
            return
        if len(self.queue) >= self.cfg.max_queue:
            rate = self.rate.per_second(self.running)
            raise self._shed("queue_full", 1.0 / rate if rate else 1.0)
        wait = self.predicted_wait(tenant, priority)
        if wait > deadline - now:
            retry = wait - (deadline - now) if math.isfinite(wait) else (self.rate.mean_s or 1.0)
            raise self._shed("predicted_wait", retry,
                             f" ({wait * 1000:.0f} ms predicted, {(deadline - now) * 1000:.0f} ms left)")
        self.arrivals[priority].add()
        self.admitted.add()
        w = Waiter(tenant, priority, deadline, blocks, loop.create_future(), now, cost=cost, weight=weight)
        w.timer = loop.call_at(deadline, self._expire, w)
        self.queue.push(w)
        self._kick()
        try:
            await w.future
        except asyncio.CancelledError:
            if self.queue.remove(w):
                w.timer.cancel()
            elif w.future.done() and not w.future.cancelled() and w.future.exception() is None:
                self.release(None)      # granted, but its handler went away before using the slot
            raise

    def release(self, held_s: float | None) -> None:
        self.running -= 1
        if held_s is not None:
            self.rate.observe(held_s)
        self._pump()

    def _shed(self, reason: str, retry_s: float, detail: str = "") -> Exception:
        self.metrics.shed.labels(self.name, reason).inc()
        return shed(reason, self.name, retry_s, detail)

    def _expire(self, w: Waiter) -> None:
        if self.queue.remove(w) and not w.future.done():
            self.metrics.expired.labels(self.name, PRIORITIES[w.priority]).inc()
            w.future.set_exception(shed("expired", self.name, self.rate.mean_s or 1.0))

    def _pump(self) -> None:
        loop_time = asyncio.get_running_loop().time()
        while (w := self.queue.peek()) is not None:
            if loop_time >= w.deadline:     # its timer is due this very iteration: never dispatch it
                w.timer.cancel()
                self._expire(w)
                continue
            if not self._room_for(w.blocks):
                return
            self.queue.pop()
            w.timer.cancel()
            self._grant(w.blocks)
            w.future.set_result(None)

    def _kick(self) -> None:
        if self._ticker is None:
            self._wake = asyncio.Event()
            self._ticker = asyncio.get_running_loop().create_task(self._tick(), name=f"admission-{self.name}")
        self._wake.set()

    async def _tick(self) -> None:
        tick = self.cfg.tick_ms / 1000
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.queue:
                self._pump()
                await asyncio.sleep(tick)

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            try:
                await self._ticker
            except asyncio.CancelledError:
                pass
            self._ticker = None


class Slot:
    """A request's place on an engine; release() exactly once when it ends."""

    __slots__ = ("_admission", "_queue", "tenant", "priority", "granted_at", "_released")

    def __init__(self, admission: "Admission", queue: EngineQueue, tenant: str, priority: int = 0) -> None:
        self._admission = admission
        self._queue = queue
        self.tenant = tenant
        self.priority = priority
        self.granted_at = time.perf_counter()
        self._released = False

    def release(self, served: bool = True) -> None:
        if self._released:
            return
        self._released = True
        self._queue.release(time.perf_counter() - self.granted_at if served else None)
        self._admission._leave(self.tenant)


class Admission:
    def __init__(self, cfg: AdmissionConfig, metrics: Any, engines: dict[str, EngineBackend]) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.queues: dict[str, EngineQueue] = {}
        self.tenants: dict[str, int] = {}   # requests queued or running per tenant
        # The tenant's fair-share weight; the policy state installs its lookup (policies: tenants.NAME.weight).
        self.weight_of: Callable[[str], int] = lambda tenant: 1
        # The desired-replicas rule (desired_replicas.py); the gateway sets slo_ttft_s from its metrics config.
        self.scaling = DesiredReplicasConfig()
        self._desired: dict[str, DesiredReplicas] = {}
        self.add_engines(engines)

    def add_engines(self, engines: dict[str, EngineBackend]) -> None:
        """Queues for engines that joined (the gateway loads its engines after it is built)."""
        for name, eng in engines.items():
            self.queues[name] = EngineQueue(name, eng, self.cfg, self.metrics)

    def deadline(self, header: str | None, elapsed_s: float) -> float:
        """Event-loop time by which the request must start: x-request-deadline-ms (a budget in ms
        from its arrival at the gateway, capped at max_deadline_ms) or the configured default."""
        ms = self.cfg.default_deadline_ms
        if header is not None:
            ms = min(parse_int(header.strip(), "x-request-deadline-ms", minimum=1, code="invalid_deadline"),
                     self.cfg.max_deadline_ms)
        return asyncio.get_running_loop().time() + ms / 1000 - elapsed_s

    async def admit(self, rec: KeyRecord, engine: str, prompt_tokens: int, deadline: float,
                    priority: int | None = None, max_tokens: int = 0) -> Slot:
        """priority: the admission class index (a policy rule or the request may set it); None: the
        key's class. prompt_tokens + max_tokens is what the request costs in the fair queue."""
        priority = rec.priority_class if priority is None else priority
        q = self.queues[engine]
        cap = self.cfg.max_concurrent_per_tenant if rec.max_concurrent is None else rec.max_concurrent
        held = self.tenants.get(rec.tenant, 0)
        if cap and held >= cap:
            mean = q.rate.mean_s or 1.0
            raise q._shed("tenant_concurrency", mean / cap, f" ({held} in flight, cap {cap})")
        block_size = max(1, q.engine.stats().block_size)
        blocks = math.ceil((prompt_tokens + 1) / block_size)
        self.tenants[rec.tenant] = held + 1
        try:
            await q.acquire(rec.tenant, priority, deadline, blocks, prompt_tokens + max_tokens,
                            self.weight_of(rec.tenant))
        except BaseException:
            self._leave(rec.tenant)
            raise
        return Slot(self, q, rec.tenant, priority)

    def _leave(self, tenant: str) -> None:
        n = self.tenants.get(tenant, 0) - 1
        if n > 0:
            self.tenants[tenant] = n
        else:
            self.tenants.pop(tenant, None)

    def snapshot(self) -> dict[str, tuple[list[int], float]]:
        """Per engine: queue depth per class and the predicted wait of a new batch request."""
        return {name: ([q.queue.depth(c) for c in range(len(PRIORITIES))], q.predicted_wait())
                for name, q in self.queues.items()}

    def desired_replicas(self, now: float | None = None) -> dict[str, int]:
        """Per engine: the replicas it should run (tokenyard_engine_desired_replicas). Each call
        advances the scale-down hysteresis, which counts seconds, not calls, so scrapers may poll."""
        now = time.monotonic() if now is None else now
        out = {}
        for name, q in self.queues.items():
            tracker = self._desired.get(name)
            if tracker is None or tracker.cfg is not self.scaling:
                tracker = self._desired[name] = DesiredReplicas(self.scaling)
            out[name] = tracker.update(q.scaling_signals(self.scaling.rate_window_s), now)
        return out

    async def stop(self) -> None:
        for q in self.queues.values():
            await q.stop()
