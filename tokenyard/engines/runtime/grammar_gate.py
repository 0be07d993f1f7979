"""The step a constrained request takes before it enters its engine: its grammar, checked and built
off the event loop and off the engine's step.

    gate = GrammarGate(GrammarWorker(model_dir, budget, name), build=engine.prepare_grammar,
                       warm=engine.warm_grammars)
    await gate.start()                 # the worker's vocabulary and the engine's grammar set, warmed
    await gate.prepare(fmt)            # GrammarError: refused (the gateway's 400 response_format)
    engine.add_request(..., params)    # at once, no await between: the grammar is in its cache

Rules:
- A json_schema goes to the worker first (tokenyard/engines/runtime/grammar_worker.py: a process of its own
  with a hard time and memory budget), so a schema too expensive to compile is refused without
  ever being compiled where the engine runs. {"type": "json_object"} is one fixed, small grammar
  (11 ms on SmolLM2's vocabulary) and skips the check.
- Then `build(fmt)` compiles it into the engine's cache on this gate's own thread (the event loop
  and the engine's step thread never compile). An in-process engine passes build; an engine in a
  process of its own compiles there, on a thread of the child (tokenyard/engines/serving/engine_process.py).
- `warm()` (the engine's grammar set: its tokenizer info, ~1.5 s on SmolLM2) runs on the same
  thread after start-up, so the first schema does not pay it on the loop; a build waits behind it.
  Given `idle` (the engine has nothing in flight), the worker's start and the warm-up wait for the
  first lull of `idle_s` after start(): warming imports xgrammar and walks the vocabulary in Python,
  holding the GIL the engine's step needs, so requests that ran beside it right after ready took up
  to 5x their usual time (bench/RESULTS.md, "Issue 52, what was left"). A constrained request that
  comes before the lull starts the worker and builds the grammar set itself, as without the warm-up.
- The engine's cache is an LRU of 64 compiled grammars and the gate has one thread: between
  prepare() returning and the synchronous add_request at most one other compile can finish, so
  the grammar prepared for a request is still cached when the request is added.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from tokenyard.engines.runtime.grammar_worker import GrammarWorker

log = logging.getLogger(__name__)

IDLE_S = 1.0     # the lull (nothing in flight) the background warm-up waits for, when given `idle`


class GrammarGate:
    def __init__(self, worker: GrammarWorker | None, build: Callable[[dict], None] | None = None,
                 warm: Callable[[], None] | None = None, name: str = "engine",
                 idle: Callable[[], bool] | None = None, idle_s: float = IDLE_S) -> None:
        self.worker = worker
        self._build = build
        self._warm = warm
        self.name = name
        self._idle, self._idle_s = idle, idle_s
        self._pool: ThreadPoolExecutor | None = None    # made when first needed; close() ends it
        self._warming: asyncio.Future | None = None
        self._waiting: asyncio.Task | None = None       # waits for the first lull (idle given)

    async def start(self) -> None:
        """Start the worker and warm the engine's grammar set, both in the background: now, or
        (idle given) once the engine has been idle for idle_s."""
        if self._idle is not None:
            if self._waiting is None:
                self._waiting = asyncio.get_running_loop().create_task(self._after_lull(),
                                                                       name=f"grammar-warm-{self.name}")
            return
        await self._start_now()

    async def _after_lull(self) -> None:
        assert self._idle is not None
        loop = asyncio.get_running_loop()
        since = loop.time()
        while loop.time() - since < self._idle_s:
            await asyncio.sleep(min(0.1, self._idle_s))
            if not self._idle():
                since = loop.time()
        await self._start_now()

    async def _start_now(self) -> None:
        if self.worker is not None:
            try:
                await self.worker.start()
            except OSError:
                log.warning("grammar worker did not start; the first response_format request retries",
                            exc_info=True)
        if self._warm is not None and self._warming is None:
            self._warming = asyncio.get_running_loop().run_in_executor(self._executor(), self._quiet_warm)

    async def prepare(self, fmt: dict) -> None:
        """Check (json_schema) and build the request's grammar; GrammarError when it is refused."""
        if self.worker is not None and fmt.get("type") != "json_object":
            await self.worker.check(fmt)
        if self._build is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor(), self._build, fmt)

    def close(self) -> None:
        if self._waiting is not None:
            self._waiting.cancel()
            self._waiting = None
        if self.worker is not None:
            self.worker.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool, self._warming = None, None

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tokenyard-grammar-{self.name}")
        return self._pool

    def _quiet_warm(self) -> None:
        # Warming runs right after ready, beside the first requests, on the cores they need (a replica
        # measured its first request at 2.3x its tenth while this ran: bench/RESULTS.md, "Cold start,
        # cut"). At the lowest CPU priority it takes only what they leave; the thread's own priority is
        # put back after it where the OS allows (raising it needs CAP_SYS_NICE: else its later
        # builds, a request's own schema, keep the low one, which costs them only under load).
        before = set_priority(19)
        try:
            self._warm()
        except Exception:  # noqa: BLE001 - no grammar support here: each request says why when it asks
            log.info("grammar set not warmed", exc_info=True)
        finally:
            if before is not None:
                set_priority(before)


def set_priority(nice: int) -> int | None:
    """Set the calling thread's nice value (Linux: threads have their own); its previous value, or
    None where the OS does not allow the change."""
    try:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, nice)
        return before
    except (AttributeError, OSError):
        return None
