"""How many batch lines may run at once in this gateway: at most batch.max_in_flight, fewer while the
event loop falls behind.

    limit = AdaptiveLimit(maximum=16, max_lag_s=0.002)
    limit.start()                  # samples the loop's lag
    await limit.acquire() ... limit.release()

Interactive requests and batch lines share one event loop: routing, tokenising, admission and every
streamed token of both run on it. An engine with free slots says nothing about that loop, and on a
small machine the loop is what a batch takes from interactive users: while it is busy with batch
lines, an interactive request's next step waits. So the limit follows the loop's lag (how late a
10 ms sleep wakes, averaged over ADJUST_S): above `max_lag_s` the limit halves, at most once per
ADJUST_S; otherwise it grows by one line per ADJUST_S, up to `maximum` (additive increase,
multiplicative decrease). It never drops below one line, so a batch always progresses. max_lag_s 0
turns the adaptation off (the limit stays at `maximum`).
"""
from __future__ import annotations

import asyncio
import math
from typing import Callable

SAMPLE_S = 0.01     # one lag sample: how late a sleep of this long wakes
ADJUST_S = 0.1      # the limit moves at most this often
POLL_S = 0.005      # a waiting acquire() looks again this often


class AdaptiveLimit:
    def __init__(self, maximum: int, max_lag_s: float) -> None:
        self.maximum = maximum
        self.max_lag_s = max_lag_s
        self.limit = float(maximum)
        self.running = 0
        self.lag_s = 0.0                 # the last window's mean lag
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.max_lag_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._sample(), name="batch-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def acquire(self, give_up: Callable[[], bool] = lambda: False) -> bool:
        """Take a slot (True), or False without one as soon as `give_up()` says so: a batch cancelled
        while every slot is another batch's must not wait for that batch's lines to end."""
        while self.running >= max(1, math.floor(self.limit)):
            if give_up():
                return False
            await asyncio.sleep(POLL_S)
        self.running += 1
        return True

    def release(self) -> None:
        self.running -= 1

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        window_start, total, count = loop.time(), 0.0, 0
        while True:
            t0 = loop.time()
            await asyncio.sleep(SAMPLE_S)
            now = loop.time()
            total += max(0.0, now - t0 - SAMPLE_S)
            count += 1
            if now - window_start >= ADJUST_S:
                self.lag_s = total / count
                if self.lag_s > self.max_lag_s:
                    self.limit = max(1.0, self.limit / 2)
                else:
                    self.limit = min(float(self.maximum), self.limit + 1)
                window_start, total, count = now, 0.0, 0
