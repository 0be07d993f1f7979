"""Sleep and wake of an engine stepped in a process of its own (engine_process.py; the levels:
tokenyard/engines/core/sleep_level.py). A mixin of EngineProcess: it uses the process's streams, its
batched send and its dead/writer state.
"""
from __future__ import annotations

import asyncio

from tokenyard.engines.core.errors import EngineDeadError
from tokenyard.engines.core.sleep_level import (
    ASLEEP,
    AWAKE,
    WAKING,
    SleepBusy,
    SleepLevelError,
    SleepUnsupported,
    check_sleep_level,
)


class ProcessSleep:
    @property
    def sleep_level(self) -> int:
        return self._sleep_level

    @property
    def sleep_state(self) -> str:
        if self._waking_since is not None:
            return WAKING
        return ASLEEP if self._sleep_level else AWAKE

    async def sleep(self, level: int, drain_timeout_s: float = 30.0) -> float:
        """As AsyncEngine.sleep: drain (SleepBusy past drain_timeout_s), then the core sleeps."""
        level = check_sleep_level(level)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s
        while True:
            while self._streams or self._waking_since is not None:
                if loop.time() >= deadline:
                    raise SleepBusy(f"engine {self.name} still had {max(1, len(self._streams))} request(s) in "
                                    f"flight after {drain_timeout_s:g} s; it stays awake")
                await asyncio.sleep(0.02)
            seconds, err = await self._control(("sleep", level))
            if err is None:
                self._sleep_level = max(self._sleep_level, level)
                return seconds
            kind, message = err
            if kind == "level":
                raise SleepLevelError(message)
            if kind != "busy":
                raise SleepUnsupported(message)
            if loop.time() >= deadline:        # another worker's requests keep a shared core busy
                raise SleepBusy(f"engine {self.name} is busy ({message}); it stays awake")
            await asyncio.sleep(0.02)       # a request slipped in before the core took the message

    async def wake(self) -> dict[str, float]:
        """Wake the core's engine now; {phase: seconds}. EngineDeadError when the process failed."""
        if not self._sleep_level:
            return {}
        if self._waking_since is None:
            self._waking_since = asyncio.get_running_loop().time()
        (phases,) = await self._control(("wake",))
        if self._sleep_level:
            self._awake()
        return phases

    async def _control(self, msg: tuple) -> tuple:
        """Send a sleep or wake message and wait for its answer (one at a time)."""
        if self._control_lock is None:
            self._control_lock = asyncio.Lock()
        async with self._control_lock:
            if self.dead is not None or self._writer is None:
                raise EngineDeadError(f"engine {self.name} is down: {self.dead or 'not started'}")
            self._control_reply = asyncio.get_running_loop().create_future()
            self._send(msg)
            try:
                return await self._control_reply
            finally:
                self._control_reply = None

    def _awake(self) -> None:
        if self._waking_since is not None:
            self.last_wake_s = asyncio.get_running_loop().time() - self._waking_since
        self._sleep_level, self._waking_since = 0, None

