"""Sleep and wake of an AsyncEngine (the levels: tokenyard/engines/core/sleep_level.py).

    seconds = await engine.sleep(1, drain_timeout_s=30)   # waits for the requests in flight, then sleeps
    phases = await engine.wake()                          # or: the next request wakes it (the step loop)

A mixin of AsyncEngine, which holds the engine core, its step executor, the request streams, the
failure handling (_fail_all, _restart) this uses.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from tokenyard.engines.core.errors import EngineDeadError, RequestError
from tokenyard.engines.core.sleep_level import ASLEEP, AWAKE, WAKING, SleepBusy, SleepUnsupported, check_sleep_level

log = logging.getLogger("tokenyard.engines.runtime.async_engine")


class SleepControl:
    engine: Any
    name: str
    dead: str | None
    num_failed_steps: int
    _streams: dict
    _executor: Any
    _factory: Any
    _stats: Any
    _waking: "asyncio.Future[dict[str, float]] | None"
    last_wake_s: float | None
    last_wake_phases: dict[str, float]

    @property
    def sleep_level(self) -> int:
        return int(getattr(self.engine, "sleep_level", 0))

    @property
    def sleep_state(self) -> str:
        """"awake", "asleep" or "waking"."""
        if self._waking is not None:
            return WAKING
        return ASLEEP if self.sleep_level else AWAKE

    async def sleep(self, level: int, drain_timeout_s: float = 30.0) -> float:
        """Wait for the requests in flight to finish (new ones keep coming in and are served: the caller
        stops sending them first), then put the engine to sleep on the step thread. SleepLevelError for
        a bad level, SleepUnsupported when the engine cannot sleep, SleepBusy when requests were still
        in flight after drain_timeout_s (the engine stays awake). Returns the seconds the sleep took."""
        level = check_sleep_level(level)
        if not hasattr(self.engine, "sleep"):
            raise SleepUnsupported(f"engine {self.name} cannot sleep")
        if self.dead is not None:
            raise EngineDeadError(f"engine {self.name} is down: {self.dead}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s
        while True:
            while self._streams or self.engine.has_unfinished() or self._waking is not None:
                if loop.time() >= deadline:
                    raise SleepBusy(f"engine {self.name} still had {max(1, len(self._streams))} request(s) in "
                                    f"flight after {drain_timeout_s:g} s; it stays awake")
                await asyncio.sleep(0.02)
            try:
                seconds = await loop.run_in_executor(self._executor, self.engine.sleep, level)
            except RequestError:     # a request arrived between the check and the step thread: drain again
                continue
            self._stats = await loop.run_in_executor(self._executor, self.engine.stats)
            return seconds

    async def wake(self) -> dict[str, float]:
        """Wake the engine now ({phase: seconds}; {} when awake). A wake already under way is joined.
        A wake that raises fails the requests waiting for it (retryable: none got a token) and the
        engine is restarted (given a factory) or declared dead; the error is raised here too."""
        if self._waking is not None:
            return await asyncio.shield(self._waking)
        if not self.sleep_level:
            return {}
        loop = asyncio.get_running_loop()
        waking = self._waking = loop.create_future()
        t0 = loop.time()
        try:
            phases = await loop.run_in_executor(self._executor, self.engine.wake)
            self._stats = await loop.run_in_executor(self._executor, self.engine.stats)
        except Exception as e:  # noqa: BLE001 - the requests waiting for the wake must hear of it
            self._waking = None
            waking.set_exception(e)
            waking.exception()       # retrieved: joiners re-raise it, nobody else must be warned
            await self._wake_failed(e)
            raise
        self._waking = None
        self.last_wake_s, self.last_wake_phases = loop.time() - t0, phases
        waking.set_result(phases)
        return phases

    async def _wake_failed(self, e: Exception) -> None:
        """The engine's state is unknown after a wake that raised: like a replica that crashed."""
        log.error("engine %s: waking failed: %s: %s", self.name, type(e).__name__, e)
        self.num_failed_steps += 1
        self._fail_all(f"engine {self.name} failed while waking: {type(e).__name__}: {e}", retryable=True)
        if self._factory is not None:
            await self._restart(f"wake raised {type(e).__name__}: {e}")
        else:
            self.dead = f"waking failed: {type(e).__name__}: {e}"

    if TYPE_CHECKING:     # AsyncEngine's
        def _fail_all(self, message: str, retryable: bool = False) -> None: ...

        async def _restart(self, why: str) -> bool: ...
