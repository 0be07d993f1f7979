"""When a Batch API line may start on an engine: only in capacity interactive traffic leaves idle.

A line starts on a shared engine only while
  - nothing waits in that engine's admission queue (a queued request, of any class, goes first),
  - fewer than `batch.idle_share` of the engine's slots (admission.max_running, else its
    max_num_seqs) are taken, counting the line itself, and
  - fewer than `batch.idle_share` of its KV blocks are in use,
so interactive requests arriving meanwhile always find free slots and KV room and are admitted at
once; the batch fills in behind them. Lines also start at most one per batch.start_gap_ms per engine: lines
that started together end together, and spacing their successors keeps a burst of line starts
(routing, tokenising, admission: CPU on the event loop) from delaying an interactive request that
arrives in the middle of it. An engine of the bulk pool (`pools.bulk`) runs nothing else,
and its share is all of it. Lines already running are never preempted by the gateway: they hold
their slot until they end (at most max_tokens), which is why the share stays below one.
"""
from __future__ import annotations

import asyncio
import math
from typing import Any

POLL_S = 0.005       # how often a waiting line looks again (the engine's room changes with each step)


class IdleCapacity:
    def __init__(self, admission: Any, idle_share: float, bulk_engines: set[str], start_gap_s: float = 0.0) -> None:
        self.admission = admission
        self.idle_share = idle_share
        self.bulk_engines = bulk_engines
        self.start_gap_s = start_gap_s
        self._last_start: dict[str, float] = {}

    def share(self, engine: str) -> float:
        return 1.0 if engine in self.bulk_engines else self.idle_share

    def has_room(self, engine: str) -> bool:
        q = self.admission.queues[engine]
        if len(q.queue):
            return False
        share = self.share(engine)
        if q.running + 1 > max(1, math.floor(q.slots * share)):
            return False
        s = q.engine.stats()
        if s.num_total_blocks and (s.num_total_blocks - s.num_free_blocks) > share * s.num_total_blocks:
            return False
        return True

    async def wait(self, engine: str) -> None:
        loop = asyncio.get_running_loop()
        while loop.time() - self._last_start.get(engine, -1e9) < self.start_gap_s or not self.has_room(engine):
            await asyncio.sleep(POLL_S)
        self._last_start[engine] = loop.time()
