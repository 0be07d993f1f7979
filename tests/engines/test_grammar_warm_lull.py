"""The background grammar warm-up waits for the engine's first lull (grammar_gate.py): warming holds
the GIL the step needs, so it must not run beside the first requests after ready."""
from __future__ import annotations

import asyncio
import threading

from tokenyard.engines.runtime.grammar_gate import GrammarGate


def test_warm_waits_for_a_lull_then_runs_once() -> None:
    busy = {"in_flight": 1}
    warmed = threading.Event()
    calls: list[float] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def warm() -> None:
            calls.append(loop.time())
            warmed.set()

        gate = GrammarGate(None, warm=warm, idle=lambda: busy["in_flight"] == 0, idle_s=0.2)
        t0 = loop.time()
        await gate.start()
        await gate.start()                      # a second start schedules nothing more
        await asyncio.sleep(0.5)
        assert not calls, "warmed while a request was in flight"
        busy["in_flight"] = 0
        lull = loop.time()
        for _ in range(100):
            if warmed.is_set():
                break
            await asyncio.sleep(0.02)
        assert len(calls) == 1
        # idle is polled every 0.1 s: the lull counts from the last busy poll, up to 0.1 s before it
        assert calls[0] - lull >= 0.2 - 0.1 - 0.02 and calls[0] - t0 >= 0.6 - 0.02
        gate.close()

    asyncio.run(main())


def test_without_idle_it_warms_at_start_and_close_cancels_a_waiting_warm() -> None:
    async def main() -> None:
        done = threading.Event()
        gate = GrammarGate(None, warm=done.set)
        await gate.start()
        assert await asyncio.to_thread(done.wait, 5.0)
        gate.close()
        never: list[int] = []
        waiting = GrammarGate(None, warm=lambda: never.append(1), idle=lambda: True, idle_s=0.2)
        await waiting.start()
        waiting.close()
        await asyncio.sleep(0.4)
        assert never == []

    asyncio.run(main())
