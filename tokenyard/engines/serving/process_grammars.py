"""Grammars for an engine stepped in a process of its own (tokenyard/engines/serving/engine_process.py):
checked against their budget in the parent's grammar worker, compiled on a thread of the child.

    parent:  grammars = ProcessGrammars(GrammarWorker(model_dir, budget, name))
             await grammars.prepare(fmt, send)   # GrammarError when refused; then add_request at once
             grammars.resolve(token, error)      # the child's ("grammar", token, error) reply
             grammars.child_gone()               # the child exited: waiting prepares return
    child:   compiler = ChildCompiler(engine, link.send)   # warms the engine's grammar set
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
    """The parent's side: the budget check, then the child's compile, awaited by token."""

    def __init__(self, worker: GrammarWorker) -> None:
        self.worker = worker
        self._tokens = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._known: OrderedDict[str, None] = OrderedDict()

    async def start(self) -> None:
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
        self.worker.close()


class ChildCompiler:
    """The child's side: one thread that warms the engine's grammar set, then compiles each prepared
    format into the engine's cache and replies through `send` (thread-safe, engine_child._Link)."""

    def __init__(self, engine: Any, send: Callable[[tuple], None]) -> None:
        self._engine = engine
        self._send = send
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenyard-grammar")
        self._pool.submit(self._warm)

    def submit(self, token: int, fmt: dict) -> None:
        self._pool.submit(self._compile, token, fmt)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _warm(self) -> None:
        try:
            self._engine.warm_grammars()
        except Exception:  # noqa: BLE001 - no grammar support here: each request says why when it asks
            log.info("grammar set not warmed", exc_info=True)

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
