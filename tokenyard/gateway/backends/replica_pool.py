"""Several replicas of one engine behind the AsyncEngine interface the gateway already uses.

    pool = ReplicaPool("demo-large", [Replica("local", AsyncEngine(...)), Replica(url, RemoteEngine(url))], cfg)
    await pool.start()
    stream = pool.add_request(rid, prompt_ids, params, priority=0, cache_salt=tenant)

Admission, Generation and metrics see one engine: `stats()` sums the routable replicas (running,
waiting, KV blocks, max_num_seqs), so the gateway's queue feeds the pool as a whole and the
autoscaling gauges describe the fleet.

Choice of replica (`replica_pool.policy`):
- cache_aware (default): the replica with the lowest cost
      load + kv_weight x kv_usage - affinity_weight x (leading prompt blocks it was sent before /
      blocks hashed)
  where load is the requests it has (this gateway's in flight, or the replica's own running +
  waiting, whichever is larger) and the affinity comes from prefix_affinity.AffinityIndex. A
  prompt whose prefix went to a replica goes there again unless that replica is more than
  about affinity_weight (16) requests busier; unseen prefixes go to the least loaded replica (ties
  in turn), so distinct prefixes spread evenly.
- least_loaded: the same without affinity; round_robin: in turn.

Health: remote replicas are checked with GET /health every health_interval_s; a failed check
or a request that failed in transport counts a failure, and eject_after_failures in a row
eject the replica (no new requests, its affinity index forgotten: its cache may be gone). An
ejected replica returns after readmit_after_successes good checks in a row. A replica that is
alive but not ready (draining, starting) gets no new requests and is not counted as failing.

Sleep (tokenyard/gateway/backends/replica_sleep.py, the admin API): a replica asleep (KV cache
released, level 1; weights dropped too, level 2) stays in the pool but is chosen only when no
replica is awake; then the request goes to one already waking, else to the lightest sleeper,
which wakes for it (the request waits for the wake within its deadline; a replica wakes itself when
a request reaches it). Sleeping replicas are not summed into `stats()` while one is awake, so
admission and the autoscaling signals do not count them as capacity. A replica that fails while
waking fails its requests before their first token: they are retried like any other.

Retry: a request whose replica failed before sending its first token (refused, reset, 503
draining) is run on another replica, up to max_attempts replicas in all; once a token was
streamed it is never retried, and the client gets the error.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import replace
from typing import Any, AsyncIterator, Callable

from tokenyard.engines.core.errors import EngineDeadError
from tokenyard.engines.core.outputs import EngineStats, StepOutput
from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.core.sleep_level import AWAKE, WAKING
from tokenyard.engines.runtime.async_engine import RequestStream
from tokenyard.gateway.backends.prefix_affinity import AffinityIndex, prefix_hashes
from tokenyard.gateway.backends.remote_engine import RemoteEngine, empty_stats
from tokenyard.gateway.config.replica_config import PoolConfig

log = logging.getLogger("tokenyard.replicas")


class Replica:
    """One member of a pool, with its health state and counters (read by the metrics)."""

    def __init__(self, label: str, engine: Any, cfg: PoolConfig, remote: bool) -> None:
        self.label = label                 # the url, or "local"
        self.engine = engine               # AsyncEngine or RemoteEngine
        self.remote = remote
        self.index = AffinityIndex(cfg.affinity_index_size)
        self.healthy = not remote          # remote replicas are admitted by their first good check
        self.ready = True
        self.ever_ok = not remote
        self.failures = 0                  # consecutive
        self.successes = 0                 # consecutive good checks
        self.chosen = 0                    # requests routed here
        self.affinity_hits = 0             # of those, chosen with a known prefix
        self.ejections = 0
        self.retries_from = 0              # requests retried elsewhere after failing here
        self.sleep_pending = False         # an admin sleep is draining it: others are chosen first
        self.wake_sent = False             # a request went to it while it slept: it is waking for it

    @property
    def routable(self) -> bool:
        return self.healthy and self.ready and self.engine.dead is None

    @property
    def sleep_state(self) -> str:
        """"awake", "asleep" or "waking", as the engine reports it (a remote one: its latest stats) or
        "waking" from the moment a request was sent to it asleep."""
        reported = getattr(self.engine, "sleep_state", AWAKE)
        if reported == AWAKE:
            self.wake_sent = False
            return AWAKE
        return WAKING if self.wake_sent else reported

    @property
    def sleep_level(self) -> int:
        return int(getattr(self.engine, "sleep_level", 0))

    @property
    def awake(self) -> bool:
        """Routable, awake and not being put to sleep: counted as capacity."""
        return self.routable and not self.sleep_pending and self.sleep_state == AWAKE

    @property
    def state(self) -> str:
        """For the metrics: "up" (routable and awake), "asleep", "waking" or "down"."""
        if not self.routable:
            return "down"
        sleep = self.sleep_state
        return "up" if sleep == AWAKE else sleep

    def load(self) -> int:
        s = self.engine.stats()
        return max(self.engine.num_in_flight, s.num_running + s.num_waiting)


class PoolStream:
    """The outputs of one request, whichever replica ends up serving it."""

    def __init__(self, pool: "ReplicaPool", request_id: str, call: tuple, replica: Replica,
                 inner: RequestStream) -> None:
        self.pool = pool
        self.request_id = request_id
        self.call = call                   # (prompt ids, params, priority, salt) for a retry
        self.replica = replica
        self.inner = inner
        self.tried = [replica]
        self.delivered = False             # a token reached the reader: never retry
        self.aborted = False
        self.finished = False

    async def get(self) -> StepOutput:
        while True:
            out = await self.inner.get()
            if (out.finish_reason == "error" and not self.delivered and not self.aborted
                    and getattr(self.inner, "retryable", False) and self.pool._retry(self)):
                continue
            return self._seen(out)

    def get_nowait(self) -> StepOutput | None:
        out = self.inner.get_nowait()
        return None if out is None else self._seen(out)

    def _seen(self, out: StepOutput) -> StepOutput:
        if out.new_token_ids:
            self.delivered = True
        if out.finished:
            self.finished = True
            self.pool._streams.pop(self.request_id, None)
        return out

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        while not self.finished:
            yield await self.get()


class ReplicaPool:
    def __init__(self, name: str, replicas: list[Replica], cfg: PoolConfig, model_fingerprint: str = "") -> None:
        if not replicas:
            raise ValueError("a replica pool needs at least one replica")
        self.name = name
        self.replicas = replicas
        self.cfg = cfg
        self.model_fingerprint = model_fingerprint
        self._streams: dict[str, PoolStream] = {}
        self._turn = itertools.count()
        self._health: asyncio.Task | None = None
        self.retries = 0
        self.num_failed_steps_local = 0
        for r in replicas:
            if r.remote:
                r.engine.on_failure = lambda msg, r=r: self._failed(r, msg)

    # -- the AsyncEngine interface ------------------------------------------------------------
    @property
    def dead(self) -> str | None:
        if any(r.routable for r in self.replicas):
            return None
        return "no healthy replica"

    @property
    def max_model_len(self) -> int:
        known = [r.engine.max_model_len for r in self.replicas if not r.remote or r.engine.info]
        return min(known) if known else (self.cfg.max_model_len or 4096)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_failed_steps(self) -> int:
        return sum(r.engine.num_failed_steps for r in self.replicas)

    @property
    def block_size(self) -> int:
        for r in self.replicas:
            if not r.remote or r.engine.info:
                return r.engine.stats().block_size
        return 16

    def stats(self) -> EngineStats:
        """The awake replicas' stats summed (else the routable ones', else all replicas')."""
        members = ([r for r in self.replicas if r.awake] or [r for r in self.replicas if r.routable]
                   or self.replicas)
        known = [r.engine.stats() for r in members if not r.remote or r.engine.info]
        if not known:
            return empty_stats(max_num_seqs=1, block_size=self.block_size)
        total = sum(s.num_total_blocks for s in known)
        free = sum(s.num_free_blocks for s in known)
        hit_tokens = sum(s.prefix_cache_hit_tokens for s in known)
        queried = sum(s.prefix_cache_hit_tokens / s.prefix_cache_hit_rate for s in known if s.prefix_cache_hit_rate)
        return replace(
            known[0], num_running=sum(s.num_running for s in known), num_waiting=sum(s.num_waiting for s in known),
            num_free_blocks=free, num_total_blocks=total, kv_usage=(total - free) / total if total else 0.0,
            num_preemptions=sum(s.num_preemptions for s in known),
            num_grammar_closed=sum(s.num_grammar_closed for s in known),
            prefix_cache_hit_rate=hit_tokens / queried if queried else 0.0, prefix_cache_hit_tokens=hit_tokens,
            num_steps=sum(s.num_steps for s in known), last_step_tokens=sum(s.last_step_tokens for s in known),
            max_num_seqs=sum(s.max_num_seqs for s in known),
            max_num_batched_tokens=sum(s.max_num_batched_tokens for s in known))

    async def start(self) -> None:
        await asyncio.gather(*(r.engine.start() for r in self.replicas))
        await self.check_all()
        if any(r.remote for r in self.replicas) and self._health is None:
            self._health = asyncio.get_running_loop().create_task(self._health_loop(), name=f"health-{self.name}")

    async def stop(self) -> None:
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
            self._health = None
        for r in self.replicas:
            await r.engine.stop()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | dict | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> PoolStream:
        """Choose a replica and hand the request to it; EngineDeadError when none will take it."""
        call = (prompt_token_ids, params, priority, cache_salt)
        stream: PoolStream | None = None
        exclude: list[Replica] = []
        while len(exclude) < self.cfg.max_attempts:
            replica = self.choose(prompt_token_ids, cache_salt, exclude)
            if replica is None:
                break
            try:
                inner = replica.engine.add_request(request_id, prompt_token_ids, params, priority, cache_salt)
            except EngineDeadError:
                exclude.append(replica)
                continue
            stream = PoolStream(self, request_id, call, replica, inner)
            stream.tried = exclude + [replica]
            break
        if stream is None:
            raise EngineDeadError(f"engine {self.name}: no healthy replica")
        self._streams[request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.aborted = True
            stream.replica.engine.abort(request_id)

    # -- choice -------------------------------------------------------------------------------
    def choose(self, prompt_ids: list[int], salt: str | None, exclude: list[Replica] = ()) -> Replica | None:
        cands = [r for r in self.replicas if r.routable and r not in exclude]
        if not cands:
            return None
        cands = self._awake_first(cands)
        turn = next(self._turn)
        order = cands[turn % len(cands):] + cands[:turn % len(cands)]    # ties go in turn
        cfg = self.cfg
        hashes: list[bytes] = []
        if cfg.policy == "round_robin":
            best, matched = order[0], 0
        else:
            if cfg.policy == "cache_aware":
                hashes = prefix_hashes(prompt_ids, self.block_size, cfg.affinity_blocks, salt)
            best, best_cost, matched = None, 0.0, 0
            for r in order:
                m = r.index.match(hashes) if hashes else 0
                cost = r.load() + cfg.kv_weight * r.engine.stats().kv_usage
                if m:
                    cost -= cfg.affinity_weight * m / len(hashes)
                if best is None or cost < best_cost:
                    best, best_cost, matched = r, cost, m
        best.chosen += 1
        if matched:
            best.affinity_hits += 1
        if hashes:
            best.index.record(hashes)
        return best

    def _awake_first(self, cands: list[Replica]) -> list[Replica]:
        """The awake candidates; else those still awake but being put to sleep (serving beats a wake);
        else one already waking; else the lightest sleeper, which wakes for this request."""
        for group in ([r for r in cands if r.awake], [r for r in cands if r.sleep_state == AWAKE],
                      [r for r in cands if r.sleep_state == WAKING]):
            if group:
                return group
        sleeper = min(cands, key=lambda r: r.sleep_level)
        sleeper.wake_sent = True
        log.info("engine %s: no replica awake; waking %s (level %d) for a request", self.name, sleeper.label,
                 sleeper.sleep_level)
        return [sleeper]

    def _retry(self, stream: PoolStream) -> bool:
        """Run a request that failed before its first token on another replica."""
        self._streams.pop(stream.request_id, None)
        ids, params, priority, salt = stream.call
        while len(stream.tried) < self.cfg.max_attempts:
            replica = self.choose(ids, salt, stream.tried)
            if replica is None:
                return False
            stream.tried.append(replica)
            try:
                inner = replica.engine.add_request(stream.request_id, ids, params, priority, salt)
            except EngineDeadError:
                continue
            stream.replica.retries_from += 1
            self.retries += 1
            log.info("engine %s: request %s retried on %s (failed on %s before its first token)",
                     self.name, stream.request_id, replica.label, stream.replica.label)
            stream.replica, stream.inner = replica, inner
            self._streams[stream.request_id] = stream
            return True
        return False

    # -- health -------------------------------------------------------------------------------
    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(r) for r in self.replicas))

    async def _check(self, r: Replica) -> None:
        if not r.remote:
            alive, ready = r.engine.dead is None, True
        else:
            alive, ready = await r.engine.check_health()
            fp = r.engine.info.get("model_fingerprint")
            if alive and fp and self.model_fingerprint and fp != self.model_fingerprint:
                if r.ready:
                    log.error("engine %s: replica %s serves another model/tokenizer; not used", self.name, r.label)
                ready = False
        if not alive:
            self._failed(r, "health check failed")
            return
        r.failures = 0
        r.successes += 1
        r.ready = ready
        if not r.healthy and (not r.ever_ok or r.successes >= self.cfg.readmit_after_successes):
            r.healthy = r.ever_ok = True
            if r.remote:
                await r.engine.refresh_stats()
            log.info("engine %s: replica %s is in service", self.name, r.label)

    def _failed(self, r: Replica, why: str) -> None:
        r.successes = 0
        r.failures += 1
        if r.healthy and r.failures >= self.cfg.eject_after_failures:
            r.healthy = False
            r.ejections += 1
            r.index.clear()
            log.warning("engine %s: replica %s ejected after %d failures (%s)", self.name, r.label, r.failures, why)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            await self.check_all()


def build_pool(name: str, spec: Any, build_local: Callable[[Any], Any], model_fingerprint: str = "") -> ReplicaPool:
    """A pool for an EngineSpec with `replicas` (build_local makes the in-process engine core)."""
    from tokenyard.engines.runtime.async_engine import AsyncEngine
    cfg = spec.replicas.pool
    members = []
    for rs in spec.replicas.replicas:
        if rs.local:
            members.append(Replica("local", AsyncEngine(build_local(spec), name), cfg, remote=False))
        else:
            eng = RemoteEngine(rs.url, name, connect_timeout_s=cfg.connect_timeout_s,
                               stats_interval_s=cfg.stats_interval_s, health_timeout_s=cfg.health_timeout_s,
                               max_model_len=cfg.max_model_len or 4096)
            members.append(Replica(rs.url, eng, cfg, remote=True))
    return ReplicaPool(name, members, cfg, model_fingerprint)
