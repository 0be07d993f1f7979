"""Grammars for an engine stepped in a process of its own (tokenyard/engines/serving/engine_process.py):
checked against their budget in the parent's grammar worker, compiled on a thread of the child.

    parent:  grammars = ProcessGrammars(GrammarWorker(model_dir, budget, name))
             await grammars.prepare(fmt, send)   # GrammarError when refused; then add_request at once
             grammars.resolve(token, error)      # the child's ("grammar", token, error) reply
             grammars.child_gone()               # the child exited: waiting prepares return
    child:   compiler = ChildCompiler(engine, link.send)   # the first compile builds the grammar set
             compiler.submit(token, fmt)                   # on the parent's ("grammar", token, fmt)

Rules:
- A json_schema goes to the parent's worker first (tokenyard/engines/runtime/grammar_worker.py: its own process,
  a hard time and memory budget), so a schema too expensive to compile is refused (the gateway's
  400 response_format) and never reaches the engine's process. {"type": "json_object"} skips it.
- Then the parent sends ("grammar", token, fmt); the child's loop hands it to its compile thread,
  which compiles into the engine's grammar cache (xgrammar's compiler leaves the GIL: the loop
  steps on) and sends ("grammar", token, error or None) itself. The loop never compiles a prepared
  grammar; add_request, which follows at once, finds it in the cache.
- The parent remembers the schemas the current child compiled, the newest KNOWN of them (half the
  engine's cache of 64: every grammar the child compiles is prepared here first, and each add
  touches its entry there, so a known one is still cached), and answers those at once instead of
  queueing behind another schema's compile.
- A child that exits while prepares wait: they return without an error, and the add_request that
  follows raises EngineDeadError (503) while the process is started again; what it knew is dropped.
- The child never warms its grammar set on its own: the first compile builds it (the library's
  import and a walk of the vocabulary, 0.9 s of Python holding the GIL the step needs on a 2-core
  VM). Warmed at once after ready it made a SmolLM2 replica's first request 2-7x the rest; warmed in
  the engine's first lull (the rule until 2026-12-05) it made any request that came in the lull's
  warm-up 1.2-2.6x the rest (a first request sent 1.5 s after ready: bench/RESULTS.md, "Ready in
  under 2 s"). Only a replica that serves structured outputs pays it, once, on that request.
- The parent's worker (a process that imports the library, torch with it, builds its own vocabulary
  and compiles its first grammar: 3-4 s of CPU) starts in the parent's first rest of WORKER_IDLE_S
  when it is given `idle` (nothing in flight), else at once, in the idle scheduling class (grammar_worker.set_idle) so
  it takes only CPU the engine leaves; a json_schema check starts it (and lifts it) itself.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from tokenyard.engines.core.structured_output import CACHE_SIZE, GrammarError, check_response_format
from tokenyard.engines.runtime.grammar_worker import GrammarWorker, schema_key

log = logging.getLogger(__name__)

KNOWN = CACHE_SIZE // 2
# The rest (nothing in flight) after which the parent starts its grammar worker. Its start is 3-4 s of
# CPU; even in the idle class it slowed requests sent during it by about 1.25x on a 2-core VM (caches,
# memory bandwidth): after 1 s of rest that was any request sent 1-5 s after ready. After 5 s the
# replica has been idle a while, and a request that comes in the start's few seconds is the one hurt.
WORKER_IDLE_S = 5.0
POLL_S = 0.1                # how often the child's thread looks at the engine while it waits for the lull
_GONE = object()            # a pending prepare's answer when the child exited


def grammar_info(engine: Any) -> tuple[str, float, int] | None:
    """What the parent needs to check an engine's schemas (tokenizer folder, time and memory budget),
    or None for an engine without grammars (the mock)."""
    model_dir = getattr(engine, "grammar_model_dir", None)
    if model_dir is None or not hasattr(engine, "prepare_grammar"):
        return None
    budget = engine.grammar_budget
    return str(model_dir), float(budget.time_s), int(budget.memory_mb)


class ProcessGrammars:
    """The parent's side: the budget check, then the child's compile, awaited by token. idle (nothing
    in flight): the worker starts in the first lull of idle_s after start(), not at once."""

    def __init__(self, worker: GrammarWorker, idle: Callable[[], bool] | None = None,
                 idle_s: float = WORKER_IDLE_S) -> None:
        self.worker = worker
        self._idle, self._idle_s = idle, idle_s
        self._tokens = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._known: OrderedDict[str, None] = OrderedDict()
        self._waiting: asyncio.Task | None = None       # the worker's start, waiting for the lull

    async def start(self) -> None:
        if self._idle is None:
            await self._start_worker()
        elif self._waiting is None:
            self._waiting = asyncio.get_running_loop().create_task(self._after_lull(),
                                                                   name=f"grammar-worker-{self.worker.name}")

    async def _after_lull(self) -> None:
        assert self._idle is not None
        loop = asyncio.get_running_loop()
        since = loop.time()
        while loop.time() - since < self._idle_s:
            await asyncio.sleep(min(POLL_S, self._idle_s))
            if not self._idle():
                since = loop.time()
        await self._start_worker()

    async def _start_worker(self) -> None:
        try:
            await self.worker.start()
        except OSError:
            log.warning("grammar worker of %s did not start; the first response_format request retries",
                        self.worker.name, exc_info=True)

    async def prepare(self, fmt: dict, send: Callable[[int, dict], bool]) -> None:
        """Check `fmt` against its budget and have the child compile it; GrammarError when refused.
        `send(token, fmt)` writes the request to the child, False when there is none (it is down)."""
        check_response_format(fmt)
        if fmt.get("type") != "json_object":
            await self.worker.check(fmt)
        key = schema_key(fmt)
        if key in self._known:
            self._known.move_to_end(key)
            return
        token = next(self._tokens)
        future = asyncio.get_running_loop().create_future()
        if not send(token, fmt):
            return                        # no child: add_request raises EngineDeadError (503)
        self._pending[token] = future
        try:
            error = await future
        finally:
            self._pending.pop(token, None)
        if error is _GONE:
            return
        if error is not None:
            raise GrammarError(error)
        self._known[key] = None
        while len(self._known) > KNOWN:
            self._known.popitem(last=False)

    def resolve(self, token: int, error: str | None) -> None:
        future = self._pending.get(token)
        if future is not None and not future.done():
            future.set_result(error)

    def child_gone(self) -> None:
        self._known.clear()
        for future in self._pending.values():
            if not future.done():
                future.set_result(_GONE)

    def close(self) -> None:
        self.child_gone()
        if self._waiting is not None:
            self._waiting.cancel()
            self._waiting = None
        self.worker.close()


class ChildCompiler:
    """The child's side: one thread that compiles each prepared format into the engine's cache and
    replies through `send` (thread-safe, engine_child._Link). The engine's grammar set (the library's
    import and a walk of the vocabulary: 0.9 s of Python holding the GIL for SmolLM2 on a 2-core VM) is
    built by the first compile, not ahead of it: see the module doc."""

    def __init__(self, engine: Any, send: Callable[[tuple], None]) -> None:
        self._engine = engine
        self._send = send
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenyard-grammar")

    def submit(self, token: int, fmt: dict) -> None:
        self._pool.submit(self._compile, token, fmt)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, token: int, fmt: dict) -> None:
        try:
            self._engine.prepare_grammar(fmt)
            error = None
        except GrammarError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - any failure refuses this schema, not the engine
            error = f"response_format schema cannot be compiled: {type(e).__name__}: {e}"
        try:
            self._send(("grammar", token, error))
        except OSError:
            pass            # the parent hung up
